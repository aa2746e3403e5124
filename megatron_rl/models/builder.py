"""Build the megatron-core GPTModel for an HF architecture and wrap it for training.

:func:`build_model` picks the layer spec: Transformer Engine's when TE imports and CUDA is
present, megatron-core's local spec otherwise (CPU, CI). :func:`wrap_ddp_and_optimizer` wraps
the model in megatron-core's DistributedDataParallel and builds the optimizer and LR scheduler,
wiring ``finalize_model_grads`` and ``no_sync`` into the config (without them DP ranks diverge).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Any, Mapping

import torch

from megatron_rl.models.hf_config import build_model_spec

logger = logging.getLogger(__name__)


def transformer_engine_usable() -> bool:
    """True when Transformer Engine is importable and a CUDA device is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_te_for(transformer_impl: str) -> bool | None:
    """``trainer.transformer_impl`` -> ``build_model``'s ``use_te``: auto -> None (TE when usable),
    transformer_engine -> True, local -> False.

    Raises:
        ValueError: an unknown value.
    """
    choices = {"auto": None, "transformer_engine": True, "local": False}
    if transformer_impl not in choices:
        raise ValueError(f"trainer.transformer_impl must be one of {sorted(choices)}, got {transformer_impl!r}")
    return choices[transformer_impl]


def transformer_config_for(hf_config: Mapping[str, Any], trainer, *, router_replay: bool = False) -> Any:
    """The one place a run's ``TransformerConfig`` is built: the HF architecture plus the
    ``trainer`` section (a ``config.schema.TrainerConfig``): TP/PP/CP sizes, sequence
    parallelism, precision (fp32 | bf16 params and compute), FP8 (format, recipe, amax history
    length and reduction, margin, FP8 parameter all-gather), activation recompute and, for a
    Mixture-of-Experts model, expert parallelism and the router options (:func:`moe_kwargs_for`;
    ``router_replay``: build megatron-core's ``RouterReplay`` instances (the policy model of an MoE
    run; never the reference model, which routes by itself: ALGORITHMS.md 9)).

    Raises:
        ValueError: an unsupported HF config or an inconsistent trainer section (names the key).
    """
    from megatron_rl.models.hf_config import build_transformer_config

    bf16 = trainer.precision == "bf16"
    return build_transformer_config(
        hf_config, tensor_model_parallel_size=trainer.tensor_model_parallel_size,
        pipeline_model_parallel_size=trainer.pipeline_model_parallel_size,
        context_parallel_size=trainer.context_parallel_size, sequence_parallel=trainer.sequence_parallel,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16,
        fp8=trainer.fp8, fp8_recipe=trainer.fp8_recipe if trainer.fp8 else None,
        fp8_amax_history_len=trainer.fp8_amax_history_len, fp8_amax_compute_algo=trainer.fp8_amax_compute_algo,
        fp8_margin=trainer.fp8_margin, fp8_param_gather=trainer.fp8_param_gather, recompute=trainer.recompute,
        **moe_kwargs_for(hf_config, trainer, router_replay=router_replay),
    )


def moe_kwargs_for(hf_config: Mapping[str, Any], trainer, *, router_replay: bool = False) -> dict:
    """``build_transformer_config``'s Mixture-of-Experts arguments from the ``trainer`` section
    (``expert_model_parallel_size``, ``expert_tensor_parallel_size``, ``moe_router_load_balancing_type``,
    ``moe_aux_loss_coeff``; Megatron's names) and ``actor.router_replay``; {} for a dense model
    whose trainer section keeps the defaults.

    Raises:
        ValueError: expert parallelism (or replay) asked of a dense model (names the key).
    """
    from megatron_rl.models.hf_config import moe_spec

    ep = getattr(trainer, "expert_model_parallel_size", 1)
    etp = getattr(trainer, "expert_tensor_parallel_size", None)
    if moe_spec(hf_config) is None:
        if ep != 1 or (etp not in (None, trainer.tensor_model_parallel_size)) or router_replay:
            raise ValueError(f"trainer.expert_model_parallel_size={ep} / trainer.expert_tensor_parallel_size={etp} / "
                             f"actor.router_replay={router_replay} need a Mixture-of-Experts model; HF config "
                             f"'model_type'={hf_config.get('model_type')!r} is dense")
        return {}
    return dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                moe_router_load_balancing_type=getattr(trainer, "moe_router_load_balancing_type", "none"),
                moe_aux_loss_coeff=getattr(trainer, "moe_aux_loss_coeff", 0.0),
                moe_enable_routing_replay=router_replay)


