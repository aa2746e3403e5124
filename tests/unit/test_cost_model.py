"""benchmarks/cost_model.py against hand-computed cases (docs/cost_model.md has the formulas)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.fixture(scope="module")
def cm():
    spec = importlib.util.spec_from_file_location("cost_model", REPO / "benchmarks" / "cost_model.py")
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["cost_model"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_qwen25_32b_parameter_count(cm):
    shape = cm.ModelShape.from_hf_config(json.loads((REPO / "examples/qwen2.5-32b/config.json").read_text()))
    # q 5120*5120 + 5120 bias, k and v 5120*1024 + 1024 each, o 5120*5120, MLP 3*5120*27648, 2 norms of 5120
    layer = (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120
    assert layer == 487_605_248
    assert shape.params_per_layer() == layer
    # 64 layers + untied embedding and output (152064 x 5120 each) + final norm
    assert shape.total_params() == 64 * layer + 2 * 152064 * 5120 + 5120 == 32_763_876_352
    # KV cache per token on one GPU of TP 4: 2 (K, V) x 64 layers x 2 KV heads x 128 x 2 bytes
    assert shape.kv_bytes_per_token(4) == 65_536


def test_memory_per_gpu_hand_computed_case(cm):
    """h 1024, f 4096, 8 layers, 16 heads, 4 KV heads (d 64), vocabulary 32000, untied, QKV bias;
    TP 2 x PP 2 x DP 2, sequence parallel, distributed optimizer, full recompute, one 4096-token
    micro-batch, 8 micro-batches an update."""
    shape = cm.ModelShape(hidden=1024, ffn=4096, layers=8, heads=16, kv_heads=4, vocab=32000)
    layout = cm.TrainLayout(tp=2, pp=2, dp=2, seq_len=4096, microbatches_per_update=8)
    # layer: q 1024^2, k+v 2*1024*256, o 1024^2, biases 1024+512, MLP 3*1024*4096, norms 2048
    assert shape.params_per_layer() == 15_207_936
    # per GPU: 4 layers / TP 2 + embedding (vocab 32000 is a multiple of 128 x 2) / TP 2 [+ final norm]
    params = cm.stage_params(shape, layout)
    assert params["first"] == 4 * 15_207_936 / 2 + 32000 * 1024 / 2 == 46_799_872
    assert params["last"] == 46_799_872 + 1024
    m = cm.memory_per_gpu(shape, layout)
    assert m["stage"] == "last"
    last = 46_800_896
    static = last * (2 + 4 + 12 / 2)  # bf16 weights + fp32 grads + (fp32 params, Adam m, v) / DP
    kept = 1 * 4 * (2 * 1024 * 4096 / 2)  # 1 micro-batch in flight, 4 layers, layer input 2 s h / TP
    # one layer without recompute, bytes per token / TP: sharded (Q 2h, K+V 4gd, attention out 2h,
    # FC1 out 4f, SwiGLU out 2f, lse 4a) + replicated-without-SP (norm inputs 4h, QKV in 2h, FC1 in 2h)
    per_token = (2 * 1024 + 4 * 256 + 2 * 1024 + 6 * 4096 + 4 * 16 + 8 * 1024) / 2
    assert per_token == 18_976
    working = 2 * per_token * 4096  # recomputed activations + their gradients
    logits = 4096 * 16000 * 22  # tokens x vocabulary / TP x 22 bytes
    frag = 0.1 * (kept + working + logits)
    total = static + kept + working + logits + frag + 5 * GIB
    assert total == pytest.approx(7_705_742_540.8)
    assert m["total_gib"] == pytest.approx(total / GIB, rel=1e-12)
    assert m["stages"]["first"] == pytest.approx(
        (46_799_872 * 12 + 2 * 4 * 4_194_304 + working + 0.1 * (2 * 4 * 4_194_304 + working) + 5 * GIB) / GIB)


def test_selective_and_no_recompute_keep_every_layers_activations(cm):
    shape = cm.ModelShape(hidden=1024, ffn=4096, layers=8, heads=16, kv_heads=4, vocab=32000)
    full = cm.memory_per_gpu(shape, cm.TrainLayout(tp=2, pp=2, dp=2, seq_len=4096, microbatches_per_update=8))
    sel = cm.memory_per_gpu(shape, cm.TrainLayout(tp=2, pp=2, dp=2, seq_len=4096, microbatches_per_update=8,
                                                  recompute="selective"))
    first = sel["per_stage_items"]["first"]
    kept = next(v for k, v in first.items() if k.startswith("activations kept"))
    # first stage: 2 micro-batches in flight x 4 layers x 18976 bytes/token x 4096 tokens
    assert kept == pytest.approx(2 * 4 * 18_976 * 4096 / GIB)
    assert sel["total_gib"] > full["total_gib"]


def test_layout_errors_name_the_setting(cm):
    shape = cm.ModelShape(hidden=1024, ffn=4096, layers=8, heads=16, kv_heads=4, vocab=32000)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size 3"):
        cm.stage_params(shape, cm.TrainLayout(tp=1, pp=3, dp=1, seq_len=16))
    with pytest.raises(ValueError, match="tensor_model_parallel_size 3"):
        cm.stage_params(shape, cm.TrainLayout(tp=3, pp=1, dp=1, seq_len=16))
    with pytest.raises(ValueError, match="recompute"):
        cm.TrainLayout(tp=1, pp=1, dp=1, seq_len=16, recompute="some")
    with pytest.raises(KeyError, match="hidden_size"):
        cm.ModelShape.from_hf_config({"num_hidden_layers": 2})


def test_decode_iteration_hand_computed(cm):
    shape = cm.QWEN25_32B
    t = cm.decode_iteration_s(shape, cm.H100, 4, 100, 1000.0)
    weights = 32_763_876_352 * 2 / 4
    kv = 100 * 1000 * 65_536
    t_mem = (weights + kv) / (3.35e12 * 0.6)
    t_flops = (2 * 32_763_876_352 / 4 * 100 + 4 * 100 * 1000 * 5120 * 64 / 4) / (989e12 * 0.5)
    assert t_mem > t_flops  # memory-bound at batch 100
    assert t == pytest.approx(t_mem + 2 * 64 * 20e-6 + 2e-3)
    eng = cm.engine_memory(shape, cm.H100, cm.RolloutEngine(tp=4, mem_fraction=0.85))
    assert eng["weights_gib"] == pytest.approx(weights / GIB)
    assert eng["kv_tokens"] == pytest.approx((0.85 * 79.6 * GIB - weights) / 65_536)


def test_recipe_layouts_match_the_yaml_and_sbatch(cm):
    rows = {r["recipe"]: r for r in cm.recipe_layouts()}
    d = rows["dapo"]
    assert (d["layout"].tp, d["layout"].pp, d["layout"].dp) == (8, 2, 2)
    assert d["layout"].seq_len == 2048 + 20480 and d["layout"].recompute == "full"
    assert (d["trainer_nodes"], d["rollout_nodes"], d["rollout_tp"]) == (4, 4, 4)
    assert rows["grpo"]["layout"].ref_model and not d["layout"].ref_model
    for r in rows.values():  # every recipe's layout fits an H100 80GB with room to spare
        assert cm.memory_per_gpu(cm.QWEN25_32B, r["layout"])["total_gib"] < 0.6 * cm.H100.memory_gib


def test_colocated_memory_phases_hand_computed(cm):
    """Qwen2.5-0.5B-like shape on an H100, engine TP 1 at 0.5: update = residual 4 + weights + one bucket of 0.5;
    generate = residual 4 + 0.5 x 79.6; train = the trainer's own total + the engine residue 1.5."""
    shape = cm.ModelShape(hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied_embeddings=True)
    lay = cm.TrainLayout(tp=1, pp=1, dp=1, seq_len=1024)
    eng = cm.RolloutEngine(tp=1, mem_fraction=0.5)
    m = cm.colocated_memory(shape, lay, cm.H100, eng)
    w = shape.total_params() * 2 / 2**30
    assert m["phases_gib"]["update"] == pytest.approx(4 + w + 0.5)
    assert cm.colocated_memory(shape, lay, cm.H100, eng, buffers=2)["phases_gib"]["update"] == pytest.approx(4 + w + 1.0)
    assert m["phases_gib"]["generate"] == pytest.approx(4 + 0.5 * 79.6)
    assert m["phases_gib"]["train"] == pytest.approx(cm.memory_per_gpu(shape, lay)["total_gib"] + 1.5)
    assert m["fits"]
    st = cm.colocated_step_time(shape, cm.RLRecipe(), lay, 1, engine=eng)
    assert st["gpus"] == 8 and st["step_s"] == pytest.approx(
        st["rollout_s"] + st["logprob_s"] + st["update_s"] + st["offload_onload_s"] + st["handover_s"])


