"""Colocated mode on the trainer's side (issue 17): offload / onload of the trainer's state around
training, and the step hooks that run the memory protocol (`megatron_rl.weight_sync.colocated`).

Mechanisms (megatron-core 0.19, its own RL hooks, used as they are):
  * parameters and gradients: `_ParamAndGradBuffer.offload_to_cpu(move_params, move_grads)` /
    `reload_from_cpu` of every buffer of the DDP wrapper (`DistributedDataParallel.buffers` and
    `expert_parallel_buffers`): grads are freed (`storage().resize_(0)`, re-zeroed on reload);
    params are copied into a pinned host buffer that is allocated once and reused (`param_data_cpu`),
    so repeated offloads do not hold two host copies (verl #6193);
  * optimizer state and fp32 master params: `MegatronOptimizer.offload_to_cpu` /
    `restore_from_cpu` (per tensor `.cpu()` / `.cuda()`; this one allocates host memory on each
    offload - megatron-core's behaviour, logged in the phase's memory);
  * then `torch.cuda.empty_cache()` so the engines can take the pages.
On CPU every one of these is a no-op (the state already lives in host memory and there is no
device to free; `pin_memory` needs CUDA), so `TrainerOffload` does nothing there and says so once.
slime's `torch_memory_saver` (virtual-memory pausing, which also frees NCCL buffers) is not
installed here and not used.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_rl.weight_sync.colocated import EngineMemory, PhaseLog, wait_device_freed

logger = logging.getLogger(__name__)

__all__ = ["Colocation", "TrainerOffload"]


class TrainerOffload:
    """Offload / onload of one rank's parameters, gradients and optimizer state (module docstring).

    Args:
        ddp_models: the DDP-wrapped model chunks (`Run.ddp_model`).
        optimizer: the megatron-core optimizer (`Run.optimizer`).
    """

    def __init__(self, ddp_models, optimizer) -> None:
        self.ddp_models = list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]
        self.optimizer = optimizer
        self.active = torch.cuda.is_available()
        self.offloaded = False
        if not self.active:
            logger.info("colocated mode on CPU: trainer offload is a no-op (state already in host memory)")

    def _buffers(self):
        for m in self.ddp_models:
            yield from list(getattr(m, "buffers", []) or []) + list(getattr(m, "expert_parallel_buffers", []) or [])

    def offload(self) -> None:
        """Parameters and gradients to the reused pinned host buffer / freed, optimizer state to host."""
        if not self.active or self.offloaded:
            return
        torch.cuda.synchronize()  # pragma: no cover - GPU only
        for buf in self._buffers():  # pragma: no cover
            buf.offload_to_cpu(move_params=True, move_grads=True)
        if hasattr(self.optimizer, "offload_to_cpu"):  # pragma: no cover
            self.optimizer.offload_to_cpu()
        torch.cuda.empty_cache()  # pragma: no cover
        self.offloaded = True  # pragma: no cover

    def onload(self) -> None:
        """Back on the device (the inverse of `offload`)."""
        if not self.active or not self.offloaded:
            return
        for buf in self._buffers():  # pragma: no cover - GPU only
            buf.reload_from_cpu(move_params=True, move_grads=True)
        if hasattr(self.optimizer, "restore_from_cpu"):  # pragma: no cover
            self.optimizer.restore_from_cpu()
        torch.cuda.synchronize()  # pragma: no cover
        self.offloaded = False  # pragma: no cover


class Colocation:
    """The step hooks of colocated mode, on every rank (the engine calls on the controller only).

    `before_train()` after the step's batch is generated: engines release weights and KV cache
    (controller, waits until freed), a barrier, then this rank onloads. `after_train()` after the
    PPO updates: offload, empty cache; on several nodes, each other node's leader then restarts
    its own engines that died (`node_engines`, `EngineSet.restart_dead`) and a barrier lets the
    controller's weight sync find them up. The publisher's `ColocatedWeightSender` then resumes
    the weights, hands them over and resumes the KV cache. `metrics()` returns the phases' times
    and memory readings of the step (controller).
    """

    def __init__(self, offload: TrainerOffload, engines: Optional[EngineMemory], log: PhaseLog, barrier,
                 node_engines=None, nnodes: int = 1, wait_freed=None, gather=None) -> None:
        self.gather = gather
        """`gather(x) -> [x of every rank]` (collective); used on several nodes."""
        self.node_restarts = 0
        self.wait_freed = wait_freed
        """A node leader other than the controller, GPU only: waits until its device is freed."""
        self.offload = offload
        self.engines = engines
        self.log = log
        self.barrier = barrier
        self.node_engines = node_engines
        self.nnodes = nnodes

    def before_train(self) -> None:
        """Engines release (controller), every rank waits for it, then onloads."""
        if self.engines is not None:
            self.engines.release()
        self.barrier()
        if self.wait_freed is not None:  # pragma: no cover - GPU only
            self.wait_freed()
        self.log.run("trainer_onload", self.offload.onload)

    def after_train(self) -> None:
        """This rank offloads (before any engine resumes: the publisher runs after this)."""
        self.log.run("trainer_offload", self.offload.offload)
        if self.nnodes > 1:  # the gather is the barrier: the controller's sync then finds them up
            restarted = sum(self.gather(self.node_engines.restart_dead() if self.node_engines is not None else 0))
            if self.engines is not None:  # the controller: say so in its own log and metrics
                if restarted:
                    logger.warning("%d rollout engine(s) on other nodes were restarted by their node's local rank 0 "
                                   "(see train_rank<k>.log)", restarted)
                self.node_restarts += restarted
                self.log.metrics["colocate/node_engine_restarts"] = float(self.node_restarts)

    def metrics(self) -> dict[str, float]:
        """The step's `colocate/*` metrics (and forget them)."""
        return self.log.take()


