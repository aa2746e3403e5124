"""The tool interface: a `Tool` takes a call's arguments and returns a `ToolResult` the model reads.

A tool never raises into the trainer for anything the model did: a bad argument, a program that
crashes, a time-out all come back as `ToolResult(ok=False, error=reason)`. Exceptions are for the
user's mistakes at start (a bad config) and for bugs. A failure of the tool's own infrastructure (the
sandbox service unreachable, the executor crashed, a worker that never started) is not the model's
doing: `ToolResult(ok=False, infrastructure=True)`, and the sample is marked invalid instead of
scored (CASES.md T10).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ToolResult:
    """What one tool call produced."""

    ok: bool
    """True when the tool ran and succeeded; False for any error the model should see."""
    output: str = ""
    """The tool's output (for the python tool: its stdout, truncated)."""
    error: str = ""
    """Why the call failed, in words the model can act on (empty when `ok`)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Numbers about the call for logging (`wall_s`, `truncated`, ...); never shown to the model."""
    infrastructure: bool = False
    """The call failed for a reason outside the model's control (a connection error, the executor
    or sandbox crashed or never started), with `ok` False: the episode ends and its sample is
    invalid (excluded from the group statistics, advantage 0, loss mask 0; counted in
    `rollout/tool_infra_failures`), never scored 0 (CASES.md T10). A program the model wrote that
    raises (`1/0`) is a normal tool output, not this."""

    def to_message(self) -> str:
        """The text returned to the model: the output, then `Error: ...` when the call failed."""
        if self.ok:
            return self.output
        return f"{self.output}\nError: {self.error}" if self.output else f"Error: {self.error}"


@dataclass(kw_only=True)
class ToolCall:
    """One parsed call: the tool's registered name and its JSON arguments."""

    name: str
    """The tool's name as the model wrote it."""
    arguments: dict[str, Any]
    """The call's arguments (a JSON object)."""


class Tool(ABC):
    """A tool the model can call. Subclasses set `name`, `description`, `parameters` and `call`.

    `parameters` is a JSON schema object (`{"type": "object", "properties": ..., "required": [...]}`),
    the same shape chat templates expect in `tools=[...]`; `schema()` wraps it as an OpenAI function.
    `call` may run on several threads at once (calls of different samples run concurrently).
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}, "required": []}

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hermes function schema: `{"type": "function", "function": {...}}`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: Any) -> str:
        """The reason `arguments` does not fit `parameters` (a missing required key, an unknown key,
        a wrong JSON type), or "" when it fits."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"tool {self.name!r} is missing required argument(s) {missing}; expected {sorted(props)}"
        unknown = [k for k in arguments if k not in props]
        if unknown and not self.parameters.get("additionalProperties", False):
            return f"tool {self.name!r} got unknown argument(s) {unknown}; expected {sorted(props)}"
        types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
        for k, v in arguments.items():
            want = types.get(props.get(k, {}).get("type", ""))
            if want is not None and not isinstance(v, want):
                return f"argument {k!r} of tool {self.name!r} must be a {props[k]['type']}, got {type(v).__name__}"
        return ""

    @abstractmethod
    def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool. Never raises for the model's input: errors come back as `ok=False`."""

    def close(self) -> None:
        """Release the tool's resources (processes, connections). Calling it twice is harmless."""
