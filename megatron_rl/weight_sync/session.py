"""The receiver's side of weight updates: the update session (groups, open/close, partial writes)
and the model-update lock that orders updates against generation.

``UpdateSession`` is the state machine behind SGLang's weight-update endpoints, without HTTP:

- named process groups (``init_group`` / ``destroy_group``) that the trainer broadcasts on;
- one session at a time: ``begin`` opens it (a second ``begin`` is refused), ``end`` closes it
  (``end`` without ``begin`` is refused); an update call outside a session is refused;
- each ``/update_weights_from_distributed`` call is numbered (1, 2, ...; the numbers the test hook
  the test hook ``megatron_rl.engine.test_hooks`` refers to), validated
  (``start_update``), then received and written (``receive``);
- the ``+partial`` rule: once a call of the open session has written weights (``wrote``), any
  later refusal in that session leaves the weights a mix of two versions, so the target's
  ``weight_version`` gets ``PARTIAL_VERSION_SUFFIX`` (until a call sets a new version). A call that
  sets a ``weight_version`` ends the mix: a later refusal in the same session does not mark it.
  A refusal when nothing of the session was written says "No weight was changed.";
- one receive buffer (uint8) kept across buckets and syncs, grown to the largest bucket seen.

Every refused call raises ``SessionError`` whose message is the HTTP answer's ``message``.
Nothing from the network is ever unpickled: weights arrive by ``torch.distributed.broadcast`` into
tensors whose dtypes and shapes come from the validated JSON metadata.

``ModelUpdateLock`` is SGLang's model-update lock on the event loop: generation requests hold the
read lock from admission to answer, so an update (the write lock) waits for the requests in flight
unless the server is paused (``/pause_generation``) or the call sets ``abort_all_requests``. A writer
already waiting for readers re-checks whether it may stop waiting whenever it is woken (``wake``), so
a pause that lands while an update waits behind a running request frees it (case N10 B; SGLang
#25319).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_rl.weight_sync.buckets import BucketMeta, dtype_from_name, flattened_layout, unflatten_bucket

logger = logging.getLogger(__name__)

__all__ = ["PARTIAL_VERSION_SUFFIX", "ModelUpdateLock", "SessionError", "UpdateCall", "UpdateSession", "WeightTarget"]

PARTIAL_VERSION_SUFFIX = "+partial"
"""Appended to ``weight_version`` when a failed update left the weights partly written."""


class SessionError(Exception):
    """A refused session call; ``str(e)`` is the message of the HTTP 400 ``{"success": false}`` answer."""


class WeightTarget(Protocol):
    """What the session writes into (``megatron_rl.engine.batching.GenerationEngine`` is one)."""

    weight_version: str
    """The version label served with every generation; the session sets it and marks it partial."""
    model_lock: AbstractContextManager
    """Held while parameters are written (generation steps hold it too)."""

    def direct_targets(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                       shapes: Sequence[Sequence[int]]) -> list[torch.Tensor] | None:
        """The parameters themselves when a broadcast can land in place, else None."""

    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors in, all or nothing; ValueError (nothing written) on a bad name or shape."""


@dataclass(frozen=True)
class UpdateCall:
    """One validated ``/update_weights_from_distributed`` call, ready for ``UpdateSession.receive``."""

    number: int
    """1-based call number within the server's life."""
    names: list[str]
    dtype_names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    load_format: str | None
    """None: one broadcast per tensor, in list order; ``"flattened_bucket"``: one broadcast of the bucket."""
    group: Any
    """The ``torch.distributed.ProcessGroup`` to receive on (the sender is its rank 0)."""
    weight_version: str | None
    """Set once the call has written everything; None keeps the version."""