def build_layer_spec(hf_config: Mapping[str, Any], *, use_te: bool | None = None, attention_backend: str = "auto"):
    """Layer spec (``ModuleSpec``) for the architecture: TE when usable (or forced), else local.
    ``attention_backend="sdpa"`` puts torch's SDPA core attention into the local spec
    (``models.sdpa_attention``); "auto" keeps megatron-core's own.

    Raises:
        ValueError: ``use_te=True`` but Transformer Engine is not usable here; "sdpa" with the TE
            spec; an unknown ``attention_backend``.
    """
    if attention_backend not in ("auto", "sdpa"):
        raise ValueError(f"attention_backend must be auto or sdpa, got {attention_backend!r}")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = build_model_spec(hf_config)
    if use_te is None:
        use_te = transformer_engine_usable()
    if use_te:
        if not transformer_engine_usable():
            raise ValueError("use_te=True needs Transformer Engine and a CUDA device")
        if attention_backend == "sdpa":
            raise ValueError("attention_backend sdpa is for the local layer spec; Transformer Engine layers bring "
                             "their own attention (trainer.transformer_impl: local to use sdpa)")
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.moe.num_experts if spec.moe else None, moe_grouped_gemm=False,
            qk_layernorm=spec.qk_layernorm)
    # MoE: megatron-core's SequentialMLP (one MLP module per local expert; the HF <-> megatron map
    # in models.hf_weights names them experts.local_experts.<e>)
    layer = get_gpt_layer_local_spec(num_experts=spec.moe.num_experts if spec.moe else None, moe_grouped_gemm=False,
                                     qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    if attention_backend == "sdpa":
        from megatron_rl.models.sdpa_attention import SDPADotProductAttention

        layer.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    # torch norms that also run under sequence parallelism (megatron-core's WrappedTorchNorm refuses it)
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_rl.models.sp_norm import SequenceParallelTorchNorm

    sub = layer.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelTorchNorm
    attn = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name, IdentityOp) is not IdentityOp:
            setattr(attn, name, SequenceParallelTorchNorm)
    return layer


def _is_sp_norm(cls) -> bool:
    from megatron_rl.models.sp_norm import SequenceParallelTorchNorm

    return cls is SequenceParallelTorchNorm


