"""DAA and the difficulty tracker (ALGORITHMS section 4): the spec's numbers, to its digits, checked
against closed forms computed by hand in the comments."""

import json
import math

import pytest
import torch

from megatron_rl.algorithms.advantages import compute_advantages, group_ids_to_index
from megatron_rl.algorithms.daa import DifficultyTracker, apply_daa, balanced_beta, daa_factor

G = 16


def _amps(q: float, G: int) -> tuple[float, float]:
    """amp_c, amp_i from the derivation, by direct enumeration over k (unbiased-std GRPO)."""

    def adv(k: int, correct: bool) -> float:
        mu = k / G
        std = math.sqrt((k * (1 - mu) ** 2 + (G - k) * mu**2) / (G - 1))
        return ((1.0 if correct else 0.0) - mu) / (std + 1e-6)

    def expect(correct: bool) -> float:
        num = den = 0.0
        for j in range(G):  # j correct among the G-1 others
            p = math.comb(G - 1, j) * q**j * (1 - q) ** (G - 1 - j)
            k = j + 1 if correct else j
            if 1 <= k <= G - 1:  # the group is kept
                num += p * adv(k, correct)
                den += p
        return num / den

    return expect(True) / (1 - q), expect(False) / (-q)


def test_amplification_derivation_numbers():
    amp_c, amp_i = _amps(0.01, G)
    assert round(amp_c, 2) == 3.61 and round(amp_i, 2) == 25.83
    amp_c, amp_i = _amps(0.05, G)
    assert round(amp_c, 2) == 3.16 and round(amp_i, 2) == 5.89
    # the closed form beta = amp_i / amp_c holds up to the eps in the std
    for q in (0.01, 0.05, 0.2):
        amp_c, amp_i = _amps(q, G)
        assert amp_i / amp_c == pytest.approx(balanced_beta(q, G), rel=1e-4)
    # balanced for q >= 0.3: ratio within 0.5 %
    amp_c, amp_i = _amps(0.3, G)
    assert amp_i / amp_c == pytest.approx(1.0, abs=5e-3)


def test_balanced_beta_values():
    # (1 - .01^15) / (1 - .99^15) = 1 / 0.139942 = 7.1458
    assert round(balanced_beta(0.01, G), 2) == 7.15
    # (1 - .05^15) / (1 - .95^15) = 1 / 0.536709 = 1.8632
    assert round(balanced_beta(0.05, G), 2) == 1.86
    t = balanced_beta(torch.tensor([0.01, 0.05, 0.0]), G)
    assert t.dtype == torch.float64 and math.isinf(float(t[2]))
    with pytest.raises(ValueError):
        balanced_beta(0.1, 1)


def test_factor_values():
    assert daa_factor(0.01, group_size=G, factor="balanced") == pytest.approx(7.1458, abs=1e-3)  # below the cap
    assert daa_factor(0.001, group_size=G, factor="balanced") == 8.0  # beta(0.001) ~ 67 -> capped
    assert daa_factor(0.6, group_size=G, factor="balanced") == 1.0  # above hard_threshold 0.5
    # beta(0.7) = (1 - .7^15) / (1 - .3^15) = 0.99525 < 1 -> clamped to 1 (threshold raised to 0.9)
    assert daa_factor(0.7, group_size=G, factor="balanced", hard_threshold=0.9) == 1.0
    # power: (0.5 / 0.1) ** 1 = 5; gamma 2 -> 25 capped at 8; gamma 0.5 -> sqrt(5) = 2.236
    assert daa_factor(0.1, factor="power") == pytest.approx(5.0)
    assert daa_factor(0.1, factor="power", gamma=2.0) == 8.0
    assert daa_factor(0.1, factor="power", gamma=0.5) == pytest.approx(math.sqrt(5))
    assert daa_factor(0.0, factor="power") == 8.0
    with pytest.raises(ValueError, match="group_size"):
        daa_factor(0.1, factor="balanced")
    with pytest.raises(ValueError):
        daa_factor(0.1, group_size=G, factor="linear")
    with pytest.raises(ValueError):
        daa_factor(0.1, group_size=G, factor="balanced", max_factor=0.5)


