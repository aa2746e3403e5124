"""Every config key with its type, default and docstring, read from the schema's source.

A field's docstring is the string literal right under it in its class body (megatron-core's
`TransformerConfig` style); fields inherited from a registered options dataclass
(`megatron_rl.algorithms.options`) are found in that class's source. `megatron-rl config-keys`
prints the result; a unit test requires a docstring on every leaf.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Optional

from megatron_rl.config.schema import Config


@dataclass(frozen=True)
class KeyInfo:
    """One leaf of the config tree."""

    key: str
    """Dotted key, e.g. `actor.clip_ratio_high`."""
    type: str
    """The annotation as written (`float`, `Optional[int]`, `list[str]`)."""
    default: Any
    """The default value (a copy for list defaults)."""
    doc: Optional[str]
    """The field's docstring, dedented; None when it has none."""


@functools.lru_cache(maxsize=None)
def _class_docs(cls: type) -> dict[str, tuple[str, Optional[str]]]:
    """field name -> (annotation source, docstring or None) for the fields `cls` itself declares."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, tuple[str, Optional[str]]] = {}
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = inspect.cleandoc(nxt.value.value)
            out[node.target.id] = (ast.unparse(node.annotation), doc)
    return out


def field_doc(cls: type, name: str) -> tuple[str, Optional[str]]:
    """(annotation, docstring) of field `name` of dataclass `cls`, from the class in its MRO that
    declares it."""
    for klass in cls.__mro__:
        docs = _class_docs(klass)
        if name in docs:
            return docs[name]
    return ("?", None)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def config_keys(cls: type = Config, prefix: str = "") -> list[KeyInfo]:
    """Every leaf key under `cls` (default: the whole `Config`), depth first in field order."""
    hints = typing.get_type_hints(cls)
    out: list[KeyInfo] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_keys(hints[f.name], f"{prefix}{f.name}.")
            continue
        annotation, doc = field_doc(cls, f.name)
        out.append(KeyInfo(key=prefix + f.name, type=annotation, default=_default(f), doc=doc))
    return out


def format_keys(keys: list[KeyInfo]) -> str:
    """The listing of `megatron-rl config-keys`: `key: type = default` then the indented docstring."""
    lines = []
    for k in keys:
        default = "null" if k.default is None else repr(k.default)
        lines.append(f"{k.key}: {k.type} = {default}")
        for line in (k.doc or "(no docstring)").splitlines():
            lines.append(f"    {line}")
    return "\n".join(lines)
