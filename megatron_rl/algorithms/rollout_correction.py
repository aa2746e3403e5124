"""Off-policy correction against the rollout engine's log-probs (ALGORITHMS.md section 8, and 5's TIS).

Three log-probs per token: `behav_logp` (the rollout engine's, `rollout_logprobs`), `prox_logp`
(the trainer's `old_logprobs`, the anchor of the clip; the engine's own with
`actor.old_logprob_source: rollout`) and `logp` (current). Decoupled PPO (Hilton et al., arXiv
2110.00641; AReaL, arXiv 2505.24298) keeps the policy loss around `prox_logp` and corrects for the
behaviour policy with the per-token behaviour weight

    w_t = exp(clamp(prox_logp - behav_logp, -20, 20))    (valid tokens only; detached)

- `token_tis`: `min(w_t, cap)` multiplies the token's policy loss (truncated importance sampling,
  Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
  fengyao.notion.site, 2025). Section 5's `actor.tis` is this mode at eta = 0: one code path.
- `seq_tis`: `min(exp(clamp(sum_t log w_t, -20, 20)), cap)` for every token of the sample.
- `mask`: tokens (`level: token`) or whole samples with any such token (`level: sequence`) whose
  `w_t` leaves [mask_low, mask_high] get loss mask 0 (rejection, verl's `rollout_rs`; icepop).
- `none`: nothing.

A rejected token leaves the loss entirely, as in verl's `rollout_rs` (its `modified_response_mask`
replaces the response mask): it is not in the token-mean denominator, and a sample with every token
rejected is not counted in the `N` of the seq-mean modes (ALGORITHMS.md 6). The weights are built
only where the mask is 1 (padding never produces inf or NaN) and never carry a gradient.

Deliberate deviations: the sequence log-weight of `seq_tis` is clamped to [-20, 20] again after the
sum (as verl's safety bound), so a long sample cannot overflow; verl's `rollout_rs: sequence` tests
the product of the weights, our `level: sequence` tests each token (section 8's wording).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_rl.algorithms import options
from megatron_rl.registry import Registry

logger = logging.getLogger(__name__)

LOG_W_CLAMP = 20.0
"""Section 5's clamp of a log-ratio, applied to log w_t (and to the sequence sum of seq_tis)."""


@dataclass
class RolloutCorrection:
    """The correction of one batch.

    Attributes:
        weights: `[B, S] float32`, detached, the factor of each token's policy loss (0 where
            `loss_mask` is False); None when the mode reweights nothing (`mask`, `none`).
        loss_mask: `[B, S] bool`, True = trained: the input mask less the rejected tokens.
        sums: 0-d detached float32 sums over the input's valid tokens, to be summed over
            micro-batches and ranks and divided by `valid`: `valid` (tokens), `behav_weight`
            (sum of w_t), `is_weight` (sum of the weights applied; tis modes), `truncated`
            (tokens whose weight was capped; tis modes), `masked` (tokens rejected; mask).
    """

    weights: Optional[torch.Tensor]
    loss_mask: torch.Tensor
    sums: dict[str, torch.Tensor]


CorrectionFn = Callable[..., tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")
"""`algorithm.rollout_correction.mode` -> `fn(log_w [B, S], mask [B, S] bool, **options) ->
(weights or None, new mask, extra sums)`; options: `options.ROLLOUT_CORRECTION_OPTIONS`."""


def behaviour_log_weights(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                          loss_mask: torch.Tensor) -> torch.Tensor:
    """`log w_t = clamp(prox_logp - behav_logp, -20, 20)` on valid tokens, 0 elsewhere.

    Args:
        prox_logprobs: `[B, S] float`, proximal log-probs (the trainer's `old_logprobs`), nats.
        behav_logprobs: `[B, S] float`, the rollout engine's log-probs (`rollout_logprobs`), nats.
        loss_mask: `[B, S] bool`, True = trained; other positions may hold anything (NaN, inf).

    Returns:
        `[B, S] float32`, detached. Raises `ValueError` on a shape mismatch.
    """
    if behav_logprobs.shape != prox_logprobs.shape or loss_mask.shape != prox_logprobs.shape:
        raise ValueError(f"prox_logprobs {tuple(prox_logprobs.shape)}, behav_logprobs {tuple(behav_logprobs.shape)} "
                         f"and loss_mask {tuple(loss_mask.shape)} must have the same [B, S] shape")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=prox_logprobs.device)
    diff = torch.where(mask, prox_logprobs.detach().float() - behav_logprobs.detach().float(), zero)
    return diff.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)


def _check_cap(tis_cap: float) -> None:
    if not tis_cap > 0:
        raise ValueError(f"algorithm.rollout_correction.tis_cap (actor.tis.clip) must be > 0, got {tis_cap}")


def _count(x: torch.Tensor) -> torch.Tensor:
    return x.sum().to(torch.float32)


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(log_w: torch.Tensor, mask: torch.Tensor):
    """No correction: no weights, the mask unchanged."""
    return None, mask, {}


