"""Hugging Face ``config.json`` -> megatron-core ``TransformerConfig`` (the one place building it).

Supported ``model_type``: ``qwen2`` (Qwen2 / Qwen2.5: GQA, q/k/v bias, RMSNorm, SwiGLU, RoPE),
``qwen3`` (as qwen2 without q/k/v bias, with per-head q/k RMSNorm and an explicit ``head_dim``)
``llama`` (no bias, default RoPE only) and ``qwen3_moe`` (Qwen3 attention, every layer's MLP a
Mixture-of-Experts block: softmax router, top-k, no shared expert). GPTModel takes the rotary base, the vocabulary and
the embedding tying itself, so those come back separately in :class:`ModelSpec`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
_RECOMPUTE_CHOICES = (None, "full", "selective")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Model facts GPTModel needs besides ``TransformerConfig``, read from an HF config."""

    model_type: str
    """HF ``model_type`` (one of SUPPORTED_MODEL_TYPES)."""
    vocab_size: int
    """Vocabulary size of the tokenizer / HF embedding rows (unpadded)."""
    padded_vocab_size: int
    """vocab_size rounded up to a multiple of make_vocab_size_divisible_by x TP (megatron rows)."""
    tie_word_embeddings: bool
    """Whether the output layer shares the input embedding (share_embeddings_and_output_weights)."""
    max_position_embeddings: int
    """Longest sequence the model was trained for, tokens."""
    rotary_base: float
    """RoPE base (HF ``rope_theta``)."""
    qk_layernorm: bool
    """Per-head RMSNorm on queries and keys (Qwen3, Qwen3-MoE)."""
    moe: "MoESpec | None" = None
    """The Mixture-of-Experts facts (None for dense models)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Mixture-of-Experts facts of an HF config (Qwen3-MoE: every layer is an MoE layer).

    HF keys: ``num_experts`` (``num_local_experts`` as transformers >= 5 saves it),
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``.
    """

    num_experts: int
    """Routed experts per layer (HF ``num_experts``)."""
    topk: int
    """Experts each token is routed to (HF ``num_experts_per_tok``)."""
    ffn_hidden_size: int
    """Hidden size of one expert's SwiGLU MLP (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool
    """Whether the top-k gate probabilities are renormalised to sum to 1 (HF ``norm_topk_prob``).
    True: softmax over the k chosen logits (megatron ``moe_router_pre_softmax=False``); False:
    softmax over all experts, the k probabilities taken as they are (``moe_router_pre_softmax=True``)."""


def moe_spec(hf_config: Mapping[str, Any]) -> MoESpec | None:
    """The :class:`MoESpec` of an HF config, None for a dense ``model_type``.

    Refused (``ValueError`` naming the HF key): shared experts (``shared_expert_intermediate_size``
    > 0, ``n_shared_experts`` > 0), dense layers among the MoE ones (``mlp_only_layers`` not empty,
    ``decoder_sparse_step`` != 1, ``first_k_dense_replace`` > 0), top-k > experts, and a router
    other than softmax (``scoring_func``).
    """
    model_type = _model_type(hf_config)
    if model_type not in MOE_MODEL_TYPES:
        return None
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if hf_config.get(key):
            raise ValueError(f"unsupported HF config key {key!r}={hf_config[key]!r}: shared experts are not "
                             "supported yet (Qwen3-MoE has none)")
    if hf_config.get("mlp_only_layers"):
        raise ValueError(f"unsupported HF config key 'mlp_only_layers'={hf_config['mlp_only_layers']!r}: dense "
                         "layers among MoE layers are not supported yet (every layer must be an MoE layer)")
    if int(hf_config.get("decoder_sparse_step", 1) or 1) != 1:
        raise ValueError(f"unsupported HF config key 'decoder_sparse_step'={hf_config['decoder_sparse_step']!r}: "
                         "only 1 (every layer an MoE layer) is supported")
    if hf_config.get("first_k_dense_replace"):
        raise ValueError(f"unsupported HF config key 'first_k_dense_replace'={hf_config['first_k_dense_replace']!r}: "
                         "dense-first layers are not supported yet")
    if hf_config.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"unsupported HF config key 'scoring_func'={hf_config['scoring_func']!r}: only 'softmax'")
    # transformers >= 5 writes the expert count as num_local_experts (Qwen3MoeConfig's attribute map)
    if hf_config.get("num_experts") is None and hf_config.get("num_local_experts") is not None:
        num_experts = int(hf_config["num_local_experts"])
    else:
        num_experts = int(_require(hf_config, "num_experts"))
    topk = int(_require(hf_config, "num_experts_per_tok"))
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(f"HF config keys 'num_experts'={num_experts}, 'num_experts_per_tok'={topk}: need "
                         "1 <= num_experts_per_tok <= num_experts")
    return MoESpec(num_experts=num_experts, topk=topk,
                   ffn_hidden_size=int(_require(hf_config, "moe_intermediate_size")),
                   norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)))


def _require(hf_config: Mapping[str, Any], key: str) -> Any:
    if key not in hf_config or hf_config[key] is None:
        raise ValueError(
            f"HF config (model_type={hf_config.get('model_type')!r}) is missing required key {key!r}"
        )
    return hf_config[key]


def _model_type(hf_config: Mapping[str, Any]) -> str:
    model_type = _require(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported HF config key 'model_type'={model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return model_type


def _rope_theta(hf_config: Mapping[str, Any]) -> float:
    # transformers >= 5 moves rope_theta into rope_parameters; accept both layouts.
    rope_parameters = hf_config.get("rope_parameters") or {}
    rope_scaling = hf_config.get("rope_scaling") or {}
    for scaling in (rope_scaling, rope_parameters):
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"unsupported HF config key 'rope_scaling' (rope_type={rope_type!r}); only default RoPE"
            )
    if hf_config.get("rope_theta") is not None:
        return float(hf_config["rope_theta"])
    if rope_parameters.get("rope_theta") is not None:
        return float(rope_parameters["rope_theta"])
    raise ValueError(f"HF config (model_type={hf_config.get('model_type')!r}) is missing required key 'rope_theta'")


def padded_vocab_size(
    vocab_size: int, *, tensor_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> int:
    """Round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by x TP`` (as megatron).

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def build_model_spec(
    hf_config: Mapping[str, Any],
    *,
    tensor_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
) -> ModelSpec:
    """Read vocabulary, tying, positions and RoPE base from an HF config dict.

    Raises:
        ValueError: unsupported ``model_type``, unsupported RoPE scaling or a missing key.
    """
    model_type = _model_type(hf_config)
    vocab_size = int(_require(hf_config, "vocab_size"))
    return ModelSpec(
        model_type=model_type,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(
            vocab_size,
            tensor_model_parallel_size=tensor_model_parallel_size,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        ),
        # HF's default for tie_word_embeddings is True (PretrainedConfig); Llama overrides to False.
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", model_type != "llama")),
        max_position_embeddings=int(_require(hf_config, "max_position_embeddings")),
        rotary_base=_rope_theta(hf_config),
        qk_layernorm=model_type in _QK_NORM_MODEL_TYPES,
        moe=moe_spec(hf_config),
    )