def build_model(
    hf_config: Mapping[str, Any],
    tf_config,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    make_vocab_size_divisible_by: int = 128,
    use_te: bool | None = None,
    attention_backend: str = "auto",
):
    """Build a megatron-core ``GPTModel`` (one pipeline stage) for an HF config.

    The output layer keeps its vocabulary shard (``parallel_output=True``): the model returns
    logits ``[B, S, padded_V / tp]`` (see ``megatron_rl.trainer.logprobs.forward_logits``).
    Weights are initialised randomly; load HF weights with ``models.hf_weights.load_hf_weights``.

    Args:
        hf_config: parsed HF config.json.
        tf_config: the ``TransformerConfig`` from ``build_transformer_config`` (same HF config).
        pre_process: this stage holds the embedding (first PP stage).
        post_process: this stage holds the final norm and output layer (last PP stage).
        make_vocab_size_divisible_by: vocabulary padding multiple (times TP).
        use_te: force (True) or forbid (False) the Transformer Engine spec; None picks TE when
            it is importable and CUDA is present.
        attention_backend: "auto" (megatron-core's core attention) or "sdpa" (torch SDPA in the
            local spec; ``build_layer_spec``).

    Returns:
        ``megatron.core.models.gpt.GPTModel`` on the current device (CPU without CUDA).

    Raises:
        ValueError: unsupported HF config, or ``use_te=True`` without TE/CUDA.
    """
    from megatron.core.models.gpt import GPTModel

    spec = build_model_spec(
        hf_config,
        tensor_model_parallel_size=tf_config.tensor_model_parallel_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    layer_spec = build_layer_spec(hf_config, use_te=use_te, attention_backend=attention_backend)
    if layer_spec.submodules.input_layernorm is not None and _is_sp_norm(layer_spec.submodules.input_layernorm):
        # the local spec: the final norm too (megatron-core would pick WrappedTorchNorm for it)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        from megatron_rl.models.sp_norm import SequenceParallelTorchNorm

        layer_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(tf_config),
                                                layer_norm=SequenceParallelTorchNorm)
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rotary_base,
    )
    # megatron-core's local spec without Apex builds its norms with torch's RMSNorm in float32 whatever
    # params_dtype says; Megatron-LM's Float16Module would cast them. A bf16 model with fp32 norms
    # breaks megatron's Float16Optimizer checkpoint (its state ids are paired with the bf16 params in
    # order: "Optimizer shape (128,) does not match model shape (256,)" at the first save), so every
    # floating parameter is brought to params_dtype here.
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != tf_config.params_dtype:
            p.data = p.data.to(tf_config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    logger.info(
        "built GPTModel %s: %d params on this rank, vocab %d (padded %d), tied=%s",
        spec.model_type,
        sum(p.numel() for p in model.parameters()),
        spec.vocab_size,
        spec.padded_vocab_size,
        spec.tie_word_embeddings,
    )
    return model


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingModel:
    """Model chunks wrapped for training, with their optimizer and LR/WD scheduler."""

    model: list
    """DDP-wrapped model chunks (one per virtual pipeline stage; one without VPP)."""
    optimizer: Any
    """megatron-core ``MegatronOptimizer``."""
    scheduler: Any
    """megatron-core ``OptimizerParamScheduler`` (call ``step(increment=1)`` per update)."""


def wrap_ddp_and_optimizer(
    model,
    tf_config,
    *,
    lr: float,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    adam_betas: tuple[float, float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    use_distributed_optimizer: bool = False,
    min_lr: float | None = None,
    lr_warmup_steps: int = 0,
    lr_decay_steps: int = 1,
    lr_decay_style: str = "constant",
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
    bucket_size: int | None = None,
    pg_collection=None,
) -> TrainingModel:
    """Wrap model chunk(s) in megatron DDP and build the optimizer and scheduler.

    Sets ``tf_config.finalize_model_grads_func = finalize_model_grads`` and
    ``tf_config.no_sync_func = ddp.no_sync`` (a list of them with several chunks): megatron's
    forward-backward schedules only reduce data-parallel gradients through these hooks.

    Args:
        model: a ``GPTModel`` or a list of chunks (virtual pipeline stages).
        tf_config: the ``TransformerConfig`` the model was built with (mutated as above).
        lr: peak learning rate.
        weight_decay: decoupled weight decay (AdamW), constant.
        clip_grad: global gradient-norm clip; 0 disables.
        adam_betas, adam_eps: Adam hyper-parameters.
        use_distributed_optimizer: shard optimizer state over data-parallel ranks (ZeRO-1).
        min_lr: floor of the decay (default: lr).
        lr_warmup_steps, lr_decay_steps, lr_decay_style: scheduler ("constant", "linear",
            "cosine", ...), in optimizer steps.
        grad_reduce_in_fp32: reduce gradients in fp32 (bf16 runs).
        overlap_grad_reduce: overlap DP gradient reduction with backward.
        bucket_size: DDP bucket size in elements (None: megatron's default).
        pg_collection: megatron ``ProcessGroupCollection`` (``ProcessGroups.pg_collection``);
            None uses megatron's global groups.

    Returns:
        :class:`TrainingModel`.

    Raises:
        ValueError: a non-positive lr, negative weight decay / clip, or lr_decay_steps < 1.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if weight_decay < 0 or clip_grad < 0:
        raise ValueError(f"weight_decay and clip_grad must be >= 0, got {weight_decay!r}, {clip_grad!r}")
    if lr_decay_steps < 1:
        raise ValueError(f"lr_decay_steps must be >= 1, got {lr_decay_steps!r}")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    ddp_kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    wrapped = [
        DistributedDataParallel(
            config=tf_config,
            ddp_config=ddp_config,
            module=chunk,
            # Bucketing only pays off for the first chunk with virtual pipelining (as Megatron-LM).
            disable_bucketing=index > 0,
            **ddp_kwargs,
        )
        for index, chunk in enumerate(chunks)
    ]
    for chunk in wrapped:
        # Weights are identical on all DP ranks only after this broadcast (random init differs).
        chunk.broadcast_params()

    tf_config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in wrapped]
    tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_betas[0],
        adam_beta2=adam_betas[1],
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=tf_config.bf16,
        fp16=tf_config.fp16,
        params_dtype=tf_config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    opt_kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    optimizer = get_megatron_optimizer(opt_config, wrapped, **opt_kwargs)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if lr_warmup_steps > 0 else lr,
        max_lr=lr,
        min_lr=opt_config.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=max(lr_decay_steps, lr_warmup_steps + 1),
        lr_decay_style=lr_decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return TrainingModel(model=wrapped, optimizer=optimizer, scheduler=scheduler)