def test_constant_factor():
    # the paper's rule as reported: lambda below tau, 1 at and above it; max_factor does not cap lambda
    assert daa_factor(1 / 16) == 2.0  # the default factor is constant, lambda 2, tau 0.5
    assert daa_factor(7 / 16) == 2.0 and daa_factor(0.5) == 1.0 and daa_factor(9 / 16) == 1.0
    assert daa_factor(0.25, amplification=3.0, max_factor=1.5) == 3.0
    assert daa_factor(0.25, hard_threshold=0.2) == 1.0
    assert daa_factor(torch.tensor([0.1, 0.5, 0.9])).tolist() == [2.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="amplification"):
        daa_factor(0.1, amplification=0.5)


def test_constant_rule_on_a_hand_made_batch():
    # 3 kept groups of G = 4 plus one dropped group, binary rewards, GRPO with the unbiased std:
    #   g0: k = 1 (p_hat 0.25 < 0.5, hard): mean 0.25, std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5,
    #       A = +1.5 for the correct one, -0.5 for the others -> the correct one becomes +3.0
    #   g1: k = 2 (p_hat 0.5, not < tau): mean 0.5, std sqrt(4 * 0.25 / 3) = 0.57735, A = +-0.86603, unchanged
    #   g2: k = 3 (p_hat 0.75): A = +0.5 (correct), -1.5, unchanged
    #   g3: k = 1 but not eligible (stands for a group outside dynamic sampling's keep), unchanged
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0], dtype=torch.float64)
    uid = torch.arange(16) // 4
    adv = compute_advantages("grpo", r, uid, torch.ones(16, dtype=torch.bool))
    eps = 1e-6
    assert float(adv[0]) == pytest.approx(0.75 / (0.5 + eps), rel=1e-6)  # float32 advantages
    gidx, p = group_ids_to_index(uid)
    tr = DifficultyTracker()
    k = [1, 2, 3, 1]
    q_hat = torch.tensor([tr.estimate(f"p{i}", k[i], 4, "group") for i in range(4)], dtype=torch.float64)
    assert q_hat.tolist() == [0.25, 0.5, 0.75, 0.25]
    eligible = torch.tensor([True, True, True, False])
    out, stats = apply_daa(adv, r.bool(), gidx, q_hat, eligible)  # defaults: constant, lambda 2, tau 0.5
    expected = adv.clone()
    expected[0] = 2.0 * adv[0]  # only the correct response of g0
    assert torch.equal(out, expected)
    assert float(out[0]) == pytest.approx(3.0, abs=1e-5)
    assert stats == {"amplified_frac": 1 / 16, "factor_mean": 2.0, "hard_group_frac": 1 / 4}
    # a correct response whose advantage is not positive (e.g. an overlong penalty) is never amplified
    shaped = adv.clone()
    shaped[0] = -0.1
    out, stats = apply_daa(shaped, r.bool(), gidx, q_hat, eligible, amplification=3.0)
    assert torch.equal(out, shaped) and stats["amplified_frac"] == 0.0 and stats["factor_mean"] == 1.0
    assert stats["hard_group_frac"] == 1 / 4  # g0 is still a hard group


def test_difficulty_group_mode():
    tr = DifficultyTracker()
    assert tr.estimate("p", 1, G, "group") == 1 / 16  # never below 1/G
    # beta(1/16) = (1 - (1/16)^15) / (1 - (15/16)^15) = 1 / 0.62079 = 1.6108
    assert round(daa_factor(1 / 16, group_size=G, factor="balanced"), 2) == 1.61


