"""Configuration: dataclass schema, YAML recipes, dotted overrides, validation."""

from megatron_rl.config.loader import config_to_dict, environment_checks, load_config, save_config, validate_config
from megatron_rl.config.schema import Config

__all__ = ["Config", "load_config", "validate_config", "environment_checks", "save_config", "config_to_dict"]
