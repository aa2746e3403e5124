"""Advantage estimators (ALGORITHMS section 3): hand-computed values, grouping, invalid rows."""

import math

import pytest
import torch

from megatron_rl.algorithms.advantages import (
    ADV_ESTIMATORS,
    check_group_size,
    compute_advantages,
    group_ids_to_index,
)

EPS = 1e-6


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def _valid(n):
    return torch.ones(n, dtype=torch.bool)


def test_grpo_unbiased_and_population():
    r = _t([1.0, 2.0, 3.0])
    # mean 2; squared deviations 1, 0, 1 -> unbiased var 2/2 = 1, std 1
    a = compute_advantages("grpo", r, [0, 0, 0], _valid(3))
    assert torch.allclose(a, _t([-1 / (1 + EPS), 0.0, 1 / (1 + EPS)]), atol=1e-7)
    # population var 2/3, std sqrt(2/3) = 0.816497
    a = compute_advantages("grpo", r, [0, 0, 0], _valid(3), grpo_std="population")
    s = math.sqrt(2 / 3)
    assert torch.allclose(a, _t([-1 / (s + EPS), 0.0, 1 / (s + EPS)]), atol=1e-6)
    assert a.dtype == torch.float32


def test_grpo_without_std_normalisation():
    # Dr. GRPO: r - mean only: [1, 2, 6] mean 3 -> [-2, -1, 3]
    a = compute_advantages("grpo", _t([1.0, 2.0, 6.0]), ["g"] * 3, _valid(3), norm_adv_by_std_in_grpo=False)
    assert torch.equal(a, _t([-2.0, -1.0, 3.0]))


def test_all_equal_group_is_exactly_zero_even_with_rounding():
    # mean of three float 0.1 values is not exactly 0.1 in floating point; max == min catches it
    for name in ADV_ESTIMATORS.names():
        a = compute_advantages(
            name, _t([0.1, 0.1, 0.1, 1.0, 0.0]), [0, 0, 0, 1, 1], _valid(5),
            response_mask=torch.ones(5, 3, dtype=torch.bool),
        )
        assert torch.equal(a[:3], torch.zeros(3)), name


def test_rloo_hand_values_and_invalid_member():
    r = _t([1.0, 2.0, 3.0, 6.0])
    a = compute_advantages("rloo", r, [7, 7, 7, 7], _valid(4))
    # 1 - (2+3+6)/3 = -8/3; 2 - (1+3+6)/3 = -4/3; 3 - (1+2+6)/3 = 0; 6 - (1+2+3)/3 = 4
    assert torch.allclose(a, _t([-8 / 3, -4 / 3, 0.0, 4.0]), atol=1e-6)
    r = _t([1.0, float("nan"), 3.0, 6.0])
    valid = torch.tensor([True, True, True, True])
    a = compute_advantages("rloo", r, [7, 7, 7, 7], valid)
    # NaN is invalid: peers of 1 are {3, 6}: 1 - 4.5 = -3.5; 3 - 3.5 = -0.5; 6 - 2 = 4
    assert torch.allclose(a, _t([-3.5, 0.0, -0.5, 4.0]), atol=1e-6)


def test_reinforce_plus_plus_baseline_token_whitening():
    # groups a = [1, 0] (3 and 1 tokens), b = [3, 1] (1, 1 tokens), c = [5, 5] (1, 1 tokens)
    r = _t([1.0, 0.0, 3.0, 1.0, 5.0, 5.0])
    uid = ["a", "a", "b", "b", "c", "c"]
    mask = torch.zeros(6, 3, dtype=torch.bool)
    for i, n in enumerate([3, 1, 1, 1, 1, 1]):
        mask[i, :n] = True
    a = compute_advantages("reinforce_plus_plus_baseline", r, uid, _valid(6), response_mask=mask)
    # centred: a -> [.5, -.5], b -> [1, -1], c -> [0, 0]; 8 tokens:
    # .5 x3, -.5, 1, -1, 0, 0 -> sum 1, mean 1/8
    # deviations: .375 x3, -.625, .875, -1.125, -.125 x2
    # squares: 3*.140625 + .390625 + .765625 + 1.265625 + 2*.015625 = 2.875; unbiased var 2.875/7
    inv = 1 / math.sqrt(2.875 / 7 + 1e-8)
    expect = [0.375 * inv, -0.625 * inv, 0.875 * inv, -1.125 * inv, 0.0, 0.0]  # c forced to 0
    assert torch.allclose(a, _t(expect), atol=1e-6)
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("reinforce_plus_plus_baseline", r, uid, _valid(6))


def test_invalid_rows_and_small_groups_are_zero_never_nan():
    r = _t([float("nan"), 1.0, float("inf"), 2.0, 4.0, 3.0])
    valid = torch.tensor([True, True, True, True, False, True])
    # group 0: [nan, 1] -> one valid -> 0, 0; group 1: [inf, 2] -> one valid; group 2: [4 (failed), 3]
    for name in ADV_ESTIMATORS.names():
        a = compute_advantages(name, r, [0, 0, 1, 1, 2, 2], valid, response_mask=torch.ones(6, 2, dtype=torch.bool))
        assert torch.equal(a, torch.zeros(6)), name


def test_grouping_is_by_uid_value_not_position():
    idx, p = group_ids_to_index(["b", "a", "b", "c", "a"])
    assert p == 3 and idx.tolist() == [0, 1, 0, 2, 1]
    idx, p = group_ids_to_index(torch.tensor([42, 7, 42, 7, 3]))
    assert p == 3 and idx.tolist() == [0, 1, 0, 1, 2]  # first-appearance order, not sorted
    idx, p = group_ids_to_index(torch.tensor([], dtype=torch.long))
    assert p == 0 and idx.numel() == 0


def test_repeated_prompt_distinct_groups_share_nothing():
    # same prompt drawn twice -> two uids; each group is normalised on its own
    r = _t([1.0, 0.0, 1.0, 1.0])
    a = compute_advantages("grpo", r, ["p1#0", "p1#0", "p1#1", "p1#1"], _valid(4))
    # group p1#0: mean .5, unbiased std sqrt(.5) = .707107 -> +-0.5/0.707107 = +-0.707106
    s = math.sqrt(0.5)
    assert torch.allclose(a, _t([0.5 / (s + EPS), -0.5 / (s + EPS), 0.0, 0.0]), atol=1e-6)


def test_errors():
    with pytest.raises(KeyError, match="grpo"):
        compute_advantages("ppo_gae", _t([1.0, 2.0]), [0, 0], _valid(2))
    with pytest.raises(ValueError, match="grpo_std"):
        compute_advantages("grpo", _t([1.0, 2.0]), [0, 0], _valid(2), grpo_std="biased")
    with pytest.raises(ValueError):
        compute_advantages("grpo", _t([1.0, 2.0]), [0], _valid(2))
    with pytest.raises(ValueError, match="rollout.n"):
        check_group_size("grpo", 1)
    check_group_size("grpo", 2)


def test_rloo_equals_scaled_grpo_without_std_property():
    # r_i - mean_{j!=i} = n/(n-1) (r_i - mean): a cross-check between estimators on random data
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 5, (48,), generator=g).float()
    uid = torch.arange(48) % 6
    a_rloo = compute_advantages("rloo", r, uid, _valid(48))
    a_grpo = compute_advantages("grpo", r, uid, _valid(48), norm_adv_by_std_in_grpo=False)
    assert torch.allclose(a_rloo, a_grpo * 8 / 7, atol=1e-5)
