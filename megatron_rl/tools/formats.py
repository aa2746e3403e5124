"""The exact texts of one tool round in the `"code"` format (ToRL, arXiv 2503.23383), shared by the
multi-turn rollout loop and the SFT that teaches the tiny model to call the tool, so the two cannot drift.

A tool-using response is three separately tokenised parts (never re-tokenise the joined text: BPE
merges at the boundaries could differ from what the rollout builds)::

    model  A: code_call_text("print(7*8+6*4-3)")   -> "```python\\nprint(7*8+6*4-3)\\n```\\n"
    tool   T: code_response_text("77\\n")           -> "```output\\n77\\n\\n```\\n"   (loss mask 0)
    model  B: "Answer: 77" + EOS

The engine stops generating part A on `CODE_STOP` (the closing fence and its newline), so A ends with it.
`code_response_text(r.to_message())` equals `format_tool_response(r, fmt="code") + "\\n"` for any
`ToolResult` `r` (pinned by tests/unit/test_tool_formats.py). The message is not stripped: the python
tool's output of `print(77)` is "77\\n", so the real tool part is "```output\\n77\\n\\n```\\n".
"""

from __future__ import annotations

from megatron_rl.tools.base import ToolResult

CODE_STOP = "\n```\n"
"""Stop string of a model turn that calls the tool: the newline, closing fence and newline after the program."""

CODE_OPEN = "```python\n"
"""How a tool call opens (what `parsing.parse_tool_calls(fmt="code")` looks for)."""


def code_call_text(code: str) -> str:
    """The model's tool-call text for the Python program `code`: `"```python\\n{code}\\n```\\n"`.

    It ends with `CODE_STOP`. `code` should not end with a newline (it would leave an empty line
    before the fence, which the SFT data never shows).
    """
    return f"{CODE_OPEN}{code}{CODE_STOP}"


def code_response_text(result_message: str) -> str:
    """The environment's answer to a call: `"```output\\n{result_message}\\n```\\n"`.

    `result_message` is `ToolResult.to_message()` unchanged, so this equals
    `parsing.format_tool_response(result, fmt="code") + "\\n"`. For the python tool the message is
    the program's raw stdout, trailing newline included (`to_message` strips nothing): `print(77)`
    gives "77\\n", so the block is "```output\\n77\\n\\n```\\n" (an empty line before the fence);
    the tiny SFT data (tools/train_tiny_base.py) is built the same way.
    """
    return f"```output\n{result_message}\n```\n"


def code_result_text(result: ToolResult) -> str:
    """`code_response_text(result.to_message())`: the tool part the rollout appends after a call
    that returned `result` (ok or not; an error reads `Error: <reason>` inside the block)."""
    return code_response_text(result.to_message())
