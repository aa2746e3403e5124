"""Packing rollout samples into padded training tensors (the one place that fixes the layout).

Layout: each sequence is `prompt_ids + response_ids`, right-padded to a common length S. The
model reads positions 0..S-1; position p predicts token p+1, so every per-token tensor here is
indexed by the *predicting* position: response token k of a sequence whose prompt has P tokens
sits at input position P+k and is predicted at position P+k-1. Right padding with a causal mask
means real tokens never attend to padding.

Micro-batches are cut either by a sequence count (`actor.ppo_micro_batch_size`) or by a token
budget (`actor.max_tokens_per_micro_batch`, see `split_by_token_budget`). With
`actor.sequence_packing` a micro-batch is run packed (`pack_sequences`): several sequences per row,
kept apart by a block-diagonal causal mask, and the per-token results are unpacked back to this
layout, so everything after the forward pass is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from megatron_rl.trainer.routed_rows import RoutedRows


@dataclass
class TrainBatch:
    """All sequences of one RL step (or one mini-batch / micro-batch of it).

    Attributes:
        input_ids: [N, S] int64, right-padded with `pad_id`.
        position_ids: [N, S] int64, 0..S-1.
        labels: [N, S] int64, `input_ids` shifted left by one (last column = pad).
        loss_mask: [N, S] bool, True on positions that predict a trained response token.
        advantages: [N] float32, one scalar per sequence (outcome level).
        rollout_logprobs: [N, S] float32, server log-probs at the predicting positions (0 elsewhere).
        old_logprobs: [N, S] float32 or None, trainer recompute before the first update.
        ref_logprobs: [N, S] float32 or None, reference policy (only with a KL loss).
        seq_lengths: [N] int64 or None, real tokens of each row (prompt + response); set by
            `build_train_batch`, needed by the token-budget split.
        pad_multiple: S and every trimmed width are multiples of this (TP under sequence parallelism).
        routed_experts: `trainer.routed_rows.RoutedRows` or None: for rollout routing replay (MoE),
            per row the experts the engine routed each of its first T_i positions to in every MoE
            layer (ALGORITHMS.md section 9), int16 and unpadded; on the controller every row, on a
            rank after `routed_rows.hand_out` the rows and layers it trains.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    seq_lengths: torch.Tensor | None = None
    pad_multiple: int = 1
    packing: "PackedRows | None" = None
    """Set on a micro-batch that runs packed (`pack_sequences`); never carried by `slice`/`select`."""
    routed_experts: "RoutedRows | None" = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, end: int) -> "TrainBatch":
        """Rows [start, end) of every tensor."""
        def s(t):
            return None if t is None else t[start:end]

        return TrainBatch(
            input_ids=s(self.input_ids), position_ids=s(self.position_ids), labels=s(self.labels),
            loss_mask=s(self.loss_mask), advantages=s(self.advantages),
            rollout_logprobs=s(self.rollout_logprobs), old_logprobs=s(self.old_logprobs),
            ref_logprobs=s(self.ref_logprobs), seq_lengths=s(self.seq_lengths), pad_multiple=self.pad_multiple,
            routed_experts=None if self.routed_experts is None else self.routed_experts.slice(start, end),
        )

    def select(self, rows: Sequence[int], width: int | None = None) -> "TrainBatch":
        """Rows `rows` (in that order) of every tensor, the per-token ones cut to the first `width`
        columns (None = all S). Cutting only removes right padding when `width` is at least the
        longest selected row: with a causal mask the kept positions compute the same values.

        Raises:
            ValueError: `width` is shorter than a selected row, or not a multiple of `pad_multiple`.
        """
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        if width is not None:
            if width % self.pad_multiple:
                raise ValueError(f"width {width} is not a multiple of pad_multiple {self.pad_multiple}")
            if self.seq_lengths is not None and len(idx) and int(self.seq_lengths[idx].max()) > width:
                raise ValueError(f"width {width} would cut a row of {int(self.seq_lengths[idx].max())} tokens")

        def s(t, per_token=True):
            if t is None:
                return None
            t = t.index_select(0, idx)
            return t[:, :width].contiguous() if per_token and width is not None else t

        return TrainBatch(
            input_ids=s(self.input_ids), position_ids=s(self.position_ids), labels=s(self.labels),
            loss_mask=s(self.loss_mask), advantages=s(self.advantages, False),
            rollout_logprobs=s(self.rollout_logprobs), old_logprobs=s(self.old_logprobs),
            ref_logprobs=s(self.ref_logprobs), seq_lengths=s(self.seq_lengths, False),
            pad_multiple=self.pad_multiple,
            routed_experts=None if self.routed_experts is None else self.routed_experts.select(idx.tolist()),
        )

    def for_broadcast(self) -> "TrainBatch":
        """This batch as the controller broadcasts it: the routing's rows left out (each rank gets
        its own share by `routed_rows.hand_out`); the same object when there is no routing."""
        if self.routed_experts is None:
            return self
        return dataclasses.replace(self, routed_experts=self.routed_experts.stripped())

    def micro_batches(self, micro_batch_size: int) -> Iterator["TrainBatch"]:
        """Consecutive micro-batches of at most `micro_batch_size` sequences."""
        for start in range(0, len(self), micro_batch_size):
            yield self.slice(start, min(start + micro_batch_size, len(self)))

    def token_budget_micro_batches(self, max_tokens: int, *, min_micro_batches: int = 0
                                   ) -> list[tuple[list[int], "TrainBatch"]]:
        """Micro-batches under a token budget: (row indices, micro-batch cut to its own padded
        width) pairs, from `split_by_token_budget` (at least `min_micro_batches` of them). Raises
        its `ValueError`s."""
        if self.seq_lengths is None:
            raise ValueError("token-budget micro-batches need seq_lengths (build the batch with build_train_batch)")
        plan = split_by_token_budget(self.seq_lengths.tolist(), max_tokens, pad_multiple=self.pad_multiple,
                                     min_micro_batches=min_micro_batches)
        return [(rows, self.select(rows, width=width)) for rows, width in plan]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class PackedRows:
    """A micro-batch's N sequences packed R to a row with no padding between them.

    Attributes:
        input_ids: [R, L] int64; a row holds whole sequences back to back, then `pad`.
        position_ids: [R, L] int64, restarting at 0 at each sequence.
        labels: [R, L] int64, each sequence's labels (next tokens) at its positions.
        attention_mask: [R, 1, L, L] bool, True = masked (megatron-core's convention): a position
            attends only to earlier positions of its own sequence (block-diagonal causal).
        index: [N, S] int64, the flat position (r * L + column) in the packed rows of each
            position of the unpacked micro-batch; padding positions point at 0 (their values are
            never trained: the loss mask is 0 there).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[R, L, ...] per packed position -> [N, S, ...] per position of the unpacked micro-batch
        (a gather: differentiable, gradients flow back to the packed positions)."""
        flat = packed.reshape(-1, *packed.shape[2:])
        return flat[self.index.reshape(-1)].reshape(*self.index.shape, *packed.shape[2:])


