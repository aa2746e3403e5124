"""benchmarks/moe_sync.py's pure functions against hand-computed bytes: the export footprint and
memory budget of the tiny Qwen3-MoE and of the 30B-A3B-shaped 2-layer model, the broadcast plan
of a few tensors, the median split of metrics rows. No timing here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.benchmark_module import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ms():
    return load_benchmark("moe_sync")


def test_footprint_of_the_tiny_moe(ms):
    """examples/tiny/moe_base_model: hidden 128, 4 layers, 4 / 2 heads of 32, 8 experts of 128,
    vocabulary 128, untied, float32."""
    cfg = json.loads((REPO / "examples" / "tiny" / "moe_base_model" / "config.json").read_text())
    f = ms.export_footprint(cfg, itemsize=4, ep_size=2)
    expert = 3 * 128 * 128 * 4                      # gate, up, down of one expert: 196,608 B
    layer_experts = 8 * expert                      # 1,572,864 B
    attn = (128 * 128 + 2 * 64 * 128 + 128 * 128 + 2 * 32) * 4  # q, k, v, o, q_norm, k_norm
    layer_other = attn + 8 * 128 * 4 + 2 * 128 * 4  # + router + the two layer norms
    head = 2 * 128 * 128 * 4 + 128 * 4              # embedding, lm_head (untied), final norm
    total = head + 4 * (layer_experts + layer_other)
    assert f["total_bytes"] == total == 7_230_976
    assert f["num_tensors"] == 3 + 4 * (24 + 9) == 135
    assert f["expert_bytes"] == 4 * layer_experts
    assert f["largest_expert_group_bytes"] == layer_experts
    assert f["largest_shard_bytes"] == total - 4 * layer_experts // 2 == 4_085_248
    assert f["budget_bytes"] == 1.5 * 4_085_248 + layer_experts
    assert f["expert_bytes_one"] == expert and f["ep_gather_bytes"] == 2 * expert
    assert f["budget_strict_bytes"] == 1.5 * 4_085_248 + 2 * expert
    assert f["largest_tensor"]["bytes"] == 128 * 128 * 4


def test_footprint_of_the_30b_shaped_model(ms):
    """Qwen3-30B-A3B cut to 2 layers, bf16: 128 experts of 2048 x 768 (x3), vocabulary 151936, untied."""
    cfg = ms.synthetic_30b_config(2)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"],
            cfg["num_experts_per_tok"], cfg["vocab_size"]) == (2, 2048, 128, 768, 8, 151936)
    f = ms.export_footprint(cfg, itemsize=2, ep_size=2)
    expert = 3 * 2048 * 768 * 2
    layer_experts = 128 * expert                    # 1.208 GB
    attn = (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 128) * 2
    layer_other = attn + 128 * 2048 * 2 + 2 * 2048 * 2
    head = 2 * 151936 * 2048 * 2 + 2048 * 2
    assert f["total_bytes"] == head + 2 * (layer_experts + layer_other) == 3_737_146_368
    assert f["largest_expert_group_bytes"] == layer_experts == 1_207_959_552
    assert f["largest_shard_bytes"] == f["total_bytes"] - layer_experts == 2_529_186_816
    assert f["largest_tensor"] == {"name": "model.embed_tokens.weight", "bytes": 151936 * 2048 * 2}
    assert ms.synthetic_30b_config(2, vocab_size=32768)["vocab_size"] == 32768


def test_footprint_refuses_an_ep_size_that_does_not_split_the_experts(ms):
    cfg = json.loads((REPO / "examples" / "tiny" / "moe_base_model" / "config.json").read_text())
    with pytest.raises(ValueError, match="do not split over EP 3"):
        ms.export_footprint(cfg, itemsize=4, ep_size=3)


def test_broadcast_plan(ms):
    """Buckets of at most 1 MiB (alignment included); flattened: one message a bucket, null: one a tensor."""
    metas = [("a", torch.bfloat16, (3,)),             # 6 B
             ("b", torch.float32, (1024, 128)),       # 512 KiB, starts at 8 (aligned to 4)
             ("c", torch.float32, (1024, 256)),       # 1 MiB: does not fit, a bucket of its own
             ("d", torch.bfloat16, (5,))]             # 10 B
    flat = ms.broadcast_plan(metas, 1.0, "flattened_bucket")
    assert flat["bucket_bytes"] == [8 + 512 * 1024, 1024 * 1024, 10]
    assert flat["messages"] == [[8 + 512 * 1024, 1], [1024 * 1024, 1], [10, 1]]
    per_tensor = ms.broadcast_plan(metas, 1.0, None)
    assert per_tensor["bucket_bytes"] == flat["bucket_bytes"]
    assert per_tensor["messages"] == [[6, 2], [512 * 1024, 4], [1024 * 1024, 4], [10, 2]]
    with pytest.raises(ValueError):
        ms.broadcast_plan(metas, 1.0, "direct")


def test_median_split_and_gbps(ms):
    rows = [{"timing/step_s": 3.0, "timing/update_s": 1.0}, {"timing/step_s": 1.0, "timing/update_s": 2.0},
            {"timing/step_s": 2.0}]
    got = ms.median_split(rows, {"step": "timing/step_s", "update": "timing/update_s", "sync": "timing/weight_sync_s"})
    assert got == {"step": 2.0, "update": 1.5, "sync": None}
    assert ms.gbps(2e9, 4.0) == 0.5
