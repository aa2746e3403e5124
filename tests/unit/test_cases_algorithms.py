"""CASES B02 B03 B06 B08 B09 B11 B12 B13 B14 (shared/cases/CASES.md), each with exactly the
case's inputs and expected outputs, plus randomized property tests (fixed seeds) for each
family of fault."""

import math
import threading

import pytest
import torch

from megatron_rl.algorithms.advantages import ADV_ESTIMATORS, check_group_size, compute_advantages, group_ids_to_index
from megatron_rl.algorithms.aggregation import aggregate_loss
from megatron_rl.algorithms.dynamic_sampling import (
    DynamicSamplingExhausted,
    collect_groups,
    group_keep_mask,
    keep_group,
    trajectory_rewards,
    validate_dynamic_sampling,
)
from megatron_rl.algorithms.kl import tis_weights
from megatron_rl.algorithms.losses import POLICY_LOSSES, policy_loss_metrics
from megatron_rl.algorithms.reward_shaping import generated_lengths, overlong_penalty, validate_overlong_buffer

NAN = float("nan")
ALL_VALID = lambda n: torch.ones(n, dtype=torch.bool)  # noqa: E731


def _close(actual, expected, atol):
    torch.testing.assert_close(actual.detach().float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------- B02
def test_B02_nan_rewards_singletons_and_std_convention():
    # [1, NaN, 3]: valid {1, 3}, mean 2; population std 1 -> (1-2)/(1+1e-6) = -0.999999
    a = compute_advantages("grpo", torch.tensor([1.0, NAN, 3.0]), [0, 0, 0], ALL_VALID(3), grpo_std="population")
    _close(a, [-1.0, 0.0, 1.0], 1e-5)
    # unbiased: std sqrt(2) = 1.414214 -> -+0.707106
    a = compute_advantages("grpo", torch.tensor([1.0, NAN, 3.0]), [0, 0, 0], ALL_VALID(3))
    _close(a, [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)], 1e-5)
    # singleton group -> 0 (a documented decision; verl would return the raw score 1.0)
    for name in ADV_ESTIMATORS.names():
        for std in ("unbiased", "population"):
            a = compute_advantages(name, torch.tensor([1.0]), [0], ALL_VALID(1), grpo_std=std,
                                   response_mask=torch.ones(1, 4, dtype=torch.bool))
            assert a.tolist() == [0.0]
    # 7 NaN + one 0.5 -> the survivor has no finite peer -> 0, no NaN anywhere
    r = torch.tensor([NAN] * 7 + [0.5])
    for name in ADV_ESTIMATORS.names():
        a = compute_advantages(name, r, [9] * 8, ALL_VALID(8), response_mask=torch.ones(8, 2, dtype=torch.bool))
        assert torch.equal(a, torch.zeros(8)), name
    # [0,0,0,1]: mean .25; population std sqrt(3/16) = .433013 -> -.57735, 1.73205
    r = torch.tensor([0.0, 0.0, 0.0, 1.0])
    _close(compute_advantages("grpo", r, [0] * 4, ALL_VALID(4), grpo_std="population"),
           [-0.57735, -0.57735, -0.57735, 1.73205], 1e-4)
    # unbiased std sqrt(.75/3) = .5 -> -.5, 1.5
    _close(compute_advantages("grpo", r, [0] * 4, ALL_VALID(4)), [-0.5, -0.5, -0.5, 1.5], 1e-5)
    # singleton groups are a config error for group-relative estimators
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError):
            check_group_size(name, 1)


