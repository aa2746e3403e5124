"""Mixture-of-Experts part of the cost model (issue 29): Qwen3-30B-A3B DAPO with rollout routing replay on H100s.

Part of `benchmarks/cost_model.py` (its `main` prints this section and stores it under `"moe"` in
`benchmarks/results/cost_model.json`); kept apart, as the asynchronous step is, to keep each file
short. docs/cost_model.md, "Mixture-of-Experts: Qwen3-30B-A3B", states every formula and source:

* **parameters**: total (what memory, the checkpoint and the weight sync carry) against active
  (attention + router + top-k experts a token, what the FLOPs of training and decoding see);
* **trainer memory per GPU** of a megatron-core MoE layout: dense weights split over TP, experts over
  EP x expert-TP, the distributed optimizer's fp32 state over the dense data-parallel group for the
  dense weights and over the expert data-parallel group for the experts (world / (ETP x EP x PP));
  the dropless routed activations of one layer (top-k copies of each token, x an imbalance factor);
* **all-to-all volume** of the token dispatcher (megatron's `alltoall`): per MoE layer and pass each
  token goes to its k experts and comes back, k x 2h bytes each way, the share (EP - 1) / EP leaving
  the GPU; over NVLink when the EP group sits in one node, over InfiniBand for the share that
  crosses nodes;
* **weight sync with EP**: the stage's source rank gathers the experts over EP (and every weight over
  TP) before the broadcast to the engines (`megatron_rl/weight_sync/publisher.py`), so a sync moves
  the whole checkpoint once to the engines and the experts' (EP - 1) / EP share once inside the trainer;
* **rollout**: the decode roofline of `cost_model.decode_iteration_s` with MoE weights: an iteration
  reads the dense weights and only the experts its batch touches (E (1 - (1 - k/E)^B) of E per layer)
  and computes 2 x active parameters a token;
* **step time** (synchronous and eta = 1, `cost_model_async`) for the recipe's batch, with the
  all-to-all time added to the trainer's passes (not overlapped: megatron-core 0.19's alltoall
  dispatcher runs it between the expert GEMMs).

Every number is a model, not a measurement. Import with `cost_model` importable (benchmarks/ on
sys.path, or the module registered under that name, as tests/unit/test_cost_model.py does).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import cost_model as cm
import cost_model_async as cma

GIB = cm.GIB


@dataclass(frozen=True)
class MoEShape:
    """Decoder-only MoE transformer (Qwen3-MoE: GQA with q/k RMSNorm, every layer's MLP a softmax-routed
    mixture of `experts` SwiGLU experts of width `moe_ffn`, top-`topk` a token, no shared expert)."""

    hidden: int
    moe_ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    topk: int
    tied_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for k in ("hidden", "moe_ffn", "layers", "heads", "kv_heads", "head_dim", "vocab", "experts", "topk"):
            if getattr(self, k) <= 0:
                raise ValueError(f"MoEShape.{k} must be > 0, got {getattr(self, k)}")
        if self.topk > self.experts:
            raise ValueError(f"MoEShape.topk {self.topk} exceeds experts {self.experts}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "MoEShape":
        """From a Hugging Face qwen3_moe config.json dict.

        Raises:
            KeyError: a required key (hidden_size, moe_intermediate_size, num_experts, ...) is missing, named.
            ValueError: shared experts or dense layers (not modelled: `shared_expert_intermediate_size`,
                `mlp_only_layers`, `decoder_sparse_step` != 1), named.
        """
        if cfg.get("shared_expert_intermediate_size") or cfg.get("mlp_only_layers") or \
                int(cfg.get("decoder_sparse_step", 1) or 1) != 1:
            raise ValueError("config.json has shared experts or dense layers (shared_expert_intermediate_size / "
                             "mlp_only_layers / decoder_sparse_step): not modelled by the MoE cost model")
        try:
            heads = cfg["num_attention_heads"]
            return cls(hidden=cfg["hidden_size"], moe_ffn=cfg["moe_intermediate_size"], layers=cfg["num_hidden_layers"],
                       heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                       head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                       experts=cfg["num_experts"], topk=cfg["num_experts_per_tok"],
                       tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qk_norm=cfg.get("model_type") == "qwen3_moe", qkv_bias=bool(cfg.get("attention_bias", False)))
        except KeyError as e:
            raise KeyError(f"config.json lacks {e.args[0]!r} (needed by the MoE cost model)") from None

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries (heads x head_dim; 4096 for Qwen3-30B-A3B, twice its hidden size)."""
        return self.heads * self.head_dim

    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections (+ biases) and the per-head q/k RMSNorms."""
        q, kv = self.q_dim, self.kv_heads * self.head_dim
        p = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.qkv_bias:
            p += q + 2 * kv
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up (h x f each) and down (f x h)."""
        return 3 * self.hidden * self.moe_ffn

    def dense_params_per_layer(self) -> int:
        """Everything of a layer but its experts: attention, the router (h x E), two RMSNorms."""
        return self.attention_params_per_layer() + self.hidden * self.experts + 2 * self.hidden

    def params_per_layer(self) -> int:
        return self.dense_params_per_layer() + self.experts * self.expert_params()

    def active_params_per_layer(self) -> int:
        """What one token runs through in a layer: the dense part and `topk` experts."""
        return self.dense_params_per_layer() + self.topk * self.expert_params()

    def embedding_params(self, vocab: Optional[int] = None) -> int:
        return (vocab or self.vocab) * self.hidden

    def _embeddings(self) -> int:
        return self.embedding_params() * (1 if self.tied_embeddings else 2) + self.hidden  # + final norm

    def total_params(self) -> int:
        """Weights of the HF checkpoint (unpadded vocabulary)."""
        return self.layers * self.params_per_layer() + self._embeddings()

    def expert_params_total(self) -> int:
        """All experts of all layers (what expert parallelism splits)."""
        return self.layers * self.experts * self.expert_params()

    def active_params(self) -> int:
        """Parameters a token runs through (embedding and output layer included, as the model card counts)."""
        return self.layers * self.active_params_per_layer() + self._embeddings()

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> float:
        """KV cache bytes per token on one GPU of a TP group (KV heads replicated when tp > kv_heads)."""
        return 2 * self.layers * max(self.kv_heads / tp, 1) * self.head_dim * dtype_bytes

    def experts_touched(self, batch: float) -> float:
        """Expected distinct experts of a layer that a decode batch of `batch` tokens routes to,
        E (1 - (1 - k/E)^B) (independent uniform routing: an upper bound for skewed routers)."""
        return self.experts * (1.0 - (1.0 - self.topk / self.experts) ** max(batch, 0.0))


