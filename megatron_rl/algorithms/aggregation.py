"""Loss aggregation modes as (numerator, count) pairs for megatron-core's per-token loss path.

ALGORITHMS section 6. With `N` the number of sequences that have at least one valid token over
the whole mini-batch (all micro-batches and data-parallel ranks):
- `token-mean` (DAPO, arXiv 2503.14476): `sum_{i,t} m*l / sum_{i,t} m`.
- `seq-mean-token-mean` (GRPO, arXiv 2402.03300): `(1/N) sum_i (sum_t m*l / sum_t m)`.
- `seq-mean-token-sum`: `(1/N) sum_i sum_t m*l`.
- `seq-mean-token-sum-norm` (Dr. GRPO, arXiv 2503.20783): `(1/N) sum_i sum_t m*l / C`, with
  `C = loss_scale_factor` a constant (default `data.max_response_length`), never the padded width.

Each micro-batch returns `(numerator, count)`; the global loss is
`sum(numerators) / sum(counts)` over all micro-batches and DP ranks, which is what megatron-core
computes with `calculate_per_token_loss=True` (it sums both and divides in
`finalize_model_grads`). The result, and its gradient, is independent of how a mini-batch is
split into micro-batches or ranks and of padding width (CASES B05, B06).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from megatron_rl.algorithms.options import LOSS_AGG_MODE_NAMES
from megatron_rl.registry import Registry

logger = logging.getLogger(__name__)

AggFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
LOSS_AGG_MODES: Registry[AggFn] = Registry("loss aggregation mode")
"""name -> fn(token_loss [B,S], loss_mask [B,S] bool, *, loss_scale_factor) -> (numerator, count)."""


def _masked(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if token_loss.dim() != 2 or loss_mask.shape != token_loss.shape:
        raise ValueError(
            f"token_loss and loss_mask must both be [B, S]; got {tuple(token_loss.shape)} and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.bool()
    # where (not multiply) so that inf/NaN at masked positions neither leak nor poison gradients
    return torch.where(mask, token_loss, torch.zeros_like(token_loss)), mask


def _num_seqs(mask: torch.Tensor) -> torch.Tensor:
    return mask.any(dim=-1).sum().to(torch.int)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, loss_scale_factor: float | None = None):
    """Numerator `sum m*l`, count = valid tokens. `loss_scale_factor` is ignored."""
    lm, mask = _masked(token_loss, loss_mask)
    return lm.sum(), mask.sum().to(torch.int)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, loss_scale_factor: float | None = None):
    """Numerator `sum_i mean_t(m*l)` over sequences with a valid token, count = such sequences."""
    lm, mask = _masked(token_loss, loss_mask)
    ntok = mask.sum(dim=-1).clamp(min=1).to(lm.dtype)  # (B,); empty rows add 0
    return (lm.sum(dim=-1) / ntok).sum(), _num_seqs(mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, loss_scale_factor: float | None = None):
    """Numerator `sum_{i,t} m*l`, count = sequences with a valid token."""
    lm, mask = _masked(token_loss, loss_mask)
    return lm.sum(), _num_seqs(mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    token_loss: torch.Tensor, loss_mask: torch.Tensor, *, loss_scale_factor: float | None = None
):
    """Numerator `sum_{i,t} m*l / C`, count = sequences with a valid token.

    Raises `ValueError` if `loss_scale_factor` (C) is None or not > 0: the padded width
    `loss_mask.shape[-1]` is never used as a fallback (CASES B06).
    """
    if loss_scale_factor is None or not loss_scale_factor > 0:
        raise ValueError(
            "loss_agg_mode 'seq-mean-token-sum-norm' needs a constant actor.loss_scale_factor > 0 "
            f"(default data.max_response_length), got {loss_scale_factor!r}"
        )
    lm, mask = _masked(token_loss, loss_mask)
    return lm.sum() / float(loss_scale_factor), _num_seqs(mask)


def aggregate_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's contribution to the mini-batch loss.

    Args:
        token_loss: `[B, S] float`, per-token loss (any value where the mask is False).
        loss_mask: `[B, S] bool`, True = trained token.
        mode: a key of `LOSS_AGG_MODES`.
        loss_scale_factor: the constant C of `seq-mean-token-sum-norm` (ignored by other modes).

    Returns:
        `(numerator, count)`: `numerator` a 0-d tensor of `token_loss`'s dtype (with gradient),
        `count` a 0-d `torch.int` tensor: valid tokens for `token-mean`, sequences with at least
        one valid token otherwise. Global loss = sum of numerators / sum of counts over all
        micro-batches and DP ranks; a micro-batch with nothing valid returns (0, 0).

    Raises:
        KeyError: unknown mode. ValueError: shape mismatch, missing C for the norm mode.
    """
    return LOSS_AGG_MODES.get(mode)(token_loss, loss_mask, loss_scale_factor=loss_scale_factor)


assert sorted(LOSS_AGG_MODES.names()) == sorted(LOSS_AGG_MODE_NAMES), "register the name in algorithms/options.py too"
