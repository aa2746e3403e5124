"""KL-to-reference estimators and truncated importance sampling (TIS) weights (ALGORITHMS 5).

KL(pi || ref) from tokens sampled by pi (Schulman, "Approximating KL divergence", 2020), with
`d = clamp(ref_logp - logp, -20, 20)`: `k1 = -d`, `k2 = d^2 / 2`,
`k3 = clamp(exp(d) - d - 1, -10, 10)`; `low_var_kl` is an alias of `k3` (verl's name).

TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
2025; as in verl/slime): per-token weight `min(exp(old_logp - rollout_logp), clip)`, detached,
built from the trainer's old log-probs and the rollout server's log-probs, never from the current
log-probs (CASES B09). The raw (untruncated) mean ratio and the mean weight are both reported.
"""

from __future__ import annotations

import logging

import torch

from megatron_rl.algorithms.options import KL_TYPE_NAMES

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


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance-sampling weights for the rollout/trainer mismatch.

    Args:
        old_logprobs: `[B, S] float`, trainer recompute before the update (NOT current logprobs).
        rollout_logprobs: `[B, S] float`, log-probs returned by the rollout server.
        loss_mask: `[B, S] bool`, True = trained token.
        clip: cap C (`actor.tis.clip`, > 0).

    Returns:
        `(weights, stats)`: `weights [B, S] float32`, detached, `min(exp(clamp(old - rollout,
        -20, 20)), C)` on valid tokens and 0 elsewhere; `stats` 0-d detached tensors
        `tis/raw_ratio_mean` (mean of the untruncated ratio) and `tis/weight_mean` (mean of the
        weights used), masked means (0 with no valid token).

    Raises:
        ValueError: `clip <= 0`, shape mismatch.
    """
    if not clip > 0:
        raise ValueError(f"actor.tis.clip must be > 0, got {clip}")
    if rollout_logprobs.shape != old_logprobs.shape or loss_mask.shape != old_logprobs.shape:
        raise ValueError("old_logprobs, rollout_logprobs and loss_mask must have the same [B, S] shape")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs.device)
    log_ratio = torch.where(mask, old_logprobs.detach().float() - rollout_logprobs.detach().float(), zero)
    raw = torch.exp(log_ratio.clamp(-_D_CLAMP, _D_CLAMP))
    weights = torch.where(mask, raw.clamp(max=clip), zero)
    n = mask.sum().clamp(min=1).float()
    stats = {
        "tis/raw_ratio_mean": torch.where(mask, raw, zero).sum() / n,
        "tis/weight_mean": weights.sum() / n,
    }
    return weights.detach(), stats
