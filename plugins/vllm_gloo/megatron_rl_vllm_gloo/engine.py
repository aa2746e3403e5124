"""The worker side of a ``gloo`` weight transfer, shaped after vLLM 0.32's dense NCCL engine.

``vllm/distributed/weight_transfer/nccl_engine.py`` (``NCCLWeightTransferEngine``) is followed
step for step, with a torch gloo process group in place of ``StatelessProcessGroup`` +
``PyNcclCommunicator`` (which need an accelerator):

* ``init_transfer_engine``: the same ``init_info`` fields (``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``packed``), the same rank arithmetic
  (``nccl_common.worker_init_process_group``: ``dp_index * (TP x PP) + rank + rank_offset``); the
  group is formed the way megatron-rl's trainer forms it (``megatron_rl.weight_sync.group``,
  SGLang's ``init_custom_process_group``): ``rendezvous("tcp://host:port")`` (the trainer, rank 0,
  hosts the TCPStore), ``PrefixStore(group_name)``, ``_new_process_group_helper(..., "gloo")``.
  Optional fields: ``group_name`` (default ``weight_update_group``, the trainer's) and ``timeout_s``.
* ``start_weight_update`` / ``finish_weight_update``: vLLM's layer-wise reload, as the nccl engine
  (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``): the CPU build repacks the
  attention weights (qkv_proj) after loading, so a plain ``load_weights`` between two generations
  would leave them stale.
* ``receive_weights``: one ``broadcast`` from rank 0 per tensor, in the posted order, into a CPU
  tensor of the posted dtype and shape, handed to ``model.load_weights`` (copied to the model's
  device first when that is not the CPU). Packed transfer is refused.
* ``update_weights``: the base class's, without its ``torch.accelerator.synchronize()`` on CPU
  (there is no accelerator; a gloo broadcast is complete when it returns).
* a failed ``update_weights`` finalizes the reload before raising (`GlooWeightTransferEngine.restore_after_failure`):
  vLLM's worker ends the session on that error without ``finish_weight_update``, which left the
  layers that had received nothing on the meta device and the engine crashing on its next request;
* on CPU, ``finish_weight_update`` also repacks the logits GEMM of tied embeddings
  (`refresh_cpu_lm_heads`: vLLM's reload leaves a tied ``lm_head`` computing with the old weights).

Test hook (never set it in normal use): while the file named by ``MEGATRON_RL_VLLM_GLOO_FAULT_FILE``
(`FAULT_FILE_ENV`) exists, ``update_weights`` raises before receiving anything, as a worker whose load
fails would; vLLM answers the ``/update_weights`` call with HTTP 500. The live tier
(tests/live/test_vllm_cpu_live.py) uses it to check that such a failure stops the training run with an
error naming the engine.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

logger = logging.getLogger(__name__)

__all__ = ["FAULT_FILE_ENV", "GlooWeightTransferEngine", "GlooWeightTransferInitInfo", "GlooWeightTransferUpdateInfo",
           "RECEIVE_AHEAD_BYTES", "check_fault_hook", "join_group", "received",
           "refresh_cpu_lm_heads"]

DEFAULT_GROUP_NAME = "weight_update_group"

FAULT_FILE_ENV = "MEGATRON_RL_VLLM_GLOO_FAULT_FILE"
"""Test hook: a path; while a file exists there, every ``update_weights`` raises (`check_fault_hook`)."""


def check_fault_hook() -> None:
    """Raise when the test hook `FAULT_FILE_ENV` names a file that exists (read at every call, so a
    test can switch the fault on and off while the server runs); nothing when unset.

    Raises:
        RuntimeError: the hook is on (the message names the variable and the file).
    """
    path = os.environ.get(FAULT_FILE_ENV, "").strip()
    if path and os.path.exists(path):
        raise RuntimeError(f"weight update refused by the test hook {FAULT_FILE_ENV}={path} (the file exists)")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine`` (the nccl engine's TCP fields, plus two optional ones)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.packed:
            raise ValueError("the gloo weight transfer receives one broadcast per tensor; packed transfer is not "
                             "supported (send packed: false)")
        if self.world_size < 2 or not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"need world_size >= 2 and 1 <= rank_offset < world_size, got world_size="
                             f"{self.world_size}, rank_offset={self.rank_offset}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: as ``NCCLWeightTransferUpdateInfo``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"`names`, `dtype_names` and `shapes` must have the same length: got {n}, "
                             f"{len(self.dtype_names)} and {len(self.shapes)}")
        for name in self.dtype_names:
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"dtype_names: {name!r} is not a torch dtype")


def join_group(host: str, port: int, world_size: int, rank: int, group_name: str,
               timeout_s: float) -> dist.ProcessGroup:
    """Join the trainer's private gloo group (``megatron_rl.weight_sync.group.init_custom_process_group``).

    Raises:
        ValueError: a group of that name already exists in this process.
        RuntimeError: the rendezvous failed or timed out; torch's private API changed.
    """
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this worker")
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options" if "pg_options" in params else None
    if options is None:
        raise RuntimeError(f"torch {torch.__version__}: _new_process_group_helper takes neither backend_options nor "
                           "pg_options; megatron_rl_vllm_gloo must be updated")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{int(port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend("gloo"), store,
                                           group_name=group_name, timeout=timeout, **{options: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def refresh_cpu_lm_heads(model: torch.nn.Module) -> int:
    """Re-run ``process_weights_after_loading`` of the tied LM heads among the layers with vLLM's
    embedding method and a CPU GEMM (``cpu_linear``); returns how many.

    On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packs a copy of the weight
    for the logits GEMM (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``). With tied
    embeddings (``tie_word_embeddings``: ``lm_head.weight is embed_tokens.weight``), the layer-wise
    reload copies a new ``embed_tokens.weight`` into the shared tensor and repacks ``embed_tokens``,
    but ``lm_head`` loads nothing itself, so its packed copy keeps the old weights and the logits
    come from them (found by megatron-rl's live tier: 34 nats off after an embedding update).

    Only a ``ParallelLMHead`` whose weight is another such layer's is repacked: the reload already
    repacked the embedding and an untied head (each received its own tensor). The repack of a large
    vocabulary is most of a CPU sync (py-spy of benchmarks/vllm_cpu.py --part sync: 3 repacks of the
    65536 x 2048 embedding per sync when every layer was refreshed, 2 now). A model without any layer
    of that class (another structure) gets every such layer refreshed, as before.
    """
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear")
              and type(getattr(m, "quant_method", None)).__name__ == "UnquantizedEmbeddingMethod"]
    heads = [m for m in layers if any(c.__name__ == "ParallelLMHead" for c in type(m).__mro__)]
    if heads:
        weights = {id(getattr(m, "weight", None)) for m in layers if m not in heads}
        layers = [m for m in heads if id(getattr(m, "weight", None)) in weights]
    for module in layers:
        module.quant_method.process_weights_after_loading(module)
    return len(layers)


RECEIVE_AHEAD_BYTES = 1 << 30
"""Bytes `received` may hold received but not yet loaded (beyond the tensor being loaded)."""


def received(update_info: GlooWeightTransferUpdateInfo, group: dist.ProcessGroup,
             ahead_bytes: int = RECEIVE_AHEAD_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each broadcast of ``update_info``, in order, received from rank 0 of
    ``group`` on a thread that runs ahead of the consumer by up to ``ahead_bytes`` (at least one
    tensor), so receiving overlaps loading.

    Measured on the 0.89 GB benchmark model (benchmarks/vllm_cpu.py --part sync, 2 CPU cores):
    received and loaded one after the other, the trainer's broadcast of a bucket waited for every
    load before it; overlapped, it waits for the larger of the two.

    If the consumer stops early (an error while loading), the thread still receives the remaining
    broadcasts and drops them, so the trainer's collective completes and it reads the HTTP error
    instead of timing out in the broadcast.

    Raises:
        RuntimeError: whatever the broadcast raised (re-raised in the consumer).
    """
    items = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
    ready: queue.Queue = queue.Queue()
    state = {"held": 0, "stop": False}
    lock = threading.Condition()

    def receive() -> None:
        try:
            for name, dtype_name, shape in items:
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                dist.broadcast(weight, src=0, group=group)
                size = weight.numel() * weight.element_size()
                with lock:
                    if state["stop"]:
                        continue  # the consumer is gone: drain the collective
                    lock.wait_for(lambda: state["stop"] or state["held"] == 0 or state["held"] + size <= ahead_bytes)
                    if state["stop"]:
                        continue
                    state["held"] += size
                ready.put((name, weight, size))
            ready.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            ready.put(e)

    thread = threading.Thread(target=receive, name="gloo-weight-receive", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            item = ready.get()
            if item is None:
                finished = True
                break
            if isinstance(item, BaseException):
                finished = True
                raise item
            name, weight, size = item
            yield name, weight
            del weight
            with lock:
                state["held"] -= size
                lock.notify_all()
    finally:
        if not finished:
            with lock:
                state["stop"] = True
                lock.notify_all()
        thread.join()


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives dense checkpoint-format weights from the trainer (rank 0) over a gloo group."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (replacing one joined before); blocks until every rank joined."""
        self.shutdown()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(f"worker rank {rank} (rank_offset {init_info.rank_offset}) does not fit world_size "
                             f"{init_info.world_size}")
        logger.info("joining the gloo weight-transfer group %r at %s:%d as rank %d of %d", init_info.group_name,
                    init_info.master_address, init_info.master_port, rank, init_info.world_size)
        self.group = join_group(init_info.master_address, init_info.master_port, init_info.world_size, rank,
                                init_info.group_name, init_info.timeout_s)

    def start_weight_update(self) -> None:
        """Initialize layer-wise reloading for the incoming checkpoint weights (as the nccl engine)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Finalize layer-wise reloading after all weights have been received (as the nccl engine),
        then, on CPU, refresh the packed GEMM copies of the embedding-method layers (`refresh_cpu_lm_heads`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cpu":
            refresh_cpu_lm_heads(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, with the accelerator synchronize only where there is an accelerator.

        On a failure the layer-wise reload is finalized before the error goes on (`restore_after_failure`):
        vLLM's worker then ends the session without calling `finish_weight_update`, which would leave
        every layer that received nothing on the meta device, and the next forward crashing.

        Raises:
            RuntimeError: the test hook `FAULT_FILE_ENV` is on (`check_fault_hook`); whatever receiving
                or loading raised.
        """
        try:
            check_fault_hook()
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.restore_after_failure()
            raise
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def restore_after_failure(self) -> None:
        """Finalize the open layer-wise reload after a failed ``update_weights``: layers that received
        nothing get their previous weights back, layers that received everything keep the new ones, so
        the engine stays able to serve (issue 30 found it crashing on the next request otherwise); the
        next update replaces everything. Errors here are logged, the caller's error is what counts."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
            if self.device.type == "cpu":
                refresh_cpu_lm_heads(self.model)
            logger.warning("weight update failed; the layer-wise reload was finalized (layers that received nothing "
                           "keep their previous weights)")
        except Exception as e:  # noqa: BLE001 - best effort
            logger.warning("finalizing the layer-wise reload after a failed weight update: %s", e)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """One gloo broadcast from rank 0 per tensor, in order, each loaded as it arrives; the next
        tensors are received on a thread while one loads (`received`), so the trainer's broadcast does
        not wait on the loads."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized; call /init_weight_transfer_engine first")
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:  # older vLLM: no MTP completeness check to disable
            from contextlib import nullcontext as disable_mtp_completeness_check
        with disable_mtp_completeness_check():
            for name, weight in received(update_info, self.group):
                if self.device.type != "cpu":
                    weight = weight.to(self.device)
                self.model.load_weights([(name, weight)])
                del weight

    def shutdown(self) -> None:
        """Leave the group (frees its name for the next init); idempotent."""
        group, self.group = self.group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # noqa: BLE001 - best effort at teardown
                logger.warning("destroying the gloo weight-transfer group: %s", e)
