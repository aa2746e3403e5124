"""Which node of the job this process is on (torchrun's environment) and the address other
nodes reach it at; used by colocated runs on several nodes (issue 17: engines on every trainer
node, each node's local rank 0 starts and feeds its own engines).

Imports only the standard library.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["NodeInfo", "node_address", "node_info"]


@dataclass(frozen=True)
class NodeInfo:
    """This process's place: `node_rank` of `nnodes` nodes, `local_rank` of `local_world_size`
    ranks on this node. A plain process (not under torchrun) is node 0 of 1, local rank 0."""

    node_rank: int
    nnodes: int
    local_rank: int
    local_world_size: int

    @property
    def is_leader(self) -> bool:
        """Local rank 0: starts this node's colocated engines and hands them the weights."""
        return self.local_rank == 0


def node_info(environ=None) -> NodeInfo:
    """`NodeInfo` from torchrun's variables (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `LOCAL_RANK`,
    `GROUP_RANK`, or `RANK // LOCAL_WORLD_SIZE` without `GROUP_RANK`).

    Raises:
        ValueError: `WORLD_SIZE` is not a multiple of `LOCAL_WORLD_SIZE` (nodes of unequal size).
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return NodeInfo(0, 1, 0, 1)
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if local_world <= 0 or world % local_world:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}: every node must "
                         "run the same number of trainer ranks")
    rank = int(env.get("RANK", 0))
    node = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else rank // local_world
    return NodeInfo(node, world // local_world, int(env.get("LOCAL_RANK", rank % local_world)), local_world)


def node_address(peer: str) -> str:
    """The address of this host on the interface that routes to `peer` (the head node,
    `MASTER_ADDR`): what other nodes use to reach servers bound here to 0.0.0.0. A UDP socket's
    `connect` picks the route without sending anything. Falls back to the host name's address."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