@pytest.fixture(scope="module")
def cma(cm):
    spec = importlib.util.spec_from_file_location("cost_model_async", REPO / "benchmarks" / "cost_model_async.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_async_step_hand_computed(cma):
    """eta = 1 (docs/cost_model.md "Asynchronous step"): max(rollout + re-prefill, log-probs + update) + sync;
    run = steps x step + one rollout to fill the pipeline, on the same GPUs."""
    st = {"rollout_s": 600.0, "logprob_s": 100.0, "update_s": 300.0, "weight_sync_s": 3.0, "step_s": 1003.0, "gpus": 64}
    a = cma.async_step(st, reprefill_s=20.0)
    assert (a["rollout_side_s"], a["train_side_s"], a["async_step_s"], a["bound"]) == (620.0, 400.0, 623.0, "rollout")
    assert a["speedup"] == pytest.approx(1003 / 623)
    b = cma.async_step({**st, "rollout_s": 300.0, "update_s": 400.0, "step_s": 803.0})
    assert (b["async_step_s"], b["bound"]) == (503.0, "train")
    r = cma.async_run_cost(st, 400, reprefill_s=20.0)
    assert r["wall_hours"] == pytest.approx((400 * 623 + 600) / 3600)  # 69.39 h
    assert r["gpu_hours"] == pytest.approx(64 * 69.38888889)  # 4440.9
    assert r["sync_gpu_hours"] == pytest.approx(64 * 400 * 1003 / 3600)  # 7132.4


def test_async_reprefill_and_recipe_step(cm, cma):
    """Re-prefill of the partial rollouts, by hand: running batch = KV pool tokens // live context
    (200 + 4000 x (1 + 1) / 2 = 4200), each token 2 N + 2 h L x 4200 FLOPs on 4 GPUs at 50 % of 989
    TFLOP/s; the recipes' 4 + 4 nodes then run a rollout-bound step ~1.42x faster than synchronous."""
    shape, recipe, cl = cm.QWEN25_32B, cm.RLRecipe(), cm.Cluster()
    kv_tokens = (0.85 * 79.6 * GIB - 32_763_876_352 * 2 / 4) / 65_536
    batch = int(min(1024, kv_tokens // 4200))
    want = batch * 4200 * (2 * 32_763_876_352 + 2 * 5120 * 64 * 4200) / (4 * 989e12 * 0.5)
    assert cma.reprefill_s(cm, shape, recipe, cl) == pytest.approx(want)  # ~30 s
    st = cm.step_time(shape, recipe, cl)
    a = cma.async_step(st, want)
    assert a["async_step_s"] == pytest.approx(max(st["rollout_s"] + want, st["logprob_s"] + st["update_s"])
                                              + st["weight_sync_s"])
    assert a["bound"] == "rollout" and 1.40 < a["speedup"] < 1.45  # 58.5 -> 41.4 min a step