def test_posterior_and_history_numbers_of_the_spec():
    # G = 16, k = 1 after m earlier all-wrong groups: Beta(0.5 + 1, 0.5 + 15 + 16 m), mean
    # 1.5 / (17 + 16 m) = 1.5/17, 1.5/33, 1.5/65, 1.5/113 = 0.08824, 0.04545, 0.02308, 0.01327;
    # beta(q) = 1 / (1 - (1-q)^15) (q^15 < 1e-15): (1-q)^15 = 0.25017, 0.49768, 0.70454, 0.81836
    # -> 1.3336, 1.9908, 3.3846, 5.5055 (ALGORITHMS.md 4.3 prints 1.33, 1.99, 3.39, 5.51: its 3.39 is 3.3846)
    spec = {0: (0.0882, 1.33), 1: (0.0455, 1.99), 3: (0.0231, 3.38), 6: (0.0133, 5.51)}
    for m, (q_spec, beta_spec) in spec.items():
        tr = DifficultyTracker()
        for step in range(m):
            tr.record("p", 0, G, step=step)
        q = tr.estimate("p", 1, G, "history", step=m)
        assert q == pytest.approx(1.5 / (17 + 16 * m), rel=1e-15)
        assert round(q, 4) == q_spec, (m, q)
        assert round(balanced_beta(q, G), 2) == beta_spec, (m, q)
        assert daa_factor(q, group_size=G, factor="balanced") == pytest.approx(balanced_beta(q, G))  # under the cap
        # posterior ignores the history: always the m = 0 value
        assert tr.estimate("p", 1, G, "posterior") == pytest.approx(1.5 / 17, rel=1e-15)
    # with no history, history == posterior; another prompt's history does not leak
    tr = DifficultyTracker()
    tr.record("other", 0, G)
    assert tr.estimate("p", 1, G, "history") == tr.estimate("p", 1, G, "posterior") == 1.5 / 17
    # another prior: Beta(1, 1) -> (1 + 3) / (2 + 16) for k = 3
    assert DifficultyTracker(a0=1.0, b0=1.0).estimate("p", 3, G, "posterior") == pytest.approx(4 / 18)


def test_posterior_mean_monte_carlo():
    """q ~ Beta(1/2, 1/2), k ~ Binomial(16, q): the mean of q among draws with a given k is
    (a0 + k) / (a0 + b0 + G), and keeping only mixed groups (1 <= k <= 15, dynamic sampling's keep
    rule) changes nothing, since keeping depends on k alone. The removed `conditional` estimate
    (likelihood divided again by the keep probability: 0.0461 for k = 1, by quadrature below) is
    rejected by the same draws.

    Tolerance: 5 Monte Carlo standard errors of each k's mean (sd(q | k) / sqrt(draws with k));
    with 400,000 draws every k has >= 9,000 draws, so 5 SE <= 0.006."""
    gen = torch.Generator().manual_seed(0)
    n = 400_000
    # q = sin^2(pi/2 * u), u uniform, is exactly Beta(1/2, 1/2) (the arcsine law), from a seeded generator
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    q = torch.sin(0.5 * math.pi * u) ** 2
    k = (torch.rand(n, G, dtype=torch.float64, generator=gen) < q[:, None]).sum(dim=1)  # Binomial(16, q)
    kept = (k >= 1) & (k <= G - 1)
    tr = DifficultyTracker()
    for kk in range(1, G):
        sel = k == kk
        sel_kept = sel & kept
        assert torch.equal(sel, sel_kept)  # kept is a function of k: the same draws
        count = int(sel_kept.sum())
        assert count >= 9_000, (kk, count)
        mc_mean = float(q[sel_kept].mean())
        se = float(q[sel_kept].std()) / math.sqrt(count)
        assert 5 * se <= 0.006
        closed = tr.estimate("p", kk, G, "posterior")
        assert closed == pytest.approx((0.5 + kk) / 17)
        assert abs(mc_mean - closed) < 5 * se, (kk, mc_mean, closed, se)
    # the conditional (double-counted) value for k = 1, by quadrature in theta (q = sin^2 theta)
    theta = (torch.arange(20_000, dtype=torch.float64) + 0.5) / 20_000 * (math.pi / 2)
    qq = torch.sin(theta) ** 2
    lik = qq * (1 - qq) ** 15 / (1 - (1 - qq) ** 16 - qq**16)
    conditional = float((qq * lik).sum() / lik.sum())
    assert round(conditional, 4) == 0.0461
    sel = k == 1
    se1 = float(q[sel].std()) / math.sqrt(int(sel.sum()))
    assert float(q[sel].mean()) - conditional > 20 * se1  # ~2x low, far outside the noise


