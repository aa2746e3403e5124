"""How the rollout sends a prompt's responses to the engines (issue 30), a base of `schema.RolloutConfig`.

Kept here so the schema module stays small. The requests themselves: `megatron_rl.rollout.manager`
(seeds: `megatron_rl.rollout.partial.response_seeds`; vLLM's group request:
`megatron_rl.rollout.vllm_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["RolloutRequests"]


@dataclass(kw_only=True)
class RolloutRequests:
    """Request options of the rollout (`rollout.*`)."""

    parallel_sampling: Optional[bool] = None
    """Send a prompt's `n` responses as one request with `n` (vLLM's parallel sampling: one prefill
    and one request's overhead instead of `n`; the tiny CI recipe's rollout on a CPU vLLM took 0.51 s
    a step this way against 0.78 s with one request per response, docs/engines.md). Response j of a
    prompt then samples with the prompt's seed + j (the seed vLLM gives child j) instead of a seed
    derived per response, so turning it on or off changes the sampled tokens (and the numbers of a
    run, step 0's evaluation included); the same seeds on another backend (e.g. `embedded` with this
    on) do not give vLLM's tokens, whose sampler is its own. None (default): on for `vllm` and
    `vllm-embedded`, off for the others (their batch call takes a seed per response anyway); the run
    logs what it resolved to. Multi-turn episodes always send one request per turn."""

    def consecutive_seeds(self, backend: str) -> bool:
        """Whether the responses of a prompt get consecutive seeds (this option, resolved for `backend`)."""
        return self.parallel_sampling if self.parallel_sampling is not None else backend in ("vllm", "vllm-embedded")
