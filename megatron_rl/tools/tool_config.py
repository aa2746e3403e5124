"""Load the tool config file (`tool_config_path`, verl's key) and build its tools.

The file (YAML):

    tools:
      - name: python              # a name in TOOLS, or verl's `class_name: pkg.module.Class`
        config:                   # the tool's constructor keywords (python: SandboxConfig's fields)
          wall_timeout_s: 10
        tool_schema:              # optional (verl): overrides the name / description / parameters shown
          type: function
          function: {name: python, description: ..., parameters: {...}}

Every mistake fails at start naming the file and the key: an unknown key (with the nearest valid
one and the full list), an unknown tool, a value the tool refuses, two tools with one name.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.tools.base import Tool
from megatron_rl.tools.registry import TOOLS

logger = logging.getLogger(__name__)

TOP_KEYS = ("tools",)
ENTRY_KEYS = ("class_name", "config", "name", "tool_schema")
SCHEMA_KEYS = ("function", "type")
FUNCTION_KEYS = ("description", "name", "parameters", "strict")


@dataclass(kw_only=True)
class ToolSpec:
    """One tool of the file, checked but not built."""

    cls: type
    """The `Tool` subclass."""
    config: dict[str, Any]
    """Keyword arguments for `cls`."""
    schema: dict[str, Any] | None
    """verl's `tool_schema.function` overrides, or None."""
    where: str
    """`file: tools[i]`, for messages."""


def _unknown(where: str, key: str, allowed: Any) -> ValueError:
    allowed = sorted(allowed)
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"{where}: unknown key {key!r}{hint} (allowed keys: {', '.join(allowed)})")


def _check_keys(where: str, mapping: Any, allowed: Any) -> None:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    for key in mapping:
        if key not in allowed:
            raise _unknown(where, str(key), allowed)


def _check_schema_types(where: str, function: dict[str, Any]) -> None:
    """`name` and `description` strings, `parameters` a JSON-schema object (a mapping whose
    `properties` is a mapping and `required` a list of names): else every call would fail on it."""
    for key in ("name", "description"):
        if key in function and not isinstance(function[key], str):
            raise ValueError(f"{where}.{key}: must be a string, got {type(function[key]).__name__}")
    if "parameters" not in function:
        return
    params = function["parameters"]
    if not isinstance(params, dict):
        raise ValueError(f"{where}.parameters: must be a mapping (a JSON schema object), got {type(params).__name__}")
    if not isinstance(params.get("properties", {}), dict):
        raise ValueError(f"{where}.parameters.properties: must be a mapping of argument names to schemas")
    if any(not isinstance(v, dict) for v in params.get("properties", {}).values()):
        raise ValueError(f"{where}.parameters.properties: each argument's schema must be a mapping")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(f"{where}.parameters.required: must be a list of argument names")


def config_keys(cls: type) -> tuple[str, ...] | None:
    """The config keys a tool class accepts: its `config_class` dataclass's fields, else its
    constructor's keyword names; None when it takes any `**kwargs` without a `config_class`."""
    cfg = getattr(cls, "config_class", None)
    if cfg is not None and is_dataclass(cfg):
        return tuple(f.name for f in fields(cfg))
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def _tool_class(where: str, entry: dict[str, Any]) -> type:
    if ("name" in entry) == ("class_name" in entry):
        raise ValueError(f"{where}: give exactly one of 'name' (a registered tool: {', '.join(TOOLS.names())}) "
                         "or 'class_name' (a dotted path to a Tool class)")
    if "name" in entry:
        if entry["name"] not in TOOLS:
            near = difflib.get_close_matches(str(entry["name"]), TOOLS.names(), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"{where}.name: unknown tool {entry['name']!r}{hint} "
                             f"(registered: {', '.join(TOOLS.names())})")
        return TOOLS.get(entry["name"])
    module, _, attr = str(entry["class_name"]).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}.class_name: cannot import {entry['class_name']!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"{where}.class_name: {entry['class_name']!r} is not a subclass of "
                         "megatron_rl.tools.base.Tool")
    return cls


def load_tool_config(tool_config_path: str | Path) -> list[ToolSpec]:
    """Read and check the file; raises `ValueError` naming the file and key for any mistake,
    `FileNotFoundError` when it does not exist."""
    path = Path(tool_config_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    _check_keys(str(path), data, TOP_KEYS)
    entries = data.get("tools")
    if entries is not None and not isinstance(entries, list):
        raise ValueError(f"{path}: tools: must be a list of tool entries, got {type(entries).__name__}")
    if not entries:  # a tool recipe without a tool would train without it, silently
        raise ValueError(f"{path}: tools: no tool is configured (give at least one entry with 'name' or "
                         "'class_name')")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        _check_keys(where, entry, ENTRY_KEYS)
        cls = _tool_class(where, entry)
        config = entry.get("config") or {}
        allowed = config_keys(cls)
        if allowed is None:  # a tool taking any **kwargs: its constructor judges the keys
            allowed = list(config) if isinstance(config, dict) else []
        _check_keys(f"{where}.config", config, allowed)
        schema = entry.get("tool_schema")
        if schema is not None:
            _check_keys(f"{where}.tool_schema", schema, SCHEMA_KEYS)
            _check_keys(f"{where}.tool_schema.function", schema.get("function", {}), FUNCTION_KEYS)
            schema = dict(schema.get("function", {}))
            _check_schema_types(f"{where}.tool_schema.function", schema)
        specs.append(ToolSpec(cls=cls, config=dict(config), schema=schema, where=where))
    return specs


def build_tools(tool_config_path: str | Path) -> dict[str, Tool]:
    """Load the file and build every tool (starting sandboxes): `{name: tool}`. Raises `ValueError`
    naming the file and entry when a tool refuses its config or two tools share a name."""
    tools: dict[str, Tool] = {}
    try:
        for spec in load_tool_config(tool_config_path):
            try:
                tool = spec.cls(**spec.config)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{spec.where}.config: {e}") from None
            except RuntimeError as e:  # e.g. SandboxError: the tool cannot start here; same type, located
                raise type(e)(f"{spec.where}: {e}") from e
            if spec.schema:
                for attr in ("name", "description", "parameters"):
                    if attr in spec.schema:
                        setattr(tool, attr, spec.schema[attr])
            if tool.name in tools:
                tool.close()
                raise ValueError(f"{spec.where}: a second tool named {tool.name!r}")
            tools[tool.name] = tool
    except BaseException:
        for t in tools.values():
            t.close()
        raise
    logger.info("tools from %s: %s", tool_config_path, ", ".join(tools))
    return tools
