"""The weight-update process group, built the way SGLang 0.5.23 builds its side.

SGLang's ``init_custom_process_group`` (in ``sglang.srt.utils``) creates a process group that
is *not* the default group, so that a trainer rank that already has its own world (torchrun)
and an unrelated inference process can share a second, private group:

1. rendezvous on ``tcp://host:port``: rank 0 hosts a ``TCPStore``, the others connect;
2. ``PrefixStore(group_name, store)`` so that keys cannot collide with other users of the store;
3. ``torch.distributed.distributed_c10d._new_process_group_helper(world_size, rank, [], backend,
   store, group_name=..., backend_options=None, timeout=...)`` (it adds its own
   ``group_name/`` prefix);
4. ``_world.pg_group_ranks[pg] = {i: i}``, so that ``broadcast(src=0, group=pg)`` maps rank 0 of
   the group, whatever the caller's global rank.

Both the trainer (rank 0) and the embedded server (``rank_offset + tp_rank``) use this module,
so the same trainer code works against SGLang and against the embedded server.
``_new_process_group_helper`` is private torch API: its signature is checked at call time and
a clear error names the torch version when it changes (tested with torch 2.14.1).
"""

from __future__ import annotations

import inspect
import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rl.versions import check_torch_version

logger = logging.getLogger(__name__)

__all__ = ["destroy_custom_process_group", "init_custom_process_group", "release_in_background"]

#: Parameters of ``_new_process_group_helper`` this module passes (torch 2.6 renamed
#: ``pg_options`` to ``backend_options``; SGLang switches on the version the same way).
_REQUIRED_HELPER_PARAMS = (
    "group_size",
    "group_rank",
    "global_ranks_in_group",
    "backend",
    "store",
    "group_name",
    "timeout",
)


def _options_param_name() -> str:
    params = inspect.signature(c10d._new_process_group_helper).parameters
    missing = [p for p in _REQUIRED_HELPER_PARAMS if p not in params]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}: distributed_c10d._new_process_group_helper lacks {missing}; "
            "megatron_rl.weight_sync.group was written for torch >=2.6.0,<3 (tested 2.6 and 2.14) and must be updated"
        )
    if "backend_options" in params:
        return "backend_options"
    if "pg_options" in params:
        return "pg_options"
    raise RuntimeError(
        f"torch {torch.__version__}: _new_process_group_helper takes neither backend_options nor pg_options"
    )


def init_custom_process_group(
    *,
    backend: str = "gloo",
    init_method: str | None = None,
    host: str | None = None,
    port: int | None = None,
    world_size: int,
    rank: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Create (join) a private process group outside the default world (SGLang's recipe).

    Blocks until all ``world_size`` ranks have joined the rendezvous or ``timeout_s`` passes.

    Args:
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"``.
        init_method: ``"tcp://host:port"``; or give ``host`` and ``port`` instead.
        world_size: 1 (trainer) + the servers' TP ranks.
        rank: 0 for the trainer (hosts the TCPStore); ``rank_offset + tp_rank`` for servers.
        group_name: unique within this process; the store prefix and the group's registered name.
        timeout_s: rendezvous timeout and the timeout of every collective on the group.

    Returns:
        The process group; use it as ``group=`` with ``src=0`` for broadcasts.

    Raises:
        ValueError: bad arguments, or ``group_name`` is already registered in this process.
        RuntimeError / DistStoreError: the rendezvous timed out or failed; a torch outside the
            supported range (`megatron_rl.versions`: >=2.6.0,<3).
    """
    check_torch_version(__name__)  # uses the private _new_process_group_helper
    if init_method is None:
        if host is None or port is None:
            raise ValueError("give init_method='tcp://host:port' or both host and port")
        init_method = f"tcp://{host}:{int(port)}"
    elif host is not None or port is not None:
        raise ValueError("give either init_method or host/port, not both")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got world_size={world_size}, rank={rank}")
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    timeout = timedelta(seconds=timeout_s)
    options_name = _options_param_name()

    logger.info(
        "joining process group %r as rank %d/%d via %s (%s)", group_name, rank, world_size, init_method, backend
    )
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options_name: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    logger.info("process group %r ready (rank %d/%d)", group_name, rank, world_size)
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    """Destroy a group made by ``init_custom_process_group`` and free its name for re-use.

    Leaves the default process group (if any) alone.
    """
    dist.destroy_process_group(pg)


def release_in_background(box: list) -> None:
    """Empty ``box`` (a list holding a destroyed process group whose broadcasts never completed, and
    their ``dist.Work`` handles) on a daemon thread, so that the last references drop there.

    Gloo's ``ProcessGroupGloo`` destructor waits for its pending work: after a server refused a
    bucket, the trainer's sends of that bucket wait for a receiver that never comes, until the
    group's timeout (``rollout.timeout_s``, 600 s) or until the server leaves its side of the group
    (its next ``/init_weight_transfer_engine``, or its exit). Found live against vLLM (issue 30): the
    sync's retry, which re-creates the group, hung in that destructor before it could ask the
    servers to re-join, and a run that then stopped hung at exit. A daemon thread takes the wait
    instead (``dist.destroy_process_group`` already freed the group's name), and is abandoned if the
    process exits first. The caller must hold no other reference than ``box`` (``del`` its locals first).
    """
    threading.Thread(target=box.clear, name="release-weight-update-group", daemon=True).start()
