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


# ---- Mixture-of-Experts (issue 29): benchmarks/cost_model_moe.py ---------------------------------------------

@pytest.fixture(scope="module")
def cmm(cm):
    import sys

    for name in ("cost_model_async", "cost_model_moe"):  # cost_model_moe imports both by name
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["cost_model_moe"]


def test_qwen3_30b_a3b_total_and_active_parameters(cmm):
    """Qwen3-30B-A3B by hand (examples/qwen3-30b-a3b/config.json): the model card's 30.5 B total, 3.3 B active."""
    shape = cmm.MoEShape.from_hf_config(json.loads((REPO / "examples/qwen3-30b-a3b/config.json").read_text()))
    assert shape == cmm.QWEN3_30B_A3B
    # attention: q 2048 x 32*128, k and v 2048 x 4*128 each, o 4096 x 2048, q/k norms 128 each; router 2048 x 128;
    # two RMSNorms of 2048; 128 experts of gate + up + down 3 x 2048 x 768
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128
    dense = attn + 2048 * 128 + 2 * 2048
    expert = 3 * 2048 * 768
    assert (shape.attention_params_per_layer(), shape.expert_params()) == (18_874_624, 4_718_592)
    assert shape.params_per_layer() == dense + 128 * expert == 623_120_640
    assert shape.active_params_per_layer() == dense + 8 * expert == 56_889_600
    emb = 2 * 151_936 * 2048 + 2048  # untied embedding and output layer + final norm
    assert shape.total_params() == 48 * 623_120_640 + emb == 30_532_122_624
    assert shape.active_params() == 48 * 56_889_600 + emb == 3_353_032_704
    assert shape.expert_params_total() == 48 * 128 * expert == 28_991_029_248
    assert shape.kv_bytes_per_token(4) == 2 * 48 * 1 * 128 * 2 == 24_576  # 4 KV heads / TP 4
    assert shape.experts_touched(1) == pytest.approx(8) and shape.experts_touched(10_000) == pytest.approx(128)


SMALL_MOE = dict(hidden=256, moe_ffn=128, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=1024, experts=8, topk=2)


def test_moe_memory_per_gpu_hand_computed(cmm):
    """h 256, expert width 128, 4 layers, 4 heads / 2 KV (d 64), vocabulary 1024, 8 experts top-2; TP 2 x DP 4
    (8 GPUs), EP 2 with expert TP 2 -> expert-DP 8 / (2 x 2) = 2; one 1024-token micro-batch, full recompute."""
    shape = cmm.MoEShape(**SMALL_MOE)
    lay = cmm.MoETrainLayout(tp=2, pp=1, dp=4, ep=2, seq_len=1024, microbatches_per_update=8)
    assert (lay.expert_tp, lay.expert_dp, lay.world) == (2, 2, 8)
    # dense per GPU: 4 x (attention 196,736 / TP 2 + router 2048 + norms 512, both replicated) + embedding and
    # output 1024 x 256 / 2 each + final norm 256; experts: 4 layers x 8 x 98,304 / (EP 2 x ETP 2)
    p = cmm.moe_stage_params(shape, lay)["last"]
    assert p == {"dense": 4 * (196_736 / 2 + 2048 + 512) + 2 * 1024 * 256 / 2 + 256, "expert": 4 * 8 * 98_304 / 4}
    d, e = 666_112, 786_432
    assert (p["dense"], p["expert"]) == (d, e)
    static = (2 + 4) * (d + e) + 12 * d / 4 + 12 * e / 2  # bf16 + fp32 grads; optimizer / DP 4 (dense), / 2 (experts)
    kept = 4 * 2 * 256 * 1024 / 2  # 4 layers' inputs, 2 h / TP a token
    # one layer a token: attention (Q 2q + K,V 4gd + out 2q + lse 4a) / 2 + (norm inputs 4h + QKV in 2h) / 2
    # + router 8 E / 2 = 776 + 768 + 32; pairs 1024 x 2 / EP 2 x 1.5 = 1536 of 6h + 6f / ETP = 1920 bytes
    layer = 1024 * (776 + 768 + 32) + 1536 * 1920
    assert cmm.moe_layer_working_bytes(shape, lay) == layer == 4_562_944
    logits = 1024 * 512 * 22
    total = static + kept + 2 * layer + logits + 0.1 * (kept + 2 * layer + logits) + 5 * GIB
    m = cmm.moe_memory_per_gpu(shape, lay)
    assert m["total_gib"] == pytest.approx(total / GIB, rel=1e-12)
    assert (m["dense_params_per_gpu"], m["expert_params_per_gpu"]) == (d, e)
    with pytest.raises(ValueError, match="expert_model_parallel_size 3"):
        cmm.moe_stage_params(shape, cmm.MoETrainLayout(tp=1, pp=1, dp=3, ep=3, seq_len=16))
    with pytest.raises(ValueError, match="does not divide into expert_tensor_parallel_size 2 x expert_model_parallel_size 4"):
        cmm.MoETrainLayout(tp=2, pp=1, dp=2, ep=4, seq_len=16)
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        cmm.MoETrainLayout(tp=2, pp=1, dp=1, ep=1, seq_len=16, sequence_parallel=False)


