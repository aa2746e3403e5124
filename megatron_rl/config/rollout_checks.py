"""The rollout section's start-up checks of the engines (issue 32), a base of `schema.RolloutConfig`.

Kept here so the schema module stays small; checked by `_check_rollout_checks` from the section's
`__post_init__`. The checks themselves run against the engines in `megatron_rl.rollout.engine_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["VLLM_LOGPROBS_MODE", "RolloutChecks", "vllm_logprobs_mode"]

VLLM_LOGPROBS_MODE = "raw_logprobs"
"""The `--logprobs-mode` every vLLM engine runs with (`launcher.build_vllm_command` pins it): the
log-softmax of the raw logits, before temperature, penalties and top-k/top-p filtering, i.e. the
policy's own log-probs (ALGORITHMS.md section 8)."""


def vllm_logprobs_mode(args: Sequence[str]) -> str | None:
    """The value `args` (`vllm serve` flags) give `--logprobs-mode` (also spelled `--logprobs_mode`,
    or `--flag=value`; the last one wins, as with argparse), or None when they give none."""
    value = None
    for i, a in enumerate(args):
        for flag in ("--logprobs-mode", "--logprobs_mode"):
            if a == flag and i + 1 < len(args):
                value = str(args[i + 1])
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
    return value


@dataclass(kw_only=True)
class RolloutChecks:
    """Start-up checks of the rollout engines (`rollout.*`)."""

    check_logprob_semantics: bool = True
    """Before step 1, check on every engine that the log-probs it reports are those of the
    unscaled, unfiltered policy (temperature 1, no top-k/top-p), as the trainer computes them
    (`megatron_rl.rollout.engine_checks`: a few tokens sampled at temperature 3 (2 on vLLM) and top-p 0.95,
    re-scored as prompt tokens; 0.2-0.8 s per engine on the tiny model on CPU). A mismatch stops the run,
    naming the engine and the setting that fixes it (SGLang: SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the
    server's environment; vLLM: `--logprobs-mode raw_logprobs`). The PPO anchor of
    `actor.old_logprob_source: rollout`, the rollout-correction weights and
    `train/rollout_logprob_abs_diff` all read those log-probs. Default true; false skips the check
    (only for engines known to be right)."""

    def _check_rollout_checks(self) -> None:
        """Raises `ConfigError` when `rollout.vllm_extra_args` sets another `--logprobs-mode` than
        `VLLM_LOGPROBS_MODE` (the launcher pins it; the engine would report processed log-probs)."""
        mode = vllm_logprobs_mode(getattr(self, "vllm_extra_args", ()) or ())
        if mode is not None and mode != VLLM_LOGPROBS_MODE:
            from megatron_rl.errors import ConfigError

            raise ConfigError(
                f"rollout.vllm_extra_args: --logprobs-mode {mode} is not allowed: megatron-rl starts vLLM with "
                f"--logprobs-mode {VLLM_LOGPROBS_MODE} (the policy's log-probs before temperature and top-k/top-p, "
                "what the trainer's PPO anchor and rollout-correction ratios need); remove it")
        if not isinstance(self.check_logprob_semantics, bool):
            from megatron_rl.errors import ConfigError

            raise ConfigError(f"rollout.check_logprob_semantics: {self.check_logprob_semantics!r} must be true or "
                              "false")