def pack_sequences(mb: TrainBatch, *, width: int | None = None) -> PackedRows:
    """Pack a right-padded micro-batch's sequences several to a row (first-fit, longest first).

    A row holds up to `width` tokens (default: 1.5 x the longest sequence, rounded up to
    `mb.pad_multiple`: the fastest of 1.2x, 1.3x, 1.5x and 2x on the tiny model on CPU, where the
    mask makes the attention cost grow with the row); rows are then cut to the longest fill. With the block-diagonal causal mask every token
    sees exactly the tokens it sees unpacked. megatron-core's rotary embedding numbers positions
    0..L-1 along the packed row (it does not read `position_ids`), which changes no attention
    score in exact arithmetic (rotary scores depend only on the distance between two positions of
    one sequence); in float32 the logits move by ~1e-5 (benchmarks/README.md, "Where megatron-rl's
    step goes").

    Raises:
        ValueError: `mb` has no `seq_lengths`, or `width` is shorter than a sequence.
    """
    if mb.seq_lengths is None:
        raise ValueError("sequence packing needs seq_lengths (build the batch with build_train_batch)")
    lengths = [max(int(x), 1) for x in mb.seq_lengths.tolist()]
    longest = max(lengths)
    width = _round_up(width or (3 * longest + 1) // 2, mb.pad_multiple)
    if width < longest:
        raise ValueError(f"packing width {width} < the longest sequence ({longest} tokens)")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((k for k, used in enumerate(fill) if used + lengths[i] <= width), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += lengths[i]
    n, s = mb.input_ids.shape
    cols = _round_up(max(fill), mb.pad_multiple)
    input_ids = torch.zeros(len(rows), cols, dtype=torch.long)  # (R, L)
    labels = torch.zeros(len(rows), cols, dtype=torch.long)  # (R, L)
    position_ids = torch.zeros(len(rows), cols, dtype=torch.long)  # (R, L)
    mask = torch.ones(len(rows), 1, cols, cols, dtype=torch.bool)  # (R, 1, L, L)
    future = torch.ones(cols, cols, dtype=torch.bool).triu(1)  # (L, L) True above the diagonal
    index = torch.zeros(n, s, dtype=torch.long)  # (N, S)
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            ln = lengths[i]
            input_ids[r, off:off + ln] = mb.input_ids[i, :ln]
            labels[r, off:off + ln] = mb.labels[i, :ln]
            position_ids[r, off:off + ln] = torch.arange(ln)
            mask[r, 0, off:off + ln, off:off + ln] = future[:ln, :ln]
            index[i, :ln] = torch.arange(r * cols + off, r * cols + off + ln)
            off += ln
    return PackedRows(input_ids=input_ids, position_ids=position_ids, labels=labels, attention_mask=mask, index=index)


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, *, pad_multiple: int = 1,
                          min_micro_batches: int = 0) -> list[tuple[list[int], int]]:
    """Partition rows into micro-batches whose *padded* size stays within `max_tokens`.

    The cost of a micro-batch is what the model really processes: rows x its padded width, the
    width being its longest row (prompt + response tokens) rounded up to `pad_multiple` (TP under
    sequence parallelism); the micro-batch is cut to that width, so shorter micro-batches carry no
    padding of the longest row in the mini-batch. (verl's `ppo_max_token_len_per_gpu` counts
    unpadded tokens because verl packs sequences without padding; this trainer pads, so the
    padded count is the one that bounds activation memory.)

    Rows are taken longest first (ties by index) and added to the current micro-batch while
    (rows + 1) x width <= max_tokens, which keeps the padding small. Which rows share a
    micro-batch does not change the mini-batch gradient: the loss normaliser is global
    (ALGORITHMS.md section 6).

    With `min_micro_batches`, the micro-batch with the most rows (the first of equals) is halved
    until there are that many: ranks whose forward passes run collectives together (the MoE token
    dispatcher over an expert-parallel group spanning data-parallel ranks) must run the same number
    of micro-batches, and halving only lowers each one's padded size.

    Args:
        lengths: real tokens of each row (prompt + response).
        max_tokens: the budget (`actor.max_tokens_per_micro_batch`).
        pad_multiple: widths are rounded up to a multiple of this.
        min_micro_batches: the fewest micro-batches to return (0 = as the budget packs them).

    Returns:
        (row indices, width) per micro-batch, in processing order; every row appears once.

    Raises:
        ValueError: a row alone exceeds the budget (the message names the key and the row),
            `max_tokens` is not positive, or `min_micro_batches` exceeds the rows.
    """
    if max_tokens <= 0:
        raise ValueError(f"actor.max_tokens_per_micro_batch: {max_tokens!r} must be > 0")
    if min_micro_batches > len(lengths):
        raise ValueError(f"{min_micro_batches} micro-batches asked of {len(lengths)} rows: each needs at least one row")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    plan: list[tuple[list[int], int]] = []
    for i in order:
        width = _round_up(max(int(lengths[i]), 1), pad_multiple)
        if width > max_tokens:
            raise ValueError(
                f"actor.max_tokens_per_micro_batch ({max_tokens}) is smaller than one sequence: row {i} has "
                f"{int(lengths[i])} tokens (prompt + response{f', padded to {width}' if width != lengths[i] else ''}); "
                "set it to at least data.max_prompt_length + data.max_response_length"
            )
        if plan and (len(plan[-1][0]) + 1) * plan[-1][1] <= max_tokens:
            plan[-1][0].append(i)  # rows come longest first: the micro-batch's width is unchanged
        else:
            plan.append(([i], width))
    while len(plan) < min_micro_batches:
        j = max(range(len(plan)), key=lambda k: (len(plan[k][0]), -k))
        rows, width = plan[j]
        half = (len(rows) + 1) // 2  # rows are longest first: the first half keeps the width
        rest = rows[half:]
        plan[j: j + 1] = [(rows[:half], width), (rest, _round_up(max(max(int(lengths[i]) for i in rest), 1), pad_multiple))]
    return plan


def build_train_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    advantages: Sequence[float],
    rollout_logprobs: Sequence[Sequence[float]],
    trained: Sequence[bool],
    pad_id: int,
    pad_to_multiple_of: int = 1,
    routed_experts: Sequence[Any] | None = None,
    response_masks: Sequence[Sequence[bool] | None] | None = None,
) -> TrainBatch:
    """Pack N (prompt, response) pairs into a right-padded `TrainBatch`.

    Args:
        prompt_ids / response_ids: N token lists; responses keep their EOS token.
        advantages: N floats.
        rollout_logprobs: N lists, one log-prob per response token.
        trained: N bools; False zeroes the sequence's loss mask (failed reward, overlong filter).
        pad_id: padding token id.
        pad_to_multiple_of: S is rounded up to a multiple of this (sequence parallelism needs TP).
        routed_experts: None, or N arrays (numpy or torch, any int dtype) of shape [T_i, L, K]:
            the experts the engine routed each of the first T_i positions of prompt + response to
            (T_i <= len(prompt) + len(response); the engine routes every token it processed, so
            usually all but the last). Becomes `TrainBatch.routed_experts` (`RoutedRows`).
        response_masks: None, or N entries, each None (every response token trained) or one bool
            per response token: False on tokens the model did not write (a multi-turn episode's
            tool answers and template tokens), which leave the loss mask.

    Raises:
        ValueError: lengths of a response and its log-probs differ, an empty prompt, or routing
            data that is longer than its sequence or has another [L, K] than the others (names the row).
    """
    n = len(prompt_ids)
    if not (len(response_ids) == len(advantages) == len(rollout_logprobs) == len(trained) == n):
        raise ValueError("build_train_batch: all per-sequence inputs must have the same length")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    s_len = max(lengths)
    s_len = -(-s_len // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((n, s_len), pad_id, dtype=torch.long)  # (N, S)
    labels = torch.full((n, s_len), pad_id, dtype=torch.long)  # (N, S)
    loss_mask = torch.zeros((n, s_len), dtype=torch.bool)  # (N, S)
    rlp = torch.zeros((n, s_len), dtype=torch.float32)  # (N, S)
    for i, (p, r, lp, keep) in enumerate(zip(prompt_ids, response_ids, rollout_logprobs, trained)):
        if len(p) == 0:
            raise ValueError(f"sequence {i}: empty prompt")
        if len(lp) != len(r):
            raise ValueError(f"sequence {i}: {len(r)} response tokens but {len(lp)} rollout log-probs")
        rm = None if response_masks is None else response_masks[i]
        if rm is not None and len(rm) != len(r):
            raise ValueError(f"sequence {i}: {len(r)} response tokens but a response mask of {len(rm)}")
        seq = list(p) + list(r)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:], dtype=torch.long)
        if r:
            lo, hi = len(p) - 1, len(p) - 1 + len(r)
            loss_mask[i, lo:hi] = bool(keep) if rm is None else torch.tensor(list(rm), dtype=torch.bool) & bool(keep)
            rlp[i, lo:hi] = torch.tensor(lp, dtype=torch.float32)
    position_ids = torch.arange(s_len, dtype=torch.long).unsqueeze(0).expand(n, s_len).contiguous()
    routed = None if routed_experts is None else RoutedRows.from_samples(routed_experts, lengths)
    return TrainBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
        rollout_logprobs=rlp,
        seq_lengths=torch.tensor(lengths, dtype=torch.long),
        pad_multiple=pad_to_multiple_of,
        routed_experts=routed,
    )

