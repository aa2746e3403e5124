"""What the weight-sync transports need from a rollout engine: the receiver protocols.

The transports (``sender.WeightSyncSender``, ``colocated.ColocatedWeightSender``) and the publisher
are typed against these ``typing.Protocol`` classes, not against ``megatron_rl.rollout``'s clients,
so the arrow runs one way: ``rollout`` knows nothing of how weights are sent, and ``weight_sync``
imports nothing from ``rollout`` (tests/unit/test_weight_sync_receiver.py checks both: no such
import, and that ``RolloutClient`` and ``VLLMClient`` provide every method below).

Every method raises ``megatron_rl.errors.RolloutServerError`` when the engine cannot be reached or
refuses (``status_code`` holds the HTTP status where there was an answer). Timeouts are seconds;
None means the client's default.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

from megatron_rl.errors import RolloutServerError, WeightSyncError

logger = logging.getLogger(__name__)

__all__ = ["BroadcastReceiver", "EngineSession", "TensorReceiver", "label_engines"]


@runtime_checkable
class EngineSession(Protocol):
    """One engine's control calls around a weight update: pause, open and close the update session,
    flush, read and set the version label, continue; also the checks after a sync."""

    base_url: str
    """The engine's URL; every error of a sync names it."""

    def model_info(self) -> dict:
        """The engine's model description: ``weight_version``, and ``dtype`` where reported."""

    def weight_version(self) -> str:
        """Label of the weights the engine samples from now."""

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """Relabel the weights only (no weight changes). ``abort_all_requests`` also aborts every
        request first; the transports never ask for that (requests paused in place must survive)."""

    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> dict:
        """Stop scheduling; returns once no step runs (``abort``: requests in flight end aborted;
        ``in_place``: frozen with their KV cache; ``retract``: requeued)."""

    def continue_generation(self) -> dict:
        """Resume after ``pause_generation``."""

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the requests whose id starts with ``rid`` (or all of them)."""

    def begin_weight_update(self, selector: Literal["all", "target", "draft"] = "all", *,
                            timeout_s: float | None = None) -> dict:
        """Open the update session (after ``pause_generation``); refused while one is open."""

    def end_weight_update(self, *, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        """Close the update session. The transports pass no ``weight_version``: they label the
        engines with ``update_weight_version`` only after the flush (DESIGN.md step 7)."""

    def flush_cache(self, timeout_s: float = 0.0) -> str:
        """Drop the KV / prefix cache computed with the old weights, waiting up to ``timeout_s`` for
        requests in flight; refused (HTTP 400) while requests still run."""

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of weight ``name`` (HF name) as nested lists of floats."""

    def close(self) -> None:
        """Release the client's connections (the engine keeps running)."""


@runtime_checkable
class BroadcastReceiver(EngineSession, Protocol):
    """An engine that receives weights by broadcast in a trainer-made process group
    (``sender.WeightSyncSender``: SGLang, the embedded server, vLLM)."""

    def transfer_world_size(self) -> int:
        """Ranks the engine adds to a weight-transfer group: every worker that receives the
        weights (SGLang: its TP workers; vLLM: TP x PP x DP, ``/get_world_size``)."""

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl", *,
                                  timeout_s: float | None = None) -> dict:
        """Join the trainer's group of ``world_size`` ranks at ranks ``rank_offset ..
        rank_offset + transfer_world_size() - 1``; answers once the rendezvous is done."""

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Leave and destroy the named group."""

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str = "weight_update_group", flush_cache: bool = False,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        timeout_s: float | None = None) -> dict:
        """Receive one bucket (``names`` / ``dtypes`` / ``shapes``, one entry per tensor) by broadcast
        from rank 0 of ``group_name`` while the trainer sends it; answers after the load."""


@runtime_checkable
class TensorReceiver(EngineSession, Protocol):
    """A colocated engine that receives weights as IPC handles (``colocated.ColocatedWeightSender``)
    and releases / resumes its memory around training."""

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None,
                                   abort_all_requests: bool = False, timeout_s: float | None = None) -> dict:
        """Load the tensors of one payload per TP rank (``weight_sync.ipc``); answers after the load."""

    def release_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> dict:
        """Free ``tags`` (``weights``, ``kv_cache``); ``{"rss_before", "rss_after"}`` bytes where reported."""

    def resume_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> dict:
        """Re-allocate ``tags``; answers as ``release_memory_occupation``."""


def label_engines(engines: Sequence[EngineSession], weight_version: str) -> None:
    """The last step of a sync, after the flush: label every engine ``weight_version``, in order
    (``update_weight_version``, never aborting: requests paused in place must survive it).

    A failure part-way rolls back the labels already set, so every engine keeps reporting the
    version of the weights it was last labelled with as a whole sync (the caller leaves them paused).

    Raises:
        WeightSyncError: an engine refused or could not be reached (names it, and any engine whose
            roll-back failed too).
    """
    done: list[tuple[EngineSession, str]] = []
    for engine in engines:
        try:
            old = engine.weight_version()
            engine.update_weight_version(weight_version, abort_all_requests=False)
        except RolloutServerError as e:
            failed = []
            for labelled, was in reversed(done):
                try:
                    labelled.update_weight_version(was, abort_all_requests=False)
                except RolloutServerError as e2:
                    failed.append(f"{labelled.base_url} ({e2})")
            back = f"; rolling back the label on {failed} failed too" if failed else (
                f"; the {len(done)} engine(s) labelled before it got their old label back" if done else "")
            raise WeightSyncError(f"labelling {engine.base_url} with weight_version {weight_version!r} failed: "
                                  f"{e}{back}") from e
        done.append((engine, old))
    logger.debug("labelled %d engine(s) weight_version %r", len(done), weight_version)
