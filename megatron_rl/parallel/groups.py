"""Process groups: the one place that initialises megatron-core's parallel state and reads it.

:func:`initialize_parallel` starts ``torch.distributed`` (from torchrun's environment) if needed,
calls ``parallel_state.initialize_model_parallel`` and seeds megatron-core's RNG tracker, then
returns a frozen :class:`ProcessGroups` value that callers pass to every function that
communicates. No other module calls ``parallel_state.get_*``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.parallel.cpu_compat import enable_cpu_compat

logger = logging.getLogger(__name__)

_VALID_BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """Process groups and coordinates of this rank, built once after megatron-core initialises.

    Groups are ``torch.distributed.ProcessGroup`` objects. ``dp`` is the data-parallel group
    without context parallelism and ``dp_cp`` the one with it (the group that reduces gradients).
    """

    world_size: int
    """Number of ranks in the default group."""
    rank: int
    """Global rank of this process."""
    tp: Any
    """Tensor-parallel group."""
    pp: Any
    """Pipeline-parallel group."""
    dp: Any
    """Data-parallel group (without context parallelism)."""
    dp_cp: Any
    """Data-parallel group including context-parallel ranks (gradient reduction)."""
    cp: Any
    """Context-parallel group."""
    mp: Any
    """Model-parallel group (TP x PP)."""
    embd: Any
    """Embedding group (first and last PP stage), None when PP = 1 and untied."""
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    ep: Any = None
    """Expert-model-parallel group (the ranks that split one layer's experts); size 1 without EP."""
    ep_size: int = 1
    ep_rank: int = 0
    etp: Any = None
    """Expert-tensor-parallel group (tensor parallelism inside an expert)."""
    etp_size: int = 1
    etp_rank: int = 0
    edp: Any = None
    """Expert-data-parallel group (ranks holding the same experts: expert gradients are reduced here)."""
    edp_rank: int = 0
    """Rank in ``edp``: the ranks with 0 hold, together, one copy of every weight of their stage."""
    pg_collection: Any
    """megatron-core ``ProcessGroupCollection`` for APIs that take ``pg_collection=``."""
    timeout_s: int
    """Timeout of every collective on these groups, in seconds."""

    @property
    def is_pipeline_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage (embedding)."""
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (final norm, output layer, loss)."""
        return self.pp_rank == self.pp_size - 1


def _check_sizes(world_size: int, tp: int, pp: int, cp: int, ep: int = 1, etp: int | None = None) -> None:
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", tp if etp is None else etp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp}"
        )
    expert_parallel = (tp if etp is None else etp) * ep * pp
    if world_size % expert_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size x expert_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp if etp is None else etp} x {ep} x {pp} (megatron's expert layout)"
        )


def initialize_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    backend: str = "gloo",
    timeout_s: int = 600,
    seed: int = 1234,
) -> ProcessGroups:
    """Initialise torch.distributed and megatron-core's model-parallel state for this rank.

    ``torch.distributed`` is initialised from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` as set by torchrun) unless it already is. Without CUDA the
    CPU compatibility layer is enabled first. The RNG tracker is seeded with ``seed``
    (``model_parallel_cuda_manual_seed``: TP ranks get distinct model-parallel streams).

    Args:
        tensor_model_parallel_size: TP size, >= 1.
        pipeline_model_parallel_size: PP size, >= 1.
        context_parallel_size: CP size, >= 1. The data-parallel size is the rest of the world.
        expert_model_parallel_size: EP size, >= 1 (Mixture-of-Experts layers: each rank holds
            num_experts / EP experts of a layer; the expert layout is ETP x EP x expert-DP x PP).
        expert_tensor_parallel_size: tensor parallelism inside an expert; None = TP size.
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout_s: timeout of every collective, seconds.
        seed: base seed of the RNG tracker.

    Returns:
        The :class:`ProcessGroups` of this rank.

    Raises:
        ValueError: a bad size or backend, or a world size not divisible by TP x PP x CP.
        RuntimeError: megatron-core's parallel state is already initialised.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if backend not in _VALID_BACKENDS:
        raise ValueError(f"backend must be one of {_VALID_BACKENDS}, got {backend!r}")
    if not isinstance(timeout_s, int) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive int, got {timeout_s!r}")
    enable_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron-core parallel state is already initialised; call destroy_parallel() first")

    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world_size = dist.get_world_size()
    _check_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                 expert_model_parallel_size, expert_tensor_parallel_size)

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, -(-timeout_s // 60)),
    )
    model_parallel_cuda_manual_seed(seed)

    groups = ProcessGroups(
        world_size=world_size,
        rank=dist.get_rank(),
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(),
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        cp=parallel_state.get_context_parallel_group(),
        mp=parallel_state.get_model_parallel_group(),
        embd=parallel_state.get_embedding_group(check_initialized=False),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_group(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp=parallel_state.get_expert_tensor_parallel_group(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        edp=parallel_state.get_expert_data_parallel_group(),
        edp_rank=parallel_state.get_expert_data_parallel_rank(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        timeout_s=timeout_s,
    )
    logger.info(
        "parallel state: world=%d rank=%d tp=%d/%d pp=%d/%d dp=%d/%d cp=%d/%d ep=%d/%d etp=%d/%d backend=%s",
        groups.world_size, groups.rank, groups.tp_rank, groups.tp_size, groups.pp_rank,
        groups.pp_size, groups.dp_rank, groups.dp_size, groups.cp_rank, groups.cp_size,
        groups.ep_rank, groups.ep_size, groups.etp_rank, groups.etp_size, backend,
    )
    return groups


def destroy_parallel() -> None:
    """Destroy megatron-core's parallel state and the default process group (if initialised)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def world_of_one(**kwargs) -> Iterator[ProcessGroups]:
    """A one-process world on this host: torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, a free MASTER_PORT) are set for its duration and restored after, and
    megatron-core's parallel state is initialised (`initialize_parallel(**kwargs)`) and destroyed.

    Yields:
        The :class:`ProcessGroups` of the world.
    """
    from megatron_rl.ports import find_free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(find_free_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        pgs = initialize_parallel(**kwargs)
        try:
            yield pgs
        finally:
            destroy_parallel()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