class UpdateSession:
    """The receiver's weight-update session state machine (see the module docstring for the rules).

    Not thread-safe by itself: the HTTP app runs ``begin``, ``end``, ``start_update`` and
    ``receive`` one at a time under ``ModelUpdateLock``'s write lock; ``receive``,
    ``init_group`` and ``destroy_group`` block and run off the event loop.

    Args:
        target: the weights and version label the session writes (the generation engine).
        group_timeout_s: rendezvous and collective timeout of the groups it joins, seconds.
        refused_calls: call numbers to refuse on purpose (tests only; see ``megatron_rl.engine.test_hooks``).
        refused_by: what set ``refused_calls``, named in the refusal (the hook's variable).
    """

    def __init__(self, target: WeightTarget, *, group_timeout_s: float = 600.0,
                 refused_calls: frozenset[int] = frozenset(), refused_by: str = "the fault-injection test hook") -> None:
        self.target = target
        self.group_timeout_s = group_timeout_s
        self.refused_calls = refused_calls
        self.refused_by = refused_by
        self.groups: dict[str, Any] = {}
        """Joined process groups by name."""
        self.is_open = False
        """Between ``begin`` and ``end``."""
        self.wrote = False
        """An update call of the open session has written weights since the last version was set."""
        self.recv_buffer: torch.Tensor | None = None
        """Receive buffer of flattened buckets: [nbytes] uint8, grown to the largest bucket seen."""
        self.calls = 0
        """Update calls seen (``start_update`` numbers them from 1)."""

    # ---- groups ---------------------------------------------------------------------------

    def check_new_group(self, name: str, backend: str) -> None:
        """Refuse a group ``init_group`` cannot join, at once (no rendezvous).

        Raises:
            SessionError: a group of that name exists, or ``backend == "nccl"`` without CUDA.
        """
        if name in self.groups:
            raise SessionError(f"Failed to init group: a group named {name!r} already exists")
        if backend == "nccl" and not torch.cuda.is_available():
            raise SessionError("Failed to init group: backend 'nccl' needs CUDA; the embedded server runs on CPU, "
                               "use 'gloo'")

    def init_group(self, *, name: str, backend: str, host: str, port: int, world_size: int, rank: int) -> None:
        """Join the trainer's weight-update group ``name`` (blocks until every rank has joined).

        Raises:
            SessionError: refused by ``check_new_group``, or the rendezvous failed.
        """
        self.check_new_group(name, backend)
        from megatron_rl.weight_sync.group import init_custom_process_group

        try:
            self.groups[name] = init_custom_process_group(
                backend=backend, host=host, port=port, world_size=world_size, rank=rank, group_name=name,
                timeout_s=self.group_timeout_s,
            )
        except Exception as e:
            logger.exception("init_weights_update_group failed")
            raise SessionError(f"Failed to init group: {e}") from e

    def destroy_group(self, name: str) -> None:
        """Leave and destroy group ``name`` (forgotten even when destroying it fails).

        Raises:
            SessionError: no group of that name, or destroying it failed.
        """
        pg = self.groups.pop(name, None)
        if pg is None:
            raise SessionError(f"Failed to destroy group: no group named {name!r}")
        from megatron_rl.weight_sync.group import destroy_custom_process_group

        try:
            destroy_custom_process_group(pg)
        except Exception as e:
            raise SessionError(f"Failed to destroy group: {e}") from e

    # ---- open / close ---------------------------------------------------------------------

    def begin(self, selector: str = "all") -> None:
        """Open a session (``wrote`` starts False).

        Raises:
            SessionError: ``selector == "draft"`` (no draft model), or a session is already open.
        """
        if selector == "draft":
            raise SessionError("begin_weight_update failed: the server has no draft model")
        if self.is_open:
            raise SessionError("begin_weight_update() called while a weight update session is already open; "
                               "call end_weight_update() first")
        self.is_open = True
        self.wrote = False

    def end(self) -> None:
        """Close the open session.

        Raises:
            SessionError: no session is open.
        """
        if not self.is_open:
            raise SessionError(
                "end_weight_update() called without an open weight update session; call begin_weight_update() first"
            )
        self.is_open = False

    # ---- update calls ---------------------------------------------------------------------

    def start_update(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                     group_name: str = "weight_update_group", load_format: str | None = None,
                     selector: str = "all", weight_version: str | None = None) -> UpdateCall:
        """Number and validate an update call; nothing is received or written yet.

        Raises:
            SessionError: refused by the test hook, outside a session, mismatched or empty lists, an
                unknown ``load_format``, ``selector == "draft"``, a bad dtype or shape, an unknown
                group. Every refusal but "outside a session" follows the ``+partial`` rule.
        """
        self.calls += 1
        if self.calls in self.refused_calls:  # fault injection for tests
            logger.warning("refusing update_weights_from_distributed call %d (%s)", self.calls, self.refused_by)
            raise self.refusal(f"Failed to update weights: call {self.calls} refused by {self.refused_by}")
        if not self.is_open:
            raise SessionError(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise self.refusal(
                f"Failed to update weights: names, dtypes and shapes must be non-empty lists of one length, "
                f"got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        if load_format not in (None, "flattened_bucket"):
            raise self.refusal(
                f"Failed to update weights: load_format {load_format!r} is not supported "
                "(use null or 'flattened_bucket')"
            )
        if selector == "draft":
            raise self.refusal("Failed to update weights: the server has no draft model")
        try:
            torch_dtypes = [dtype_from_name(d) for d in dtypes]
            flattened_layout(torch_dtypes, shapes)
        except ValueError as e:
            raise self.refusal(f"Failed to update weights: {e}") from None
        pg = self.groups.get(group_name)
        if pg is None:
            raise self.refusal(f"Failed to update weights: no weight update group named {group_name!r}")
        return UpdateCall(number=self.calls, names=names, dtype_names=dtypes, dtypes=torch_dtypes, shapes=shapes,
                          load_format=load_format, group=pg, weight_version=weight_version)

    def receive(self, call: UpdateCall) -> None:
        """Receive the call's tensors from rank 0 of its group and write them (blocks); then, when the
        call carries a ``weight_version``, set it: the weights are one version again (``wrote`` False).

        Raises:
            SessionError: the tensors were refused after receiving (unknown name, shape mismatch:
                nothing of this call written), or the receive failed (the group may be out of step
                and must be re-created). Both follow the ``+partial`` rule.
        """
        try:
            self._receive_and_load(call)
        except ValueError as e:  # refused after receiving, before writing
            raise self.refusal(f"Failed to update weights: {e}") from None
        except Exception as e:  # a failed collective or allocation: the group may be out of step
            logger.exception("update_weights_from_distributed failed")
            raise self.refusal(f"Failed to update weights: {e}; the group may be out of step (destroy and "
                               "re-create it before the next update)", before_writing=False) from None
        if call.weight_version is not None:  # a complete version: what follows starts a new mix
            self.target.weight_version = call.weight_version
            self.wrote = False

    def _receive_and_load(self, call: UpdateCall) -> None:
        import torch.distributed as dist

        if call.load_format is None:
            targets = self.target.direct_targets(call.names, call.dtypes, call.shapes)
            if targets is not None:  # every entry is a parameter as it is: receive in place, no copy
                with self.target.model_lock, torch.no_grad():
                    self.wrote = True  # from the first byte on (a failure leaves a mix)
                    for t in targets:
                        dist.broadcast(t, src=0, group=call.group)
                return
        meta = BucketMeta(names=call.names, dtypes=call.dtype_names, shapes=call.shapes)
        # one receive buffer kept across buckets and syncs (load_weights copies out of it; update
        # calls run one at a time under the write lock): no fresh pages to fault in per bucket
        if self.recv_buffer is None or self.recv_buffer.numel() < meta.nbytes:
            self.recv_buffer = None
            self.recv_buffer = torch.empty(meta.nbytes, dtype=torch.uint8)
        flat = self.recv_buffer[: meta.nbytes]  # (nbytes,)
        named = unflatten_bucket(flat, meta)  # views into flat
        if call.load_format == "flattened_bucket":
            dist.broadcast(flat, src=0, group=call.group)
        else:  # null: one broadcast per tensor, in list order, each into its view
            for _, t in named:
                dist.broadcast(t, src=0, group=call.group)
        self.target.load_weights(named)  # validates every name and shape before writing any
        self.wrote = True

    # ---- the +partial rule ------------------------------------------------------------------

    def refusal(self, message: str, *, before_writing: bool = True) -> SessionError:
        """The error for a failed update call (returned, for the caller to raise).

        The call wrote nothing (``before_writing``), but an earlier call of the open session may
        have: then the weights are a mix of two versions and the version says so (``mark_partial``).
        """
        if self.is_open and self.wrote:
            earlier = " This call changed no weight, but earlier calls of this session did." if before_writing else ""
            return SessionError(f"{message}.{earlier} {self.mark_partial()}.")
        return SessionError(f"{message}. No weight was changed.")

    def mark_partial(self) -> str:
        """Append ``PARTIAL_VERSION_SUFFIX`` to the target's version (once); returns the sentence that says so."""
        # the weights match no version: say so wherever the version shows (/model_info, every
        # generation's meta_info), so no one takes them for the old version
        if not self.target.weight_version.endswith(PARTIAL_VERSION_SUFFIX):
            self.target.weight_version += PARTIAL_VERSION_SUFFIX
        logger.warning("weights partly updated by a failed update; weight_version is now %r until all "
                       "weights are sent again", self.target.weight_version)
        return (f"The weights may be partly updated (weight_version is now {self.target.weight_version!r}); "
                "send all of them again")


class ModelUpdateLock:
    """SGLang's model-update lock on the event loop: generate = reader, updates = writer.

    A writer waits for an earlier writer, then (``wait_for_readers``) for the readers in flight,
    unless ``skip_readers()`` becomes true meanwhile (re-checked at every ``wake``); new readers wait
    while a writer holds the lock. Use from one event loop only.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False

    @property
    def writer_active(self) -> bool:
        """True while a writer holds (or waits for readers under) the lock."""
        return self._writer

    async def acquire_read(self) -> None:
        """Wait until no writer holds the lock, then count one reader in."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def release_read(self) -> None:
        """Count one reader out."""
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self, wait_for_readers: bool = True, *,
                            skip_readers: Callable[[], bool] | None = None) -> None:
        """Take the write lock; with ``wait_for_readers`` also wait until no reader is in or
        ``skip_readers()`` is true (evaluated now and at every wake-up, e.g. "the engine is paused")."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._writer = True
            if wait_for_readers:
                await self._cond.wait_for(
                    lambda: self._readers == 0 or (skip_readers is not None and skip_readers()))

    async def wake(self) -> None:
        """Wake every waiter to re-check its condition (after a pause or a hold changed)."""
        async with self._cond:
            self._cond.notify_all()

    async def release_write(self) -> None:
        """Give the write lock back."""
        async with self._cond:
            self._writer = False
            self._cond.notify_all()
