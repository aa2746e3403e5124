"""Ranks of a weight-transfer group, checked before any rank joins it.

The trainer is rank 0; engine *i* brings ``transfer_world_size()`` ranks (SGLang: its TP workers;
vLLM: TP x PP x DP) and joins at rank offset 1 + the ranks of the engines before it. Inside an
engine, vLLM's worker of data-parallel replica ``d`` and rank ``r`` within the replica (TP x PP
ranks a replica) joins at ``rank_offset + d * replica_world_size + r``
(``vllm/distributed/weight_transfer/nccl_engine.py``, ``init_transfer_engine``).

A wrong number anywhere (an engine that reports 0 ranks, one listed twice, an offset past the
world size) does not fail a rendezvous: it hangs it until the timeout, with no word of which engine
was wrong. Both sides therefore check the arithmetic first and fail at once, naming the engine and
the expected and actual numbers: the trainer (``plan_transfer_ranks``, raising ``WeightSyncError``)
and the engine stand-in (``engine_transfer_ranks``, answered as a refusal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.errors import WeightSyncError

__all__ = ["TransferRanks", "engine_transfer_ranks", "plan_transfer_ranks"]


@dataclass(frozen=True)
class TransferRanks:
    """Where every engine joins the transfer group.

    Attributes:
        offsets: rank offset of each engine, in the order given (the first is 1).
        sizes: ranks of each engine.
        world_size: 1 (the trainer) + the sum of ``sizes``.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int


def plan_transfer_ranks(engines: Sequence[tuple[str, object]]) -> TransferRanks:
    """Rank offsets and world size of a group over ``engines``: (URL, reported ranks) pairs.

    Raises:
        WeightSyncError: no engine; an engine listed twice (it would join twice and the rendezvous
            would wait for ranks that never come); a reported size that is not a whole number >= 1
            (names the engine, what it reported and what was expected).
    """
    if not engines:
        raise WeightSyncError("a weight-transfer group needs at least one engine")
    seen: set[str] = set()
    sizes: list[int] = []
    for url, size in engines:
        if url in seen:
            raise WeightSyncError(f"{url} is listed twice among the engines of the weight-transfer group: it would join "
                                  "twice and the rendezvous would wait for ranks that never come")
        seen.add(url)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise WeightSyncError(f"{url} reports {size!r} weight-transfer ranks (transfer_world_size): expected a "
                                  "whole number >= 1 (its TP x PP x DP workers)")
        sizes.append(size)
    offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]  # contiguous by construction
    world_size = 1 + sum(sizes)
    return TransferRanks(offsets=tuple(offsets), sizes=tuple(sizes), world_size=world_size)


def engine_transfer_ranks(rank_offset: int, world_size: int, *, replica_world_size: int, dp_size: int,
                          engine: str = "the engine") -> list[int]:
    """The group ranks of an engine's workers, in order (replica 0's first), vLLM's arithmetic:
    ``rank_offset + d * replica_world_size + r`` for replica ``d`` < ``dp_size`` and ``r`` <
    ``replica_world_size`` (TP x PP).

    Raises:
        ValueError: sizes < 1; ``rank_offset`` < 1 (rank 0 is the trainer's); or the engine's last
            rank is past ``world_size - 1`` (names ``engine``, the ranks it needs and the world size
            it was given: the trainer counted fewer ranks for it than it has).
    """
    if replica_world_size < 1 or dp_size < 1:
        raise ValueError(f"{engine}: replica_world_size and dp_size must be >= 1, got {replica_world_size}, {dp_size}")
    if rank_offset < 1:
        raise ValueError(f"{engine}: rank_offset {rank_offset} < 1: rank 0 of the transfer group is the trainer's")
    need = replica_world_size * dp_size
    if rank_offset + need > world_size:
        raise ValueError(f"{engine} has {need} transfer ranks (TP x PP {replica_world_size} x DP {dp_size}): at rank "
                         f"offset {rank_offset} it needs a group of at least {rank_offset + need} ranks, got world_size "
                         f"{world_size} (the trainer counted fewer ranks for it than /get_world_size reports?)")
    return [rank_offset + d * replica_world_size + r for d in range(dp_size) for r in range(replica_world_size)]
