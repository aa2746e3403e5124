"""YAML recipes -> `Config`: dotted overrides, verl aliases, unknown-key errors (checks: `validate`)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.hub_ids import looks_like_hub_id
from megatron_rl.config.schema import SECRET_KEYS, Config
from megatron_rl.config.validate import validate_config
from megatron_rl.errors import ConfigError


logger = logging.getLogger(__name__)

VERL_ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "trainer.max_head_offpolicyness": "trainer.max_staleness",  # AReaL's name
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
    "actor_rollout_ref.model.use_remove_padding": "actor.sequence_packing",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_correction.tis_cap",
    "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_correction.mask_high",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "algorithm.rollout_correction.mask_low",
    "actor_rollout_ref.hybrid_engine": "rollout.colocate",
    "colocate": "rollout.colocate",  # slime's --colocate
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.mem_fraction_static",
    "sglang_mem_fraction_static": "rollout.mem_fraction_static",  # slime's --sglang-mem-fraction-static
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tp_size",
    "rollout_num_gpus_per_engine": "rollout.tp_size",  # slime's --rollout-num-gpus-per-engine
}
"""verl's full dotted paths (longest match wins) -> this project's keys (ALGORITHMS.md preamble)."""

_RC = "algorithm.rollout_correction."
VERL_VALUE_ALIASES: dict[str, dict[Any, list[tuple[str, Any]]]] = {
    _RC + "rollout_is": {"token": [(_RC + "mode", "token_tis")], "sequence": [(_RC + "mode", "seq_tis")], None: []},
    _RC + "rollout_rs": {"token": [(_RC + "mode", "mask"), (_RC + "level", "token")], None: []},
    _RC + "bypass_mode": {True: [("actor.old_logprob_source", "rollout")],
                          False: [("actor.old_logprob_source", "recompute")]},
}
"""verl keys whose values are spelt differently here: verl value -> this project's (key, value) pairs.
`null` sets nothing (the mode stays `auto` unless the other key sets it). verl's `rollout_is` plus
`rollout_rs` together (weights and rejection) is not one mode here: they set `mode` twice, an error.
verl's `rollout_rs: sequence|geometric` test the product / geometric mean of the weights, not each
token as `level: sequence` does (ALGORITHMS.md 8), so they have no alias."""


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
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def resolve_value_alias(key: str, value: Any) -> list[tuple[str, Any]]:
    """`(key, value)` as this schema's `(key, value)` pairs: VERL_VALUE_ALIASES, then VERL_ALIASES.

    Raises:
        ConfigError: a value of a verl key in VERL_VALUE_ALIASES that has no counterpart here.
    """
    table = VERL_VALUE_ALIASES.get(key)
    if table is None:
        return [(resolve_alias(key), value)]
    hashable = value is None or isinstance(value, (str, bool, int, float))
    if not hashable or value not in table or isinstance(value, bool) != any(isinstance(v, bool) for v in table):
        allowed = ", ".join("null" if v is None else repr(v) for v in table)
        raise ConfigError(f"{key}: {value!r} (verl's name) has no counterpart here; allowed: {allowed}. See "
                          "algorithm.rollout_correction.mode / level / actor.old_logprob_source (ALGORITHMS.md 8)")
    return table[value]


def _set_aliased(tree: dict, seen: dict[str, tuple[str, Any, Any]], key: str, value: Any, where: str) -> None:
    """Set `key` (resolved through VERL_VALUE_ALIASES and VERL_ALIASES) in `tree`; two different
    spellings of one key with different values in the same place (the recipe, or the overrides) are
    an error, not a silent last-wins. A later override of the same spelling is fine (the command
    line overrides)."""
    for target, val in resolve_value_alias(key, value):
        if target in seen and seen[target][0] != key and seen[target][1] != val:
            first, _, before = seen[target]
            raise ConfigError(
                f"{where}: {first}={before!r} and {key}={value!r} set the same key {target} (verl's name and this "
                f"project's); keep one"
            )
        seen[target] = (key, val, value)
        _set_dotted(tree, target, val)


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
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
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
            raise ConfigError(
                f"unknown config key {full!r}{hint} (valid keys in {path.rstrip('.') or 'the top level'}: "
                f"{', '.join(sorted(fields))})"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {full!r} is a section; got {value!r}")
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
            raise ConfigError(f"config key {full!r}: {value!r} is not {_type_words(tp)}")
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
        ConfigError (a ValueError): an unknown key (with the nearest valid one), a wrong type, a
            value out of its allowed set, or a cross-section inconsistency (see `validate_config`).
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
            raise ConfigError(f"{p}:{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level, got {type(loaded).__name__}")
        base = p.resolve().parent
        seen: dict[str, tuple[str, Any, Any]] = {}
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
_HUB_KEYS = ("model.path", "model.tokenizer_path")
"""Keys that may hold a Hugging Face hub id instead of a folder (kept as written when no such
folder exists next to the recipe; `models.hub.resolve_model_path` finds them in the cache)."""


def _resolve_paths(tree: dict, base: Path) -> None:
    def fix(p: Any, hub_ok: bool = False) -> Any:
        if isinstance(p, str) and p and not os.path.isabs(p) and not p.startswith(("http://", "https://")):
            cand = (base / p).resolve()
            if hub_ok and not cand.exists() and looks_like_hub_id(p):
                return p  # a hub id (ORG/NAME[@REV]), resolved from the HF cache where the model is opened
            return str(cand)
        return p

    for key in _PATH_KEYS:
        sec, name = key.split(".")
        if isinstance(tree.get(sec), dict) and name in tree[sec]:
            tree[sec][name] = fix(tree[sec][name], hub_ok=key in _HUB_KEYS)
    for key in _PATH_LIST_KEYS:
        sec, name = key.split(".")
        if isinstance(tree.get(sec), dict) and isinstance(tree[sec].get(name), list):
            tree[sec][name] = [fix(p) for p in tree[sec][name]]
    turns = tree.get("rollout", {}).get("multi_turn") if isinstance(tree.get("rollout"), dict) else None
    if isinstance(turns, dict) and "tool_config_path" in turns:  # rollout.multi_turn.tool_config_path
        turns["tool_config_path"] = fix(turns["tool_config_path"])


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