def test_B02_every_path_uses_the_configured_std():
    # the batch-level whitening of reinforce_plus_plus_baseline follows grpo_std as well:
    # one group [0, 1], one token each: centred [-.5, .5]; token var unbiased .5/1, population .5/2
    r, m = torch.tensor([0.0, 1.0]), torch.ones(2, 1, dtype=torch.bool)
    a_u = compute_advantages("reinforce_plus_plus_baseline", r, [0, 0], ALL_VALID(2), response_mask=m)
    a_p = compute_advantages("reinforce_plus_plus_baseline", r, [0, 0], ALL_VALID(2), response_mask=m,
                             grpo_std="population")
    _close(a_u, [-0.5 / math.sqrt(0.5 + 1e-8), 0.5 / math.sqrt(0.5 + 1e-8)], 1e-6)
    _close(a_p, [-0.5 / math.sqrt(0.25 + 1e-8), 0.5 / math.sqrt(0.25 + 1e-8)], 1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_B02_property_nan_and_failed_rewards_never_leak(seed):
    g = torch.Generator().manual_seed(seed)
    n = 64
    r = torch.randn(n, generator=g)
    r[torch.rand(n, generator=g) < 0.2] = NAN
    r[torch.rand(n, generator=g) < 0.05] = float("inf")
    valid = torch.rand(n, generator=g) > 0.1
    uid = torch.randint(0, 12, (n,), generator=g)
    mask = torch.rand(n, 5, generator=g) > 0.3
    ok = valid & torch.isfinite(r)
    for name in ADV_ESTIMATORS.names():
        for std in ("unbiased", "population"):
            a = compute_advantages(name, r, uid, valid, response_mask=mask, grpo_std=std)
            assert torch.isfinite(a).all() and (a[~ok] == 0).all()
            # same as computing on the valid rows alone (an invalid row is as if absent)
            a_sub = compute_advantages(name, r[ok], uid[ok], ALL_VALID(int(ok.sum())), response_mask=mask[ok],
                                       grpo_std=std)
            torch.testing.assert_close(a[ok], a_sub, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- B03
def test_B03_per_group_not_batch_normalisation_and_layouts():
    r = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 1])
    uid = ["a"] * 4 + ["b"] * 4
    a = compute_advantages("grpo", r, uid, ALL_VALID(8))
    # group a all equal -> 0; group b mean .25, unbiased std .5 -> -.5, 1.5
    _close(a, [0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5], 1e-5)
    # the buggy batch-wide result would be [.72]*4 + [-1.21]*3 + [.72]
    assert not torch.allclose(a, torch.tensor([0.72] * 4 + [-1.21] * 3 + [0.72]), atol=0.1)
    # interleaved layout a,b,a,b,...: rewards permuted to match
    r_int = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 1])
    uid_int = ["a", "b"] * 4
    a_int = compute_advantages("grpo", r_int, uid_int, ALL_VALID(8))
    _close(a_int, [0, -0.5, 0, -0.5, 0, -0.5, 0, 1.5], 1e-5)
    # same values once mapped back by group id (integer uids too)
    a_int2 = compute_advantages("grpo", r_int, torch.tensor([5, 3] * 4), ALL_VALID(8))
    assert torch.equal(a_int, a_int2)


@pytest.mark.parametrize("seed", range(4))
def test_B03_property_permutation_invariance(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = 48
    r = torch.randint(0, 3, (n,), generator=g).float()
    uid = torch.randint(0, 10, (n,), generator=g) * 7919  # sparse, unsorted uids
    valid = torch.rand(n, generator=g) > 0.1
    mask = torch.rand(n, 6, generator=g) > 0.2
    perm = torch.randperm(n, generator=g)
    for name in ADV_ESTIMATORS.names():
        a = compute_advantages(name, r, uid, valid, response_mask=mask)
        a_p = compute_advantages(name, r[perm], uid[perm], valid[perm], response_mask=mask[perm])
        torch.testing.assert_close(a_p, a[perm], atol=1e-6, rtol=1e-6)
        # string uids give the same grouping as int uids
        a_s = compute_advantages(name, r, [f"g{int(u)}" for u in uid], valid, response_mask=mask)
        torch.testing.assert_close(a_s, a, atol=0, rtol=0)


# ---------------------------------------------------------------- B06
def _b06_rows():
    # token-loss sums 2, 4, 6, 8
    return [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 1.0, 2.0]),
            torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0])]


def _b06_run(splits, widths, dp):
    theta = torch.ones((), requires_grad=True)
    rows = _b06_rows()
    nums, cnts, start = [], [], 0
    for size, width in zip(splits, widths):
        x = torch.full((size, width), 1e4)  # garbage in the padding
        m = torch.zeros(size, width, dtype=torch.bool)
        for i, row in enumerate(rows[start:start + size]):
            x[i, : len(row)] = row
            m[i, : len(row)] = True
        start += size
        n, c = aggregate_loss(theta * x, m, "seq-mean-token-sum-norm", loss_scale_factor=10.0)
        nums.append(n)
        cnts.append(c)
    # DP ranks hold disjoint micro-batches: megatron-core sums over both, then divides once
    per_rank = [(sum(nums[r::dp]), sum(cnts[r::dp])) for r in range(dp)]
    loss = sum(p[0] for p in per_rank) / sum(p[1] for p in per_rank)
    loss.backward()
    return loss.item(), theta.grad.item()