def setup_colocation(run) -> Colocation:
    """`Run.colocation` for `rollout.colocate: true`: the trainer offload, the controller's
    `EngineMemory` over the fleet's engines (on GPU it polls this device's memory after a release
    until it is below `rollout.mem_fraction_static` x the device's memory, N11), the barrier."""
    from megatron_rl.parallel.control import broadcast_object, gather_objects

    from megatron_rl.parallel.nodes import node_info

    log = PhaseLog()
    engines, wait_freed = None, None
    poll, threshold = None, 0.0
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        threshold = (run.cfg.rollout.mem_fraction_static or 0.5) * total
        poll = lambda: torch.cuda.device_memory_used() / 2**30  # noqa: E731
    if run.is_controller or run.node_engines is not None:  # each node's leader: its own /dev/shm
        from megatron_rl.weight_sync.ipc import sweep_orphan_segments

        orphans = sweep_orphan_segments()
        if orphans:
            logger.warning("removed %d shared-memory segment(s) of processes that are gone (%.1f MiB in /dev/shm, "
                           "e.g. a colocated run killed with its torch_shm_manager): %s", len(orphans),
                           sum(b for _, b in orphans) / 2**20, [n for n, _ in orphans[:5]])
    if run.is_controller:
        engines = EngineMemory(lambda: run.engines.fleet.up_clients(), log, release_poll=poll,
                               release_threshold_gib=threshold)
    elif run.node_engines is not None and poll is not None:  # pragma: no cover - GPU only
        what = f"node {run.node_engines.node.node_rank}'s engines"
        wait_freed = lambda: wait_device_freed(poll, threshold, what=what)  # noqa: E731
    world = run.pgs.world_size
    return Colocation(TrainerOffload(run.ddp_model, run.optimizer), engines, log,
                      barrier=lambda: broadcast_object(None, src=0, world_size=world),
                      node_engines=run.node_engines, nnodes=node_info().nnodes, wait_freed=wait_freed,
                      gather=lambda x: gather_objects(x, world_size=world))
