"""Tools for multi-turn rollouts (registry `TOOLS`): the sandboxed `python` tool, call parsing, tool configs."""

# imported for their registration side effect, so TOOLS is complete whatever is imported first
from megatron_rl.tools import python_sandbox  # noqa: F401