def test_B06_seq_mean_token_sum_norm_split_invariance():
    # loss = mean([2, 4, 6, 8]) / 10 = 0.5; d loss / d theta = 0.5 (loss is linear in theta)
    for splits, widths in (([4], [7]), ([4], [12]), ([2, 2], [7, 12]), ([1, 1, 1, 1], [7, 12, 7, 12])):
        for dp in (1, 2):
            if len(splits) % dp:
                continue
            loss, grad = _b06_run(splits, widths, dp)
            assert loss == pytest.approx(0.5, abs=1e-7) and grad == pytest.approx(0.5, abs=1e-7), (splits, dp)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_B06_property_random_splits_and_padding(mode):
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(int(n), generator=g) for n in torch.randint(0, 12, (12,), generator=g)]

    def run(order, n_mb, pad):
        theta = torch.tensor(0.5, requires_grad=True)
        nums, cnts = [], []
        for chunk in torch.tensor_split(torch.tensor(order), n_mb):
            sub = [rows[i] for i in chunk.tolist()]
            w = max([len(s) for s in sub] + [1]) + pad
            # finite garbage in the padding (NaN *inputs* upstream of a loss are sanitised by the
            # policy losses themselves; see test_losses.py::test_masked_positions_are_inert_for_every_loss)
            x, m = torch.full((len(sub), w), 1e4), torch.zeros(len(sub), w, dtype=torch.bool)
            for i, s in enumerate(sub):
                x[i, : len(s)], m[i, : len(s)] = s, True
            n, c = aggregate_loss(torch.sin(theta * x), m, mode, loss_scale_factor=16.0)
            nums.append(n)
            cnts.append(c)
        loss = torch.stack(nums).sum() / torch.stack(cnts).sum()
        loss.backward()
        return loss.item(), theta.grad.item()

    ref = run(list(range(12)), 1, 0)
    for n_mb, pad, seed in ((2, 3, 0), (4, 0, 1), (3, 9, 2), (12, 1, 3)):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(seed)).tolist()
        got = run(order, n_mb, pad)
        assert got == pytest.approx(ref, abs=1e-6)


# ---------------------------------------------------------------- B08
def _b08(loss="vanilla", **kw):
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 10.0, 10.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    logp = torch.log(ratios)
    return POLICY_LOSSES.get(loss)(logp, torch.zeros_like(logp), adv, torch.ones(1, 6, dtype=torch.bool), **kw)