def test_conditional_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"'conditional' was removed.*twice.*Use 'posterior'"):
        DifficultyTracker().estimate("p", 1, G, "conditional")


def test_history_counts_kept_groups_too():
    tr = DifficultyTracker()
    tr.record("p", 8, G)  # an earlier mixed group pulls the estimate up: (0.5 + 9) / (1 + 32)
    assert tr.estimate("p", 1, G, "history") == pytest.approx(9.5 / 33)
    assert tr.history("p") == (8, 8)


def test_history_decay():
    # decay 0.5; all-wrong groups of 16 at steps 1 and 2, a k = 1 group at step 3: the earlier groups
    # count 0.25 and 0.5, F = 16 * 0.75 = 12 -> q = (0.5 + 1) / (1 + 1 + 12 + 15) = 1.5 / 29
    tr = DifficultyTracker(history_decay=0.5)
    tr.record("p", 0, G, step=1)
    assert tr.estimate("p", 1, G, "history", step=3) == pytest.approx(1.5 / (2 + 4 + 15))  # only step 1: 16/4
    tr.record("p", 0, G, step=2)
    assert tr.history("p", step=3) == (0.0, 12.0)
    assert tr.estimate("p", 1, G, "history", step=3) == pytest.approx(1.5 / 29)
    # groups of the same step count fully (s = 0); a later group adds to the aged counts
    assert tr.estimate("p", 1, G, "history", step=2) == pytest.approx(1.5 / (2 + 24 + 15))
    tr.record("p", 4, G, step=4)  # F = 12 * 0.5 + 12 = 18, S = 4 at step 4
    assert tr.history("p", step=4) == (4.0, 18.0)
    assert tr.history("p", step=5) == (2.0, 9.0)
    # decay 1.0: plain counts, whatever the steps
    tr = DifficultyTracker()
    tr.record("p", 0, G, step=1)
    tr.record("p", 0, G, step=7)
    assert tr.estimate("p", 1, G, "history", step=100) == 1.5 / 49
    with pytest.raises(ValueError, match="before its last record"):
        tr.record("p", 0, G, step=3)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="history_decay"):
            DifficultyTracker(history_decay=bad)


def _replay(tr: DifficultyTracker, events) -> list[float]:
    out = []
    for step, key, k in events:
        if 1 <= k <= G - 1:
            out.append(tr.estimate(key, k, G, "history", step=step))
        tr.record(key, k, G, step=step)
    return out