def build_transformer_config(
    hf_config: Mapping[str, Any],
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    fp16: bool = False,
    fp8: str | None = None,
    fp8_recipe: str | None = None,
    fp8_amax_history_len: int = 1024,
    fp8_amax_compute_algo: str = "max",
    fp8_margin: int = 0,
    fp8_param_gather: bool = False,
    recompute: str | None = None,
    deterministic_mode: bool = False,
    attention_dropout: float = 0.0,
    hidden_dropout: float = 0.0,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    moe_router_load_balancing_type: str = "none",
    moe_aux_loss_coeff: float = 0.0,
    moe_enable_routing_replay: bool = False,
):
    """Build megatron-core's ``TransformerConfig`` from an HF ``config.json`` dict.

    Mapping: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads ->
    num_query_groups (GQA), intermediate_size -> ffn_hidden_size, head_dim (or hidden/heads) ->
    kv_channels, rms_norm_eps -> layernorm_epsilon with RMSNorm, silu -> SwiGLU
    (gated_linear_unit + F.silu), initializer_range -> init_method_std, q/k/v bias for qwen2
    (add_qkv_bias), no bias elsewhere (add_bias_linear=False), qk_layernorm for qwen3. The rotary
    base and vocabulary are not TransformerConfig fields: use :func:`build_model_spec`.

    Mixture-of-Experts (``qwen3_moe``): num_experts -> num_moe_experts, num_experts_per_tok ->
    moe_router_topk, moe_intermediate_size -> moe_ffn_hidden_size (and ffn_hidden_size: every layer
    is an MoE layer, and megatron's SequentialMLP deep-copies the config, process groups included,
    when the two differ), norm_topk_prob -> moe_router_pre_softmax = not norm_topk_prob (softmax
    over the k chosen logits equals HF's renormalised top-k of the full softmax), the router in
    fp32 (moe_router_dtype), megatron's SequentialMLP experts (moe_grouped_gemm=False) and the
    alltoall token dispatcher.

    Args:
        hf_config: the parsed HF config.json.
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size: sizes.
        sequence_parallel: megatron sequence parallelism (needs TP > 1).
        params_dtype: dtype of the parameters.
        bf16, fp16: mixed-precision flags (at most one).
        fp8: None, "e4m3" or "hybrid" (Transformer Engine only): the FP8 format of the GEMMs
            (hybrid = E4M3 forward, E5M2 gradients), megatron-core's ``fp8`` field.
        fp8_recipe: megatron fp8 recipe name ("delayed", "tensorwise", "mxfp8", "blockwise").
        fp8_amax_history_len, fp8_amax_compute_algo, fp8_margin: scaling of the "delayed"
            recipe (amax window in steps, "max" | "most_recent", exponent margin); the DAPO-scale
            NeMo/Megatron recipes use 1024 / "max" / 0. Ignored by the other recipes.
        fp8_param_gather: keep FP8 copies of the weights for the all-gather (megatron's
            ``fp8_param``; distributed optimizer only).
        recompute: None, "full" (uniform, every layer) or "selective" activation recomputation.
        deterministic_mode: megatron's deterministic mode.
        attention_dropout, hidden_dropout: dropout probabilities in [0, 1).
        expert_model_parallel_size: EP size (MoE only): the experts of a layer are split over this
            many ranks (megatron's ``expert_model_parallel_size``).
        expert_tensor_parallel_size: tensor parallelism inside an expert (None: = TP size).
        moe_router_load_balancing_type: "none" | "aux_loss" | "seq_aux_loss" | "global_aux_loss"
            (megatron's names; Megatron-LM ``--moe-router-load-balancing-type``).
        moe_aux_loss_coeff: the load-balancing loss coefficient (``--moe-aux-loss-coeff``), >= 0.
        moe_enable_routing_replay: build the routers with megatron-core's ``RouterReplay`` (rollout
            routing replay, ALGORITHMS.md section 9).

    Returns:
        ``megatron.core.transformer.TransformerConfig``.

    Raises:
        ValueError: unsupported ``model_type`` / activation / sliding window, a missing key,
            inconsistent sizes or bad arguments (the message names the key).
    """
    from megatron.core.transformer import TransformerConfig

    model_type = _model_type(hf_config)
    hidden_size = int(_require(hf_config, "hidden_size"))
    num_layers = int(_require(hf_config, "num_hidden_layers"))
    num_heads = int(_require(hf_config, "num_attention_heads"))
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    if model_type in MOE_MODEL_TYPES and hf_config.get("intermediate_size") is None:
        ffn_hidden_size = int(_require(hf_config, "moe_intermediate_size"))  # no dense MLP in the model
    else:
        ffn_hidden_size = int(_require(hf_config, "intermediate_size"))
    eps = float(_require(hf_config, "rms_norm_eps"))
    hidden_act = _require(hf_config, "hidden_act")
    if hidden_act != "silu":
        raise ValueError(f"unsupported HF config key 'hidden_act'={hidden_act!r}; only 'silu' (SwiGLU)")
    if hf_config.get("use_sliding_window"):
        raise ValueError("unsupported HF config key 'use_sliding_window'=True; only full attention")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"HF config key 'num_attention_heads'={num_heads} is not a multiple of "
            f"'num_key_value_heads'={num_kv_heads}"
        )
    if model_type == "llama" and hf_config.get("mlp_bias"):
        raise ValueError("unsupported HF config key 'mlp_bias'=True")
    head_dim = hf_config.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"HF config key 'hidden_size'={hidden_size} is not divisible by "
                f"'num_attention_heads'={num_heads} and 'head_dim' is missing"
            )
        head_dim = hidden_size // num_heads
    if model_type == "qwen2":
        add_qkv_bias = True
    else:
        add_qkv_bias = bool(hf_config.get("attention_bias", False))
    if recompute not in _RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {_RECOMPUTE_CHOICES}, got {recompute!r}")
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are mutually exclusive")
    for name, p in (("attention_dropout", attention_dropout), ("hidden_dropout", hidden_dropout)):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    if tensor_model_parallel_size > 1 and num_kv_heads % tensor_model_parallel_size != 0:
        raise ValueError(
            f"HF config key 'num_key_value_heads'={num_kv_heads} is not divisible by "
            f"tensor_model_parallel_size={tensor_model_parallel_size}"
        )
    if sequence_parallel and tensor_model_parallel_size == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
    if fp8 not in (None, "e4m3", "hybrid"):
        raise ValueError(f"fp8 must be None, 'e4m3' or 'hybrid', got {fp8!r}")
    if fp8_recipe not in (None, "delayed", "tensorwise", "blockwise", "mxfp8"):
        raise ValueError(f"fp8_recipe must be delayed | tensorwise | blockwise | mxfp8, got {fp8_recipe!r}")
    if fp8 is not None and not (bf16 or fp16):
        raise ValueError("fp8 needs bf16 (or fp16) mixed precision: FP8 GEMMs with higher-precision master compute")
    if fp8_amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"fp8_amax_compute_algo must be 'max' or 'most_recent', got {fp8_amax_compute_algo!r}")
    if fp8_amax_history_len < 1 or fp8_margin < 0:
        raise ValueError(f"fp8_amax_history_len must be >= 1 and fp8_margin >= 0, got {fp8_amax_history_len}, "
                         f"{fp8_margin}")
    _rope_theta(hf_config)  # validate here so a bad RoPE fails at config time
    moe = moe_spec(hf_config)
    if moe is None and (expert_model_parallel_size != 1 or moe_enable_routing_replay):
        raise ValueError(f"expert_model_parallel_size={expert_model_parallel_size} / routing replay need a "
                         f"Mixture-of-Experts model; HF config 'model_type'={model_type!r} is dense")
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    moe_kwargs: dict[str, Any] = {}
    if moe is not None:
        if moe.num_experts % expert_model_parallel_size != 0:
            raise ValueError(f"HF config key 'num_experts'={moe.num_experts} is not divisible by "
                             f"expert_model_parallel_size={expert_model_parallel_size}")
        if moe.ffn_hidden_size % expert_tensor_parallel_size != 0:
            raise ValueError(f"HF config key 'moe_intermediate_size'={moe.ffn_hidden_size} is not divisible by "
                             f"expert_tensor_parallel_size={expert_tensor_parallel_size}")
        if moe_router_load_balancing_type not in ("none", "aux_loss", "seq_aux_loss", "global_aux_loss"):
            raise ValueError("moe_router_load_balancing_type must be none | aux_loss | seq_aux_loss | "
                             f"global_aux_loss, got {moe_router_load_balancing_type!r}")
        if not moe_aux_loss_coeff >= 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {moe_aux_loss_coeff!r}")
        ffn_hidden_size = moe.ffn_hidden_size
        moe_kwargs = dict(
            num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn_hidden_size,
            moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_dtype="fp32", moe_grouped_gemm=False,
            moe_router_load_balancing_type=moe_router_load_balancing_type, moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_enable_routing_replay=moe_enable_routing_replay, moe_permute_fusion=False, moe_router_fusion=False,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )

    recompute_kwargs: dict[str, Any] = {}
    if recompute == "full":
        recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        recompute_kwargs = dict(recompute_granularity="selective")

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_query_groups=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size,
        kv_channels=int(head_dim),
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        qk_layernorm=model_type in _QK_NORM_MODEL_TYPES,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=add_qkv_bias,
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
        attention_dropout=attention_dropout,
        hidden_dropout=hidden_dropout,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        fp16=fp16,
        fp8=fp8,
        fp8_recipe=fp8_recipe if fp8_recipe is not None else "delayed",
        fp8_amax_history_len=fp8_amax_history_len,
        fp8_amax_compute_algo=fp8_amax_compute_algo,
        fp8_margin=fp8_margin,
        fp8_param=fp8_param_gather,
        deterministic_mode=deterministic_mode,
        # The RL losses hand megatron a numerator and a count per micro-batch; megatron sums both
        # over micro-batches and DP ranks (ALGORITHMS.md section 6).
        calculate_per_token_loss=True,
        # Fused kernels are CUDA-only or need torch.compile; the trainer enables none of them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Per-token losses with variable-length micro-batches (pipeline shapes vary).
        variable_seq_lengths=True,
        # Dense models have no MoE layer; megatron rejects the default "allgather" dispatcher with
        # variable_seq_lengths even so.
        moe_token_dispatcher_type="alltoall",
        **moe_kwargs,
        **recompute_kwargs,
    )
