"""DAPO dynamic sampling: keep whole groups whose metric varies, refill until the batch is full.

ALGORITHMS section 2 (DAPO, arXiv 2503.14476). A group is kept iff the std of its metric over
its valid responses is > 0, i.e. it has >= 2 valid values that are not all equal. Generation
batches are drawn until `train_batch_size` groups are kept; kept groups stay in (generation
batch, prompt index) order and are truncated to exactly `train_batch_size`.

`max_num_gen_batches <= 0` means unlimited (the loop then runs until the batch is full). When the
limit is reached: `on_exhausted="train_partial"` (default) truncates to the largest multiple of
`ppo_mini_batch_size * dp_size` and warns; `"error"` raises. Fewer kept groups than one such unit
always raises `DynamicSamplingExhausted` saying what to change.

Multi-turn fan-out groups (CASES B12): a group of trajectories, each a list of fragments, is
judged on one reward per trajectory (`trajectory_rewards`), never per fragment.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_rl.algorithms.options import check_group_size

logger = logging.getLogger(__name__)

ON_EXHAUSTED = ("train_partial", "error")


class DynamicSamplingExhausted(ValueError):
    """`max_num_gen_batches` generation batches did not yield enough informative groups."""


def validate_dynamic_sampling(*, rollout_n: int, enable: bool) -> None:
    """Filtering on needs `rollout.n >= 2` (with one response a group every std is 0 and the batch
    can never fill, CASES B11): `options.check_group_size`, the one check. Raises `ConfigError`."""
    check_group_size(rollout_n=rollout_n, filter_groups=enable)


def group_keep_mask(
    metric: torch.Tensor,
    group_index: torch.Tensor,
    valid: torch.Tensor,
    *,
    num_groups: int | None = None,
) -> torch.Tensor:
    """Per-group keep decision.

    Args:
        metric: `[N] float`, `acc` (default) or `score` per response; NaN/inf counts as invalid.
        group_index: `[N] int64` in `[0, P)`, dense group index (`advantages.group_ids_to_index`).
        valid: `[N] bool`, True = reward computed.
        num_groups: P; default `group_index.max() + 1`.

    Returns:
        `[P] bool`, True iff the group's valid metric values are not all equal (std > 0); a
        group with < 2 valid responses is dropped. Never a per-response mask (CASES B12).
    """
    if metric.shape != group_index.shape or valid.shape != metric.shape:
        raise ValueError("metric, group_index and valid must all be [N]")
    if num_groups is None:
        p = int(group_index.max()) + 1 if group_index.numel() else 0
    else:
        p = int(num_groups)
    m = metric.detach().to(torch.float64)
    ok = valid.bool() & torch.isfinite(m)
    big = torch.finfo(torch.float64).max
    vmax = torch.full((p,), -big, dtype=torch.float64, device=m.device).scatter_reduce(
        0, group_index, torch.where(ok, m, torch.full_like(m, -big)), reduce="amax"
    )
    vmin = torch.full((p,), big, dtype=torch.float64, device=m.device).scatter_reduce(
        0, group_index, torch.where(ok, m, torch.full_like(m, big)), reduce="amin"
    )
    count = torch.zeros(p, dtype=torch.long, device=m.device).index_add_(0, group_index, ok.long())
    return (count >= 2) & (vmax > vmin)


def trajectory_rewards(fragment_rewards: Sequence[Sequence[float]]) -> list[float]:
    """One reward per trajectory of a fan-out group, from the rewards its fragments carry.

    Args:
        fragment_rewards: per trajectory, the reward attached to each of its fragments (every
            fragment carries its trajectory's reward).

    Returns:
        `[len(fragment_rewards)]` rewards. Raises `ValueError` for an empty trajectory or
        fragments of one trajectory that disagree (NaN fragments must all be NaN).
    """
    out: list[float] = []
    for i, frags in enumerate(fragment_rewards):
        vals = [float(r) for r in frags]
        if not vals:
            raise ValueError(f"trajectory {i} has no fragments")
        first = vals[0]
        same = all((math.isnan(first) and math.isnan(v)) or v == first for v in vals)
        if not same:
            raise ValueError(f"fragments of trajectory {i} carry different rewards {vals}")
        out.append(first)
    return out


def keep_group(rewards: Sequence[float | None]) -> bool:
    """Keep decision for one group from one metric value per response or trajectory.

    None/NaN/inf = invalid. True iff >= 2 valid values and not all equal. Use with
    `trajectory_rewards` for fan-out groups.
    """
    vals = [float(r) for r in rewards if r is not None and math.isfinite(float(r))]
    return len(vals) >= 2 and max(vals) > min(vals)


def collect_groups(
    generate_batch: Callable[[int], list],
    *,
    train_batch_size: int,
    max_num_gen_batches: int,
    on_exhausted: str = "train_partial",
    ppo_mini_batch_size: int,
    dp_size: int = 1,
    enable: bool = True,
    keep_fn: Callable[[Any], bool],
    solve_rate_fn: Callable[[Any], float] | None = None,
    on_group: Callable[[Any, bool], None] | None = None,
) -> tuple[list, dict[str, int]]:
    """Draw generation batches until `train_batch_size` groups are kept.

    Args:
        generate_batch: `generate_batch(batch_idx)` -> list of completed groups for generation
            batch `batch_idx` (0, 1, ...); `data.gen_batch_size` groups each normally.
        train_batch_size: groups (prompts) needed.
        max_num_gen_batches: batch limit; `<= 0` means unlimited.
        on_exhausted: `"train_partial"` or `"error"` (see module docstring).
        ppo_mini_batch_size, dp_size: a partial batch is truncated to a multiple of their product.
        enable: False = no filtering: one generation batch, every group kept (truncated to
            `train_batch_size`).
        keep_fn: `keep_fn(group) -> bool`, e.g. `keep_group` on the group's acc values.
        solve_rate_fn: optional `group -> mean accuracy`; counts `solve_none` (0.0) and
            `solve_all` (1.0) over every generated group. Without it both are reported as 0.
        on_group: optional `on_group(group, kept)` called for every group generated, kept or
            not (e.g. to update the difficulty tracker, ALGORITHMS 2 and 4).

    Returns:
        `(kept, stats)`: kept groups in (batch, index) order; `stats` has `num_gen_batches`,
        `kept_groups` (after truncation), `solve_none`, `solve_all`, `generated_groups`.

    Raises:
        DynamicSamplingExhausted: the limit was hit and `on_exhausted="error"`, or fewer groups
            than `ppo_mini_batch_size * dp_size` were kept; the message names the numbers.
        ValueError: bad arguments, or `generate_batch` returned no groups.
    """
    if train_batch_size <= 0 or ppo_mini_batch_size <= 0 or dp_size <= 0:
        raise ValueError(
            f"train_batch_size, ppo_mini_batch_size and dp_size must be > 0; got {train_batch_size}, "
            f"{ppo_mini_batch_size}, {dp_size}"
        )
    if on_exhausted not in ON_EXHAUSTED:
        raise ValueError(f"filter_groups.on_exhausted must be one of {ON_EXHAUSTED}, got {on_exhausted!r}")
    kept: list = []
    stats = {"num_gen_batches": 0, "kept_groups": 0, "solve_none": 0, "solve_all": 0, "generated_groups": 0}
    batch_idx = 0
    while len(kept) < train_batch_size:
        if enable and max_num_gen_batches > 0 and batch_idx >= max_num_gen_batches:
            break
        groups = generate_batch(batch_idx)
        batch_idx += 1
        stats["num_gen_batches"] = batch_idx
        if not groups:
            raise ValueError(f"generate_batch({batch_idx - 1}) returned no groups")
        for g in groups:
            k = True if not enable else bool(keep_fn(g))
            stats["generated_groups"] += 1
            if solve_rate_fn is not None:
                rate = solve_rate_fn(g)
                stats["solve_none"] += int(rate == 0.0)
                stats["solve_all"] += int(rate == 1.0)
            if on_group is not None:
                on_group(g, k)
            if k:
                kept.append(g)
        if not enable:
            break
        if batch_idx % 10 == 0 and len(kept) < train_batch_size:
            logger.warning(
                "dynamic sampling: %d generation batches drawn, %d of %d groups kept so far "
                "(algorithm.filter_groups.max_num_gen_batches=%d%s)", batch_idx, len(kept), train_batch_size,
                max_num_gen_batches, ", unlimited" if max_num_gen_batches <= 0 else "")
    if len(kept) >= train_batch_size:
        kept = kept[:train_batch_size]
    elif enable:
        unit = ppo_mini_batch_size * dp_size
        usable = (len(kept) // unit) * unit
        where = (
            f"dynamic sampling kept {len(kept)} of the {train_batch_size} groups needed "
            f"(data.train_batch_size) after {stats['num_gen_batches']} generation batches "
            f"(algorithm.filter_groups.max_num_gen_batches={max_num_gen_batches})"
        )
        advice = (
            "raise algorithm.filter_groups.max_num_gen_batches (<= 0 = unlimited) or data.gen_batch_size, "
            "lower data.train_batch_size, sample with more diversity (rollout.temperature), "
            "or use data the policy can partly solve"
        )
        if on_exhausted == "error":
            raise DynamicSamplingExhausted(f"{where}; on_exhausted=error. To fix: {advice}")
        if usable < unit:
            raise DynamicSamplingExhausted(
                f"{where}, fewer than one mini-batch (actor.ppo_mini_batch_size={ppo_mini_batch_size} x "
                f"data-parallel size {dp_size} = {unit}). To fix: {advice}, or lower actor.ppo_mini_batch_size"
            )
        logger.warning("%s; training on %d groups (multiple of %d)", where, usable, unit)
        kept = kept[:usable]
    stats["kept_groups"] = len(kept)
    return kept, stats
