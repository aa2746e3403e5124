"""Cost model of Qwen2.5-32B RL (GRPO / DAPO / DA3PO recipes) and Qwen3-30B-A3B DAPO on H100 clusters: memory, step time, GPU-hours.

An analytical model, not a measurement (docs/cost_model.md explains every formula and its source):

* **Trainer memory per GPU** for a megatron-core layout (TP x PP x DP, sequence parallel,
  distributed optimizer, full / selective / no recompute, micro-batch, sequence length): bf16
  weights, fp32 gradient buffer, fp32 main params + Adam moments sharded over DP, activations
  (Korthikanti et al., arXiv 2205.05198, re-derived for GQA + SwiGLU + RMSNorm without dropout),
  the logits of the longest sequence (vocabulary-parallel log-prob + entropy), runtime overhead.
* **Rollout engine** (SGLang, TP k): weights + KV cache per GPU, KV capacity in tokens, and a
  decode roofline: an iteration reads the weights and the live KV cache from HBM (or is bound by
  its FLOPs), plus two TP all-reduces a layer and a fixed scheduling overhead.
  Checked against published decode figures (`ANCHORS`).
* **Step time and GPU-hours** of the synchronous loop (rollout, then old log-probs, update, weight
  sync) for the recipe's batch (gen batch 1536 x 16 responses, train batch 512 x 16, 16 updates),
  as a function of the mean response length, and the node split that minimises GPU-hours; the
  asynchronous step (eta = 1: `benchmarks/cost_model_async.py`) against it.
* **Mixture-of-Experts** (`benchmarks/cost_model_moe.py`): Qwen3-30B-A3B's total vs active
  parameters, the MoE trainer layout's memory, the token dispatcher's all-to-all volume, the EP
  weight-sync bytes, and its DAPO step (synchronous and eta = 1).

    .venv/bin/python benchmarks/cost_model.py                 # tables + benchmarks/results/cost_model.json
    .venv/bin/python benchmarks/cost_model.py --mean-response 6000 --steps 400

Sizes are in GiB (2**30 bytes) for memory, seconds for time.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
GIB = float(2**30)


# ----------------------------------------------------------------------------------------------
# model and hardware
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """Decoder-only transformer shape (Qwen2 / Llama family: GQA, SwiGLU, RMSNorm, RoPE)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0
    tied_embeddings: bool = False
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        for k in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "head_dim"):
            if getattr(self, k) <= 0:
                raise ValueError(f"ModelShape.{k} must be > 0, got {getattr(self, k)}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        """From a Hugging Face config.json dict (qwen2 / llama keys).

        Raises:
            KeyError: a required key (hidden_size, intermediate_size, ...) is missing, named.
        """
        try:
            return cls(hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                       heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                       vocab=cfg["vocab_size"], head_dim=cfg.get("head_dim") or 0,
                       tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=cfg.get("model_type", "qwen2") == "qwen2" or bool(cfg.get("attention_bias", False)))
        except KeyError as e:
            raise KeyError(f"config.json lacks {e.args[0]!r} (needed by the cost model)") from None

    def params_per_layer(self) -> int:
        """Attention (q, k, v, o + q/k/v biases) + SwiGLU MLP (gate, up, down) + two RMSNorms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * kv
        return attn + 3 * self.hidden * self.ffn + 2 * self.hidden

    def embedding_params(self, vocab: Optional[int] = None) -> int:
        return (vocab or self.vocab) * self.hidden

    def total_params(self) -> int:
        """Weights of the HF checkpoint (unpadded vocabulary)."""
        emb = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return self.layers * self.params_per_layer() + emb + self.hidden

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> float:
        """KV cache bytes per token on one GPU of a TP group: 2 (K, V) x layers x kv_heads/tp x head_dim x dtype.

        KV heads are replicated when tp > kv_heads (each GPU keeps at least one)."""
        return 2 * self.layers * max(self.kv_heads / tp, 1) * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class GPU:
    """Datasheet numbers (dense, no sparsity)."""

    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_tb_s: float
    source: str = ""


H100 = GPU("H100 SXM 80GB", 79.6, 989.0, 3.35, "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3")
H200 = GPU("H200 SXM 141GB", 140.4, 989.0, 4.8, "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e")
H20 = GPU("H20 96GB", 95.6, 148.0, 4.0, "NVIDIA H20 (China SKU): 148 TFLOP/s bf16 dense, 4.0 TB/s HBM3")


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by x TP."""
    m = divisible_by * tp
    return int(math.ceil(vocab / m) * m)


# ----------------------------------------------------------------------------------------------
# trainer memory
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainLayout:
    """A megatron-core training layout and the shapes of its largest micro-batch."""

    tp: int
    pp: int
    dp: int
    seq_len: int
    micro_batch: int = 1
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    recompute: Optional[str] = "full"  # None | "selective" | "full"
    grad_fp32: bool = True  # megatron DDP grad_reduce_in_fp32 (megatron_rl.models.builder default)
    ref_model: bool = False  # a frozen bf16 reference policy (GRPO's KL term)
    microbatches_per_update: int = 256  # per DP rank; bounds the micro-batches in flight (1F1B)
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"recompute must be None, 'selective' or 'full', got {self.recompute!r}")
        for k in ("tp", "pp", "dp", "seq_len", "micro_batch", "microbatches_per_update"):
            if getattr(self, k) < 1:
                raise ValueError(f"TrainLayout.{k} must be >= 1, got {getattr(self, k)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def stage_params(shape: ModelShape, layout: TrainLayout) -> dict[str, float]:
    """Parameters held by one GPU of the first and of the last pipeline stage.

    Raises:
        ValueError: layers do not divide by PP, or heads / KV heads by TP.
    """
    if shape.layers % layout.pp:
        raise ValueError(f"{shape.layers} layers do not divide into pipeline_model_parallel_size {layout.pp}")
    if shape.heads % layout.tp or (shape.kv_heads % layout.tp and layout.tp % shape.kv_heads):
        raise ValueError(f"{shape.heads} query / {shape.kv_heads} KV heads do not split over "
                         f"tensor_model_parallel_size {layout.tp}")
    v = padded_vocab(shape.vocab, layout.tp, layout.make_vocab_size_divisible_by)
    layers = shape.layers // layout.pp * shape.params_per_layer() / layout.tp
    emb = shape.embedding_params(v) / layout.tp
    if layout.pp == 1:
        both = layers + emb * (1 if shape.tied_embeddings else 2) + shape.hidden
        return {"first": both, "last": both}
    last_emb = emb  # untied: the output layer; tied: megatron keeps a copy of the embedding on the last stage
    return {"first": layers + emb, "last": layers + last_emb + shape.hidden}


def activation_bytes_per_token_layer(shape: ModelShape, layout: TrainLayout) -> float:
    """Activation bytes stored by one transformer layer per token (bf16) without recompute.

    Derivation (docs/cost_model.md; Korthikanti et al. section 4 re-done for Qwen2: GQA, SwiGLU,
    RMSNorm, no dropout, flash attention, so no a*s^2 term): RMSNorm inputs 2 x 2h, QKV input 2h,
    Q 2h, K and V 2 x 2 g d, attention output (= output-projection input) 2h, FC1 input 2h, FC1
    output (gate and up) 2 x 2f, SwiGLU output (FC2 input) 2f, softmax log-sum-exp 4 a (fp32).
    With sequence parallelism everything is split over TP; without it the RMSNorm inputs and the
    QKV / FC1 inputs (8h) are replicated on every TP rank.
    """
    h, f, t = shape.hidden, shape.ffn, layout.tp
    gd = shape.kv_heads * shape.head_dim
    sharded = 2 * h + 4 * gd + 2 * h + 6 * f + 4 * shape.heads  # Q, K+V, attention out, FC1 out, SwiGLU out, lse
    replicated = 4 * h + 2 * h + 2 * h  # two norm inputs, QKV input, FC1 input
    if layout.sequence_parallel:
        return (sharded + replicated) / t
    return sharded / t + replicated


def memory_per_gpu(shape: ModelShape, layout: TrainLayout, *, logits_bytes_per_element: float = 22.0,
                   runtime_overhead_gib: float = 5.0, fragmentation: float = 0.10) -> dict:
    """Memory of one trainer GPU, per item, for the worse of the first and last pipeline stage.

    Args:
        logits_bytes_per_element: bytes per logit of the longest micro-batch while its loss is
            computed and back-propagated (bf16 output 2 + fp32 copy 4 + cross-entropy softmax 4 +
            shifted 4 + exp 4 + gradient 4 = 22; megatron_rl.trainer.logprobs).
        runtime_overhead_gib: CUDA context, NCCL buffers, cuBLAS / TE workspaces.
        fragmentation: allocator slack as a share of the activation and logits memory.

    Returns:
        {"stage": "first"|"last", "items": {name: GiB}, "total_gib": float, "params_per_gpu": float,
         "stages": {stage: total GiB}, "per_stage_items": {stage: {name: GiB}}}; the unlabelled
        keys describe the worse stage.
    """
    params = stage_params(shape, layout)
    tokens = layout.seq_len * layout.micro_batch
    per_layer_full = activation_bytes_per_token_layer(shape, layout) * tokens
    layers_here = shape.layers // layout.pp
    if layout.recompute == "full":
        stored_per_layer = 2 * shape.hidden * tokens / (layout.tp if layout.sequence_parallel else 1)
    elif layout.recompute == "selective":
        stored_per_layer = per_layer_full  # flash attention already avoids the a*s^2 term selective recompute drops
    else:
        stored_per_layer = per_layer_full
    in_flight_first = min(layout.pp, layout.microbatches_per_update)
    v_local = padded_vocab(shape.vocab, layout.tp, layout.make_vocab_size_divisible_by) / layout.tp
    out = {}
    for stage, p in params.items():
        in_flight = in_flight_first if stage == "first" else 1
        items = {
            "weights (bf16)": 2 * p,
            "gradients (fp32 buffer)" if layout.grad_fp32 else "gradients (bf16 buffer)": (4 if layout.grad_fp32 else 2) * p,
            "fp32 params + Adam m, v" + (f" (/ DP {layout.dp})" if layout.distributed_optimizer else ""):
                12 * p / (layout.dp if layout.distributed_optimizer else 1),
        }
        if layout.ref_model:
            items["reference policy (bf16)"] = 2 * p
        act = in_flight * layers_here * stored_per_layer
        items[f"activations kept ({in_flight} micro-batch{'es' if in_flight > 1 else ''} x {layers_here} layers)"] = act
        working = 2 * per_layer_full if layout.recompute == "full" else per_layer_full
        items["one layer's recomputed activations + their gradients" if layout.recompute == "full"
              else "one layer's activation gradients"] = working
        logits = tokens * v_local * logits_bytes_per_element if stage == "last" else 0.0
        if logits:
            items[f"logits + log-prob/entropy temporaries ({tokens} x {int(v_local)})"] = logits
        items["allocator fragmentation"] = fragmentation * (act + working + logits)
        items["CUDA context, NCCL, workspaces"] = runtime_overhead_gib * GIB
        gib = {k: v / GIB for k, v in items.items()}
        out[stage] = {"items": gib, "total_gib": sum(gib.values()), "params_per_gpu": p}
    worst = max(out, key=lambda s: out[s]["total_gib"])
    return {"stage": worst, **out[worst], "stages": {s: out[s]["total_gib"] for s in out},
            "per_stage_items": {s: out[s]["items"] for s in out}}


# ----------------------------------------------------------------------------------------------
# rollout engines
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeModel:
    """Efficiency knobs of the decode roofline (defaults checked against `ANCHORS`)."""

    hbm_efficiency: float = 0.6  # achieved share of datasheet HBM bandwidth
    flops_efficiency: float = 0.5  # achieved share of dense bf16 peak for the decode GEMMs
    allreduce_s: float = 20e-6  # one TP all-reduce of a decode batch's hidden states over NVLink
    overhead_s: float = 2e-3  # scheduling, sampling, launch gaps per iteration (CUDA graphs on)


def decode_iteration_s(shape: ModelShape, gpu: GPU, tp: int, batch: int, mean_context: float,
                       dm: DecodeModel = DecodeModel(), weight_bytes: float = 2.0, kv_dtype_bytes: int = 2) -> float:
    """Seconds of one decode iteration of `batch` sequences of mean context `mean_context` tokens.

    max(memory time, compute time) + 2 all-reduces per layer (if tp > 1) + overhead, with
    memory time = (weights per GPU + live KV cache per GPU) / (HBM bandwidth x efficiency).
    """
    weights = shape.total_params() * weight_bytes / tp
    kv = batch * mean_context * shape.kv_bytes_per_token(tp, kv_dtype_bytes)
    t_mem = (weights + kv) / (gpu.hbm_tb_s * 1e12 * dm.hbm_efficiency)
    flops = 2 * shape.total_params() / tp * batch + 4 * batch * mean_context * shape.hidden * shape.layers / tp
    t_flops = flops / (gpu.bf16_tflops * 1e12 * dm.flops_efficiency * (2.0 if weight_bytes == 1 else 1.0))
    comm = 2 * shape.layers * dm.allreduce_s if tp > 1 else 0.0
    return max(t_mem, t_flops) + comm + dm.overhead_s


@dataclass(frozen=True)
class RolloutEngine:
    """An SGLang engine of `tp` GPUs with `--mem-fraction-static mem_fraction`."""

    tp: int = 4
    mem_fraction: float = 0.85
    max_running_requests: int = 1024


def engine_memory(shape: ModelShape, gpu: GPU, eng: RolloutEngine) -> dict:
    """Per-GPU weights, KV cache pool, its capacity in tokens, and what is left outside the pool (GiB)."""
    weights = shape.total_params() * 2 / eng.tp / GIB
    pool = eng.mem_fraction * gpu.memory_gib
    kv = pool - weights
    if kv <= 0:
        raise ValueError(f"{gpu.name}: weights {weights:.1f} GiB per GPU at TP {eng.tp} exceed "
                         f"--mem-fraction-static {eng.mem_fraction} x {gpu.memory_gib} GiB")
    per_tok = shape.kv_bytes_per_token(eng.tp)
    return {"weights_gib": weights, "kv_cache_gib": kv, "kv_bytes_per_token_per_gpu": per_tok,
            "kv_tokens": kv * GIB / per_tok, "outside_pool_gib": gpu.memory_gib - pool}


def engine_throughput(shape: ModelShape, gpu: GPU, eng: RolloutEngine, mean_context: float,
                      dm: DecodeModel = DecodeModel()) -> dict:
    """Steady-state decode tokens/s of one engine when the KV pool (or max_running_requests) is full."""
    mem = engine_memory(shape, gpu, eng)
    batch = int(min(eng.max_running_requests, mem["kv_tokens"] // max(mean_context, 1)))
    batch = max(batch, 1)
    t = decode_iteration_s(shape, gpu, eng.tp, batch, mean_context, dm)
    return {"batch": batch, "iteration_s": t, "tokens_per_s": batch / t,
            "single_stream_tokens_per_s": 1.0 / decode_iteration_s(shape, gpu, eng.tp, 1, mean_context, dm)}


@dataclass(frozen=True)
class Anchor:
    """A published decode measurement to check the roofline against."""

    what: str
    shape: ModelShape
    gpu: GPU
    tp: int
    batch: int
    mean_context: float
    published_tokens_per_s: float
    weight_bytes: float
    source: str


LLAMA3_70B = ModelShape(hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, vocab=128256, qkv_bias=False)
QWEN25_32B = ModelShape(hidden=5120, ffn=27648, layers=64, heads=40, kv_heads=8, vocab=152064)

ANCHORS = (
    Anchor("QwQ-32B (Qwen2.5-32B shape), vLLM, 8 x H200 (TP 8), 1 stream, mean TPOT 6.70 ms", QWEN25_32B, H200, 8, 1,
           500, 1 / 6.70e-3, 2.0, "vllm-project/vllm issue 18725 (H200 vs B200 serving benchmark)"),
    Anchor("LLaMA 70B FP8, TensorRT-LLM 0.5, 4 x H100 (TP 4), batch 64, 128 in / 2048 out", LLAMA3_70B, H100, 4, 64,
           128 + 1024, 2616, 1.0, "TensorRT-LLM 0.5.0 docs/source/performance.md, H100 FP8 table"),
)


def check_anchors(dm: DecodeModel = DecodeModel()) -> list[dict]:
    """Model vs published decode throughput for each anchor (ratio model / published)."""
    rows = []
    for a in ANCHORS:
        t = decode_iteration_s(a.shape, a.gpu, a.tp, a.batch, a.mean_context, dm, weight_bytes=a.weight_bytes)
        model = a.batch / t
        rows.append({"what": a.what, "source": a.source, "published_tokens_per_s": a.published_tokens_per_s,
                     "model_tokens_per_s": model, "ratio": model / a.published_tokens_per_s})
    return rows


# ----------------------------------------------------------------------------------------------
# step time and GPU-hours
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RLRecipe:
    """The batch shapes of one RL step (examples/qwen2.5-32b/*.yaml)."""

    train_batch: int = 512
    gen_batch: int = 1536
    n: int = 16
    ppo_mini_batch: int = 32
    max_prompt: int = 2048
    max_response: int = 20480
    mean_prompt: float = 200.0  # DAPO-Math-17k prompts with the template: a few hundred tokens (assumption)
    mean_response: float = 4000.0  # assumption; sensitivity shown in docs/cost_model.md
    response_cv: float = 1.0  # coefficient of variation of response lengths (time-weighted live context)
    gen_batches_per_step: float = 1.0  # dynamic sampling: generation batches a step needs
    ref_model: bool = False

    @property
    def updates_per_step(self) -> int:
        return self.train_batch // self.ppo_mini_batch

    def longest_response(self, responses: float) -> float:
        """Expected longest of `responses` responses: mean x ln(responses) (exponential lengths), capped
        at max_response."""
        return min(float(self.max_response), self.mean_response * math.log(max(responses, 2.0)))

    def mean_live_context(self) -> float:
        """Mean context of a running sequence, time-weighted: prompt + E[L^2] / (2 E[L])."""
        return self.mean_prompt + self.mean_response * (1 + self.response_cv**2) / 2


@dataclass(frozen=True)
class Cluster:
    trainer_nodes: int = 4
    rollout_nodes: int = 4
    gpus_per_node: int = 8
    gpu: GPU = H100
    train_hfu: float = 0.35  # hardware FLOPs utilisation of log-prob and update passes (recompute included)
    weight_sync_gb_s: float = 20.0  # trainer -> engines broadcast (NCCL over InfiniBand), GB/s
    engine: RolloutEngine = RolloutEngine()


def train_flops(shape: ModelShape, recipe: RLRecipe, *, recompute: Optional[str] = "full") -> dict:
    """FLOPs of the old-log-prob pass (+ reference) and the update over one train batch.

    Dense: 2 N per token forward, 4 N backward, + 2 N recompute (full); attention: 4 s h L per
    token forward at mean causal context s / 2 (x 3 for forward + backward, + 1 for recompute).
    """
    seqs = recipe.train_batch * recipe.n
    s = recipe.mean_prompt + recipe.mean_response
    tokens = seqs * s
    n = shape.total_params()
    attn_fwd = 2 * shape.hidden * shape.layers * s  # per token: 4 h L x (s / 2)
    fwd = (2 * n + attn_fwd) * tokens
    logprob = fwd * (2 if recipe.ref_model else 1)
    update = fwd * (3 + (1 if recompute == "full" else 0))
    return {"tokens": tokens, "logprob_flops": logprob, "update_flops": update, "update_model_flops": 3 * fwd}


def step_time(shape: ModelShape, recipe: RLRecipe, cluster: Cluster, dm: DecodeModel = DecodeModel()) -> dict:
    """Seconds of one synchronous RL step: rollout (throughput-bound or the longest response),
    old log-probs, update, weight sync."""
    engines = cluster.rollout_nodes * cluster.gpus_per_node // cluster.engine.tp
    if engines < 1:
        raise ValueError("no rollout engine: rollout_nodes x gpus_per_node < engine TP")
    ctx = recipe.mean_live_context()
    eng = engine_throughput(shape, cluster.gpu, cluster.engine, ctx, dm)
    responses = recipe.gen_batch * recipe.n * recipe.gen_batches_per_step
    gen_tokens = responses * recipe.mean_response
    t_throughput = gen_tokens / (engines * eng["tokens_per_s"])
    # the longest response decodes one token an iteration, at a batch that shrinks as the generation
    # batch drains: its length ~ mean x ln(responses) (the maximum of exponential lengths), capped
    longest = recipe.longest_response(responses)
    t_tail = longest * decode_iteration_s(shape, cluster.gpu, cluster.engine.tp, 8, longest / 2, dm)
    rollout = max(t_throughput, t_tail)
    fl = train_flops(shape, recipe)
    trainer_gpus = cluster.trainer_nodes * cluster.gpus_per_node
    hw = trainer_gpus * cluster.gpu.bf16_tflops * 1e12
    rate = hw * cluster.train_hfu  # every pass (log-prob forward, forward, backward, recompute) at the same rate
    logprob = fl["logprob_flops"] / rate
    update = fl["update_flops"] / rate
    sync = shape.total_params() * 2 / (cluster.weight_sync_gb_s * 1e9)
    total = rollout + logprob + update + sync
    return {"engines": engines, "engine": eng, "mean_live_context": ctx, "generated_tokens": gen_tokens,
            "rollout_s": rollout, "rollout_throughput_bound_s": t_throughput, "rollout_tail_bound_s": t_tail,
            "longest_response": longest,
            "logprob_s": logprob, "update_s": update, "weight_sync_s": sync, "step_s": total,
            "train_tokens": fl["tokens"],
            "gpus": (cluster.trainer_nodes + cluster.rollout_nodes) * cluster.gpus_per_node}


def run_cost(shape: ModelShape, recipe: RLRecipe, cluster: Cluster, steps: int, dm: DecodeModel = DecodeModel()) -> dict:
    """Wall hours and GPU-hours of `steps` RL steps."""
    st = step_time(shape, recipe, cluster, dm)
    hours = st["step_s"] * steps / 3600
    return {**st, "steps": steps, "wall_hours": hours, "gpu_hours": hours * st["gpus"]}


# ----------------------------------------------------------------------------------------------
# colocated layouts (issue 17)
# ----------------------------------------------------------------------------------------------

def colocated_memory(shape: ModelShape, layout: TrainLayout, gpu: GPU, eng: RolloutEngine, *,
                     trainer_residual_gib: float = 4.0, engine_residue_gib: float = 1.5,
                     bucket_gib: float = 0.5, buffers: int = 1) -> dict:
    """Memory of one GPU of a colocated node in each phase, GiB (the protocol of DESIGN.md:
    release -> train -> offload -> resume weights -> IPC update -> resume KV -> generate).

    train: the trainer resident (`memory_per_gpu`) + the released engine's residue (CUDA context,
    graphs); update: the trainer's residual after offload + the engine's weight shard + `buffers`
    IPC buckets of `bucket_gib` (`ColocatedWeightSender(buffers=...)`, 1 by default); generate: the residual + the engine's `mem_fraction x GPU` pool (weights + KV).
    `fits` when every phase is <= the GPU's memory."""
    train = memory_per_gpu(shape, layout)["total_gib"] + engine_residue_gib
    weights = shape.total_params() * 2 / eng.tp / GIB
    update = trainer_residual_gib + weights + buffers * bucket_gib
    generate = trainer_residual_gib + eng.mem_fraction * gpu.memory_gib
    phases = {"train": train, "update": update, "generate": generate}
    return {"phases_gib": phases, "peak_gib": max(phases.values()), "fits": max(phases.values()) <= gpu.memory_gib,
            "engine_weights_gib": weights, "kv_cache_gib": eng.mem_fraction * gpu.memory_gib - weights}


def colocated_step_time(shape: ModelShape, recipe: RLRecipe, layout: TrainLayout, nodes: int, *,
                        gpus_per_node: int = 8, gpu: GPU = H100, engine: RolloutEngine = RolloutEngine(),
                        train_hfu: float = Cluster.train_hfu, host_gb_s: float = 25.0,
                        dm: DecodeModel = DecodeModel()) -> dict:
    """Seconds of one colocated step on `nodes` nodes: every GPU generates, then every GPU trains
    (`step_time`'s rollout and training terms over the same GPUs), plus the trainer's offload and
    onload over PCIe (`host_gb_s` per GPU each way: bf16 params + the optimizer's 12 bytes a
    parameter / DP; gradients are freed, not copied) and the IPC hand-over (the weights copied
    twice in HBM). No separate rollout nodes, no broadcast."""
    cl = Cluster(trainer_nodes=nodes, rollout_nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                 train_hfu=train_hfu, engine=engine)
    st = step_time(shape, recipe, cl, dm)
    p = stage_params(shape, layout)["first"]
    moved = 2 * p + 12 * p / (layout.dp if layout.distributed_optimizer else 1)
    offload = 2 * moved / (host_gb_s * 1e9)
    handover = 2 * shape.total_params() * 2 / engine.tp / (gpu.hbm_tb_s * 1e12)
    total = st["rollout_s"] + st["logprob_s"] + st["update_s"] + offload + handover
    return {"rollout_s": st["rollout_s"], "logprob_s": st["logprob_s"], "update_s": st["update_s"],
            "offload_onload_s": offload, "handover_s": handover, "step_s": total, "gpus": nodes * gpus_per_node,
            "engines": st["engines"]}


# ----------------------------------------------------------------------------------------------
# the recipes
# ----------------------------------------------------------------------------------------------

def _sbatch_defaults(path: Path) -> dict:
    """#SBATCH --nodes and the ${VAR:-default} values of an sbatch recipe."""
    text = path.read_text()
    out = {k: int(v) if v.isdigit() else v for k, v in re.findall(r"(\w+)=\"\$\{\1:-([^}$]+)\}\"", text)}
    m = re.search(r"#SBATCH --nodes=(\d+)", text)
    if m:
        out["nodes"] = int(m.group(1))
    return out


def recipe_layouts() -> list[dict]:
    """The trainer layouts of examples/qwen2.5-32b/*.yaml with their sbatch recipes."""
    import yaml

    rows = []
    for name in ("grpo", "dapo", "da3po"):
        y = yaml.safe_load((REPO / "examples" / "qwen2.5-32b" / f"{name}.yaml").read_text())
        sb = _sbatch_defaults(REPO / "slurm" / f"qwen2.5-32b-{name}.sbatch")
        t = y["trainer"]
        nodes = sb.get("nodes", 8)
        trainer_nodes = int(sb.get("TRAINER_NODES", 4))
        gpus_per_node = int(sb.get("GPUS_PER_NODE", 8))
        tp, pp = t["tensor_model_parallel_size"], t["pipeline_model_parallel_size"]
        dp = trainer_nodes * gpus_per_node // (tp * pp)
        seqs = y["actor"]["ppo_mini_batch_size"] * y["rollout"]["n"]
        layout = TrainLayout(
            tp=tp, pp=pp, dp=dp, seq_len=y["data"]["max_prompt_length"] + y["data"]["max_response_length"],
            micro_batch=y["actor"]["ppo_micro_batch_size"], sequence_parallel=bool(t.get("sequence_parallel")),
            distributed_optimizer=bool(t.get("use_distributed_optimizer")), recompute=t.get("recompute"),
            ref_model=bool(y["actor"].get("use_kl_loss")), microbatches_per_update=max(seqs // dp, 1))
        rows.append({"recipe": name, "nodes": nodes, "trainer_nodes": trainer_nodes,
                     "rollout_nodes": nodes - trainer_nodes, "gpus_per_node": gpus_per_node,
                     "rollout_tp": int(sb.get("ROLLOUT_TP_SIZE", 4)),
                     "rollout_mem_fraction": float(sb.get("ROLLOUT_MEM_FRACTION", 0.85)),
                     "gen_batch": y["data"].get("gen_batch_size") or y["data"]["train_batch_size"],
                     "train_batch": y["data"]["train_batch_size"], "n": y["rollout"]["n"],
                     "ppo_mini_batch": y["actor"]["ppo_mini_batch_size"], "layout": layout})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mean-response", type=float, default=RLRecipe.mean_response, help="mean response tokens")
    ap.add_argument("--mean-prompt", type=float, default=RLRecipe.mean_prompt)
    ap.add_argument("--gen-batches", type=float, default=1.0, help="generation batches per step (dynamic sampling)")
    ap.add_argument("--steps", type=int, default=400, help="RL steps of the run (the recipe's total_training_steps)")
    ap.add_argument("--train-hfu", type=float, default=Cluster.train_hfu,
                    help="hardware FLOPs utilisation of the trainer's passes")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cost_model.json")
    args = ap.parse_args()

    shape = ModelShape.from_hf_config(json.loads((REPO / "examples" / "qwen2.5-32b" / "config.json").read_text()))
    result: dict = {"model": {**asdict(shape), "params": shape.total_params()}, "gpu": asdict(H100)}
    print(f"Qwen2.5-32B: {shape.total_params() / 1e9:.2f} B parameters "
          f"({shape.params_per_layer() / 1e6:.1f} M a layer, {shape.embedding_params() / 1e6:.1f} M embedding)\n")

    # 1. trainer memory of the recipes + alternatives
    print("Trainer memory per GPU (GiB of 79.6 usable on an H100 80GB); worst pipeline stage")
    print(f"{'layout':44s} {'params/GPU':>10s} {'static':>7s} {'act+logits':>10s} {'total':>7s}  fits")
    mem_rows = []
    recipes = recipe_layouts()
    base = recipes[1]["layout"]  # dapo
    candidates = [(f"{r['recipe']} recipe: TP{r['layout'].tp} PP{r['layout'].pp} DP{r['layout'].dp}, "
                   f"{r['layout'].recompute} recompute", r["layout"]) for r in recipes]
    candidates += [
        ("dapo, selective recompute", replace(base, recompute="selective")),
        ("dapo, no sequence parallel", replace(base, sequence_parallel=False)),
        ("TP8 PP1 DP4 (same 4 nodes)", replace(base, pp=1, dp=4, microbatches_per_update=128)),
        ("TP8 PP2 DP1 (2 trainer nodes)", replace(base, dp=1, microbatches_per_update=512)),
        ("TP4 PP4 DP2 (4 nodes)", replace(base, tp=4, pp=4, dp=2)),
        ("TP8 PP1 DP2 (2 trainer nodes)", replace(base, pp=1, dp=2, microbatches_per_update=256)),
    ]
    for label, lay in candidates:
        m = memory_per_gpu(shape, lay)
        it = m["items"]
        static = sum(v for k, v in it.items() if k.startswith(("weights", "gradients", "fp32", "reference")))
        dyn = sum(v for k, v in it.items() if k.startswith(("activations", "one layer", "logits")))
        fits = m["total_gib"] <= H100.memory_gib
        print(f"{label:44s} {m['params_per_gpu'] / 1e9:9.2f}B {static:7.1f} {dyn:10.1f} {m['total_gib']:7.1f}  "
              f"{'yes' if fits else 'NO'} ({m['stage']} stage)")
        mem_rows.append({"label": label, "layout": asdict(lay), **m, "fits_h100_80gb": fits})
    result["trainer_memory"] = mem_rows
    d = next(r for r in mem_rows if r["label"].startswith("dapo recipe"))
    print("\n  dapo recipe, item by item (" + d["stage"] + " stage):")
    for k, v in d["items"].items():
        print(f"    {k:70s} {v:6.2f}")
    print(f"    {'total':70s} {d['total_gib']:6.2f}")

    # 2. rollout engines
    eng = RolloutEngine(tp=recipes[1]["rollout_tp"], mem_fraction=recipes[1]["rollout_mem_fraction"])
    em = engine_memory(shape, H100, eng)
    print(f"\nRollout engine (SGLang TP {eng.tp}, --mem-fraction-static {eng.mem_fraction}): weights "
          f"{em['weights_gib']:.1f} GiB/GPU, KV pool {em['kv_cache_gib']:.1f} GiB/GPU = {em['kv_tokens'] / 1e3:.0f} k tokens "
          f"({em['kv_bytes_per_token_per_gpu'] / 1024:.0f} KiB/token/GPU), {em['outside_pool_gib']:.1f} GiB outside the pool")
    anchors = check_anchors()
    print("\nDecode roofline vs published figures:")
    for a in anchors:
        print(f"  {a['what']}: published {a['published_tokens_per_s']:.0f} tok/s, model {a['model_tokens_per_s']:.0f} "
              f"(x{a['ratio']:.2f})  [{a['source']}]")
    result["rollout_engine"] = {"engine": asdict(eng), **em}
    result["decode_anchors"] = anchors

    # 3. step time and GPU-hours
    recipe = RLRecipe(mean_response=args.mean_response, mean_prompt=args.mean_prompt, gen_batches_per_step=args.gen_batches)
    cl = Cluster(train_hfu=args.train_hfu, engine=eng)
    print(f"\nDAPO step (gen batch {recipe.gen_batch} x {recipe.n} x {args.gen_batches:g}, train batch {recipe.train_batch} x "
          f"{recipe.n}, mean response {recipe.mean_response:.0f} tokens, {args.steps} steps):")
    print(f"{'trainer+rollout nodes':22s} {'engine tok/s':>12s} {'rollout s':>9s} {'logprob s':>9s} {'update s':>8s} "
          f"{'step min':>8s} {'wall days':>9s} {'GPU-hours':>9s}")
    splits = []
    for tn, rn in ((4, 4), (2, 4), (4, 6), (4, 8), (2, 6), (4, 12)):
        c = replace(cl, trainer_nodes=tn, rollout_nodes=rn)
        rc = run_cost(shape, recipe, c, args.steps)
        splits.append({"trainer_nodes": tn, "rollout_nodes": rn, **rc})
        mark = "  <- recipe" if (tn, rn) == (recipes[1]["trainer_nodes"], recipes[1]["rollout_nodes"]) else ""
        print(f"{tn:>10d} + {rn:<9d} {rc['engine']['tokens_per_s']:12.0f} {rc['rollout_s']:9.0f} {rc['logprob_s']:9.0f} "
              f"{rc['update_s']:8.0f} {rc['step_s'] / 60:8.1f} {rc['wall_hours'] / 24:9.1f} {rc['gpu_hours']:9.0f}{mark}")
    result["step_time"] = {"recipe": asdict(recipe), "cluster": {**asdict(cl), "gpu": cl.gpu.name}, "splits": splits}

    sens = []
    print("\nSensitivity (recipe split 4 + 4): mean response tokens -> step minutes, GPU-hours for the run")
    for L in (1000, 2000, 4000, 6000, 8000):
        rc = run_cost(shape, replace(recipe, mean_response=L), cl, args.steps)
        sens.append({"mean_response": L, "step_s": rc["step_s"], "gpu_hours": rc["gpu_hours"],
                     "rollout_share": rc["rollout_s"] / rc["step_s"]})
        print(f"  {L:5d}: {rc['step_s'] / 60:6.1f} min/step (rollout {100 * rc['rollout_s'] / rc['step_s']:.0f}%), "
              f"{rc['gpu_hours']:8.0f} GPU-hours")
    result["sensitivity_mean_response"] = sens

    # the DAPO paper's own setup, for scale: 128 H20, colocated (each phase uses all 128 GPUs)
    h20 = Cluster(trainer_nodes=16, rollout_nodes=16, gpu=H20, train_hfu=args.train_hfu,
                  engine=RolloutEngine(tp=4, mem_fraction=0.80))
    rc = step_time(shape, recipe, h20)
    colocated = rc["rollout_s"] + rc["logprob_s"] + rc["update_s"]
    print(f"\nDAPO paper's setup for scale (128 H20, verl colocated, same batch): ~{colocated / 60:.0f} min/step, "
          f"{colocated * args.steps / 86400:.1f} days for {args.steps} steps")
    result["dapo_paper_setup_128_h20"] = {"step_s": colocated, "days": colocated * args.steps / 86400,
                                          "rollout_s": rc["rollout_s"], "train_s": rc["logprob_s"] + rc["update_s"]}
    result["colocated"] = _colocated_section(shape, recipe, recipes[1], args.steps, args.train_hfu)
    import sys

    from cost_model_async import async_section  # the eta = 1 step (issue 16); benchmarks/ is on sys.path
    result["async"] = async_section(sys.modules[__name__], shape, recipe, cl, args.steps)
    from cost_model_moe import moe_section  # Qwen3-30B-A3B (issue 29)

    result["moe"] = moe_section(REPO, args.steps, args.mean_response, args.mean_prompt, args.gen_batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}")


def _colocated_section(shape32: ModelShape, recipe: RLRecipe, dapo: dict, steps: int, hfu: float) -> dict:
    """Colocated 7B on 1 node (examples/qwen2.5-7b/dapo-colocate.yaml) and 32B on 4 nodes, against
    the disaggregated 32B DAPO recipe (4 trainer + 4 rollout nodes): memory per phase, step time."""
    import yaml

    y = yaml.safe_load((REPO / "examples" / "qwen2.5-7b" / "dapo-colocate.yaml").read_text())
    shape7 = ModelShape.from_hf_config(json.loads((REPO / "examples" / "qwen2.5-7b" / "config.json").read_text()))
    t, r = y["trainer"], y["rollout"]
    lay7 = TrainLayout(tp=t["tensor_model_parallel_size"], pp=1, dp=8 // t["tensor_model_parallel_size"],
                       seq_len=y["data"]["max_prompt_length"] + y["data"]["max_response_length"],
                       microbatches_per_update=y["actor"]["ppo_mini_batch_size"] * r["n"] // 2)
    eng7 = RolloutEngine(tp=r["tp_size"], mem_fraction=r["mem_fraction_static"])
    rec7 = replace(recipe, train_batch=y["data"]["train_batch_size"], gen_batch=y["data"]["gen_batch_size"],
                   ppo_mini_batch=y["actor"]["ppo_mini_batch_size"])
    lay32 = replace(dapo["layout"], tp=8, pp=1, dp=4, microbatches_per_update=128)  # PP 1: colocation needs it
    eng32 = RolloutEngine(tp=4, mem_fraction=0.6)
    rows = {
        "7b_1_node_colocated": {"memory": colocated_memory(shape7, lay7, H100, eng7),
                                "step": colocated_step_time(shape7, rec7, lay7, 1, engine=eng7, train_hfu=hfu)},
        "32b_4_nodes_colocated": {"memory": colocated_memory(shape32, lay32, H100, eng32),
                                  "step": colocated_step_time(shape32, recipe, lay32, 4, engine=eng32, train_hfu=hfu)},
    }
    dis = run_cost(shape32, recipe, Cluster(train_hfu=hfu, engine=RolloutEngine(tp=dapo["rollout_tp"],
                                                                                 mem_fraction=dapo["rollout_mem_fraction"])),
                   steps)
    rows["32b_disaggregated_4_plus_4"] = {"step": {k: dis[k] for k in ("rollout_s", "logprob_s", "update_s",
                                                                        "weight_sync_s", "step_s", "gpus")}}
    print("\nColocated layouts (memory per H100 in each phase, GiB; step minutes; GPU-hours for the run):")
    for name, row in rows.items():
        st = row["step"]
        mem = row.get("memory")
        phases = ", ".join(f"{k} {v:.1f}" for k, v in mem["phases_gib"].items()) if mem else "(trainer / engine GPUs apart)"
        row["gpu_hours"] = st["step_s"] * steps / 3600 * st["gpus"]
        print(f"  {name:28s} {phases:44s} step {st['step_s'] / 60:6.1f} min on {st['gpus']:3d} GPUs, "
              f"{row['gpu_hours']:8.0f} GPU-hours" + ("" if not mem or mem["fits"] else "  DOES NOT FIT"))
    return rows


if __name__ == "__main__":
    main()
