"""The `python` tool: runs the model's Python program in a `Sandbox` and returns its output.

Arguments: `{"code": str}`. The result's output is the program's stdout (then its stderr, marked,
when it wrote any); a program that fails (an exception, a limit, a time-out) comes back as
`ok=False` with the reason and the end of its stderr (the traceback), which is what ToRL-style
training shows the model. Config keys are `SandboxConfig`'s fields.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from megatron_rl.tools.base import Tool, ToolResult
from megatron_rl.tools.registry import TOOLS
from megatron_rl.tools.sandbox import ProcessSandbox, Sandbox, SandboxConfig, SandboxResult

logger = logging.getLogger(__name__)


@TOOLS.register("python")
class PythonTool(Tool):
    """Runs Python code in a sandbox; built as `PythonTool(**config)` with `SandboxConfig`'s keys,
    or `PythonTool(sandbox=...)` around any `Sandbox` (a cluster's container service).

    Raises `TypeError` for an unknown config key and `ValueError` for an out-of-range limit (both
    from `SandboxConfig`), `SandboxError` when no sandbox can start here.
    """

    name = "python"
    config_class = SandboxConfig
    description = ("Run a Python 3 program and return what it prints. Each call starts fresh (no state is "
                   "kept between calls), without network access, with limited time and memory.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "The Python program to run."}},
                  "required": ["code"]}

    def __init__(self, *, sandbox: Sandbox | None = None, **config: Any) -> None:
        if sandbox is not None and config:
            raise ValueError(f"python tool: pass either a sandbox or config keys, not both (got {sorted(config)})")
        self.sandbox = sandbox if sandbox is not None else ProcessSandbox(SandboxConfig(**config))

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run `arguments["code"]`; every failure is a `ToolResult(ok=False)` with the reason."""
        why = self.check_arguments(arguments)
        if why:
            return ToolResult(ok=False, error=why)
        return self.to_result(self.sandbox.run(arguments["code"]))

    def call_many(self, arguments: Sequence[dict[str, Any]]) -> list[ToolResult]:
        """Run several calls (of different samples) concurrently; results in input order."""
        results: list[ToolResult | None] = [None] * len(arguments)
        todo = []
        for i, a in enumerate(arguments):
            why = self.check_arguments(a)
            if why:
                results[i] = ToolResult(ok=False, error=why)
            else:
                todo.append(i)
        for i, r in zip(todo, self.sandbox.run_many([arguments[i]["code"] for i in todo])):
            results[i] = self.to_result(r)
        return results  # type: ignore[return-value]

    @staticmethod
    def to_result(r: SandboxResult) -> ToolResult:
        """What the model reads from a sandbox run."""
        out = r.stdout  # a cut output carries its own marker: "[... N bytes omitted ...]"
        metrics = {"wall_s": r.wall_s, "cpu_s": r.cpu_s, "exit_code": r.exit_code, "timed_out": r.timed_out,
                   "truncated": r.truncated, "omitted_bytes": r.stdout_omitted_bytes + r.stderr_omitted_bytes,
                   "warm": bool(r.layers.get("warm"))}
        if r.ok:
            if r.stderr.strip():
                out = f"{out}\n[stderr]\n{r.stderr}" if out else f"[stderr]\n{r.stderr}"
            return ToolResult(ok=True, output=out, metrics=metrics)
        err = r.error + (f"\n{r.stderr.strip()[-2000:]}" if r.stderr.strip() else "")
        return ToolResult(ok=False, output=out, error=err, metrics=metrics, infrastructure=r.infrastructure)

    def close(self) -> None:
        """Stop the sandbox's workers."""
        self.sandbox.close()