def test_tracker_resume_is_exact():
    """A tracker saved mid-run and loaded (JSON round trip, as in the checkpoint's run state) gives
    bit-identical estimates to the one that ran on."""
    g = torch.Generator().manual_seed(3)
    events = [(1 + i // 5, f"ds/{int(torch.randint(0, 7, (1,), generator=g))}", int(torch.randint(0, 17, (1,), generator=g)))
              for i in range(60)]
    first, rest = events[:30], events[30:]
    for decay in (1.0, 0.9):
        straight = DifficultyTracker(history_decay=decay)
        _replay(straight, first)
        state = json.loads(json.dumps(straight.state_dict()))
        resumed = DifficultyTracker(history_decay=decay)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == straight.state_dict() and len(resumed) == len(straight)
        assert _replay(resumed, rest) == _replay(straight, rest)  # exact, not approx
        assert resumed.state_dict() == straight.state_dict()


def test_tracker_loads_old_checkpoints():
    # version 1 (the grid tracker): integer totals, no steps; exact with history_decay 1
    old = {"a0": 0.5, "b0": 0.5, "grid_size": 3500, "counts": {"ds/1": [0, 48], "('ds', 2)": [3, 13]}}
    tr = DifficultyTracker()
    tr.load_state_dict(old)
    assert tr.history("ds/1") == (0, 48) and tr.history(("ds", 2)) == (3, 13)
    assert tr.estimate("ds/1", 1, G, "history", step=9) == 1.5 / 65  # 3 all-wrong groups
    with pytest.raises(ValueError, match="history_decay=1.0"):
        DifficultyTracker(history_decay=0.9).load_state_dict(old)
    with pytest.raises(ValueError, match="version 7"):
        tr.load_state_dict({"version": 7, "counts": {}})


def test_tracker_errors():
    tr = DifficultyTracker()
    with pytest.raises(ValueError):
        tr.estimate("p", 0, G, "posterior")
    with pytest.raises(ValueError):
        tr.estimate("p", 16, G, "history")
    with pytest.raises(ValueError):
        tr.estimate("p", 1, G, "grid")
    with pytest.raises(ValueError):
        tr.record("p", 17, G)
    with pytest.raises(ValueError):
        tr.record("p", 1, 0)


def test_group_without_valid_responses_records_nothing():
    """Every reward of the group failed (G = 0 valid): no evidence, no crash (was a ValueError)."""
    tr = DifficultyTracker()
    tr.record("p", 2, 16)
    before = tr.state_dict()
    tr.record("p", 0, 0)
    tr.record("q", 0, 0)
    assert tr.state_dict() == before and len(tr) == 1


def test_apply_daa_only_correct_positive_in_hard_eligible_groups():
    adv = torch.tensor([2.0, -0.5, 1.0, -1.0, 0.3, -0.3], dtype=torch.float32)
    correct = torch.tensor([True, False, True, False, True, False])
    gidx = torch.tensor([0, 0, 1, 1, 2, 2])
    q_hat = torch.tensor([0.05, 0.05, 0.05])
    eligible = torch.tensor([True, False, True])
    out, stats = apply_daa(adv, correct, gidx, q_hat, eligible, factor="power", hard_threshold=0.5, max_factor=8.0)
    # power factor (0.5 / 0.05) = 10 -> capped at 8; group 1 not eligible
    assert out.tolist() == pytest.approx([16.0, -0.5, 1.0, -1.0, 2.4, -0.3])
    assert stats["amplified_frac"] == pytest.approx(2 / 6) and stats["factor_mean"] == 8.0
    assert stats["hard_group_frac"] == pytest.approx(2 / 3)  # groups 0 and 2


def test_apply_daa_balanced_uses_group_size():
    # 16 responses, one correct: GRPO advantage of the correct one is 15/16 / std
    r = torch.tensor([1.0] + [0.0] * 15)
    adv = compute_advantages("grpo", r, [0] * 16, torch.ones(16, dtype=torch.bool))
    out, stats = apply_daa(adv, r.bool(), torch.zeros(16, dtype=torch.long), torch.tensor([0.05]), torch.tensor([True]),
                           factor="balanced")
    assert float(out[0]) == pytest.approx(float(adv[0]) * 1.8632, rel=1e-4)  # beta(0.05) = 1.8632
    assert torch.equal(out[1:], adv[1:])  # incorrect responses never change


def test_daa_disabled_equals_dapo_exactly():
    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (64,), generator=g).float()
    uid = torch.arange(64) // 16
    valid = torch.ones(64, dtype=torch.bool)
    dapo = compute_advantages("grpo", r, uid, valid)
    gidx, p = group_ids_to_index(uid)
    # daa.enable false: the trainer skips apply_daa; apply_daa with nothing eligible, a cap of 1,
    # or every group easy must also be the identity, bitwise
    for kwargs in (
        dict(eligible=torch.zeros(p, dtype=torch.bool), max_factor=8.0, q=0.01),
        dict(eligible=torch.ones(p, dtype=torch.bool), max_factor=1.0, q=0.01),
        dict(eligible=torch.ones(p, dtype=torch.bool), max_factor=8.0, q=0.9),
    ):
        for factor in ("balanced", "power"):
            out, stats = apply_daa(dapo, r.bool(), gidx, torch.full((p,), kwargs["q"]), kwargs["eligible"],
                                   factor=factor, max_factor=kwargs["max_factor"])
            assert torch.equal(out, dapo) and stats["amplified_frac"] == 0.0
    # the constant factor: lambda 1, nothing eligible, or every group easy
    for amplification, eligible, q in ((1.0, True, 0.01), (2.0, False, 0.01), (2.0, True, 0.5)):
        out, stats = apply_daa(dapo, r.bool(), gidx, torch.full((p,), q), torch.full((p,), eligible),
                               amplification=amplification)
        assert torch.equal(out, dapo) and stats["amplified_frac"] == 0.0
