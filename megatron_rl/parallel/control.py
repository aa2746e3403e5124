"""The controller's channel to every trainer rank: picklable objects broadcast from global rank 0.

Rank 0 (the controller) alone talks to the rollout engines and builds each step's batch; the
other ranks wait on this channel for what to do next: a `TrainBatch` to train on, a weight-sync
plan to take part in (`megatron_rl.weight_sync.publisher.SyncPlan`), `PhaseDone` at the end of a
phase only the controller works in (an evaluation), or `ControllerFailed`, which
they raise so that no rank waits for a batch that will never come.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ControllerFailed", "PhaseDone", "broadcast_object", "gather_objects", "send_to_ranks",
           "receive_from_controller"]


@dataclass(frozen=True)
class ControllerFailed:
    """The controller stopped with an error; every other rank raises `RuntimeError(text)`."""

    text: str


@dataclass(frozen=True)
class PhaseDone:
    """The controller finished a phase the other ranks wait through (an evaluation, `name`)."""

    name: str


def broadcast_object(obj, *, src: int, world_size: int):
    """`obj` from global rank `src` to every rank of the default group (all ranks call it); the
    object itself on a world of one. Returns what `src` sent."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, *, world_size: int) -> list:
    """Every rank's `obj`, by global rank, on every rank of the default group (all ranks call it);
    `[obj]` on a world of one."""
    if world_size == 1:
        return [obj]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, obj)
    return everyone


def send_to_ranks(obj, pgs) -> None:
    """Controller side of the channel (global rank 0)."""
    broadcast_object(obj, src=0, world_size=pgs.world_size)


def receive_from_controller(pgs):
    """Other ranks: the controller's next object.

    Raises:
        RuntimeError: the controller sent `ControllerFailed` (its error is in the message).
    """
    obj = broadcast_object(None, src=0, world_size=pgs.world_size)
    if isinstance(obj, ControllerFailed):
        raise RuntimeError(f"the controller (rank 0) stopped: {obj.text}")
    return obj
