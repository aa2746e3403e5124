"""Issue 32 (seams): the ranks of a weight-transfer group are checked before any rank joins it
(`megatron_rl.weight_sync.ranks`): a wrong count fails at once naming the engine, instead of
hanging the rendezvous. Numbers by hand."""

from __future__ import annotations

import pytest

from megatron_rl.errors import WeightSyncError
from megatron_rl.weight_sync.ranks import engine_transfer_ranks, plan_transfer_ranks


def test_offsets_follow_each_engine_s_ranks():
    # a vLLM engine at TP 2 x DP 2 (4 ranks), an SGLang engine at TP 1, a vLLM engine at TP 2
    plan = plan_transfer_ranks([("http://a", 4), ("http://b", 1), ("http://c", 2)])
    assert plan.offsets == (1, 5, 6) and plan.sizes == (4, 1, 2) and plan.world_size == 8


@pytest.mark.parametrize("size", [0, -1, None, "2", 1.5, True])
def test_an_impossible_size_names_the_engine_and_what_it_reported(size):
    with pytest.raises(WeightSyncError, match=r"http://b reports .* expected a whole number >= 1"):
        plan_transfer_ranks([("http://a", 1), ("http://b", size)])


def test_an_engine_listed_twice_is_refused():
    with pytest.raises(WeightSyncError, match="http://a is listed twice"):
        plan_transfer_ranks([("http://a", 1), ("http://b", 1), ("http://a", 1)])
    with pytest.raises(WeightSyncError, match="at least one engine"):
        plan_transfer_ranks([])


def test_engine_ranks_use_vllm_s_data_parallel_arithmetic():
    # rank_offset + dp_rank * (TP x PP) + rank: TP x PP 2, DP 3, offset 5, world 11
    assert engine_transfer_ranks(5, 11, replica_world_size=2, dp_size=3) == [5, 6, 7, 8, 9, 10]
    assert engine_transfer_ranks(1, 2, replica_world_size=1, dp_size=1) == [1]


def test_engine_ranks_past_the_world_size_are_refused_naming_expected_and_got():
    with pytest.raises(ValueError, match=r"http://e has 4 transfer ranks \(TP x PP 2 x DP 2\).*at least 6 ranks, "
                                         r"got world_size 5"):
        engine_transfer_ranks(2, 5, replica_world_size=2, dp_size=2, engine="http://e")
    with pytest.raises(ValueError, match="rank 0 of the transfer group is the trainer's"):
        engine_transfer_ranks(0, 5, replica_world_size=1, dp_size=1)