def test_B08_sign_aware_dual_clip_and_clipfrac():
    out = _b08(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # (1.5,+1): max(-1.5, -1.28) = -1.28   (0.5,+1): max(-0.5, -0.8) = -0.5
    # (1.5,-1): max(1.5, 1.28) = 1.5       (0.5,-1): max(0.5, 0.8) = 0.8
    # (10,-1): max(10, 1.28) = 10 -> min(10, 3) = 3 (dual clip, A < 0 only)
    # (10,+1): max(-10, -1.28) = -1.28 (the sign-agnostic bug gives -3)
    _close(out.token_loss, [[-1.28, -0.5, 1.5, 0.8, 3.0, -1.28]], 1e-6)
    first4 = torch.tensor([[True] * 4 + [False] * 2])
    m = policy_loss_metrics(out, first4)
    # clipped branch active on (1.5,+1) and (0.5,-1) only: 2/4; the naive |r-1| > eps count is 4/4
    assert m["pg_clipfrac"].item() == 0.5
    assert m["pg_clipfrac_at_high_bound"].item() == 0.25 and m["pg_clipfrac_at_low_bound"].item() == 0.25
    assert m["pg_clipfrac_lower"].item() == 0.0
    m_all = policy_loss_metrics(out, torch.ones(1, 6, dtype=torch.bool))
    # over all six: clipped (1.5,+1), (0.5,-1), (10,+1) = 3/6; dual clip on (10,-1) = 1/6
    assert m_all["pg_clipfrac"].item() == 0.5 and m_all["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    # without effective dual clip (huge c) the (10,-1) token would be 10
    assert _b08(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9).token_loss[0, 4].item() == pytest.approx(10.0)


def test_B08_unknown_kwarg_and_bad_c_raise():
    with pytest.raises(TypeError):
        _b08(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_ratio_c=3.0)  # misspelt key is never swallowed
    with pytest.raises(TypeError):
        _b08("gspo", clip_ratio_c=3.0)
    for c in (1.0, 0.9, 0.0):
        with pytest.raises(ValueError):
            _b08(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)


@pytest.mark.parametrize("seed", range(3))
def test_B08_property_clipping_is_sign_aware(seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(8, 32, generator=g) * 1.5
    adv = torch.randn(8, 32, generator=g) * 2
    mask = torch.rand(8, 32, generator=g) > 0.2
    lo, hi, c = 0.2, 0.28, 3.0
    out = POLICY_LOSSES.get("vanilla")(logp, torch.zeros_like(logp), adv, mask, clip_ratio_low=lo,
                                       clip_ratio_high=hi, clip_ratio_c=c)
    r, l = torch.exp(logp), out.token_loss
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    ref = torch.maximum(-adv * r, -adv * r.clamp(1 - lo, 1 + hi))
    torch.testing.assert_close(l[pos], ref[pos])  # no dual clip for A > 0
    torch.testing.assert_close(l[neg], torch.minimum(ref, -c * adv)[neg])
    assert (l[neg] <= -c * adv[neg] + 1e-6).all()
    # clipped iff the clipped term is strictly the larger one; only possible where the ratio is outside the band
    outside = (r < 1 - lo) | (r > 1 + hi)
    assert not (out.is_clipped & ~outside).any()
    assert torch.equal(out.is_clipped & pos, pos & (r > 1 + hi))
    assert torch.equal(out.is_clipped & neg, neg & (r < 1 - lo))
    assert not (out.is_dual_clipped & ~neg).any()


# ---------------------------------------------------------------- B09
def test_B09_tis_weight_from_old_not_current_logprobs():
    rollout, old = torch.tensor([[-1.0]]), torch.tensor([[-0.9]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    w, _ = tis_weights(old, rollout, mask, clip=2.0)
    # min(exp(-0.9 + 1.0), 2) = exp(0.1) = 1.1051709 (buggy: exp(-0.5 + 1.0) = 1.6487)
    assert w.item() == pytest.approx(1.1051709, abs=1e-6) and not w.requires_grad
    # the weight is a constant of the update: the current logp moves, the weight and its use do not
    for cur in (-0.5, -0.9, -2.0):
        logp = torch.tensor([[cur]], requires_grad=True)
        out = POLICY_LOSSES.get("vanilla")(logp, old, torch.ones(1), mask, clip_ratio_low=10.0 / 11, clip_ratio_high=10.0)
        (out.token_loss * w).sum().backward()
        # d/dlogp of -A * r * w = -r * w with r = exp(cur + 0.9)
        assert logp.grad.item() == pytest.approx(-math.exp(cur + 0.9) * 1.1051709, rel=1e-5)
        assert w.item() == pytest.approx(1.1051709, abs=1e-6)


def test_B09_diagnostics_raw_and_truncated_means_both_logged():
    # raw token weights exp(-0.5) = 0.606531, exp(2.5) = 12.182494, exp(-0.2) = 0.818731
    old = torch.tensor([[-0.5, 2.5, -0.2]])
    rollout = torch.zeros(1, 3)
    w, stats = tis_weights(old, rollout, torch.ones(1, 3, dtype=torch.bool), clip=5.0)
    # raw mean 13.607756 / 3 = 4.535918; truncated (0.606531 + 5 + 0.818731) / 3 = 2.141754
    assert stats["tis/raw_ratio_mean"].item() == pytest.approx(4.535918, abs=2e-6)
    assert stats["tis/weight_mean"].item() == pytest.approx(2.141754, abs=2e-6)
    assert w.mean().item() == pytest.approx(2.141754, abs=2e-6)


# ---------------------------------------------------------------- B11
def _with_timeout(fn, timeout_s=20.0):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "collect_groups hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _stub_generator(reward_of, calls, gen_batch_size=8, n=4):
    """Groups are lists of n per-response acc values from a stub reward."""

    def gen(b):
        calls.append(b)
        return [[reward_of(b, p, j) for j in range(n)] for p in range(gen_batch_size)]

    return gen


def test_B11_all_zero_reward_stops_after_max_batches_and_names_counts():
    calls = []
    gen = _stub_generator(lambda b, p, j: 0.0, calls)
    with pytest.raises(DynamicSamplingExhausted) as e:
        _with_timeout(lambda: collect_groups(gen, train_batch_size=4, max_num_gen_batches=3, on_exhausted="error",
                                             ppo_mini_batch_size=4, keep_fn=keep_group))
    assert calls == [0, 1, 2]
    assert "kept 0 of the 4" in str(e.value) and "max_num_gen_batches=3" in str(e.value)
    # the default train_partial cannot train on 0 groups either: an error that says what to change
    calls.clear()
    with pytest.raises(DynamicSamplingExhausted, match="ppo_mini_batch_size"):
        _with_timeout(lambda: collect_groups(gen, train_batch_size=4, max_num_gen_batches=3, ppo_mini_batch_size=4,
                                             keep_fn=keep_group))
    assert calls == [0, 1, 2]


def test_B11_six_of_eight_mixed_fills_in_first_round():
    calls = []
    # groups 0..5 mixed (response 0 correct), groups 6, 7 all wrong
    gen = _stub_generator(lambda b, p, j: 1.0 if (p < 6 and j == 0) else 0.0, calls)
    kept, stats = _with_timeout(lambda: collect_groups(gen, train_batch_size=4, max_num_gen_batches=3,
                                                       ppo_mini_batch_size=4, keep_fn=keep_group))
    assert calls == [0] and stats["num_gen_batches"] == 1
    assert len(kept) == 4 and sum(len(g) for g in kept) == 16  # 4 x 4 samples, whole groups
    assert all(g == [1.0, 0.0, 0.0, 0.0] for g in kept)


def test_B11_n1_with_filtering_rejected_and_unlimited_documented():
    with pytest.raises(ValueError, match="rollout.n"):
        validate_dynamic_sampling(rollout_n=1, enable=True)
    calls = []
    gen = _stub_generator(lambda b, p, j: float(b >= 4 and j == 0), calls)
    kept, stats = _with_timeout(lambda: collect_groups(gen, train_batch_size=4, max_num_gen_batches=0,
                                                       ppo_mini_batch_size=4, keep_fn=keep_group))
    assert calls == [0, 1, 2, 3, 4] and len(kept) == 4  # <= 0: no limit


@pytest.mark.parametrize("seed", range(6))
def test_B11_property_bounded_calls_and_batch_sizes(seed):
    g = torch.Generator().manual_seed(seed)
    p_mixed = float(torch.rand((), generator=g)) * 0.3
    tbs, mini, dp, max_b = 8, 2, 2, int(torch.randint(1, 5, (), generator=g))
    calls = []

    def gen(b):
        calls.append(b)
        return [[1.0, 0.0] if torch.rand((), generator=g) < p_mixed else [0.0, 0.0] for _ in range(6)]

    try:
        kept, stats = _with_timeout(lambda: collect_groups(gen, train_batch_size=tbs, max_num_gen_batches=max_b,
                                                           ppo_mini_batch_size=mini, dp_size=dp, keep_fn=keep_group))
        assert len(kept) == tbs or (len(kept) % (mini * dp) == 0 and len(kept) >= mini * dp)
        assert all(keep_group(k) for k in kept)
    except DynamicSamplingExhausted:
        pass
    assert len(calls) <= max_b


# ---------------------------------------------------------------- B12
def test_B12_fanout_groups_judged_per_trajectory():
    # (a) group of trajectories of fragments, each fragment carrying its trajectory's reward
    group = [["s1a", "s1b"], ["s2a"], ["s3a", "s3b", "s3c"]]
    reward = {"s1": 1.0, "s2": 0.0, "s3": 0.0}
    frag_rewards = [[reward[f[:2]] for f in traj] for traj in group]
    per_traj = trajectory_rewards(frag_rewards)
    assert per_traj == [1.0, 0.0, 0.0] and keep_group(per_traj)
    idx = torch.zeros(3, dtype=torch.long)
    assert group_keep_mask(torch.tensor(per_traj), idx, ALL_VALID(3)).tolist() == [True]
    all_zero = trajectory_rewards([[0.0] * len(t) for t in group])
    assert not keep_group(all_zero)
    assert group_keep_mask(torch.tensor(all_zero), idx, ALL_VALID(3)).tolist() == [False]


def test_B12_flat_group_with_loo_kept_whole():
    r = torch.tensor([0.0] + [0.95] * 7)
    gidx, p = group_ids_to_index(["g"] * 8)
    keep = group_keep_mask(r, gidx, ALL_VALID(8))
    assert keep.tolist() == [True] and keep[gidx].tolist() == [True] * 8  # whole group kept
    a = compute_advantages("rloo", r, ["g"] * 8, ALL_VALID(8))
    # loser: 0 - 0.95 = -0.95; winners: 0.95 - 6*0.95/7 = 0.135714 (non-zero, group informative)
    _close(a, [-0.95] + [0.95 / 7] * 7, 1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_B12_property_keep_iff_not_all_equal(seed):
    g = torch.Generator().manual_seed(seed)
    n = 60
    metric = torch.randint(0, 2, (n,), generator=g).float()
    gidx = torch.randint(0, 15, (n,), generator=g)
    valid = torch.rand(n, generator=g) > 0.15
    keep = group_keep_mask(metric, gidx, valid, num_groups=15)
    for p in range(15):
        vals = metric[(gidx == p) & valid].tolist()
        assert bool(keep[p]) == keep_group(vals) == (len(set(vals)) > 1)
    perm = torch.randperm(n, generator=g)
    assert torch.equal(group_keep_mask(metric[perm], gidx[perm], valid[perm], num_groups=15), keep)


# ---------------------------------------------------------------- B13
def test_B13_penalty_independent_of_prompt_length():
    lengths = [3000, 3072, 3073, 3328, 4096]
    # threshold 4096 - 1024 = 3072: -(1/1024) = -0.0009765625; -(256/1024) = -0.25; -(1024/1024) = -1
    expected = [0.0, 0.0, -0.0009765625, -0.25, -1.0]
    for prompt_len in (100, 1500):
        s = prompt_len + 4096
        mask = torch.zeros(len(lengths), s, dtype=torch.bool)  # prompt positions are never action tokens
        for i, n in enumerate(lengths):
            mask[i, prompt_len : prompt_len + n] = True
        p = overlong_penalty(generated_lengths(mask), max_response_length=4096, overlong_buffer_len=1024,
                             penalty_factor=1.0)
        assert p.tolist() == expected


def test_B13_property_monotone_and_bounded():
    g = torch.Generator().manual_seed(13)
    for _ in range(5):
        l_max = int(torch.randint(64, 5000, (), generator=g))
        l_buf = int(torch.randint(1, l_max, (), generator=g))
        pf = float(torch.rand((), generator=g)) * 3
        lengths = torch.arange(0, l_max + 200)
        p = overlong_penalty(lengths, max_response_length=l_max, overlong_buffer_len=l_buf, penalty_factor=pf)
        assert (p <= 0).all() and (p >= -pf - 1e-6).all()
        assert (p[1:] <= p[:-1] + 1e-7).all()  # non-increasing in length
        assert (p[: l_max - l_buf + 1] == 0).all()
        assert p[l_max].item() == pytest.approx(-pf, abs=1e-6)


# ---------------------------------------------------------------- B14
def test_B14_generated_tokens_only_validation_and_truncation():
    # (a) 3000 generated tokens + 1500 tool-output tokens (action mask 0) -> length 3000 -> 0
    mask = torch.zeros(1, 4500, dtype=torch.bool)
    mask[0, :2000] = True
    mask[0, 3500:] = True  # tool output sits in the middle
    lengths = generated_lengths(mask)
    assert lengths.tolist() == [3000]
    kw = dict(max_response_length=4096, overlong_buffer_len=1024, penalty_factor=1.0)
    assert overlong_penalty(lengths, **kw).tolist() == [0.0]
    # the buggy length 4500 would give -1.0 (capped)
    assert overlong_penalty(torch.tensor([4500]), **kw).tolist() == [-1.0]
    # (b) buffer 5000 >= max 4096 -> config error
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        validate_overlong_buffer(max_response_length=4096, overlong_buffer_len=5000, penalty_factor=1.0)
    # (c) truncated response: 4096 tokens, no EOS -> exactly -1.0, never below -factor
    assert overlong_penalty(torch.tensor([4096]), **kw).tolist() == [-1.0]
    assert overlong_penalty(torch.tensor([4096, 100000]), max_response_length=4096, overlong_buffer_len=1024,
                            penalty_factor=0.5).tolist() == [-0.5, -0.5]
