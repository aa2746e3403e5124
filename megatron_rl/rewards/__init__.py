"""Reward functions (registry `REWARD_FNS`) and the process pool that evaluates them."""

# imported for their registration side effect, so REWARD_FNS is complete whatever is imported first
from megatron_rl.rewards import math_answer, math_dapo, math_verify_reward  # noqa: F401
