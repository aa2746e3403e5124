"""Cross-section static checks of a `Config` (DESIGN.md "Configuration checks"), run by `load_config`.

Facts local to one section are checked in the schema's `__post_init__`; the checks that need the
launch environment (world size, files, GPUs, servers) are `megatron_rl.trainer.preflight`'s.
Imports only the standard library and the registries' names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from megatron_rl.algorithms.options import (ADV_ESTIMATOR_SPECS, ResolvedCorrection, check_group_size,
                                            resolve_rollout_correction)
from megatron_rl.config.colocate import check_colocate
from megatron_rl.config.moe import routing_requested
from megatron_rl.config.hub_ids import cached_file
from megatron_rl.config.schema import Config
from megatron_rl.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every float in the config is finite (YAML reads `.nan` and `.inf`)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {value!r} must be a finite number")


def _check_vllm(cfg: Config) -> None:
    """What vLLM's weight transfer cannot do (docs/VLLM_API.md), for `vllm` and its stand-in alike.
    Both weight_sync backends are allowed: nccl is vLLM's own engine (CUDA GPUs), gloo is megatron-rl's
    (plugins/vllm_gloo in vLLM's environment; the CPU build, issue 30): the launch check asks for either.
    Every problem found is reported in one `ConfigError` (one per line), so a user fixes them at once."""
    r, ws = cfg.rollout, cfg.weight_sync
    if r.backend not in ("vllm", "vllm-embedded"):
        return
    problems = []
    if ws.load_format is not None:
        problems.append(f"weight_sync.load_format: {ws.load_format!r} is SGLang's; vLLM's /update_weights receives "
                        f"one broadcast per tensor (set it to null with rollout.backend={r.backend})")
    if cfg.trainer.pipeline_model_parallel_size > 1:
        problems.append(f"trainer.pipeline_model_parallel_size {cfg.trainer.pipeline_model_parallel_size} with "
                        f"rollout.backend={r.backend}: a vLLM server has one weight-transfer group, each pipeline "
                        "stage sends over its own (use pipeline_model_parallel_size 1)")
    if r.backend == "vllm" and r.temperature > 2.0:
        problems.append(f"rollout.temperature {r.temperature}: vLLM refuses a temperature above 2 (HTTP 400 "
                        "\"temperature must be in [0, 2]\"); lower it with rollout.backend=vllm")
    if r.admin_api_key:
        problems.append(f"rollout.admin_api_key: vLLM has no admin key (its --api-key guards /v1 only); "
                        f"unset it with rollout.backend={r.backend}")
    if r.colocate:
        problems.append(f"rollout.colocate: true with rollout.backend={r.backend}: colocated mode needs SGLang's "
                        "release / resume / update_weights_from_tensor endpoints (backend embedded or sglang)")
    if r.backend == "vllm" and r.enable_deterministic_inference:
        problems.append("rollout.enable_deterministic_inference: SGLang's flag; `vllm serve` 0.33 is started without "
                        "an equivalent, so runs would not repeat bit for bit; unset it with rollout.backend=vllm")
    if ws.check_checksums:
        logger.warning("weight_sync.check_checksums with rollout.backend=%s checks nothing: vLLM has no "
                       "/get_weights_by_name, so every tensor is counted in weight_sync/unverifiable_tensors", r.backend)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"rollout.backend={r.backend}: {len(problems)} problems:\n  - " + "\n  - ".join(problems))


def rollout_correction_of(cfg: Config) -> ResolvedCorrection:
    """The off-policy correction `cfg` trains with (`algorithm.rollout_correction` with `mode: auto`
    and unset options resolved against `actor.tis` and `trainer.max_staleness`, ALGORITHMS.md 8).
    Raises `ConfigError` naming the keys that conflict (`options.resolve_rollout_correction`)."""
    return resolve_rollout_correction(cfg.algorithm.rollout_correction, tis_enable=cfg.actor.tis.enable,
                                      tis_clip=cfg.actor.tis.clip,
                                      max_staleness=getattr(cfg.trainer, "max_staleness", 0))


def _check_off_policy(cfg: Config) -> None:
    """`actor.old_logprob_source` against eta, and the correction's mode (ALGORITHMS.md 8)."""
    correction = rollout_correction_of(cfg)
    if cfg.actor.old_logprob_source != "rollout":
        return
    eta = getattr(cfg.trainer, "max_staleness", 0)
    if eta > 0:
        raise ConfigError(
            f"actor.old_logprob_source: 'rollout' is only valid with trainer.max_staleness = 0 (got {eta}): stale "
            "samples need the trainer's recompute as the anchor of the clip and the behaviour weights against it; "
            "set actor.old_logprob_source=recompute or trainer.max_staleness=0")
    if correction.mode != "none":
        logger.warning("actor.old_logprob_source=rollout makes prox_logp = behav_logp, so every behaviour weight is 1 "
                       "and the correction %s (algorithm.rollout_correction / actor.tis) changes nothing",
                       correction.mode)


def _check_packing(cfg: Config) -> None:
    """`actor.sequence_packing` runs packed rows with a block-diagonal mask through the local layer
    spec; what it cannot run with (every problem in one error)."""
    if not cfg.actor.sequence_packing:
        return
    t = cfg.trainer
    problems = [text for bad, text in (
        (t.pipeline_model_parallel_size > 1, f"trainer.pipeline_model_parallel_size {t.pipeline_model_parallel_size} "
         "(packed micro-batches change shape between stages; use 1)"),
        (t.transformer_impl == "transformer_engine", "trainer.transformer_impl transformer_engine (the packed path "
         "needs the local layer spec: local, or auto without Transformer Engine)"),
        (t.sequence_parallel, "trainer.sequence_parallel (it needs Transformer Engine; the packed path runs on the "
         "local layer spec)"),
    ) if bad]
    if problems:
        raise ConfigError("actor.sequence_packing: true cannot run with " + "; ".join(problems))


def _check_multi_turn(cfg: Config) -> None:
    """`rollout.multi_turn` against the engines: the tool config file exists; a `code`-format turn
    stops on a stop string, which SGLang matches only with its tokenizer (warned: without it the
    turn is cut after the fact, the tokens past the fence generated for nothing)."""
    mt, r = cfg.rollout.multi_turn, cfg.rollout
    if not mt.enable:
        return
    import os

    if mt.environment == "tool" and not os.path.isfile(str(mt.tool_config_path)):
        raise ConfigError(f"rollout.multi_turn.tool_config_path: {mt.tool_config_path} is not a file (a YAML file "
                          "listing the tools, e.g. examples/tools/python_tool.yaml)")
    if mt.format == "code" and r.backend == "sglang" and r.skip_tokenizer_init:
        logger.warning("rollout.multi_turn.format=code with rollout.skip_tokenizer_init=true: SGLang matches stop "
                       "strings only with its tokenizer, so a turn is cut at the closing fence after generating on "
                       "(to the end-of-turn token or the budget); set rollout.skip_tokenizer_init=false")


def validate_config(cfg: Config) -> None:
    """Cross-section static checks (DESIGN.md "Configuration checks"); raise `ConfigError` naming keys."""
    _check_finite(cfg)
    d, a, alg, r = cfg.data, cfg.actor, cfg.algorithm, cfg.rollout
    if not str(cfg.run_dir).strip():
        raise ConfigError("run_dir: must not be empty (the folder for checkpoints, metrics and logs)")
    for key in ("path", "tokenizer_path", "hf_config_path"):
        if getattr(cfg.model, key) == "":
            raise ConfigError(f"model.{key}: must not be empty (unset it instead)")
    from megatron_rl.data.dataset import DATASET_ADAPTERS as ADAPTERS
    from megatron_rl.rewards.registry import REWARD_FNS

    if cfg.reward.reward_fn not in REWARD_FNS:
        raise ConfigError(f"reward.reward_fn: {cfg.reward.reward_fn!r} is not registered; choose one of "
                         f"{', '.join(map(repr, REWARD_FNS.names()))}")
    for key in ("train_adapter", "val_adapter"):
        if getattr(d, key) not in ADAPTERS:
            raise ConfigError(f"data.{key}: {getattr(d, key)!r} is not a dataset adapter; choose one of "
                             f"{', '.join(map(repr, ADAPTERS.names()))}")
    _check_vllm(cfg)
    if alg.filter_groups.enable and r.temperature == 0:
        raise ConfigError(
            "algorithm.filter_groups.enable with rollout.temperature=0: greedy decoding gives n identical "
            "responses, every group is filtered out and the batch can never fill"
        )
    gen = d.gen_batch_size or d.train_batch_size
    if gen < d.train_batch_size and not alg.filter_groups.enable:
        raise ConfigError(
            f"data.gen_batch_size ({gen}) < data.train_batch_size ({d.train_batch_size}) without dynamic sampling"
        )
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({d.train_batch_size}) must be a multiple of actor.ppo_mini_batch_size "
            f"({a.ppo_mini_batch_size})"
        )
    check_group_size(rollout_n=r.n, adv_estimator=alg.adv_estimator, filter_groups=alg.filter_groups.enable)
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len >= d.max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len ({ob.len}) must be < data.max_response_length ({d.max_response_length})"
        )
    if alg.daa.enable and not ADV_ESTIMATOR_SPECS.get(alg.adv_estimator).daa:
        with_daa = [n for n in ADV_ESTIMATOR_SPECS.names() if ADV_ESTIMATOR_SPECS.get(n).daa]
        raise ConfigError(
            f"algorithm.daa.enable needs a group-relative estimator ({', '.join(with_daa)}); got {alg.adv_estimator!r}"
        )
    if a.policy_loss == "gspo" and a.loss_agg_mode != "seq-mean-token-mean":
        raise ConfigError(
            f"actor.policy_loss gspo is defined with actor.loss_agg_mode seq-mean-token-mean; got {a.loss_agg_mode!r}"
        )
    if a.use_kl_loss and a.kl_loss_coef <= 0:
        raise ConfigError("actor.use_kl_loss: true needs actor.kl_loss_coef > 0")
    _check_off_policy(cfg)
    _check_packing(cfg)
    _check_multi_turn(cfg)
    if cfg.eval.n < 1:
        raise ConfigError("eval.n must be >= 1")
    longest = d.max_prompt_length + d.max_response_length
    if cfg.trainer.sequence_parallel:  # rows are padded to a multiple of TP
        longest = -(-longest // cfg.trainer.tensor_model_parallel_size) * cfg.trainer.tensor_model_parallel_size
    if a.token_budget is not None and a.token_budget < longest:
        raise ConfigError(
            f"actor.max_tokens_per_micro_batch ({a.token_budget}) is smaller than one sequence of up to "
            f"data.max_prompt_length + data.max_response_length = {longest} tokens (padded); raise it to at least that"
        )
    t = cfg.trainer
    if t.context_parallel_size > 1:
        raise ConfigError(
            f"trainer.context_parallel_size={t.context_parallel_size}: this trainer does not implement context "
            "parallelism: it does not split each sequence over the context-parallel ranks (megatron-core's "
            "get_batch_on_this_cp_rank chunks) nor gather the per-token log-probs back, and megatron-core runs it only "
            "in Transformer Engine's attention (TEDotProductAttention; its local attention asserts "
            "context_parallel_size == 1). Set trainer.context_parallel_size=1 and use tensor/pipeline/data parallelism"
        )
    if t.sequence_parallel and t.tensor_model_parallel_size == 1:
        raise ConfigError("trainer.sequence_parallel needs trainer.tensor_model_parallel_size > 1")
    if cfg.model.path is None and cfg.model.hf_config_path is None:
        raise ConfigError("model.path (a Hugging Face model folder or hub id ORG/NAME[@REVISION]) is required")
    check_colocate(cfg, check_model_layout(cfg))


def check_model_layout(cfg: Config, *, warn: bool = True) -> Optional[dict]:
    """Static checks of the parallel layout (and the Mixture-of-Experts keys) against the model's
    config.json, when it is readable; returns that config.json (None when unreadable). The trainer
    runs it again once `model.path` is a local folder (a hub id not yet cached at load time skips it).

    Raises:
        ConfigError: a setting the model cannot run with, naming the key and the config.json.
    """
    cands = [cached_file(cfg.model.path, "config.json") or Path(cfg.model.path) / "config.json"] if cfg.model.path else []
    if cfg.model.hf_config_path:
        cands.append(Path(cfg.model.hf_config_path))
    src = next((c for c in cands if c.is_file()), None)
    if src is None:
        return None
    try:
        hf = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{src}: not valid JSON ({e})") from None
    t = cfg.trainer
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    layers = hf.get("num_hidden_layers")
    if heads and heads % tp:
        raise ConfigError(f"trainer.tensor_model_parallel_size {tp} must divide num_attention_heads {heads} ({src})")
    if kv and kv % tp:
        raise ConfigError(f"trainer.tensor_model_parallel_size {tp} must divide num_key_value_heads {kv} ({src})")
    moe = hf.get("model_type") == "qwen3_moe"
    ep = t.expert_model_parallel_size
    if cfg.actor.router_replay and cfg.rollout.return_routed_experts is False:
        raise ConfigError("actor.router_replay needs the engines' routing: rollout.return_routed_experts must not be "
                          "false")
    expert_keys = {"trainer.expert_model_parallel_size": ep if ep != 1 else None,
                   "trainer.expert_tensor_parallel_size": t.expert_tensor_parallel_size,
                   "trainer.moe_router_load_balancing_type": t.moe_router_load_balancing_type
                   if t.moe_router_load_balancing_type != "none" else None,
                   "trainer.moe_aux_loss_coeff": t.moe_aux_loss_coeff or None,
                   "actor.router_replay": cfg.actor.router_replay or None,
                   "rollout.return_routed_experts": cfg.rollout.return_routed_experts or None}
    if not moe and any(v is not None for v in expert_keys.values()):
        given = ", ".join(f"{k}={v}" for k, v in expert_keys.items() if v is not None)
        raise ConfigError(f"{given}: need a Mixture-of-Experts model; {src} has model_type "
                          f"{hf.get('model_type')!r}")
    if moe:
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if experts and experts % ep:
            raise ConfigError(f"trainer.expert_model_parallel_size {ep} must divide num_experts {experts} ({src})")
        etp = t.expert_tensor_parallel_size or tp
        mffn = hf.get("moe_intermediate_size")
        if mffn and mffn % etp:
            raise ConfigError(f"trainer.expert_tensor_parallel_size {etp} must divide moe_intermediate_size {mffn} "
                              f"({src})")
        if tp > 1 and not t.sequence_parallel:
            raise ConfigError(f"trainer.tensor_model_parallel_size {tp} with a Mixture-of-Experts model needs "
                              "trainer.sequence_parallel: true (megatron-core refuses MoE training with TP and no SP)")
        if etp != tp:
            raise ConfigError(f"trainer.expert_tensor_parallel_size {etp} != trainer.tensor_model_parallel_size {tp}: "
                              "the weight publisher exports and gathers experts with the TP layout; set them equal "
                              "(or leave expert_tensor_parallel_size unset)")
        if t.moe_aux_loss_coeff > 0 and t.moe_router_load_balancing_type == "none":
            raise ConfigError(f"trainer.moe_aux_loss_coeff {t.moe_aux_loss_coeff} has no effect with "
                              "trainer.moe_router_load_balancing_type none: set the type (aux_loss, seq_aux_loss, "
                              "global_aux_loss) or the coefficient 0")
        if t.moe_aux_loss_coeff > 0 and t.moe_router_load_balancing_type != "none" and \
                cfg.actor.loss_agg_mode != "token-mean":
            raise ConfigError(f"trainer.moe_aux_loss_coeff {t.moe_aux_loss_coeff} with actor.loss_agg_mode "
                              f"{cfg.actor.loss_agg_mode!r}: megatron-core scales the load-balancing loss for a "
                              "per-token count, and this mode's count is sequences, which would multiply its weight "
                              "by the tokens per sequence; use loss_agg_mode token-mean or moe_aux_loss_coeff 0")
        if warn and routing_requested(cfg) and cfg.actor.old_logprob_source == "rollout":
            logger.warning("actor.old_logprob_source=rollout skips the old-log-prob forward, where "
                           "train/router_mismatch is measured: the metric is not reported (routing replay, if on, "
                           "still applies in the update)")
        if ep > 1 and cfg.rollout.colocate:
            raise ConfigError("rollout.colocate with trainer.expert_model_parallel_size > 1 is not supported yet: the "
                              "colocated hand-over sends from each node's local rank 0 without the EP gather")
        ffn = None  # the dense intermediate_size is not used by an all-MoE model
    else:
        ffn = hf.get("intermediate_size")
    if ffn and ffn % tp:
        raise ConfigError(f"trainer.tensor_model_parallel_size {tp} must divide intermediate_size {ffn} ({src})")
    if layers and layers % pp:
        raise ConfigError(f"trainer.pipeline_model_parallel_size {pp} must divide num_hidden_layers {layers} ({src})")
    max_pos = hf.get("max_position_embeddings")
    d = cfg.data
    longest = d.max_prompt_length + max(d.max_response_length, cfg.eval.max_response_length or 0)
    if max_pos and longest > max_pos:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length (or eval.max_response_length) = {longest} exceeds "
            f"the model's max_position_embeddings {max_pos} ({src})"
        )
    return hf
