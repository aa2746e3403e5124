"""Registry of tools (`TOOLS`), looked up by name from a tool config file (`tool_config_path`).

A user adds a tool in one file: subclass `megatron_rl.tools.base.Tool`, decorate the class with
`@TOOLS.register("my_tool")`, and name it in the tool config (`name: my_tool`), or point the
config at the class (`class_name: my_pkg.my_tools.MyTool`, verl's key), which imports the module.
The class is built as `cls(**config)` from the entry's `config` mapping, so its constructor's
keyword arguments are the config keys (an unknown one fails at start). The built-in tools
register when the package `megatron_rl.tools` is imported (which importing this module does first).
"""

from __future__ import annotations

from megatron_rl.registry import Registry

TOOLS: Registry[type] = Registry("tool")
