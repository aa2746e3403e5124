"""DAA and the difficulty tracker (ALGORITHMS section 4): the spec's numbers, to its digits."""

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
    assert daa_factor(0.01, group_size=G) == pytest.approx(7.1458, abs=1e-3)  # below the cap of 8
    assert daa_factor(0.001, group_size=G) == 8.0  # beta(0.001) ~ 67 -> capped
    assert daa_factor(0.6, group_size=G) == 1.0  # above hard_threshold 0.5
    # beta(0.7) = (1 - .7^15) / (1 - .3^15) = 0.99525 < 1 -> clamped to 1 (threshold raised to 0.9)
    assert daa_factor(0.7, group_size=G, hard_threshold=0.9) == 1.0
    # power: (0.5 / 0.1) ** 1 = 5; gamma 2 -> 25 capped at 8; gamma 0.5 -> sqrt(5) = 2.236
    assert daa_factor(0.1, factor="power") == pytest.approx(5.0)
    assert daa_factor(0.1, factor="power", gamma=2.0) == 8.0
    assert daa_factor(0.1, factor="power", gamma=0.5) == pytest.approx(math.sqrt(5))
    assert daa_factor(0.0, factor="power") == 8.0
    with pytest.raises(ValueError, match="group_size"):
        daa_factor(0.1)
    with pytest.raises(ValueError):
        daa_factor(0.1, group_size=G, factor="linear")
    with pytest.raises(ValueError):
        daa_factor(0.1, group_size=G, max_factor=0.5)


def test_difficulty_group_mode():
    tr = DifficultyTracker()
    assert tr.estimate("p", 1, G, "group") == 1 / 16  # never below 1/G
    # beta(1/16) = (1 - (1/16)^15) / (1 - (15/16)^15) = 1 / 0.62079 = 1.6108
    assert round(daa_factor(1 / 16, group_size=G), 2) == 1.61


def test_conditional_and_history_numbers():
    tr = DifficultyTracker()
    q = tr.estimate("p", 1, G, "conditional")
    assert round(q, 3) == 0.047
    assert round(daa_factor(q, group_size=G), 2) == 1.95
    # history: 1, 3, 6 earlier all-wrong groups of the same prompt (each contributes (1-q)^16)
    expected = {1: (0.020, 3, 3.8), 3: (0.0092, 4, 7.8), 6: (0.0051, 4, 13.6)}
    for m, (qv, digits, fv) in expected.items():
        tr = DifficultyTracker()
        for _ in range(m):
            tr.record("p", 0, G)
        q = tr.estimate("p", 1, G, "history")
        assert round(q, digits) == qv, (m, q)
        assert round(daa_factor(q, group_size=G, max_factor=100.0), 1) == fv, (m, q)
        assert daa_factor(q, group_size=G) == min(8.0, daa_factor(q, group_size=G, max_factor=100.0))
    # with no history, history == conditional; another prompt's history does not leak
    tr = DifficultyTracker()
    tr.record("other", 0, G)
    assert tr.estimate("p", 1, G, "history") == tr.estimate("p", 1, G, "conditional")


def test_grid_resolution_is_why_the_numbers_hold():
    # The Beta(1/2,1/2) prior is singular at q = 0 and the k = 1 conditional likelihood tends to
    # 1/G there, so a uniform grid under-weights that mass and converges like 1/sqrt(cells).
    # The documented numbers belong to the default 3500-cell midpoint grid. Reference: substitute
    # q = sin^2(theta), under which Beta(1/2,1/2) is uniform and the integrand smooth.
    n = 20_000
    theta = (torch.arange(n, dtype=torch.float64) + 0.5) / n * (math.pi / 2)
    q = torch.sin(theta) ** 2
    lik = q * (1 - q) ** 15 / (1 - (1 - q) ** 16 - q**16)
    exact = float((q * lik).sum() / lik.sum())
    assert round(exact, 4) == 0.0461  # the converged value: 0.046, not 0.047
    ests = [DifficultyTracker(grid_size=s).estimate("p", 1, G, "conditional") for s in (3500, 40_000, 400_000)]
    assert ests[0] > ests[1] > ests[2] > exact
    assert ests[2] - exact < 2e-4


def test_history_counts_kept_groups_too():
    tr = DifficultyTracker()
    tr.record("p", 8, G)  # an earlier mixed group: q^8 (1-q)^8 pulls the estimate up
    assert tr.estimate("p", 1, G, "history") > tr.estimate("p", 1, G, "conditional")
    assert tr.history("p") == (8, 8)


def test_tracker_state_roundtrip_json():
    tr = DifficultyTracker()
    tr.record("ds/1", 0, G)
    tr.record(("ds", 2), 3, G)
    state = json.loads(json.dumps(tr.state_dict()))
    tr2 = DifficultyTracker(grid_size=100)
    tr2.load_state_dict(state)
    assert tr2.grid_size == tr.grid_size and len(tr2) == 2
    for key in ("ds/1", ("ds", 2), "new"):
        assert tr2.estimate(key, 2, G, "history") == tr.estimate(key, 2, G, "history")


def test_tracker_errors():
    tr = DifficultyTracker()
    with pytest.raises(ValueError):
        tr.estimate("p", 0, G, "conditional")
    with pytest.raises(ValueError):
        tr.estimate("p", 16, G, "history")
    with pytest.raises(ValueError):
        tr.estimate("p", 1, G, "posterior")
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


def test_apply_daa_balanced_uses_group_size():
    # 16 responses, one correct: GRPO advantage of the correct one is 15/16 / std
    r = torch.tensor([1.0] + [0.0] * 15)
    adv = compute_advantages("grpo", r, [0] * 16, torch.ones(16, dtype=torch.bool))
    out, stats = apply_daa(adv, r.bool(), torch.zeros(16, dtype=torch.long), torch.tensor([0.05]), torch.tensor([True]))
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
        out, stats = apply_daa(
            dapo, r.bool(), gidx, torch.full((p,), kwargs["q"]), kwargs["eligible"], max_factor=kwargs["max_factor"]
        )
        assert torch.equal(out, dapo) and stats["amplified_frac"] == 0.0
