"""Per-token log-probs and entropy over a tensor-parallel (vocabulary-sharded) output layer.

log p(label) comes from megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``
(negated). Entropy over a sharded vocabulary is not in megatron-core; with m the global max
logit (all-reduce MAX), Z = sum_v exp(x_v - m) and W = sum_v exp(x_v - m) (x_v - m) (both
all-reduced SUM over the TP group), H = log Z - W / Z. Vocabulary rows added by padding
(index >= vocab_size) are excluded from both. The [B, S, V] tensor is never gathered.

Gradients follow megatron's TP convention: every TP rank computes the same loss from the
reduced values, and the backward of the reductions is the identity.

Layout: megatron-core is sequence-first inside (``[S, B, h]``); GPTModel converts at its
embedding and output layer, so :func:`forward_logits` (the one place the trainer calls the
model for logits) sees batch-first ``[B, S, V/tp]`` in and out.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _vocab_shard(tp_group) -> tuple[int, int]:
    import torch.distributed as dist

    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _reduce(tensor: torch.Tensor, tp_group, op=None) -> torch.Tensor:
    """All-reduce over the TP group; SUM is differentiable (identity backward), MAX is not."""
    import torch.distributed as dist

    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return tensor
    if op is None:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(tensor, group=tp_group)
    dist.all_reduce(tensor, op=op, group=tp_group)
    return tensor


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and the entropy of each next-token distribution.

    Args:
        logits: [B, S, V/tp] float (any float dtype; computed in float32), this rank's
            contiguous vocabulary shard of the (padded) output layer; position s predicts
            token s+1, i.e. ``labels`` are the inputs shifted left by the caller.
        labels: [B, S] long, token ids in [0, vocab_size). Positions that are not trained must
            still hold a valid id (e.g. 0) and be dropped later with ``loss_mask``.
        vocab_size: unpadded vocabulary size V; logits at indices >= V (padding) are excluded.
        tp_group: tensor-parallel group over which the vocabulary is sharded. None means the
            logits hold the whole vocabulary (single process, no collectives).

    Returns:
        ``(logprobs, entropy)``, each [B, S] float32. Differentiable w.r.t. ``logits``.

    Raises:
        ValueError: shapes disagree, or ``vocab_size`` is out of range for the sharded logits.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, S, V/tp] and labels [B, S], got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    tp_rank, tp_size = _vocab_shard(tp_group)
    local_vocab = logits.shape[-1]
    if not 0 < vocab_size <= local_vocab * tp_size:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {local_vocab * tp_size}] (padded vocabulary)")
    vocab_start = tp_rank * local_vocab
    num_valid = max(0, min(local_vocab, vocab_size - vocab_start))  # padding sits at the end

    logits = logits.float()  # [B, S, V/tp]
    if num_valid < local_vocab:
        padded = torch.arange(local_vocab, device=logits.device) >= num_valid
        # masked_fill returns a copy; megatron's cross entropy edits its input in place.
        masked = logits.masked_fill(padded, float("-inf"))
    else:
        masked = logits.clone()
    if tp_group is None:
        # One shard: the same quantity as megatron's kernel (log Z - x_label) without collectives.
        logprobs = torch.gather(torch.log_softmax(masked, dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)
    else:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logprobs = -vocab_parallel_cross_entropy(masked, labels, tp_group=tp_group)

    # Entropy on the valid slice only: no -inf, so no 0 * inf in forward or backward.
    valid = logits[..., :num_valid]  # [B, S, num_valid]
    if num_valid > 0:
        local_max = valid.detach().amax(dim=-1)
    else:
        local_max = logits.new_full(logits.shape[:2], float("-inf"))
    import torch.distributed as dist

    global_max = _reduce(local_max, tp_group, op=dist.ReduceOp.MAX)  # [B, S], constant shift
    shifted = valid - global_max.unsqueeze(-1)
    exp = torch.exp(shifted)
    sum_exp = _reduce(exp.sum(dim=-1), tp_group)  # [B, S]
    sum_exp_x = _reduce((exp * shifted).sum(dim=-1), tp_group)  # [B, S]
    entropy = torch.log(sum_exp) - sum_exp_x / sum_exp
    return logprobs.float(), entropy.float()


def forward_logits(
    model,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    packed_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run a GPTModel (one full pipeline, pre and post process) and return its logits shard.

    Batches must be right-padded: with causal attention no real token attends to a pad that
    follows it, so no attention mask is passed to megatron (its local spec builds the causal
    mask itself only when the mask is None; a given mask replaces the causal one).

    Args:
        model: megatron-core ``GPTModel`` (optionally DDP-wrapped), ``parallel_output=True``.
        input_ids: [B, S] long token ids, right-padded.
        position_ids: [B, S] long; default ``arange(S)`` for every row.
        attention_mask: optional [B, S] (bool or int, 1/True = real token); only checked to be
            right-padding, never passed down.
        packed_mask: optional [B, 1, S, S] bool, True = masked: packed rows
            (`trainer.batch.pack_sequences`), passed to the model in place of its causal mask.

    Returns:
        logits: [B, S, V_padded / tp] in the model's compute dtype; position s scores token s+1.
        Layout: megatron works sequence-first ([S, B, h]); GPTModel transposes at its
        embedding and output layer, so no conversion happens here.

    Raises:
        ValueError: ``input_ids`` not 2-D, shapes disagree, or the mask is not right-padding.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {tuple(input_ids.shape)}")
    batch, seq = input_ids.shape
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        mask = attention_mask.bool()
        # Right padding <=> the mask never goes from 0 back to 1 along S.
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError("attention_mask is not right-padded (a real token follows a pad)")
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)  # [B, S]
    if packed_mask is not None and tuple(packed_mask.shape) != (batch, 1, seq, seq):
        raise ValueError(f"packed_mask must be [B, 1, S, S] = {(batch, 1, seq, seq)}, got {tuple(packed_mask.shape)}")
    return model(input_ids, position_ids, packed_mask)  # [B, S, V/tp]
