"""YAML recipes -> `Config`: dotted overrides, verl aliases, unknown-key errors, cross-section checks."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.schema import SECRET_KEYS, Config

logger = logging.getLogger(__name__)

VERL_ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.model.path": "model.path",
    "reward_model.overlong_buffer.": "reward.overlong_buffer.",
    "reward_model.reward_kwargs.overlong_buffer_cfg.": "reward.overlong_buffer.",
    "custom_reward_function.overlong_buffer.": "reward.overlong_buffer.",
    "trainer.total_training_steps": "trainer.total_training_steps",
    "trainer.save_freq": "trainer.save_interval",
    "trainer.test_freq": "eval.interval",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "trainer.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "trainer.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "trainer.context_parallel_size",
    "actor_rollout_ref.actor.megatron.sequence_parallel": "trainer.sequence_parallel",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": "trainer.use_distributed_optimizer",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.optim.clip_grad",
    "actor_rollout_ref.actor.grad_clip": "actor.optim.clip_grad",
    "actor_rollout_ref.actor.tis_imp_ratio_cap": "actor.tis.clip",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
}
"""verl's full dotted paths (longest match wins) -> this project's keys (ALGORITHMS.md preamble)."""


def resolve_alias(key: str) -> str:
    """Map a verl dotted path onto this schema's path; other keys pass through."""
    best = ""
    for alias in VERL_ALIASES:
        if (key == alias or (alias.endswith(".") and key.startswith(alias))) and len(alias) > len(best):
            best = alias
    if not best:
        return key
    target = VERL_ALIASES[best]
    return target + key[len(best):] if best.endswith(".") else target


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _set_aliased(tree: dict, seen: dict[str, tuple[str, Any]], key: str, value: Any, where: str) -> None:
    """Set `key` (resolved through VERL_ALIASES) in `tree`; two different spellings of one key with
    different values in the same place (the recipe, or the overrides) are an error, not a silent
    last-wins. A later override of the same spelling is fine (the command line overrides)."""
    target = resolve_alias(key)
    if target in seen and seen[target][0] != key and seen[target][1] != value:
        first, before = seen[target]
        raise ValueError(
            f"{where}: {first}={before!r} and {key}={value!r} set the same key {target} (verl's name and this "
            f"project's); keep one"
        )
    seen[target] = (key, value)
    _set_dotted(tree, target, value)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` -> (key, value); the value is parsed as YAML (`true`, `3`, `[a, b]`, `null`).

    Raises:
        ValueError: no `=` or an empty key.
    """
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return key, value


def _type_matches(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is typing.Union or str(origin) == "types.UnionType":
        return any(_type_matches(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_matches(inner, v) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _build(cls: type, tree: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in tree.items():
        full = f"{path}{key}"
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{path}{near[0]}'?" if near else ""
            raise ValueError(
                f"unknown config key {full!r}{hint} (valid keys in {path.rstrip('.') or 'the top level'}: "
                f"{', '.join(sorted(fields))})"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"config key {full!r} is a section; got {value!r}")
            kwargs[key] = _build(tp, value, full + ".")
            continue
        wants_int = tp is int or int in typing.get_args(tp)
        if isinstance(value, int) and not isinstance(value, bool) and _type_matches(tp, 1.5) and not wants_int:
            value = float(value)
        if isinstance(value, str) and _type_matches(tp, 1.0) and not _type_matches(tp, ""):
            try:  # YAML 1.1 reads "3e-4" (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        if not _type_matches(tp, value):
            raise ValueError(f"config key {full!r}: {value!r} is not {_type_words(tp)}")
        kwargs[key] = value
    return cls(**kwargs)


def _type_words(tp) -> str:
    """A config type in words for error messages: ``int | None`` -> "an int or null",
    ``Literal["a", "b"] | None`` -> "one of 'a', 'b' or null", ``list[str]`` -> "a list"."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if args and origin is not list and origin is not dict and origin is not tuple:  # a union
        parts = [_type_words(a) for a in args if a is not type(None)]
        words = " or ".join(parts)
        return words + " or null" if type(None) in args else words
    names = {bool: "a boolean", int: "an int", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    return names.get(origin or tp, f"of type {getattr(tp, '__name__', tp)}")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe, apply `key.sub=value` overrides (verl aliases accepted), validate.

    Relative data/model paths in the recipe resolve against the recipe's folder; paths given as
    overrides resolve against the current directory.

    Raises:
        FileNotFoundError: the recipe does not exist.
        ValueError: an unknown key (with the nearest valid one), a wrong type, a value out of its
            allowed set, or a cross-section inconsistency (see `validate_config`).
    """
    tree: dict = {}
    base = Path.cwd()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{p}:{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{p}: expected a mapping at the top level, got {type(loaded).__name__}")
        base = p.resolve().parent
        seen: dict[str, tuple[str, Any]] = {}
        for key, value in _flatten(loaded).items():
            _set_aliased(tree, seen, key, value, str(p))
        _resolve_paths(tree, base)
    over_tree: dict = {}
    seen = {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_aliased(over_tree, seen, key, value, "overrides")
    _resolve_paths(over_tree, Path.cwd())
    for key, value in _flatten(over_tree).items():
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    validate_config(cfg)
    return cfg


_PATH_KEYS = ("model.path", "model.hf_config_path", "model.tokenizer_path")
_PATH_LIST_KEYS = ("data.train_files", "data.val_files")


def _resolve_paths(tree: dict, base: Path) -> None:
    def fix(p: Any) -> Any:
        if isinstance(p, str) and p and not os.path.isabs(p) and not p.startswith(("http://", "https://")):
            cand = (base / p).resolve()
            return str(cand)
        return p

    for key in _PATH_KEYS:
        sec, name = key.split(".")
        if isinstance(tree.get(sec), dict) and name in tree[sec]:
            tree[sec][name] = fix(tree[sec][name])
    for key in _PATH_LIST_KEYS:
        sec, name = key.split(".")
        if isinstance(tree.get(sec), dict) and isinstance(tree[sec].get(name), list):
            tree[sec][name] = [fix(p) for p in tree[sec][name]]


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every float in the config is finite (YAML reads `.nan` and `.inf`)."""
    import dataclasses
    import math

    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}: {value!r} must be a finite number")


def validate_config(cfg: Config) -> None:
    """Cross-section static checks (DESIGN.md "Configuration checks"); raise ValueError naming keys."""
    _check_finite(cfg)
    d, a, alg, r = cfg.data, cfg.actor, cfg.algorithm, cfg.rollout
    if not str(cfg.run_dir).strip():
        raise ValueError("run_dir: must not be empty (the folder for checkpoints, metrics and logs)")
    for key in ("path", "tokenizer_path", "hf_config_path"):
        if getattr(cfg.model, key) == "":
            raise ValueError(f"model.{key}: must not be empty (unset it instead)")
    from megatron_rl.data.dataset import DATASET_ADAPTERS as ADAPTERS
    from megatron_rl.rewards.registry import REWARD_FNS

    if cfg.reward.reward_fn not in REWARD_FNS:
        raise ValueError(f"reward.reward_fn: {cfg.reward.reward_fn!r} is not registered; choose one of "
                         f"{', '.join(map(repr, REWARD_FNS.names()))}")
    for key in ("train_adapter", "val_adapter"):
        if getattr(d, key) not in ADAPTERS:
            raise ValueError(f"data.{key}: {getattr(d, key)!r} is not a dataset adapter; choose one of "
                             f"{', '.join(map(repr, ADAPTERS.names()))}")
    if alg.filter_groups.enable and r.temperature == 0:
        raise ValueError(
            "algorithm.filter_groups.enable with rollout.temperature=0: greedy decoding gives n identical "
            "responses, every group is filtered out and the batch can never fill"
        )
    gen = d.gen_batch_size or d.train_batch_size
    if gen < d.train_batch_size and not alg.filter_groups.enable:
        raise ValueError(
            f"data.gen_batch_size ({gen}) < data.train_batch_size ({d.train_batch_size}) without dynamic sampling"
        )
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError(
            f"data.train_batch_size ({d.train_batch_size}) must be a multiple of actor.ppo_mini_batch_size "
            f"({a.ppo_mini_batch_size})"
        )
    if alg.adv_estimator in ("grpo", "rloo") and r.n < 2:
        raise ValueError(f"rollout.n ({r.n}) must be >= 2 for the group-relative estimator {alg.adv_estimator!r}")
    if alg.filter_groups.enable and r.n < 2:
        raise ValueError(
            f"algorithm.filter_groups.enable with rollout.n={r.n}: every group has zero std, the batch can never fill"
        )
    ob = cfg.reward.overlong_buffer
    if ob.enable and ob.len >= d.max_response_length:
        raise ValueError(
            f"reward.overlong_buffer.len ({ob.len}) must be < data.max_response_length ({d.max_response_length})"
        )
    if alg.daa.enable and alg.adv_estimator not in ("grpo", "rloo"):
        raise ValueError(
            f"algorithm.daa.enable needs a group-relative estimator (grpo, rloo); got {alg.adv_estimator!r}"
        )
    if a.policy_loss == "gspo" and a.loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(
            f"actor.policy_loss gspo is defined with actor.loss_agg_mode seq-mean-token-mean; got {a.loss_agg_mode!r}"
        )
    if a.use_kl_loss and a.kl_loss_coef <= 0:
        raise ValueError("actor.use_kl_loss: true needs actor.kl_loss_coef > 0")
    if cfg.eval.n < 1:
        raise ValueError("eval.n must be >= 1")
    longest = d.max_prompt_length + d.max_response_length
    if cfg.trainer.sequence_parallel:  # rows are padded to a multiple of TP
        longest = -(-longest // cfg.trainer.tensor_model_parallel_size) * cfg.trainer.tensor_model_parallel_size
    if a.token_budget is not None and a.token_budget < longest:
        raise ValueError(
            f"actor.max_tokens_per_micro_batch ({a.token_budget}) is smaller than one sequence of up to "
            f"data.max_prompt_length + data.max_response_length = {longest} tokens (padded); raise it to at least that"
        )
    t = cfg.trainer
    if t.context_parallel_size > 1:
        raise ValueError(
            f"trainer.context_parallel_size={t.context_parallel_size}: this trainer does not implement context "
            "parallelism: it does not split each sequence over the context-parallel ranks (megatron-core's "
            "get_batch_on_this_cp_rank chunks) nor gather the per-token log-probs back, and megatron-core runs it only "
            "in Transformer Engine's attention (TEDotProductAttention; its local attention asserts "
            "context_parallel_size == 1). Set trainer.context_parallel_size=1 and use tensor/pipeline/data parallelism"
        )
    if t.sequence_parallel and t.tensor_model_parallel_size == 1:
        raise ValueError("trainer.sequence_parallel needs trainer.tensor_model_parallel_size > 1")
    if cfg.model.path is None and cfg.model.hf_config_path is None:
        raise ValueError("model.path (a Hugging Face model folder) is required")
    _check_model_layout(cfg)


def _check_model_layout(cfg: Config) -> None:
    """Static checks of the parallel layout against the model's config.json, when it is readable."""
    import json

    cands = [Path(cfg.model.path) / "config.json"] if cfg.model.path else []
    if cfg.model.hf_config_path:
        cands.append(Path(cfg.model.hf_config_path))
    src = next((c for c in cands if c.is_file()), None)
    if src is None:
        return
    try:
        hf = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: not valid JSON ({e})") from None
    t = cfg.trainer
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    layers = hf.get("num_hidden_layers")
    if heads and heads % tp:
        raise ValueError(f"trainer.tensor_model_parallel_size {tp} must divide num_attention_heads {heads} ({src})")
    if kv and kv % tp:
        raise ValueError(f"trainer.tensor_model_parallel_size {tp} must divide num_key_value_heads {kv} ({src})")
    ffn = hf.get("intermediate_size")
    if ffn and ffn % tp:
        raise ValueError(f"trainer.tensor_model_parallel_size {tp} must divide intermediate_size {ffn} ({src})")
    if layers and layers % pp:
        raise ValueError(f"trainer.pipeline_model_parallel_size {pp} must divide num_hidden_layers {layers} ({src})")
    max_pos = hf.get("max_position_embeddings")
    d = cfg.data
    longest = d.max_prompt_length + max(d.max_response_length, cfg.eval.max_response_length or 0)
    if max_pos and longest > max_pos:
        raise ValueError(
            f"data.max_prompt_length + data.max_response_length (or eval.max_response_length) = {longest} exceeds "
            f"the model's max_position_embeddings {max_pos} ({src})"
        )


def environment_checks(cfg: Config) -> list[tuple[str, callable]]:
    """Checks that need the launch environment (DESIGN.md); `--dry-run` lists them as deferred.

    Returns (description, check) pairs; each check raises RuntimeError with a clear message, and
    returns None when it passed or a "not applicable: ..." reason when it did not apply.
    """
    t = cfg.trainer

    def world_size() -> None:
        world = int(os.environ.get("WORLD_SIZE", t.nproc_per_node))
        mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        if world % mp:
            source = ("WORLD_SIZE from the launcher (torchrun / srun)" if "WORLD_SIZE" in os.environ
                      else "trainer.nproc_per_node")
            raise RuntimeError(
                f"world size {world} ({source}) is not divisible by trainer.tensor_model_parallel_size x "
                f"trainer.pipeline_model_parallel_size x trainer.context_parallel_size = "
                f"{t.tensor_model_parallel_size} x {t.pipeline_model_parallel_size} x {t.context_parallel_size} = {mp}: "
                f"set {'the number of processes' if 'WORLD_SIZE' in os.environ else 'trainer.nproc_per_node'} "
                f"to a multiple of {mp}"
            )

    def data_parallel_split() -> None:
        world = int(os.environ.get("WORLD_SIZE", t.nproc_per_node))
        mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
        if world % mp:
            return  # reported by world_size()
        dp = world // mp
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        if mini % dp:
            raise RuntimeError(
                f"actor.ppo_mini_batch_size x rollout.n = {mini} sequences per mini-batch do not split over "
                f"{dp} data-parallel ranks (world {world} / TP*PP*CP {mp})"
            )

    def sequence_parallel() -> str | None:
        if not t.sequence_parallel:
            return "not applicable: trainer.sequence_parallel is off"
        from megatron_rl.models.builder import transformer_engine_usable

        if not transformer_engine_usable():
            raise RuntimeError(
                "trainer.sequence_parallel needs Transformer Engine: megatron-core's local layer spec (used "
                "without TE, e.g. on CPU) has no sequence-parallel LayerNorm/RMSNorm. Set "
                "trainer.sequence_parallel=false or install Transformer Engine"
            )

    def transformer_impl() -> str | None:
        if t.transformer_impl != "transformer_engine":
            return f"not applicable: trainer.transformer_impl is {t.transformer_impl}"
        from megatron_rl.models.builder import transformer_engine_usable

        if not transformer_engine_usable():
            raise RuntimeError(
                "trainer.transformer_impl=transformer_engine needs Transformer Engine and a CUDA GPU; "
                "use trainer.transformer_impl=auto (local layers without TE) or install Transformer Engine"
            )

    def fp8() -> str | None:
        if t.fp8 is None:
            return "not applicable: trainer.fp8 is unset"
        if importlib.util.find_spec("transformer_engine") is None:
            raise RuntimeError("trainer.fp8 is set but Transformer Engine is not installed "
                               "(pip install transformer-engine[pytorch]; FP8 GEMMs exist only in TE)")
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("trainer.fp8 needs a CUDA GPU (Hopper or newer); none is available")
        major, _ = torch.cuda.get_device_capability()
        if major < 9:
            raise RuntimeError(f"trainer.fp8 needs a Hopper (sm90) or newer GPU; found compute capability {major}.x")
        if t.fp8_recipe == "mxfp8" and major < 10:
            raise RuntimeError(f"trainer.fp8_recipe=mxfp8 needs a Blackwell (sm100) or newer GPU (Transformer Engine's "
                               f"MXFP8); found compute capability {major}.x: use fp8_recipe=delayed, tensorwise or "
                               "blockwise on Hopper")

    def model_files() -> None:
        p = cfg.model.path
        if p is None or not (Path(p) / "config.json").is_file():
            raise RuntimeError(f"model.path {p!r} has no config.json")

    def servers() -> str | None:
        if not cfg.rollout.server_urls:
            return "not applicable: rollout.server_urls is empty, embedded servers are started and health-checked at launch"
        if cfg.rollout.server_urls:
            from megatron_rl.rollout.client import RolloutClient

            for url in cfg.rollout.server_urls:
                RolloutClient(url, api_key=cfg.rollout.api_key, timeout_s=10).health()

    def run_dir_state() -> None:
        from megatron_rl.checkpoint.save import latest_checkpoint

        if t.resume_mode != "disable":
            return "not applicable: trainer.resume_mode is auto (a run dir with checkpoints is resumed)"
        if latest_checkpoint(cfg.run_dir) is not None:
            raise RuntimeError(
                f"run_dir {cfg.run_dir} holds checkpoints of an earlier run (latest step "
                f"{latest_checkpoint(cfg.run_dir)}) and trainer.resume_mode is disable: use another run_dir, "
                f"delete {cfg.run_dir}/checkpoints, or set trainer.resume_mode=auto to continue it"
            )

    def data_files() -> None:
        if not cfg.data.train_files:
            raise RuntimeError("data.train_files: at least one file of training prompts is required")
        for f in list(cfg.data.train_files) + list(cfg.data.val_files):
            if not Path(f).is_file():
                raise RuntimeError(f"data file not found: {f}")

    return [
        ("world size divisible by TP*PP*CP", world_size),
        ("run_dir free of an earlier run's checkpoints when trainer.resume_mode is disable", run_dir_state),
        ("mini-batches split evenly over data-parallel ranks", data_parallel_split),
        ("data files exist", data_files),
        ("Transformer Engine and CUDA for trainer.transformer_impl=transformer_engine", transformer_impl),
        ("Transformer Engine and a Hopper GPU for FP8", fp8),
        ("Transformer Engine for sequence parallelism", sequence_parallel),
        ("model.path holds a Hugging Face model", model_files),
        ("rollout servers reachable (rollout.server_urls)", servers),
    ]


def config_to_dict(cfg: Config, *, redact: bool = True) -> dict:
    """The resolved config as plain data; secrets (SECRET_KEYS) replaced by '***' when set."""
    data = dataclasses.asdict(cfg)
    if redact:
        for key in SECRET_KEYS:
            sec, name = key.split(".")
            if data[sec].get(name) is not None:
                data[sec][name] = "***"
    return data


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config (secrets redacted) as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
