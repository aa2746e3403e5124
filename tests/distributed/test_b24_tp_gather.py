"""Case B24 (slime#2280): tensor-parallel shards must be gathered before a sync or export, by a
partition dim that does not depend on megatron's parameter attributes, and a parameter whose
partitioning cannot be established must stop the sync before anything is sent."""

import pytest

from tiny_qwen2 import run_ranks

pytestmark = pytest.mark.timeout(300)


def test_b24_gather_by_name_and_fail_fast():
    results = run_ranks("b24", 2, timeout_s=240)
    assert len(results) == 2
    for r in results:
        e = r["errors"]
        assert "megatron marks its partition dim as 1, its name says 0" in e["contradiction"]
        assert "linear_fc1.weight" in e["contradiction"]
        assert "linear_qkv.weight: local shape (128, 64) is not a 1/2 shard (dim 0)" in e["full-size shard"], e
        assert "extra_expert" in e["unmapped"] and "no HF mapping" in e["unmapped"]