@ROLLOUT_CORRECTIONS.register("token_tis")
def token_tis(log_w: torch.Tensor, mask: torch.Tensor, *, tis_cap: float):
    """`min(w_t, tis_cap)` per valid token (0 elsewhere); `log_w`, `mask`: `[B, S]`.
    Raises `ValueError` when `tis_cap <= 0`."""
    _check_cap(tis_cap)
    raw = torch.exp(log_w)
    weights = torch.where(mask, raw.clamp(max=tis_cap), torch.zeros_like(raw))
    return weights, mask, {"is_weight": weights.sum(), "truncated": _count(mask & (raw > tis_cap))}


@ROLLOUT_CORRECTIONS.register("seq_tis")
def seq_tis(log_w: torch.Tensor, mask: torch.Tensor, *, tis_cap: float):
    """`min(exp(clamp(sum_t log w_t, -20, 20)), tis_cap)` on every valid token of each sample (0
    elsewhere); `log_w`, `mask`: `[B, S]`. Raises `ValueError` when `tis_cap <= 0`."""
    _check_cap(tis_cap)
    seq = torch.exp(log_w.sum(dim=-1, keepdim=True).clamp(-LOG_W_CLAMP, LOG_W_CLAMP))  # (B, 1)
    weights = torch.where(mask, seq.clamp(max=tis_cap).expand_as(log_w), torch.zeros_like(log_w))
    return weights, mask, {"is_weight": weights.sum(), "truncated": _count(mask & (seq > tis_cap))}


@ROLLOUT_CORRECTIONS.register("mask")
def mask_rejection(log_w: torch.Tensor, mask: torch.Tensor, *, mask_low: Optional[float] = None,
                   mask_high: float, level: str = "token"):
    """Rejection: valid tokens with `w_t` outside [mask_low, mask_high] (`level: token`), or every
    token of a sample holding one (`level: sequence`), get mask 0. `mask_low` None = 1 / mask_high.
    Raises `ValueError` unless `0 <= mask_low < 1 < mask_high` and level is token or sequence."""
    low = 1.0 / mask_high if mask_low is None else mask_low
    if not (0.0 <= low < 1.0 < mask_high):
        raise ValueError(f"algorithm.rollout_correction needs 0 <= mask_low < 1 < mask_high, got {low}, {mask_high}")
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.level must be token or sequence, got {level!r}")
    w = torch.exp(log_w)
    out = mask & ((w < low) | (w > mask_high))  # (B, S)
    if level == "sequence":
        out = mask & out.any(dim=-1, keepdim=True)
    return None, mask & ~out, {"masked": _count(out)}


def rollout_correction(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       mode: str, **opts) -> RolloutCorrection:
    """The off-policy correction of one batch (ALGORITHMS.md 8; module docstring for the formulas).

    Args:
        prox_logprobs: `[B, S] float`, proximal log-probs (trainer's `old_logprobs`), nats.
        behav_logprobs: `[B, S] float`, behaviour log-probs (`rollout_logprobs`), nats.
        loss_mask: `[B, S] bool`, True = trained token.
        mode: a registered mode (`token_tis`, `seq_tis`, `mask`, `none`; never `auto`, see
            `options.resolve_rollout_correction`).
        **opts: the mode's options (`options_of(ROLLOUT_CORRECTION_OPTIONS.get(mode), ...)`).

    Returns:
        A `RolloutCorrection` (detached weights, the new mask, sums for the metrics).

    Raises:
        KeyError: unknown mode. ValueError: shapes, options out of range. TypeError: a foreign option.
    """
    fn = ROLLOUT_CORRECTIONS.get(mode)
    mask = loss_mask.bool()
    log_w = behaviour_log_weights(prox_logprobs, behav_logprobs, mask)
    valid = _count(mask)
    # a NaN weight (a NaN log-prob, or -inf on both sides) cannot be corrected: the token is left out
    # of the loss (mask 0) and counted, instead of turning the loss NaN; `none` uses no weight at all
    nonfinite = mask & torch.isnan(log_w) if mode != "none" else torch.zeros_like(mask)
    if bool(nonfinite.any()):
        mask = mask & ~nonfinite
        log_w = torch.where(nonfinite, torch.zeros_like(log_w), log_w)
    weights, new_mask, extra = fn(log_w, mask, **opts)
    sums = {"valid": valid, "nonfinite": _count(nonfinite),
            "behav_weight": torch.where(mask, torch.exp(log_w), torch.zeros_like(log_w)).sum()}
    sums.update(extra)
    return RolloutCorrection(weights=None if weights is None else weights.detach(), loss_mask=new_mask,
                             sums={k: v.detach().float() for k, v in sums.items()})


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Section 5's truncated importance-sampling weights: `token_tis` with cap `clip`, same code.

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
    c = rollout_correction(old_logprobs, rollout_logprobs, loss_mask, "token_tis", tis_cap=clip)
    n = c.sums["valid"].clamp(min=1.0)
    return c.weights, {"tis/raw_ratio_mean": c.sums["behav_weight"] / n, "tis/weight_mean": c.sums["is_weight"] / n}


assert ROLLOUT_CORRECTIONS.names() == options.ROLLOUT_CORRECTION_OPTIONS.names(), (
    "every rollout correction registers its function here and its options dataclass in algorithms/options.py"
)
