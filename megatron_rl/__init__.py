"""megatron-rl: RL post-training (GRPO, DAPO, DA3PO) on megatron-core with SGLang-API rollout servers."""

__version__ = "0.1.0"
