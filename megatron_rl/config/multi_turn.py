"""The rollout section's multi-turn keys (issue 31), a base of `schema.RolloutConfig`.

verl's names (`actor_rollout_ref.rollout.multi_turn.*` there, `rollout.multi_turn.*` here):
`enable`, `max_assistant_turns`, `tool_config_path`, `max_parallel_calls`,
`max_tool_response_length`, `tool_response_truncate_side`, `format`. Kept here so the schema module
stays small; checked from the section's `__post_init__` (`_check_multi_turn`). The episode loop is
`megatron_rl.rollout.multiturn`; the page is docs/MULTITURN.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.algorithms.options import check_choice, check_positive

__all__ = ["MultiTurnConfig", "RolloutTurns"]

TRUNCATE_SIDES = ("left", "middle", "right")
FORMATS = ("hermes", "code")
"""`megatron_rl.tools.parsing.FORMATS` (config imports no tool code; a test keeps the two equal)."""


@dataclass(kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tools (`rollout.multi_turn.*`)."""

    enable: bool = False
    """Run every sample as an episode of turns (`rollout.multi_turn.environment`): the engine
    generates until a tool call or the end, the tools run, their answers are appended as tokens
    (loss mask 0) and generation continues. Default false (one prompt -> one completion).
    verl: `actor_rollout_ref.rollout.multi_turn.enable`."""
    environment: str = "tool"
    """Registry name of the environment that runs an episode (`megatron_rl.rollout.multiturn.ENVIRONMENTS`);
    `tool` (default): the model calls the tools of `tool_config_path`."""
    format: str = "code"
    """How the model writes calls and reads answers (`megatron_rl.tools.parsing.FORMATS`):
    `code` (default; ToRL, arXiv 2503.23383: a ```python block, the turn stops at its closing
    fence, the answer comes back as an ```output block) or `hermes` (Qwen2.5's <tool_call> JSON;
    the turn ends with the end-of-turn token, the answer comes back as a user turn with
    <tool_response>). verl: `multi_turn.format` (hermes)."""
    max_assistant_turns: int = 4
    """Model turns an episode may take, >= 1; a turn that still calls a tool at the limit ends the
    episode without running it. Default 4. verl: `multi_turn.max_assistant_turns`."""
    max_tool_calls: int = 8
    """Tool calls an episode may run, >= 1; a call past it is answered with a tool error naming the
    limit (the model then gets its turn to answer). Default 8."""
    max_parallel_calls: int = 1
    """Calls of one turn that run, >= 1; more in the same turn are answered with a tool error. Default 1.
    verl: `multi_turn.max_parallel_calls`."""
    max_tool_response_length: int = 256
    """Characters of one tool answer the model reads, >= 1; longer ones are cut on
    `tool_response_truncate_side` and marked. Default 256. verl: `multi_turn.max_tool_response_length`."""
    tool_response_truncate_side: str = "middle"
    """left | middle (default) | right: what of a long tool answer is dropped... `left` keeps the
    end, `right` keeps the start, `middle` keeps both ends. verl: `multi_turn.tool_response_truncate_side`."""
    tool_timeout_s: float = 120.0
    """Seconds a turn's tool calls may take before each unfinished one is answered with a tool error
    (> 0; a guard against a custom tool that never returns; the python tool stops itself at its
    `wall_timeout_s`). Default 120."""
    tool_config_path: Optional[str] = None
    """YAML file listing the tools (`megatron_rl.tools.tool_config`, e.g. examples/tools/python_tool.yaml);
    relative paths are from the config file's folder. Required with `enable`. verl: `multi_turn.tool_config_path`."""

    def __post_init__(self) -> None:
        for name in ("max_assistant_turns", "max_tool_calls", "max_parallel_calls", "max_tool_response_length"):
            check_positive(f"rollout.multi_turn.{name}", getattr(self, name))
        check_positive("rollout.multi_turn.tool_timeout_s", self.tool_timeout_s)
        check_choice("rollout.multi_turn.tool_response_truncate_side", self.tool_response_truncate_side,
                     TRUNCATE_SIDES)
        check_choice("rollout.multi_turn.format", self.format, FORMATS)
        if self.enable and not self.tool_config_path and self.environment == "tool":
            from megatron_rl.errors import ConfigError

            raise ConfigError("rollout.multi_turn.enable: the `tool` environment needs rollout.multi_turn.tool_config_path "
                              "(a YAML file listing the tools, e.g. examples/tools/python_tool.yaml)")


@dataclass(kw_only=True)
class RolloutTurns:
    """The `rollout.multi_turn` section (a base of `schema.RolloutConfig`)."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools (issue 31; docs/MULTITURN.md)."""
