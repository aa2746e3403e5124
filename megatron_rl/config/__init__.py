"""Configuration: dataclass schema, YAML recipes, dotted overrides, static validation.

Imports only the standard library, PyYAML and the registries' names (no torch, megatron,
transformers); the launch-time checks are `megatron_rl.trainer.preflight`'s.
"""

from megatron_rl.config.loader import config_to_dict, load_config, save_config
from megatron_rl.config.schema import Config
from megatron_rl.config.validate import validate_config

__all__ = ["Config", "load_config", "validate_config", "save_config", "config_to_dict"]
