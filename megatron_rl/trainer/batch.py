"""Packing rollout samples into padded training tensors (the one place that fixes the layout).

Layout: each sequence is `prompt_ids + response_ids`, right-padded to a common length S. The
model reads positions 0..S-1; position p predicts token p+1, so every per-token tensor here is
indexed by the *predicting* position: response token k of a sequence whose prompt has P tokens
sits at input position P+k and is predicted at position P+k-1. Right padding with a causal mask
means real tokens never attend to padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


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
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

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
            ref_logprobs=s(self.ref_logprobs),
        )

    def micro_batches(self, micro_batch_size: int) -> Iterator["TrainBatch"]:
        """Consecutive micro-batches of at most `micro_batch_size` sequences."""
        for start in range(0, len(self), micro_batch_size):
            yield self.slice(start, min(start + micro_batch_size, len(self)))


def build_train_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    advantages: Sequence[float],
    rollout_logprobs: Sequence[Sequence[float]],
    trained: Sequence[bool],
    pad_id: int,
    pad_to_multiple_of: int = 1,
) -> TrainBatch:
    """Pack N (prompt, response) pairs into a right-padded `TrainBatch`.

    Args:
        prompt_ids / response_ids: N token lists; responses keep their EOS token.
        advantages: N floats.
        rollout_logprobs: N lists, one log-prob per response token.
        trained: N bools; False zeroes the sequence's loss mask (failed reward, overlong filter).
        pad_id: padding token id.
        pad_to_multiple_of: S is rounded up to a multiple of this (sequence parallelism needs TP).

    Raises:
        ValueError: lengths of a response and its log-probs differ, or an empty prompt.
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
        seq = list(p) + list(r)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:], dtype=torch.long)
        if r:
            lo, hi = len(p) - 1, len(p) - 1 + len(r)
            loss_mask[i, lo:hi] = bool(keep)
            rlp[i, lo:hi] = torch.tensor(lp, dtype=torch.float32)
    position_ids = torch.arange(s_len, dtype=torch.long).unsqueeze(0).expand(n, s_len).contiguous()
    return TrainBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
        rollout_logprobs=rlp,
    )
