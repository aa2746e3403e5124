"""Per-token policy-gradient losses: PPO-clip (decoupled, dual-clip), GSPO, CISPO (ALGORITHMS 5).

- `vanilla`: PPO clip (Schulman et al., arXiv 1707.06347) with decoupled bounds (clip-higher,
  DAPO arXiv 2503.14476) and dual clip for negative advantages (Ye et al., arXiv 1912.09729):
  `pg = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`, then for `A < 0` only `pg = min(pg, -c*A)`.
- `gspo` (arXiv 2507.18071): sequence ratio `s_i = exp(mean_t(logp - old_logp))` over valid
  tokens, used per token as `sg(s_i) * exp(logp_t - sg(logp_t))` in the clipped objective.
- `cispo` (arXiv 2506.13585): `pg = -sg(w_t) * A * logp_t`, `w_t = min(r_t, 1 + eps_high)` and,
  only when `cispo_clip_low` is set, `max(w_t, 1 - eps_low)`.

Every function takes explicit keyword-only options (no `**kwargs`: a misspelt or foreign option
raises `TypeError`, CASES B08): exactly the fields of its registered options dataclass in
`options.POLICY_LOSS_OPTIONS` (torch-free, so the config lists and checks them), so a caller passes
`**options_of(POLICY_LOSS_OPTIONS.get(name), cfg.actor)` and returns token losses that are 0 where `loss_mask` is False.
Masked positions are replaced by 0 before any arithmetic, so arbitrary values there (inf, NaN,
huge gaps) produce neither NaN/inf losses nor NaN gradients. Reduction is `aggregation.py`'s job.

Deliberate deviation: GSPO's mean log-ratio is clamped to [-20, 20] like the token log-ratio
(the paper does not clamp; verl clamps at 10 on the log side).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.algorithms import options
from megatron_rl.registry import Registry

logger = logging.getLogger(__name__)

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossOutput:
    """Result of a policy loss; all tensors `[B, S]`, 0/False where `loss_mask` is False.

    Attributes:
        token_loss: `[B, S]` float, per-token loss to be aggregated (has gradients).
        is_clipped: `[B, S]` bool, the clipped branch is the active one (vanilla, gspo), or the
            importance weight was truncated (cispo).
        is_dual_clipped: `[B, S]` bool, the dual-clip bound `-c*A` is active (vanilla, A < 0).
        approx_kl: `[B, S]` float, detached `old_logprobs - logprobs`.
        ratio: `[B, S]` float, detached ratio used (token ratio, or sequence ratio for gspo).
    """

    token_loss: torch.Tensor
    is_clipped: torch.Tensor
    is_dual_clipped: torch.Tensor
    approx_kl: torch.Tensor
    ratio: torch.Tensor


PolicyLossFn = Callable[..., PolicyLossOutput]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
"""name -> loss function; names: vanilla, gspo, cispo. Options: `options.POLICY_LOSS_OPTIONS`."""


def _prepare(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes; return mask-sanitised (logp, old_logp, advantages [B,S], mask bool)."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, S], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same [B, S] shape"
        )
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages [B] must have B={logprobs.shape[0]}, got {advantages.shape[0]}")
        advantages = advantages[:, None].expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"advantages must be [B] or [B, S], got shape {tuple(advantages.shape)}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logp = torch.where(mask, logprobs, zero)
    old = torch.where(mask, old_logprobs.detach().to(logprobs.dtype), zero)
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)
    return logp, old, adv, mask


def _check_bounds(low: float, high: float, what: str) -> None:
    if not (0.0 <= low < 1.0):
        raise ValueError(f"{what} low bound must be in [0, 1), got {low}")
    if not high >= 0.0:
        raise ValueError(f"{what} high bound must be >= 0, got {high}")


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
) -> PolicyLossOutput:
    """Decoupled PPO clip with dual clip (arXiv 1707.06347, 2503.14476, 1912.09729).

    Args:
        logprobs: `[B, S] float`, current policy log-probs (gradients flow here).
        old_logprobs: `[B, S] float`, trainer recompute before the update (detached).
        advantages: `[B]` or `[B, S] float` (detached).
        loss_mask: `[B, S] bool`, True = trained token.
        clip_ratio_low, clip_ratio_high: `eps_low`, `eps_high` (`actor.clip_ratio_low/high`).
        clip_ratio_c: dual-clip constant `c` (> 1), applied only where `A < 0`.

    Per token: `r = exp(clamp(logp - old, -20, 20))`,
    `pg = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`; where `A < 0`: `pg = min(pg, -c*A)`.

    Raises:
        ValueError: `clip_ratio_c <= 1`, bounds out of range, shape mismatch.
        TypeError: any unknown keyword (no catch-all).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")
    _check_bounds(clip_ratio_low, clip_ratio_high, "actor.clip_ratio")
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(pg1, pg2)
    is_clipped = (pg2 > pg1) & mask
    pg3 = -adv * clip_ratio_c
    neg = adv < 0
    dual = torch.minimum(clip_loss, pg3)
    is_dual = neg & (pg3 < clip_loss) & mask
    loss = torch.where(neg, dual, clip_loss)
    zero = torch.zeros_like(loss)
    return PolicyLossOutput(
        token_loss=torch.where(mask, loss, zero),
        is_clipped=is_clipped,
        is_dual_clipped=is_dual,
        approx_kl=(old - logp).detach(),
        ratio=torch.where(mask, ratio, zero).detach(),
    )


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
) -> PolicyLossOutput:
    """GSPO, sequence-level ratio (arXiv 2507.18071). Use with `seq-mean-token-mean` only.

    Args: as `vanilla_policy_loss`; `advantages` must be constant along each sequence.
        gspo_clip_low, gspo_clip_high: bounds on the sequence ratio (`actor.gspo_clip_*`).

    `s_i = exp(clamp(sum_t m*(logp-old) / sum_t m, -20, 20))`; per token
    `s_it = sg(s_i) * exp(logp_t - sg(logp_t))` (value `s_i`, gradient `s_i * dlogp_t`);
    `pg = max(-A*s_it, -A*clip(s_it, 1-lo, 1+hi))`. No dual clip. A sequence with no valid
    token has `s_i = 1` and loss 0.

    Raises: ValueError for bounds out of range or shape mismatch; TypeError for unknown keywords.
    """
    _check_bounds(gspo_clip_low, gspo_clip_high, "actor.gspo_clip")
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    m = mask.to(logp.dtype)
    ntok = m.sum(dim=-1).clamp(min=1.0)  # (B,)
    seq_log_ratio = ((logp.detach() - old) * m).sum(dim=-1) / ntok  # (B,)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(seq_log_ratio)[:, None]  # (B, 1), detached
    s_tok = s * torch.exp(logp - logp.detach())  # (B, S)
    pg1 = -adv * s_tok
    pg2 = -adv * s_tok.clamp(1.0 - gspo_clip_low, 1.0 + gspo_clip_high)
    loss = torch.maximum(pg1, pg2)
    zero = torch.zeros_like(loss)
    return PolicyLossOutput(
        token_loss=torch.where(mask, loss, zero),
        is_clipped=(pg2 > pg1) & mask,
        is_dual_clipped=torch.zeros_like(mask),
        approx_kl=(old - logp).detach(),
        ratio=torch.where(mask, s.expand_as(logp), zero).detach(),
    )


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cispo_clip_high: float = 0.28,
    cispo_clip_low: float | None = None,
) -> PolicyLossOutput:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

    Args: as `vanilla_policy_loss`.
        cispo_clip_high: `eps_high`, weight cap `1 + eps_high`.
        cispo_clip_low: `eps_low`; None (default, as the paper) = no lower bound.

    `r = exp(clamp(logp - old, -20, 20))`, `w = min(r, 1+eps_high)` (then `max(w, 1-eps_low)` if
    set), `pg = -sg(w) * A * logp`. Every token keeps a gradient. `is_clipped` marks tokens whose
    weight was truncated.

    Raises: ValueError for bounds out of range or shape mismatch; TypeError for unknown keywords.
    """
    _check_bounds(0.0 if cispo_clip_low is None else cispo_clip_low, cispo_clip_high, "actor.cispo_clip")
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, loss_mask)
    ratio = torch.exp((logp.detach() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    w = ratio.clamp(max=1.0 + cispo_clip_high)
    if cispo_clip_low is not None:
        w = w.clamp(min=1.0 - cispo_clip_low)
    loss = -w * adv * logp
    zero = torch.zeros_like(loss)
    return PolicyLossOutput(
        token_loss=torch.where(mask, loss, zero),
        is_clipped=(w != ratio) & mask,
        is_dual_clipped=torch.zeros_like(mask),
        approx_kl=(old - logp).detach(),
        ratio=torch.where(mask, ratio, zero),
    )


def policy_loss_metrics(out: PolicyLossOutput, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked-mean diagnostics of a policy loss (verl meanings, ALGORITHMS 5, CASES B08).

    Args:
        out: a `PolicyLossOutput`.
        loss_mask: `[B, S] bool`, True = trained token.

    Returns:
        0-d detached float tensors (0 when no token is valid):
        `pg_clipfrac`: share of valid tokens where the clipped branch is active (either bound);
        `pg_clipfrac_lower`: share where the dual clip is active (A < 0);
        `pg_clipfrac_at_high_bound` / `pg_clipfrac_at_low_bound`: the clipped share split by
        which bound was active (ratio above 1 / below 1);
        `ppo_kl`: mean of `old_logprobs - logprobs`.
    """
    mask = loss_mask.bool()
    n = mask.sum().clamp(min=1).to(torch.float32)

    def frac(x: torch.Tensor) -> torch.Tensor:
        return ((x & mask).sum().to(torch.float32) / n).detach()

    return {
        "pg_clipfrac": frac(out.is_clipped),
        "pg_clipfrac_lower": frac(out.is_dual_clipped),
        "pg_clipfrac_at_high_bound": frac(out.is_clipped & (out.ratio > 1.0)),
        "pg_clipfrac_at_low_bound": frac(out.is_clipped & (out.ratio < 1.0)),
        "ppo_kl": (torch.where(mask, out.approx_kl, torch.zeros_like(out.approx_kl)).sum().float() / n).detach(),
    }


assert POLICY_LOSSES.names() == options.POLICY_LOSS_OPTIONS.names(), (
    "every policy loss registers its function here and its options dataclass in algorithms/options.py"
)