QWEN3_30B_A3B = MoEShape(hidden=2048, moe_ffn=768, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                         experts=128, topk=8)


@dataclass(frozen=True)
class Links:
    """Per-GPU, per-direction link bandwidths (GB/s) of an H100 SXM node and the share an all-to-all achieves."""

    nvlink_gb_s: float = 450.0  # NVLink 4: 900 GB/s bidirectional per H100 SXM GPU (datasheet) = 450 each way
    ib_gb_s: float = 50.0  # one ConnectX-7 NDR 400 Gb/s port per GPU (DGX H100 compute fabric)
    alltoall_efficiency: float = 0.6  # assumption: achieved share of the link rate for all-to-all / gathers
    gpus_per_node: int = 8


# ----------------------------------------------------------------------------------------------
# trainer
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoETrainLayout:
    """A megatron-core MoE layout: attention TP x PP x DP; experts ETP x EP x expert-DP x PP = the same world."""

    tp: int
    pp: int
    dp: int
    ep: int
    seq_len: int
    etp: Optional[int] = None  # None = tp (megatron-rl's weight publisher needs ETP = TP with EP > 1)
    micro_batch: int = 1
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    recompute: Optional[str] = "full"
    grad_fp32: bool = True
    ref_model: bool = False
    microbatches_per_update: int = 256
    routing_imbalance: float = 1.5  # assumption: the busiest expert rank gets this x its even share (dropless)
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"recompute must be None, 'selective' or 'full', got {self.recompute!r}")
        for k in ("tp", "pp", "dp", "ep", "seq_len", "micro_batch", "microbatches_per_update"):
            if getattr(self, k) < 1:
                raise ValueError(f"MoETrainLayout.{k} must be >= 1, got {getattr(self, k)}")
        if self.world % (self.expert_tp * self.ep * self.pp):
            raise ValueError(f"world {self.world} (TP {self.tp} x PP {self.pp} x DP {self.dp}) does not divide into "
                             f"expert_tensor_parallel_size {self.expert_tp} x expert_model_parallel_size {self.ep} x "
                             f"pipeline_model_parallel_size {self.pp}")
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError("tensor_model_parallel_size > 1 with MoE needs sequence_parallel (megatron-core)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel ranks of each expert shard: world / (ETP x EP x PP)."""
        return self.world // (self.expert_tp * self.ep * self.pp)


def moe_stage_params(shape: MoEShape, layout: MoETrainLayout) -> dict[str, dict[str, float]]:
    """Dense and expert parameters held by one GPU of the first and of the last pipeline stage.

    Dense: attention / TP, the router and the norms replicated on every TP rank, the embedding (first
    stage) and the output layer + final norm (last stage) / TP over the padded vocabulary. Experts:
    layers of the stage x E experts / (EP x ETP).

    Raises:
        ValueError: layers not dividing by PP, heads / KV heads by TP, experts by EP, or the expert
            width by ETP (each names the setting).
    """
    if shape.layers % layout.pp:
        raise ValueError(f"{shape.layers} layers do not divide into pipeline_model_parallel_size {layout.pp}")
    if shape.heads % layout.tp or (shape.kv_heads % layout.tp and layout.tp % shape.kv_heads):
        raise ValueError(f"{shape.heads} query / {shape.kv_heads} KV heads do not split over "
                         f"tensor_model_parallel_size {layout.tp}")
    if shape.experts % layout.ep:
        raise ValueError(f"{shape.experts} experts do not divide into expert_model_parallel_size {layout.ep}")
    if shape.moe_ffn % layout.expert_tp:
        raise ValueError(f"moe_intermediate_size {shape.moe_ffn} does not divide into expert_tensor_parallel_size "
                         f"{layout.expert_tp}")
    layers = shape.layers // layout.pp
    dense_layer = shape.attention_params_per_layer() / layout.tp + shape.hidden * shape.experts + 2 * shape.hidden
    experts = layers * shape.experts * shape.expert_params() / (layout.ep * layout.expert_tp)
    v = cm.padded_vocab(shape.vocab, layout.tp, layout.make_vocab_size_divisible_by)
    emb = shape.embedding_params(v) / layout.tp
    if layout.pp == 1:
        dense = layers * dense_layer + emb * (1 if shape.tied_embeddings else 2) + shape.hidden
        return {"first": {"dense": dense, "expert": experts}, "last": {"dense": dense, "expert": experts}}
    return {"first": {"dense": layers * dense_layer + emb, "expert": experts},
            "last": {"dense": layers * dense_layer + emb + shape.hidden, "expert": experts}}


def moe_layer_working_bytes(shape: MoEShape, layout: MoETrainLayout) -> float:
    """Activation bytes of one MoE layer for the whole micro-batch on one GPU, without recompute (bf16).

    Attention part per token (the dense model's terms without the MLP; docs/cost_model.md section 1):
    Q 2 q, K and V 4 g d, attention output 2 q, log-sum-exp 4 a, split over TP; norm inputs 4 h and
    QKV input 2 h split over TP under sequence parallelism. Router: fp32 logits and probabilities
    8 E / TP a token. Experts: tokens x k / EP (token, expert) pairs reach a GPU (the whole sequence
    of its TP group, gathered over ETP), x `routing_imbalance`; each keeps its permuted input 2 h,
    FC1 output 4 f / ETP, SwiGLU output 2 f / ETP, FC2 output 2 h and the combine buffer 2 h.
    """
    h, t, f = shape.hidden, layout.tp, shape.moe_ffn
    tokens = layout.seq_len * layout.micro_batch
    gd = shape.kv_heads * shape.head_dim
    attn = (2 * shape.q_dim + 4 * gd + 2 * shape.q_dim + 4 * shape.heads) / t
    attn += (4 * h + 2 * h) / (t if layout.sequence_parallel else 1)
    router = 8 * shape.experts / t
    pairs = tokens * shape.topk / layout.ep * layout.routing_imbalance
    per_pair = 6 * h + 6 * f / layout.expert_tp
    return tokens * (attn + router) + pairs * per_pair


def moe_memory_per_gpu(shape: MoEShape, layout: MoETrainLayout, *, logits_bytes_per_element: float = 22.0,
                       runtime_overhead_gib: float = 5.0, fragmentation: float = 0.10) -> dict:
    """Memory of one trainer GPU of an MoE layout, per item (GiB), for the worse pipeline stage.

    Static: bf16 weights (2 bytes a parameter), fp32 gradients (4), fp32 params + Adam m, v (12)
    divided by the dense DP for dense weights and by the expert DP for experts (distributed
    optimizer). Activations: full recompute keeps each layer's input (2 h / TP a token) and re-runs
    one layer (`moe_layer_working_bytes`, twice: activations and their gradients); logits of the
    longest micro-batch on the last stage (22 bytes a logit, as the dense model); fragmentation and
    runtime as the dense model.

    Returns:
        {"stage", "items": {name: GiB}, "total_gib", "params_per_gpu", "dense_params_per_gpu",
         "expert_params_per_gpu", "stages": {stage: GiB}}.
    """
    params = moe_stage_params(shape, layout)
    tokens = layout.seq_len * layout.micro_batch
    working_layer = moe_layer_working_bytes(shape, layout)
    layers_here = shape.layers // layout.pp
    if layout.recompute == "full":
        stored_per_layer = 2 * shape.hidden * tokens / (layout.tp if layout.sequence_parallel else 1)
    else:
        stored_per_layer = working_layer
    v_local = cm.padded_vocab(shape.vocab, layout.tp, layout.make_vocab_size_divisible_by) / layout.tp
    dopt = layout.dp if layout.distributed_optimizer else 1
    eopt = layout.expert_dp if layout.distributed_optimizer else 1
    out = {}
    for stage, p in params.items():
        d, e = p["dense"], p["expert"]
        in_flight = min(layout.pp, layout.microbatches_per_update) if stage == "first" else 1
        gbytes = 4 if layout.grad_fp32 else 2
        items = {
            "weights (bf16)": 2 * (d + e),
            "gradients (fp32 buffer)" if layout.grad_fp32 else "gradients (bf16 buffer)": gbytes * (d + e),
            f"fp32 params + Adam m, v, dense (/ DP {dopt})": 12 * d / dopt,
            f"fp32 params + Adam m, v, experts (/ expert-DP {eopt})": 12 * e / eopt,
        }
        if layout.ref_model:
            items["reference policy (bf16)"] = 2 * (d + e)
        act = in_flight * layers_here * stored_per_layer
        items[f"activations kept ({in_flight} micro-batch{'es' if in_flight > 1 else ''} x {layers_here} layers)"] = act
        working = 2 * working_layer if layout.recompute == "full" else working_layer
        items["one MoE layer's recomputed activations + their gradients"] = working
        logits = tokens * v_local * logits_bytes_per_element if stage == "last" else 0.0
        if logits:
            items[f"logits + log-prob/entropy temporaries ({tokens} x {int(v_local)})"] = logits
        items["allocator fragmentation"] = fragmentation * (act + working + logits)
        items["CUDA context, NCCL, workspaces"] = runtime_overhead_gib * GIB
        gib = {k: v / GIB for k, v in items.items()}
        out[stage] = {"items": gib, "total_gib": sum(gib.values()), "params_per_gpu": d + e,
                      "dense_params_per_gpu": d, "expert_params_per_gpu": e}
    worst = max(out, key=lambda s: out[s]["total_gib"])
    return {"stage": worst, **out[worst], "stages": {s: out[s]["total_gib"] for s in out}}


def ep_nodes_spanned(layout: MoETrainLayout, gpus_per_node: int) -> int:
    """Nodes one EP group spans: megatron-core orders expert ranks ETP fastest, then EP, so an EP
    group is every ETP-th rank of a block of ETP x EP consecutive ranks."""
    return max(1, math.ceil(layout.expert_tp * layout.ep / gpus_per_node))


def alltoall_volume(shape: MoEShape, layout: MoETrainLayout, tokens: float, passes: int, links: Links = Links()) -> dict:
    """Bytes megatron-core's `alltoall` token dispatcher moves for `tokens` tokens over `passes` passes
    through the model (forward = 1; backward = 1; a full-recompute forward = 1), and their time on one GPU.

    * All-to-all over EP: per token, MoE layer and pass, dispatch and combine each move k copies of its
      bf16 hidden state (2 h bytes), of which (EP - 1) / EP leave the GPU: 4 k h (EP - 1) / EP bytes.
      Every token starts on one GPU (sequence parallel), so a GPU sends total / world. With the EP
      group inside a node all of it goes over NVLink; otherwise the share of destinations on other
      nodes goes over InfiniBand.
    * Expert TP (ETP > 1): after the all-to-all every (token, expert) pair is all-gathered to the ETP
      ranks of its expert (each holds 1 / ETP of the expert's width) and reduce-scattered back after
      it: a GPU receives T k (ETP - 1) 4 h / world bytes a layer and pass, over NVLink (an ETP group is
      ETP consecutive ranks of one node).
    NVLink and InfiniBand run concurrently: time = max of the two at `links.alltoall_efficiency`.

    Returns:
        {"bytes_per_token_layer_pass", "total_bytes", "per_gpu_bytes", "etp_bytes_per_gpu",
         "nvlink_bytes_per_gpu", "ib_bytes_per_gpu", "nodes_spanned", "seconds"}; ``total_bytes`` and
        ``per_gpu_bytes`` are the all-to-all's, ``etp_bytes_per_gpu`` the expert-TP gathers'.
    """
    leave = (layout.ep - 1) / layout.ep
    per = 2 * shape.topk * 2 * shape.hidden * leave
    total = per * tokens * shape.layers * passes
    per_gpu = total / layout.world
    etp = tokens * shape.topk * (layout.expert_tp - 1) * 4 * shape.hidden / layout.world * shape.layers * passes
    nodes = ep_nodes_spanned(layout, links.gpus_per_node)
    if layout.ep == 1:
        remote_share = 0.0
    else:
        local_peers = layout.ep / nodes - 1  # other EP ranks on the sender's node
        remote_share = 1.0 - local_peers / (layout.ep - 1)
    ib, nv = per_gpu * remote_share, per_gpu * (1 - remote_share) + etp
    eff = links.alltoall_efficiency
    seconds = max(nv / (links.nvlink_gb_s * 1e9 * eff), ib / (links.ib_gb_s * 1e9 * eff))
    return {"bytes_per_token_layer_pass": per, "total_bytes": total, "per_gpu_bytes": per_gpu,
            "etp_bytes_per_gpu": etp, "nvlink_bytes_per_gpu": nv, "ib_bytes_per_gpu": ib, "nodes_spanned": nodes,
            "seconds": seconds}


def ep_sync_bytes(shape: MoEShape, layout: MoETrainLayout, links: Links = Links(), broadcast_gb_s: float = 20.0) -> dict:
    """Bytes of one weight sync of an EP layout (bf16) and its time.

    The stage's source rank (TP 0, EP 0, expert-DP 0) gathers what it does not hold before the
    broadcast: the dense weights' (TP - 1) / TP over TP, the experts' (EP - 1) / EP over EP and, of its
    own EP shard, (ETP - 1) / ETP over expert TP; then the whole checkpoint goes to the engines once
    (`broadcast_gb_s`, the dense model's figure). The gathers run over NVLink, the EP one over
    InfiniBand when the EP group spans nodes; counted one after the other (bucketed, not overlapped).
    """
    experts = shape.expert_params_total() * 2
    dense = shape.total_params() * 2 - experts
    tp_gather = dense * (layout.tp - 1) / layout.tp
    ep_gather = experts * (layout.ep - 1) / layout.ep
    etp_gather = experts / layout.ep * (layout.expert_tp - 1) / layout.expert_tp
    broadcast = shape.total_params() * 2
    eff = links.alltoall_efficiency
    ep_link = links.nvlink_gb_s if ep_nodes_spanned(layout, links.gpus_per_node) == 1 else links.ib_gb_s
    t_gather = (tp_gather + etp_gather) / (links.nvlink_gb_s * 1e9 * eff) + ep_gather / (ep_link * 1e9 * eff)
    t_broadcast = broadcast / (broadcast_gb_s * 1e9)
    return {"broadcast_bytes": broadcast, "tp_gather_bytes": tp_gather, "ep_gather_bytes": ep_gather,
            "etp_gather_bytes": etp_gather, "source_receives_bytes": tp_gather + ep_gather + etp_gather,
            "gather_s": t_gather, "broadcast_s": t_broadcast, "seconds": t_gather + t_broadcast}


# ----------------------------------------------------------------------------------------------
# rollout and step
# ----------------------------------------------------------------------------------------------

def moe_decode_iteration_s(shape: MoEShape, gpu: cm.GPU, tp: int, batch: int, mean_context: float,
                           dm: cm.DecodeModel = cm.DecodeModel(), weight_bytes: float = 2.0,
                           kv_dtype_bytes: int = 2) -> float:
    """Seconds of one decode iteration of an MoE engine of `tp` GPUs (experts split over them, EP = TP).

    As `cost_model.decode_iteration_s`, with the weights read = dense weights + the experts the batch
    touches (`MoEShape.experts_touched`), the FLOPs = 2 x active parameters a token + attention
    (4 B C q_dim L / TP), and 2 all-reduces a layer (SGLang's EP MoE without DeepEP combines the
    experts' outputs with an all-reduce, like TP).
    """
    dense = shape.total_params() - shape.expert_params_total()
    experts_read = shape.layers * shape.experts_touched(batch) * shape.expert_params()
    weights = (dense + experts_read) * weight_bytes / tp
    kv = batch * mean_context * shape.kv_bytes_per_token(tp, kv_dtype_bytes)
    t_mem = (weights + kv) / (gpu.hbm_tb_s * 1e12 * dm.hbm_efficiency)
    flops = 2 * shape.active_params() / tp * batch + 4 * batch * mean_context * shape.q_dim * shape.layers / tp
    t_flops = flops / (gpu.bf16_tflops * 1e12 * dm.flops_efficiency * (2.0 if weight_bytes == 1 else 1.0))
    comm = 2 * shape.layers * dm.allreduce_s if tp > 1 else 0.0
    return max(t_mem, t_flops) + comm + dm.overhead_s


def moe_engine_throughput(shape: MoEShape, gpu: cm.GPU, eng: cm.RolloutEngine, mean_context: float,
                          dm: cm.DecodeModel = cm.DecodeModel()) -> dict:
    """Engine memory (weights = every expert, total parameters) and steady-state decode tokens/s.

    Raises:
        ValueError: the weights exceed the engine's memory fraction.
    """
    weights = shape.total_params() * 2 / eng.tp / GIB
    pool = eng.mem_fraction * gpu.memory_gib
    kv = pool - weights
    if kv <= 0:
        raise ValueError(f"{gpu.name}: weights {weights:.1f} GiB per GPU at TP {eng.tp} exceed "
                         f"--mem-fraction-static {eng.mem_fraction} x {gpu.memory_gib} GiB")
    per_tok = shape.kv_bytes_per_token(eng.tp)
    kv_tokens = kv * GIB / per_tok
    batch = max(int(min(eng.max_running_requests, kv_tokens // max(mean_context, 1))), 1)
    t = moe_decode_iteration_s(shape, gpu, eng.tp, batch, mean_context, dm)
    return {"weights_gib": weights, "kv_cache_gib": kv, "kv_bytes_per_token_per_gpu": per_tok, "kv_tokens": kv_tokens,
            "outside_pool_gib": gpu.memory_gib - pool, "batch": batch, "iteration_s": t, "tokens_per_s": batch / t,
            "single_stream_tokens_per_s": 1.0 / moe_decode_iteration_s(shape, gpu, eng.tp, 1, mean_context, dm)}


def moe_step_time(shape: MoEShape, recipe: cm.RLRecipe, cluster: cm.Cluster, layout: MoETrainLayout, *,
                  links: Links = Links(), dm: cm.DecodeModel = cm.DecodeModel()) -> dict:
    """Seconds of one synchronous RL step of an MoE policy; the keys of `cost_model.step_time`
    (so `cost_model_async.async_step` applies) plus the all-to-all and sync details.

    Rollout: as the dense model with `moe_engine_throughput`; old log-probs and update: active-parameter
    FLOPs (2 N_active + 2 q_dim L s a token forward; update = 4 forwards' worth with full recompute) at
    `cluster.train_hfu`, plus the all-to-all of 1 (log-probs) and 3 (forward, backward, recompute)
    passes; weight sync: `ep_sync_bytes`.

    Raises:
        ValueError: no rollout engine, or the layout's world is not the trainer's GPUs.
    """
    engines = cluster.rollout_nodes * cluster.gpus_per_node // cluster.engine.tp
    if engines < 1:
        raise ValueError("no rollout engine: rollout_nodes x gpus_per_node < engine TP")
    trainer_gpus = cluster.trainer_nodes * cluster.gpus_per_node
    if layout.world != trainer_gpus:
        raise ValueError(f"layout world {layout.world} != trainer nodes {cluster.trainer_nodes} x {cluster.gpus_per_node}")
    ctx = recipe.mean_live_context()
    eng = moe_engine_throughput(shape, cluster.gpu, cluster.engine, ctx, dm)
    responses = recipe.gen_batch * recipe.n * recipe.gen_batches_per_step
    gen_tokens = responses * recipe.mean_response
    t_throughput = gen_tokens / (engines * eng["tokens_per_s"])
    longest = recipe.longest_response(responses)
    t_tail = longest * moe_decode_iteration_s(shape, cluster.gpu, cluster.engine.tp, 8, longest / 2, dm)
    rollout = max(t_throughput, t_tail)
    s = recipe.mean_prompt + recipe.mean_response
    tokens = recipe.train_batch * recipe.n * s
    fwd = (2 * shape.active_params() + 2 * shape.q_dim * shape.layers * s) * tokens
    rate = trainer_gpus * cluster.gpu.bf16_tflops * 1e12 * cluster.train_hfu
    logprob_passes = 2 if recipe.ref_model else 1
    a2a_logprob = alltoall_volume(shape, layout, tokens, logprob_passes, links)
    a2a_update = alltoall_volume(shape, layout, tokens, 3 if layout.recompute == "full" else 2, links)
    logprob = fwd * logprob_passes / rate + a2a_logprob["seconds"]
    update = fwd * (4 if layout.recompute == "full" else 3) / rate + a2a_update["seconds"]
    sync = ep_sync_bytes(shape, layout, links, cluster.weight_sync_gb_s)
    total = rollout + logprob + update + sync["seconds"]
    return {"engines": engines, "engine": eng, "mean_live_context": ctx, "generated_tokens": gen_tokens,
            "rollout_s": rollout, "rollout_throughput_bound_s": t_throughput, "rollout_tail_bound_s": t_tail,
            "longest_response": longest, "logprob_s": logprob, "update_s": update,
            "alltoall_s": a2a_logprob["seconds"] + a2a_update["seconds"],
            "alltoall_bytes": a2a_logprob["total_bytes"] + a2a_update["total_bytes"],
            "alltoall_per_gpu_bytes": a2a_logprob["per_gpu_bytes"] + a2a_update["per_gpu_bytes"],
            "etp_gather_per_gpu_bytes": a2a_logprob["etp_bytes_per_gpu"] + a2a_update["etp_bytes_per_gpu"],
            "train_flops": fwd * (logprob_passes + (4 if layout.recompute == "full" else 3)),
            "weight_sync_s": sync["seconds"], "sync": sync, "step_s": total, "train_tokens": tokens,
            "gpus": (cluster.trainer_nodes + cluster.rollout_nodes) * cluster.gpus_per_node}


def moe_reprefill_s(shape: MoEShape, recipe: cm.RLRecipe, cluster: cm.Cluster,
                    dm: cm.DecodeModel = cm.DecodeModel()) -> float:
    """Upper bound on an engine's seconds to prefill again its running requests' prefixes after an
    update (partial rollouts, eta = 1): batch x live context tokens at 2 N_active + 2 q_dim L x context
    FLOPs a token, on TP GPUs at `dm.flops_efficiency` (the dense model's `reprefill_s` with active FLOPs)."""
    ctx = recipe.mean_live_context()
    eng = moe_engine_throughput(shape, cluster.gpu, cluster.engine, ctx, dm)
    per_token = 2 * shape.active_params() + 2 * shape.q_dim * shape.layers * ctx
    return eng["batch"] * ctx * per_token / (cluster.engine.tp * cluster.gpu.bf16_tflops * 1e12 * dm.flops_efficiency)


# ----------------------------------------------------------------------------------------------
# the Qwen3-30B-A3B recipe
# ----------------------------------------------------------------------------------------------

MOE_TRAIN_HFU = 0.20
"""Assumed hardware FLOPs utilisation of the MoE trainer's passes. Megatron-Core reaches 39.0 % MFU
pre-training Qwen2-57B-A14B on H100 with parallel folding (arXiv 2504.14960); the dense model here
takes 0.35 against 47 % for GPT-3 175B (the same 0.74 ratio gives 0.29); Qwen3-30B-A3B's hidden
size 2048 and 768-wide experts split over expert TP make its GEMMs small, and folding (ETP != TP) is
not available to the weight publisher: 0.20, with 0.15-0.30 in the sensitivity rows."""


def recipe_layout(repo) -> dict:
    """The trainer layout, node split and engines of examples/qwen3-30b-a3b/dapo.yaml with
    slurm/qwen3-30b-a3b-dapo.sbatch."""
    import yaml

    y = yaml.safe_load((repo / "examples" / "qwen3-30b-a3b" / "dapo.yaml").read_text())
    sb = cm._sbatch_defaults(repo / "slurm" / "qwen3-30b-a3b-dapo.sbatch")
    t = y["trainer"]
    trainer_nodes = int(sb.get("TRAINER_NODES", 4))
    gpus = int(sb.get("GPUS_PER_NODE", 8))
    tp, pp = t["tensor_model_parallel_size"], t["pipeline_model_parallel_size"]
    dp = trainer_nodes * gpus // (tp * pp)
    seqs = y["actor"]["ppo_mini_batch_size"] * y["rollout"]["n"]
    layout = MoETrainLayout(
        tp=tp, pp=pp, dp=dp, ep=t["expert_model_parallel_size"], etp=t.get("expert_tensor_parallel_size"),
        seq_len=y["data"]["max_prompt_length"] + y["data"]["max_response_length"],
        micro_batch=y["actor"]["ppo_micro_batch_size"], sequence_parallel=bool(t.get("sequence_parallel")),
        distributed_optimizer=bool(t.get("use_distributed_optimizer")), recompute=t.get("recompute"),
        ref_model=bool(y["actor"].get("use_kl_loss")), microbatches_per_update=max(seqs // dp, 1))
    nodes = sb.get("nodes", 8)
    return {"layout": layout, "nodes": nodes, "trainer_nodes": trainer_nodes, "rollout_nodes": nodes - trainer_nodes,
            "gpus_per_node": gpus, "rollout_tp": int(sb.get("ROLLOUT_TP_SIZE", 4)),
            "rollout_mem_fraction": float(sb.get("ROLLOUT_MEM_FRACTION", 0.85)),
            "router_replay": bool(y["actor"].get("router_replay")),
            "recipe": replace(cm.RLRecipe(), train_batch=y["data"]["train_batch_size"],
                              gen_batch=y["data"].get("gen_batch_size") or y["data"]["train_batch_size"],
                              n=y["rollout"]["n"], ppo_mini_batch=y["actor"]["ppo_mini_batch_size"],
                              max_prompt=y["data"]["max_prompt_length"], max_response=y["data"]["max_response_length"])}


def moe_section(repo, steps: int, mean_response: float, mean_prompt: float, gen_batches: float) -> dict:
    """Print and return the Qwen3-30B-A3B section: parameters, trainer memory of the recipe and
    alternatives, all-to-all and EP sync bytes, engine, and the step (synchronous and eta = 1) for
    node splits, with the HFU sensitivity."""
    shape = MoEShape.from_hf_config(json.loads((repo / "examples" / "qwen3-30b-a3b" / "config.json").read_text()))
    r = recipe_layout(repo)
    lay = r["layout"]
    recipe = replace(r["recipe"], mean_response=mean_response, mean_prompt=mean_prompt,
                     gen_batches_per_step=gen_batches)
    out: dict = {"model": {**asdict(shape), "total_params": shape.total_params(), "active_params": shape.active_params(),
                           "expert_params": shape.expert_params_total()}}
    print(f"\nMixture-of-Experts: Qwen3-30B-A3B, {shape.total_params() / 1e9:.2f} B parameters in total, "
          f"{shape.active_params() / 1e9:.2f} B active a token ({shape.expert_params_total() / 1e9:.2f} B in "
          f"{shape.layers} x {shape.experts} experts; {shape.params_per_layer() / 1e6:.1f} M a layer, "
          f"{shape.active_params_per_layer() / 1e6:.1f} M active)")
    print("Trainer memory per GPU (GiB of 79.6; worst pipeline stage):")
    rows = []
    cands = [(f"recipe: TP{lay.tp} EP{lay.ep} (ETP{lay.expert_tp}) PP{lay.pp} DP{lay.dp} expert-DP{lay.expert_dp}", lay),
             ("TP4 EP8 PP1 DP8 expert-DP1 (EP across 4 nodes)", replace(lay, ep=8)),
             ("TP4 EP4 PP1 DP8 expert-DP2 (EP across 2 nodes)", replace(lay, ep=4)),
             ("TP4 EP2 on 2 trainer nodes (DP4, expert-DP2)", replace(lay, dp=4, microbatches_per_update=128)),
             ("TP2 EP4 PP1 DP16 expert-DP4", replace(lay, tp=2, ep=4, dp=16, microbatches_per_update=32)),
             ("folded TP4 / ETP1 EP8 (not supported by the publisher yet)", replace(lay, ep=8, etp=1))]
    for label, l in cands:
        m = moe_memory_per_gpu(shape, l)
        fits = m["total_gib"] <= cm.H100.memory_gib
        print(f"  {label:52s} {m['params_per_gpu'] / 1e9:5.2f} B/GPU  {m['total_gib']:5.1f} GiB  {'fits' if fits else 'NO'}")
        rows.append({"label": label, "layout": asdict(l), **m, "fits_h100_80gb": fits})
    out["trainer_memory"] = rows
    print("  recipe, item by item (" + rows[0]["stage"] + " stage):")
    for k, v in rows[0]["items"].items():
        print(f"    {k:70s} {v:6.2f}")
    cl = cm.Cluster(trainer_nodes=r["trainer_nodes"], rollout_nodes=r["rollout_nodes"], gpus_per_node=r["gpus_per_node"],
                    train_hfu=MOE_TRAIN_HFU,
                    engine=cm.RolloutEngine(tp=r["rollout_tp"], mem_fraction=r["rollout_mem_fraction"]))
    st = moe_step_time(shape, recipe, cl, lay)
    eng = st["engine"]
    sync = st["sync"]
    print(f"Engine (SGLang TP {cl.engine.tp} = EP {cl.engine.tp}, --mem-fraction-static {cl.engine.mem_fraction}): weights "
          f"{eng['weights_gib']:.1f} GiB/GPU, KV pool {eng['kv_cache_gib']:.1f} GiB = {eng['kv_tokens'] / 1e6:.2f} M tokens "
          f"({eng['kv_bytes_per_token_per_gpu'] / 1024:.0f} KiB/token/GPU); batch {eng['batch']} at context "
          f"{st['mean_live_context']:.0f}: {eng['tokens_per_s']:.0f} tok/s, single stream "
          f"{eng['single_stream_tokens_per_s']:.0f} tok/s")
    print(f"Token dispatcher a step: all-to-all {st['alltoall_bytes'] / 1e12:.0f} TB in all = "
          f"{st['alltoall_per_gpu_bytes'] / 1e12:.1f} TB per trainer GPU, expert-TP gathers "
          f"{st['etp_gather_per_gpu_bytes'] / 1e12:.1f} TB per GPU: {st['alltoall_s']:.0f} s; weight sync: broadcast {sync['broadcast_bytes'] / 1e9:.1f} GB + "
          f"EP gather {sync['ep_gather_bytes'] / 1e9:.1f} GB + TP gathers "
          f"{(sync['tp_gather_bytes'] + sync['etp_gather_bytes']) / 1e9:.1f} GB = {sync['seconds']:.1f} s")
    out["dispatcher_alternatives"] = {label: alltoall_volume(shape, l, st["train_tokens"], 4)
                                      for label, l in cands if label.startswith(("recipe", "TP4 EP8", "folded"))}
    for label, v in out["dispatcher_alternatives"].items():
        print(f"  {label:52s} dispatcher {v['seconds']:4.0f} s a step (NVLink {v['nvlink_bytes_per_gpu'] / 1e12:.1f} TB, "
              f"InfiniBand {v['ib_bytes_per_gpu'] / 1e12:.1f} TB per GPU)")
    out["engine"] = {"engine": asdict(cl.engine), **eng}
    out["sync"] = sync
    print(f"Step (mean response {recipe.mean_response:.0f}, train HFU {MOE_TRAIN_HFU}; {steps} steps):")
    splits = []
    for tn, rn in ((4, 4), (4, 2), (4, 8), (2, 6)):
        c = replace(cl, trainer_nodes=tn, rollout_nodes=rn)
        l2 = lay if tn == r["trainer_nodes"] else replace(lay, dp=tn * r["gpus_per_node"] // (lay.tp * lay.pp),
                                                          microbatches_per_update=lay.microbatches_per_update * 4 // tn)
        try:
            s = moe_step_time(shape, recipe, c, l2)
        except ValueError as e:
            print(f"  {tn} + {rn}: {e}")
            continue
        a = cma.async_run_cost(s, steps, moe_reprefill_s(shape, recipe, c))
        mem = moe_memory_per_gpu(shape, l2)["total_gib"]
        row = {"trainer_nodes": tn, "rollout_nodes": rn, "trainer_gib": mem,
               **{k: s[k] for k in ("rollout_s", "logprob_s", "update_s", "alltoall_s", "weight_sync_s", "step_s", "gpus")},
               "sync_gpu_hours": a["sync_gpu_hours"], "async_step_s": a["async_step_s"], "async_gpu_hours": a["gpu_hours"],
               "speedup": a["speedup"], "bound": a["bound"]}
        splits.append(row)
        print(f"  {tn} + {rn} nodes: rollout {s['rollout_s']:5.0f} s, log-prob {s['logprob_s']:4.0f} s, update "
              f"{s['update_s']:5.0f} s (all-to-all {s['alltoall_s']:.0f} s), sync {s['weight_sync_s']:.1f} s: "
              f"{s['step_s'] / 60:5.1f} min sync, {a['async_step_s'] / 60:5.1f} min eta=1 ({a['bound']}-bound); GPU-hours "
              f"{a['sync_gpu_hours']:6.0f} -> {a['gpu_hours']:6.0f}  (trainer {mem:.1f} GiB/GPU)")
    out["step"] = {"recipe": asdict(recipe), "train_hfu": MOE_TRAIN_HFU, "splits": splits}
    sens = []
    for hfu in (0.15, 0.20, 0.30):
        s = moe_step_time(shape, recipe, replace(cl, train_hfu=hfu), lay)
        sens.append({"train_hfu": hfu, "step_s": s["step_s"], "train_s": s["logprob_s"] + s["update_s"]})
    for L in (2000, 8000):
        s = moe_step_time(shape, replace(recipe, mean_response=L), cl, lay)
        sens.append({"mean_response": L, "step_s": s["step_s"], "rollout_s": s["rollout_s"]})
    print("  sensitivity: " + ", ".join(
        (f"HFU {x['train_hfu']}: {x['step_s'] / 60:.1f} min" if "train_hfu" in x
         else f"mean response {x['mean_response']}: {x['step_s'] / 60:.1f} min") for x in sens))
    out["sensitivity"] = sens
    return out
