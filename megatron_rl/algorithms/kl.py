"""KL-to-reference estimators (ALGORITHMS 5); section 5's TIS weights are re-exported from
`rollout_correction` (the `token_tis` mode, one code path with section 8).

KL(pi || ref) from tokens sampled by pi (Schulman, "Approximating KL divergence", 2020), with
`d = clamp(ref_logp - logp, -20, 20)`: `k1 = -d`, `k2 = d^2 / 2`,
`k3 = clamp(exp(d) - d - 1, -10, 10)`; `low_var_kl` is an alias of `k3` (verl's name).

TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
2025; as in verl/slime): per-token weight `min(exp(old_logp - rollout_logp), clip)`, detached,
built from the trainer's old log-probs and the rollout server's log-probs, never from the current
log-probs (CASES B09): `rollout_correction.tis_weights`, i.e. `token_tis` at eta = 0.
"""

from __future__ import annotations

import logging

import torch

from megatron_rl.algorithms.options import KL_TYPE_NAMES
from megatron_rl.algorithms.rollout_correction import tis_weights

__all__ = ["KL_TYPES", "kl_penalty", "tis_weights"]

logger = logging.getLogger(__name__)

KL_TYPES = KL_TYPE_NAMES
_D_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_type: str,
    *,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate, to be aggregated with the actor's `loss_agg_mode`.

    Args:
        logprobs: `[B, S] float`, current policy log-probs (gradients flow here).
        ref_logprobs: `[B, S] float`, reference policy log-probs (detached).
        kl_type: `k1`, `k2`, `k3` or `low_var_kl` (= `k3`).
        loss_mask: optional `[B, S] bool` (True = trained); if given, masked positions are 0 and
            their inputs are never used (no NaN from padding values).

    Returns:
        `[B, S]` float tensor. Raises `ValueError` for an unknown `kl_type` or shape mismatch.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"actor.kl_loss_type must be one of {KL_TYPES}, got {kl_type!r}")
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)} vs ref_logprobs {tuple(ref_logprobs.shape)}")
    ref = ref_logprobs.detach().to(logprobs.dtype)
    logp = logprobs
    if loss_mask is not None:
        mask = loss_mask.bool()
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        logp = torch.where(mask, logprobs, zero)
        ref = torch.where(mask, ref, zero)
    d = (ref - logp).clamp(-_D_CLAMP, _D_CLAMP)
    if kl_type == "k1":
        kl = -d
    elif kl_type == "k2":
        kl = 0.5 * d * d
    else:
        kl = (torch.exp(d) - d - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)
    if loss_mask is not None:
        kl = torch.where(loss_mask.bool(), kl, torch.zeros_like(kl))
    return kl