def test_alltoall_volume_hand_computed(cmm):
    """1000 tokens, 4 passes, the small model at TP 2 / ETP 2 x EP 2 on 8 GPUs: a token leaves for half its
    2 experts (EP 2) in dispatch and combine, 2 x 2 x 2h x 1/2 = 1024 bytes a layer and pass; the expert-TP
    all-gather / reduce-scatter adds T k (ETP - 1) 4h / world a layer and pass per GPU."""
    shape = cmm.MoEShape(**SMALL_MOE)
    lay = cmm.MoETrainLayout(tp=2, pp=1, dp=4, ep=2, seq_len=1024)
    v = cmm.alltoall_volume(shape, lay, 1000, 4)
    assert v["bytes_per_token_layer_pass"] == 1024
    assert v["total_bytes"] == 1024 * 1000 * 4 * 4 and v["per_gpu_bytes"] == 16_384_000 / 8
    assert v["etp_bytes_per_gpu"] == 1000 * 2 * 1 * 4 * 256 / 8 * 4 * 4 == 4_096_000
    assert v["nodes_spanned"] == 1 and v["ib_bytes_per_gpu"] == 0
    assert v["seconds"] == pytest.approx((2_048_000 + 4_096_000) / (450e9 * 0.6))
    # 2 GPUs a node: the EP group (ranks r, r + 2) spans 2 nodes, so the all-to-all goes over InfiniBand
    x = cmm.alltoall_volume(shape, lay, 1000, 4, cmm.Links(gpus_per_node=2))
    assert (x["nodes_spanned"], x["ib_bytes_per_gpu"], x["nvlink_bytes_per_gpu"]) == (2, 2_048_000, 4_096_000)
    assert x["seconds"] == pytest.approx(max(4_096_000 / (450e9 * 0.6), 2_048_000 / (50e9 * 0.6)))
    # Qwen3-30B-A3B, EP 2: 2 x 8 x 2 x 2048 x 1/2 = 32 KiB a token, layer and pass
    q = cmm.alltoall_volume(cmm.QWEN3_30B_A3B, cmm.MoETrainLayout(tp=4, pp=1, dp=8, ep=2, seq_len=16), 1, 1)
    assert q["bytes_per_token_layer_pass"] == 32_768


def test_ep_sync_bytes_hand_computed(cmm):
    """Qwen3-30B-A3B at TP 4 x EP 2 (ETP 4): the source rank gathers 3/4 of the dense weights, half the experts
    over EP and 3/4 of its own EP half over expert TP; the engines receive the whole bf16 checkpoint once."""
    shape = cmm.QWEN3_30B_A3B
    s = cmm.ep_sync_bytes(shape, cmm.MoETrainLayout(tp=4, pp=1, dp=8, ep=2, seq_len=16))
    experts, total = 28_991_029_248 * 2, 30_532_122_624 * 2
    assert s["broadcast_bytes"] == total == 61_064_245_248
    assert s["tp_gather_bytes"] == (total - experts) * 3 / 4
    assert s["ep_gather_bytes"] == experts / 2 == 28_991_029_248
    assert s["etp_gather_bytes"] == experts / 2 * 3 / 4
    assert s["broadcast_s"] == pytest.approx(total / 20e9)  # 3.05 s
    assert s["gather_s"] == pytest.approx((s["tp_gather_bytes"] + s["etp_gather_bytes"] + s["ep_gather_bytes"])
                                          / (450e9 * 0.6))  # the EP group inside a node: all over NVLink


