"""Outcome-level advantage estimators (ALGORITHMS section 3), grouped by an explicit group uid.

Formulas (one scalar per response, broadcast to its tokens by the caller):
- `grpo` (DeepSeekMath, arXiv 2402.03300; Dr. GRPO variant arXiv 2503.20783):
  `A_i = (r_i - mean(r)) / (std(r) + eps)`, std unbiased (Bessel, as verl) or population;
  `norm_adv_by_std_in_grpo=False` drops the division (Dr. GRPO).
- `rloo` (arXiv 2402.14740): `A_i = r_i - mean_{j != i} r_j`.
- `reinforce_plus_plus_baseline` (REINFORCE++, arXiv 2501.03262): subtract the group mean, then
  whiten over all valid tokens of the batch: `(x - mean) * rsqrt(var + 1e-8)`.

Common rules: groups are formed by `group_uid` value, never by position; statistics in float64
over valid, finite rewards only; invalid responses (failed reward, NaN/inf) get advantage 0; a
group with fewer than 2 valid rewards, or whose valid rewards are all equal (max == min), gets
advantage exactly 0.

Deliberate deviations:
- Singleton / all-invalid groups give 0, not verl's raw score (verl uses mean 0, std 1; CASES B02).
- `reinforce_plus_plus_baseline` whitening uses the same variance convention as `grpo_std`
  (default unbiased, which is what ALGORITHMS states) so every code path shares one convention
  (CASES B02). Degenerate groups are forced to exactly 0 after whitening (verl would shift them
  by the batch mean); their tokens still count in the whitening statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Callable

import torch

from megatron_rl.algorithms import options
from megatron_rl.registry import Registry

logger = logging.getLogger(__name__)

AdvantageFn = Callable[..., torch.Tensor]

ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
"""name -> estimator. Every estimator has the signature
`fn(rewards, index, num_groups, valid, *, response_mask, grpo_std, norm_adv_by_std_in_grpo, eps)`
with `rewards: [N] float64` (invalid entries already zeroed), `index: [N] int64` group index,
`valid: [N] bool`, returning `[N] float64` with 0 on invalid rows and degenerate groups.
Each name's options and facts (`group_relative`, `needs_response_mask`) are its
`options.ADV_ESTIMATOR_SPECS` entry, importable without torch."""

GROUP_RELATIVE_ESTIMATORS = frozenset(
    n for n in options.ADV_ESTIMATOR_SPECS.names() if options.ADV_ESTIMATOR_SPECS.get(n).group_relative
)
"""Estimators that need at least 2 responses a prompt (`rollout.n >= 2`)."""

_GRPO_STD = ("unbiased", "population")
_WHITEN_EPS = 1e-8


def check_group_size(adv_estimator: str, rollout_n: int) -> None:
    """Group-relative estimators need `rollout.n >= 2`: `options.check_group_size`, the one check.

    Raises `ConfigError` (a `ValueError`) naming the estimator and `rollout.n` (CASES B02/B11).
    """
    options.check_group_size(rollout_n=rollout_n, adv_estimator=adv_estimator)


def group_ids_to_index(group_uid: torch.Tensor | Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Map group uids to dense group indices, in order of first appearance.

    Args:
        group_uid: `[N] int64` tensor, or a length-N sequence of hashables (str, int, tuple).
            Rows with equal values form one group wherever they sit (contiguous or interleaved).

    Returns:
        `(index, num_groups)`: `index: [N] int64` (CPU for sequences, same device as a tensor
        input), values in `[0, num_groups)`; group `p` is the p-th distinct uid seen.
    """
    if isinstance(group_uid, torch.Tensor):
        if group_uid.dim() != 1:
            raise ValueError(f"group_uid must be 1-D [N], got shape {tuple(group_uid.shape)}")
        n = group_uid.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.long, device=group_uid.device), 0
        uniq, inverse = torch.unique(group_uid, return_inverse=True)
        pos = torch.arange(n, device=group_uid.device)
        first = torch.full((uniq.numel(),), n, dtype=torch.long, device=group_uid.device)
        first = first.scatter_reduce(0, inverse, pos, reduce="amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(uniq.numel(), device=group_uid.device)
        return rank[inverse], int(uniq.numel())
    mapping: dict[Hashable, int] = {}
    out = [mapping.setdefault(u, len(mapping)) for u in group_uid]
    return torch.tensor(out, dtype=torch.long), len(mapping)


def _group_stats(
    values: torch.Tensor, index: torch.Tensor, num_groups: int, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group count, sum, sum of squared deviations, and degenerate flag (float64, [P])."""
    w = valid.to(values.dtype)
    count = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, w)
    total = torch.zeros_like(count).index_add_(0, index, values * w)
    mean = total / count.clamp(min=1)
    dev = (values - mean[index]) * w
    m2 = torch.zeros_like(count).index_add_(0, index, dev * dev)
    big = torch.finfo(values.dtype).max
    vmax = torch.full_like(count, -big).scatter_reduce(
        0, index, torch.where(valid, values, torch.full_like(values, -big)), reduce="amax"
    )
    vmin = torch.full_like(count, big).scatter_reduce(
        0, index, torch.where(valid, values, torch.full_like(values, big)), reduce="amin"
    )
    degenerate = (count < 2) | (vmax == vmin)
    return count, mean, m2, degenerate


def _std(m2: torch.Tensor, count: torch.Tensor, grpo_std: str) -> torch.Tensor:
    denom = count - 1 if grpo_std == "unbiased" else count
    return torch.sqrt(m2 / denom.clamp(min=1))


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    index: torch.Tensor,
    num_groups: int,
    valid: torch.Tensor,
    *,
    response_mask: torch.Tensor | None,
    grpo_std: str,
    norm_adv_by_std_in_grpo: bool,
    eps: float,
) -> torch.Tensor:
    """GRPO: `(r - mean_g) / (std_g + eps)`, or `r - mean_g` without std normalisation.

    Shapes as in `ADV_ESTIMATORS`; `response_mask` is unused.
    """
    count, mean, m2, degenerate = _group_stats(rewards, index, num_groups, valid)
    adv = rewards - mean[index]
    if norm_adv_by_std_in_grpo:
        adv = adv / (_std(m2, count, grpo_std)[index] + eps)
    return torch.where(valid & ~degenerate[index], adv, torch.zeros_like(adv))


@ADV_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor,
    index: torch.Tensor,
    num_groups: int,
    valid: torch.Tensor,
    *,
    response_mask: torch.Tensor | None,
    grpo_std: str,
    norm_adv_by_std_in_grpo: bool,
    eps: float,
) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): `r_i - mean_{j != i, j valid} r_j = n/(n-1) * (r_i - mean_g)`.

    `grpo_std`, `norm_adv_by_std_in_grpo`, `eps` and `response_mask` are unused (no std).
    """
    count, mean, _, degenerate = _group_stats(rewards, index, num_groups, valid)
    n = count[index]
    adv = (rewards - mean[index]) * n / (n - 1).clamp(min=1)
    return torch.where(valid & ~degenerate[index], adv, torch.zeros_like(adv))


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    index: torch.Tensor,
    num_groups: int,
    valid: torch.Tensor,
    *,
    response_mask: torch.Tensor | None,
    grpo_std: str,
    norm_adv_by_std_in_grpo: bool,
    eps: float,
) -> torch.Tensor:
    """REINFORCE++ with baseline (arXiv 2501.03262): group-mean baseline, then token whitening.

    `response_mask: [N, S] bool` (True = generated token, EOS included) is required: each valid
    response contributes its centred reward once per valid token to the batch mean and variance
    (variance convention from `grpo_std`). Fewer than 2 valid tokens in the batch: all zeros.
    Raises `ValueError` when `response_mask` is missing or has the wrong first dimension.
    """
    if response_mask is None:
        raise ValueError("reinforce_plus_plus_baseline needs response_mask [N, S] for token whitening")
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"response_mask must be [N, S] with N={rewards.shape[0]}, got {tuple(response_mask.shape)}"
        )
    _, mean, _, degenerate = _group_stats(rewards, index, num_groups, valid)
    centred = rewards - mean[index]
    keep = valid & ~degenerate[index]
    centred = torch.where(keep, centred, torch.zeros_like(centred))
    ntok = response_mask.to(device=rewards.device).sum(dim=1).to(torch.float64) * valid.to(torch.float64)
    total = ntok.sum()
    if total < 2:
        return torch.zeros_like(rewards)
    tok_mean = (ntok * centred).sum() / total
    denom = total - 1 if grpo_std == "unbiased" else total
    tok_var = (ntok * (centred - tok_mean) ** 2).sum() / denom
    adv = (centred - tok_mean) * torch.rsqrt(tok_var + _WHITEN_EPS)
    return torch.where(keep, adv, torch.zeros_like(adv))


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_uid: torch.Tensor | Sequence[Hashable],
    valid: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    grpo_std: str = "unbiased",
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Compute one advantage per response with the estimator registered as `name`.

    Args:
        name: a key of `ADV_ESTIMATORS` (`grpo`, `rloo`, `reinforce_plus_plus_baseline`).
        rewards: `[N] float`, shaped score per response; may contain NaN/inf (treated invalid).
        group_uid: `[N] int64` tensor or length-N sequence of hashables; one value per drawn
            group (ALGORITHMS "Identity"): rows are grouped by value, never by position.
        valid: `[N] bool`, True = reward computed; False (failed/timed-out reward) gives
            advantage 0 and excludes the row from its group's statistics.
        response_mask: `[N, S] bool`, True on generated tokens (needed by
            `reinforce_plus_plus_baseline`).
        grpo_std: `"unbiased"` (Bessel, default, as verl) or `"population"`.
        norm_adv_by_std_in_grpo: False drops the std division in `grpo` (Dr. GRPO, arXiv 2503.20783).
        eps: added to the std in `grpo`.

    Returns:
        `[N] float32` on `rewards.device`; exactly 0 for invalid rows, groups with < 2 valid
        rewards and groups whose valid rewards are all equal. Never NaN.

    Raises:
        KeyError: unknown `name` (lists the valid ones). ValueError: bad `grpo_std`, shapes.
    """
    if grpo_std not in _GRPO_STD:
        raise ValueError(f"grpo_std must be one of {_GRPO_STD}, got {grpo_std!r}")
    fn = ADV_ESTIMATORS.get(name)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if valid.shape != (n,):
        raise ValueError(f"valid must be [N]=[{n}], got shape {tuple(valid.shape)}")
    if len(group_uid) != n:
        raise ValueError(f"group_uid must have N={n} entries, got {len(group_uid)}")
    index, num_groups = group_ids_to_index(group_uid)
    index = index.to(rewards.device)
    r64 = rewards.detach().to(torch.float64)
    ok = valid.to(device=rewards.device, dtype=torch.bool) & torch.isfinite(r64)
    r64 = torch.where(ok, r64, torch.zeros_like(r64))
    adv = fn(
        r64,
        index,
        num_groups,
        ok,
        response_mask=response_mask,
        grpo_std=grpo_std,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        eps=eps,
    )
    return adv.to(torch.float32)


assert ADV_ESTIMATORS.names() == options.ADV_ESTIMATOR_SPECS.names(), (
    "every advantage estimator registers its function here and its EstimatorSpec in algorithms/options.py"
)
