"""Dynamic sampling (ALGORITHMS section 2): keep rule, batch filling, exhaustion semantics."""

import logging

import pytest
import torch

from megatron_rl.algorithms.dynamic_sampling import (
    DynamicSamplingExhausted,
    collect_groups,
    group_keep_mask,
    keep_group,
    trajectory_rewards,
    validate_dynamic_sampling,
)


def test_group_keep_mask_rules():
    metric = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, float("nan"), 0.5, 0.5, 1.0, 0.0])
    gidx = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    valid = torch.tensor([True, True, True, True, True, True, True, True, True, False])
    # 0: all 1 -> drop; 1: all 0 -> drop; 2: one valid (NaN) -> drop; 3: equal -> drop;
    # 4: the differing response failed -> one valid -> drop
    assert group_keep_mask(metric, gidx, valid).tolist() == [False] * 5
    metric[1] = 0.0
    assert group_keep_mask(metric, gidx, valid).tolist() == [True, False, False, False, False]
    assert group_keep_mask(metric, gidx, valid, num_groups=6).tolist()[-1] is False


def test_keep_group_and_trajectories():
    assert keep_group([1, 0, 0]) and not keep_group([0, 0, 0]) and not keep_group([1, None, float("nan")])
    assert trajectory_rewards([[1, 1], [0], [0, 0, 0]]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        trajectory_rewards([[1, 0]])
    with pytest.raises(ValueError):
        trajectory_rewards([[]])


def _gen_from(schedule, calls):
    """schedule[b] = list of group labels for generation batch b ('m' mixed, 'n' none, 'a' all)."""

    def gen(b):
        calls.append(b)
        return [(b, i, lab) for i, lab in enumerate(schedule(b))]

    return gen


def _keep(g):
    return g[2] == "m"


def _rate(g):
    return {"m": 0.5, "n": 0.0, "a": 1.0}[g[2]]


def test_fills_across_batches_in_order_and_truncates():
    calls = []
    sched = lambda b: ["m", "n", "m", "a"]  # 2 kept per batch
    seen = []
    kept, stats = collect_groups(
        _gen_from(sched, calls), train_batch_size=5, max_num_gen_batches=10, ppo_mini_batch_size=1,
        keep_fn=_keep, solve_rate_fn=_rate, on_group=lambda g, k: seen.append((g[:2], k)),
    )
    assert calls == [0, 1, 2]
    assert [g[:2] for g in kept] == [(0, 0), (0, 2), (1, 0), (1, 2), (2, 0)]  # (batch, index) order
    assert stats == {"num_gen_batches": 3, "kept_groups": 5, "solve_none": 3, "solve_all": 3, "generated_groups": 12}
    assert len(seen) == 12 and sum(k for _, k in seen) == 6  # every group reported, kept or not


def test_train_partial_truncates_to_multiple_of_minibatch_times_dp(caplog):
    calls = []
    sched = lambda b: ["m"] * 3 + ["n"] * 5  # 3 kept per batch
    with caplog.at_level(logging.WARNING):
        kept, stats = collect_groups(
            _gen_from(sched, calls), train_batch_size=32, max_num_gen_batches=3, on_exhausted="train_partial",
            ppo_mini_batch_size=2, dp_size=2, keep_fn=_keep,
        )
    # 9 kept after 3 batches; unit = 2 x 2 = 4 -> 8
    assert calls == [0, 1, 2] and len(kept) == 8 and stats["kept_groups"] == 8
    assert "kept 9 of the 32" in caplog.text
    with pytest.raises(DynamicSamplingExhausted, match="fewer than one mini-batch"):
        collect_groups(
            _gen_from(sched, []), train_batch_size=32, max_num_gen_batches=1, ppo_mini_batch_size=2, dp_size=2,
            keep_fn=_keep,
        )


def test_error_mode_names_numbers():
    sched = lambda b: ["m"] + ["a"] * 3
    with pytest.raises(DynamicSamplingExhausted) as e:
        collect_groups(
            _gen_from(sched, []), train_batch_size=16, max_num_gen_batches=2, on_exhausted="error",
            ppo_mini_batch_size=1, keep_fn=_keep,
        )
    msg = str(e.value)
    assert "kept 2 of the 16" in msg and "2 generation batches" in msg and "max_num_gen_batches=2" in msg
    assert isinstance(e.value, ValueError)


def test_unlimited_and_disabled():
    calls = []
    sched = lambda b: ["n"] * 4 if b < 5 else ["m"] * 4
    kept, stats = collect_groups(
        _gen_from(sched, calls), train_batch_size=4, max_num_gen_batches=0, ppo_mini_batch_size=4, keep_fn=_keep
    )
    assert stats["num_gen_batches"] == 6 and len(kept) == 4  # <= 0: no limit
    calls = []
    kept, stats = collect_groups(
        _gen_from(lambda b: ["n", "a", "m"], calls), train_batch_size=2, max_num_gen_batches=3,
        ppo_mini_batch_size=1, enable=False, keep_fn=_keep,
    )
    assert calls == [0] and [g[2] for g in kept] == ["n", "a"]  # no filtering


def test_argument_validation():
    with pytest.raises(ValueError):
        collect_groups(lambda b: [1], train_batch_size=1, max_num_gen_batches=1, on_exhausted="skip",
                       ppo_mini_batch_size=1, keep_fn=bool)
    with pytest.raises(ValueError, match="no groups"):
        collect_groups(lambda b: [], train_batch_size=1, max_num_gen_batches=1, ppo_mini_batch_size=1, keep_fn=bool)
    with pytest.raises(ValueError, match="rollout.n"):
        validate_dynamic_sampling(rollout_n=1, enable=True)
    validate_dynamic_sampling(rollout_n=1, enable=False)
