"""Registry of reward functions, looked up by name (`reward.fn`) in the reward process pool.

A reward function has the signature
`fn(response: str, ground_truth: str, *, correct_score: float = 1.0, incorrect_score: float = -1.0)
-> {"score": float, "acc": bool, "pred": str | None}` and must be a module-level function so a
spawned worker process can import it. The built-in functions register when the package
`megatron_rl.rewards` is imported (which importing this module does first).
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_rl.registry import Registry

RewardFn = Callable[..., dict[str, Any]]
REWARD_FNS: Registry[RewardFn] = Registry("reward function")