def test_moe_decode_reads_only_the_touched_experts(cmm, cm):
    """Batch 1 reads the dense weights and the 8 experts of its token in each layer; a large batch reads all 128."""
    shape, dm = cmm.QWEN3_30B_A3B, cm.DecodeModel()
    dense = 30_532_122_624 - 28_991_029_248
    weights = (dense + 48 * 8 * 4_718_592) * 2 / 4
    kv = 1 * 1000 * 24_576
    t_mem = (weights + kv) / (3.35e12 * 0.6)
    t = cmm.moe_decode_iteration_s(shape, cm.H100, 4, 1, 1000.0)
    assert t == pytest.approx(t_mem + 2 * 48 * 20e-6 + 2e-3)  # memory-bound
    big = cmm.moe_decode_iteration_s(shape, cm.H100, 4, 500, 1000.0)
    t_big = (30_532_122_624 * 2 / 4 + 500 * 1000 * 24_576) / (3.35e12 * 0.6)
    assert big == pytest.approx(t_big + 2 * 48 * 20e-6 + 2e-3, rel=1e-6)


def test_qwen3_30b_a3b_recipe_layout_and_step(cmm, cm):
    """examples/qwen3-30b-a3b/dapo.yaml + slurm/qwen3-30b-a3b-dapo.sbatch: TP 4 x PP 1 x DP 8, EP 2 (ETP 4,
    expert-DP 4) on 4 trainer nodes, engines of TP 4 on 4 rollout nodes, router replay on; the trainer fits an
    H100 80GB with > 10 GiB to spare; the step is the sum of its parts and eta = 1 overlaps them."""
    r = cmm.recipe_layout(REPO)
    lay = r["layout"]
    assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.expert_tp, lay.expert_dp) == (4, 1, 8, 2, 4, 4)
    assert lay.seq_len == 22_528 and lay.recompute == "full" and r["router_replay"]
    assert (r["trainer_nodes"], r["rollout_nodes"], r["rollout_tp"]) == (4, 4, 4)
    m = cmm.moe_memory_per_gpu(cmm.QWEN3_30B_A3B, lay)
    assert m["total_gib"] < cm.H100.memory_gib - 10
    assert cmm.ep_nodes_spanned(lay, 8) == 1  # the EP group (ranks r, r + 4) stays inside a node
    cl = cm.Cluster(engine=cm.RolloutEngine(tp=4, mem_fraction=0.85), train_hfu=cmm.MOE_TRAIN_HFU)
    st = cmm.moe_step_time(cmm.QWEN3_30B_A3B, r["recipe"], cl, lay)
    assert st["step_s"] == pytest.approx(st["rollout_s"] + st["logprob_s"] + st["update_s"] + st["weight_sync_s"])
    tokens = 512 * 16 * (200 + 4000)
    fwd = (2 * 3_353_032_704 + 2 * 4096 * 48 * 4200) * tokens
    a2a = cmm.alltoall_volume(cmm.QWEN3_30B_A3B, lay, tokens, 1)["seconds"]
    assert st["logprob_s"] == pytest.approx(fwd / (32 * 989e12 * 0.20) + a2a)
    a = cmm.cma.async_step(st, cmm.moe_reprefill_s(cmm.QWEN3_30B_A3B, r["recipe"], cl))
    assert a["bound"] == "rollout" and a["async_step_s"] < st["step_s"]
    with pytest.raises(ValueError, match="layout world 32 != trainer nodes 2"):
        cmm.moe_step_time(cmm.QWEN3_30B_A3B, r["recipe"], cm.Cluster(trainer_nodes=2), lay)
