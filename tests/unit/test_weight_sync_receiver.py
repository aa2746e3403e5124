"""Issue 32 (seams): the arrow between weight_sync and rollout runs one way.

`megatron_rl.weight_sync` imports nothing from `megatron_rl.rollout` (not even for type checking):
the transports are typed against the receiver protocols of `weight_sync/receiver.py`, and the
rollout clients provide every method of them with the protocol's parameters.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import megatron_rl.weight_sync as weight_sync_pkg
from megatron_rl.weight_sync.receiver import BroadcastReceiver, EngineSession, TensorReceiver

WEIGHT_SYNC = Path(weight_sync_pkg.__file__).resolve().parent


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, anywhere in the file (TYPE_CHECKING blocks and functions too),
    relative imports resolved against the `megatron_rl.weight_sync` package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = ["megatron_rl", "weight_sync"][: 3 - node.level]
                base = ".".join([*parts, base] if base else parts)
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def test_weight_sync_imports_nothing_from_rollout():
    files = sorted(WEIGHT_SYNC.glob("*.py"))
    assert {"sender.py", "colocated.py", "publisher.py", "receiver.py"} <= {f.name for f in files}
    bad = {f.name: [m for m in _imports(f) if m == "megatron_rl.rollout" or m.startswith("megatron_rl.rollout.")]
           for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_ast_walk_sees_a_type_checking_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_rl.rollout.client import C\n"
                 "def g():\n    import megatron_rl.rollout.engine\n")
    assert "megatron_rl.rollout.client" in _imports(f) and "megatron_rl.rollout.engine" in _imports(f)


def _protocol_methods(proto) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for klass in reversed(proto.__mro__) if klass.__name__ in (
        "EngineSession", "BroadcastReceiver", "TensorReceiver") for name, fn in vars(klass).items()
        if callable(fn) and not name.startswith("_")}


@pytest.mark.parametrize("client_path, protocols", [
    ("megatron_rl.rollout.client:RolloutClient", (EngineSession, BroadcastReceiver, TensorReceiver)),
    ("megatron_rl.rollout.vllm_client:VLLMClient", (EngineSession, BroadcastReceiver)),
])
def test_the_rollout_clients_provide_the_protocols(client_path, protocols):
    import importlib

    module, name = client_path.split(":")
    client = getattr(importlib.import_module(module), name)
    for proto in protocols:
        for method, want in _protocol_methods(proto).items():
            assert hasattr(client, method), f"{name} lacks {proto.__name__}.{method}"
            got = inspect.signature(getattr(client, method))
            for p in want.parameters.values():
                assert p.name in got.parameters, f"{name}.{method} lacks parameter {p.name!r} of {proto.__name__}"
                if p.name in ("abort_all_requests", "abort_all"):  # the defaults that decide what gets aborted
                    assert got.parameters[p.name].default == p.default, f"{name}.{method}({p.name}=...) default"
