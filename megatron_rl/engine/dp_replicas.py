"""The vLLM stand-in's data-parallel replicas in the weight-transfer group (``--stand-in-data-parallel-size``).

A vLLM server started with ``--data-parallel-size N`` answers ``/get_world_size`` with TP x PP x N
and every worker of every replica joins the trainer's transfer group, replica ``d``'s rank ``r`` at
``rank_offset + d * TP * PP + r`` (``megatron_rl.weight_sync.ranks.engine_transfer_ranks``). The
stand-in has one model and one worker per replica (TP x PP = 1); with N > 1 it still joins the
group as N ranks, so the trainer's rank arithmetic and world size meet a receiver that counts
like vLLM: replica 0 is the ``UpdateSession``'s group (it loads the weights), replicas 1 .. N-1
are gloo members held here that receive every broadcast too, and each received tensor is
compared with what replica 0 loaded (a replica that received other bytes is an error, as one
holding other weights than its siblings would be in vLLM).

The replica members are plain ``ProcessGroupGloo`` backends on the same store keys as the group
``megatron_rl.weight_sync.group.init_custom_process_group`` makes (one process may register a
group name only once). Tests only need this; a real vLLM is not simulated beyond it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rl.weight_sync.buckets import dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["ReplicaMembers"]


def _run_all(fns: Sequence[Callable[[], object]], what: str, timeout_s: float) -> list[object]:
    """Run every ``fn`` in its own thread (a collective needs all of its ranks at once) and return
    their results in order. Raises RuntimeError naming ``what`` and the first failure."""
    results: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Callable[[], object]) -> None:
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), name=f"dp-replica-{i + 1}", daemon=True)
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what}: a data-parallel replica did not finish in {timeout_s + 30:.0f} s")
    if errors:
        raise RuntimeError(f"{what}: {errors[0]}") from errors[0]
    return results


class ReplicaMembers:
    """Replicas 1 .. ``dp_size - 1`` of the stand-in in the transfer group (replica 0 is the session's).

    Args:
        dp_size: data-parallel replicas the stand-in reports (>= 1; 1 holds no member here).
        timeout_s: rendezvous and collective timeout, seconds.

    Raises:
        ValueError: ``dp_size`` < 1.
    """

    def __init__(self, dp_size: int, timeout_s: float = 600.0) -> None:
        if dp_size < 1:
            raise ValueError(f"--stand-in-data-parallel-size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.timeout_s = timeout_s
        self.members: list[tuple[int, dist.ProcessGroup]] = []
        """(group rank, gloo backend) of replicas 1 .. dp_size - 1 while joined."""

    def start_join(self, *, host: str, port: int, world_size: int, ranks: Sequence[int],
                   group_name: str) -> Callable[[], None]:
        """Start joining the group at ``ranks`` (replica 1's rank first) in threads, and return the
        function that waits for them (call it after replica 0 has joined: the rendezvous needs every
        rank). Raises RuntimeError from that function when a member failed to join."""
        timeout = timedelta(seconds=self.timeout_s)

        def join(rank: int):
            store, _, _ = next(c10d.rendezvous(f"tcp://{host}:{int(port)}", rank, world_size, timeout=timeout))
            store.set_timeout(timeout)
            # the keys init_custom_process_group's group uses: PrefixStore(name) + the helper's
            # "name/" + the gloo backend's "cpu/"
            store = c10d.PrefixStore("cpu/", c10d.PrefixStore(f"{group_name}/", c10d.PrefixStore(group_name, store)))
            return rank, dist.ProcessGroupGloo(store, rank, world_size, timeout)

        box: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: box.update(result=self._gather([lambda r=r: join(r) for r in ranks], "joining the group")),
            name="dp-replicas-join", daemon=True)
        thread.start()

        def wait() -> None:
            thread.join(self.timeout_s + 60)
            result = box.get("result")
            if isinstance(result, BaseException):
                raise result
            if result is None:
                raise RuntimeError(f"data-parallel replicas did not join in {self.timeout_s + 60:.0f} s")
            self.members = list(result)  # type: ignore[arg-type]
            logger.info("stand-in data-parallel replicas joined the transfer group at ranks %s",
                        [r for r, _ in self.members])

        return wait

    def _gather(self, fns, what: str):
        try:
            return _run_all(fns, what, self.timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            return e

    def start_receive(self, names: Sequence[str], dtype_names: Sequence[str],
                      shapes: Sequence[Sequence[int]]) -> Callable[[Callable[[str], torch.Tensor | None]], None]:
        """Start receiving one ``/update_weights`` call's tensors (one broadcast each, in list order,
        as replica 0 does) on every member, in threads; returns ``check(loaded)``, which waits for
        them and compares each received tensor with ``loaded(name)`` (replica 0's weight, or None
        when it has no such name) after replica 0 has received and loaded.

        ``check`` raises RuntimeError when a member's receive failed or it received other values
        than replica 0 loaded (names the replica's rank and the tensors)."""
        dtypes = [dtype_from_name(d) for d in dtype_names]

        def receive(pg) -> list[torch.Tensor]:
            got = []
            for dtype, shape in zip(dtypes, shapes, strict=True):
                t = torch.empty([int(s) for s in shape], dtype=dtype)
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                pg.broadcast([t], opts).wait()
                got.append(t)
            return got

        box: dict[str, object] = {}
        fns = [lambda pg=pg: receive(pg) for _, pg in self.members]
        thread = threading.Thread(target=lambda: box.update(result=self._gather(fns, "receiving the weights")),
                                  name="dp-replicas-receive",
                                  daemon=True)
        thread.start()

        def check(loaded: Callable[[str], torch.Tensor | None]) -> None:
            thread.join(self.timeout_s + 60)
            result = box.get("result")
            if isinstance(result, BaseException):
                raise result
            if result is None:
                raise RuntimeError(f"data-parallel replicas did not receive in {self.timeout_s + 60:.0f} s")
            for (rank, _), got in zip(self.members, result, strict=True):  # type: ignore[arg-type]
                bad = [n for n, t in zip(names, got, strict=True)
                       if (ref := loaded(n)) is not None and ref.shape == t.shape and not torch.equal(ref.to(t.dtype), t)]
                if bad:
                    raise RuntimeError(f"data-parallel replica at transfer rank {rank} received other values than "
                                       f"replica 0 loaded for {bad[:5]}")

        return check

    def leave(self) -> None:
        """Forget the members (their gloo contexts close when dropped)."""
        self.members = []
