"""Trainer side of the weight sync: push HF-named tensors to rollout servers by broadcast.

The trainer rank that holds the full HF-named weights is rank 0 of a private process group
(``weight_sync.group``, SGLang's recipe; transport ``torch``) whose other ranks are the servers' TP
workers; against vLLM servers (transport ``vllm-nccl``) it is rank 0 of vLLM's own NCCL group
instead (``weight_sync.vllm_nccl``: a ``StatelessProcessGroup`` store and a ctypes NCCL
communicator, one broadcast per tensor), with the same HTTP calls around it. One
sync follows DESIGN.md step 7 and SGLANG_API.md: pause generation (abort), open the update
session, then per bucket post ``/update_weights_from_distributed`` to every server from a
thread while broadcasting the bucket's tensors (one broadcast each, ``load_format`` null, or one
uint8 tensor with ``flattened_bucket``), close the session without a label, flush the cache, then
label every server with the new ``weight_version`` (``/update_weight_version``; labels rolled back
if one fails), check that every server reports it, continue generation. A failure before the
labels leaves every server paused and reporting the version it had.

Fail-fast: a server that refuses a bucket (HTTP 400) never joins the broadcast, so the trainer
polls its HTTP answers while the broadcast is pending and raises ``WeightSyncError`` with
``group_broken=True`` instead of waiting for the collective timeout.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.errors import RolloutServerError, WeightSyncError
from megatron_rl.ports import find_free_port
from megatron_rl.weight_sync.buckets import server_weight_dtype, wire_buckets
from megatron_rl.weight_sync.group import destroy_custom_process_group, init_custom_process_group, release_in_background
from megatron_rl.weight_sync.ranks import plan_transfer_ranks
from megatron_rl.weight_sync.receiver import BroadcastReceiver, label_engines

logger = logging.getLogger(__name__)

__all__ = ["WeightSyncSender", "sync_metrics"]


def sync_metrics(stats: dict, elapsed: float, *, control_s: float) -> dict[str, float]:
    """The `weight_sync/*` metrics of one sync from `send`'s stats (summed over stages when several
    ranks sent), the whole sync's wall seconds `elapsed` and the seconds of its HTTP control calls."""
    return {
        "weight_sync/time_s": elapsed,
        "weight_sync/broadcast_time_s": stats["broadcast_time_s"],
        "weight_sync/bytes": stats["bytes"],
        "weight_sync/gbps": stats["bytes"] * 8 / 1e9 / elapsed if elapsed > 0 else 0.0,
        "weight_sync/gb_per_s": stats["bytes"] / 1e9 / elapsed if elapsed > 0 else 0.0,
        "weight_sync/bucket_prepare_time_s": stats["prepare_time_s"],
        "weight_sync/load_time_s": stats["load_time_s"],
        "weight_sync/control_time_s": control_s,
        "weight_sync/num_buckets": stats["num_buckets"],
        "weight_sync/num_tensors": stats["num_tensors"],
    }


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's values as contiguous float32 bytes."""
    return hashlib.sha256(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


class _AllWorks:
    """Several ``dist.Work`` handles seen as one (``is_completed`` / ``wait``), for ``_wait_all``."""

    def __init__(self, works: list) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout=None) -> None:
        for w in self.works:
            w.wait(timeout=timeout)


class WeightSyncSender:
    """Broadcast trainer weights to rollout servers (SGLang or embedded) over one private group.

    Args:
        clients: one client per server (``receiver.BroadcastReceiver``); each joins with its
            ``transfer_world_size()`` ranks.
        master_address: address the servers reach this process at (the TCPStore host).
        master_port: rendezvous port; None picks a free one on ``master_address``.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        group_name: name of the group on both sides (unique in this process).
        bucket_size_mib: most bytes per broadcast (a larger single tensor goes alone).
        timeout_s: rendezvous timeout, timeout of every broadcast and of every HTTP call of a sync.
        dtype: dtype the servers hold their weights in; None reads ``/model_info`` ``dtype`` from the
            first server (the embedded server reports it; when absent, tensors are sent as they are
            and the server casts on load).
        load_format: SGLang's ``load_format`` of ``/update_weights_from_distributed``:
            ``"flattened_bucket"`` (one broadcast of one uint8 tensor a bucket: the tensors are
            copied into it) or None (one broadcast per tensor, in the bucket's order: no copy on
            this side, one collective call per tensor; what slime does).
        transport: ``"torch"`` (a torch process group of ``backend``: SGLang, the embedded server
            and its vLLM-dialect stand-in) or ``"vllm-nccl"`` (vLLM's own NCCL group,
            ``weight_sync.vllm_nccl``: a CUDA GPU here, ``backend="nccl"``, ``load_format=None``).

    Call ``init_group()`` once (and again after a server restart or a ``group_broken`` error),
    ``sync(...)`` after every optimizer step, ``destroy()`` at exit. With several sending ranks
    (pipeline stages) use ``begin_update`` / ``send`` / ``finish_update`` instead of ``sync``.
    """

    def __init__(
        self,
        clients: list[BroadcastReceiver],
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        bucket_size_mib: float = 512,
        timeout_s: float = 600.0,
        dtype: torch.dtype | None = None,
        load_format: str | None = None,
        transport: str = "torch",
    ) -> None:
        if not clients:
            raise ValueError("WeightSyncSender needs at least one rollout client")
        if bucket_size_mib <= 0 or timeout_s <= 0:
            raise ValueError(f"bucket_size_mib and timeout_s must be > 0, got {bucket_size_mib}, {timeout_s}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be 'flattened_bucket' or None, got {load_format!r}")
        if transport not in ("torch", "vllm-nccl"):
            raise ValueError(f"transport must be 'torch' or 'vllm-nccl', got {transport!r}")
        if transport == "vllm-nccl" and (backend != "nccl" or load_format is not None):
            raise ValueError("transport 'vllm-nccl' is vLLM's NCCL group: it needs backend='nccl' and load_format=None "
                             f"(one broadcast per tensor), got backend={backend!r}, load_format={load_format!r}")
        self.transport = transport
        self.load_format = load_format
        self.clients = list(clients)
        self._flush_refusals_logged: set[str] = set()  # engines whose expected in-place flush refusal was logged
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.bucket_size_mib = bucket_size_mib
        self.timeout_s = timeout_s
        self.dtype = dtype
        self._pg = None  # dist.ProcessGroup (transport torch) or vllm_nccl.VllmNcclGroup
        self._inflight = None  # the broadcast of the bucket on the wire (a dist.Work or _AllWorks), until it ends
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients) + 2, thread_name_prefix="weight-sync")

    @property
    def initialized(self) -> bool:
        """True between a successful ``init_group()`` and ``destroy()``."""
        return self._pg is not None

    def _all(self, fn: Callable[[BroadcastReceiver], object]) -> list[object]:
        futures = [self._pool.submit(fn, c) for c in self.clients]
        return [f.result() for f in futures]

    def init_group(self) -> None:
        """Create the group: post ``/init_weights_update_group`` to every server while joining as rank 0.

        World size is 1 + the sum of the servers' ``transfer_world_size()`` (SGLang: TP workers;
        vLLM: TP x PP x DP); server *i* joins at rank offset 1 + the ranks of the servers before it
        (``weight_sync.ranks.plan_transfer_ranks``, checked before any server is asked to join).

        Raises:
            WeightSyncError: a server reports an impossible number of ranks or is listed twice (names
                it, with the expected and reported numbers), a server refused, or the rendezvous
                failed/timed out.
        """
        if self._pg is not None:
            raise WeightSyncError("init_group() called twice; call destroy() first")
        if self.transport == "vllm-nccl":  # fail here, before any engine is asked to join
            from megatron_rl.weight_sync.vllm_nccl import NcclUnavailableError, preflight

            try:
                preflight()
            except NcclUnavailableError as e:
                raise WeightSyncError(str(e)) from e
        port = self.master_port or find_free_port(self.master_address)
        try:
            sizes = self._all(lambda c: c.transfer_world_size())
            if self.dtype is None:
                self.dtype = server_weight_dtype(self.clients[0].model_info(), url=self.clients[0].base_url)
        except RolloutServerError as e:
            raise WeightSyncError(f"cannot query the rollout servers: {e}") from e
        # checked before any engine is asked to join: a wrong count would hang the rendezvous instead
        ranks = plan_transfer_ranks([(c.base_url, s) for c, s in zip(self.clients, sizes, strict=True)])
        world_size, offsets = ranks.world_size, ranks.offsets
        # a group of this name left by a trainer that died (a server this run did not start) would
        # make the server refuse the new one: drop it first; "no such group" is the usual answer.
        # A trainer that died mid-sync also left its update session open, which would refuse the
        # next begin_weight_update: close it too (the next sync sends every weight again)
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except RolloutServerError:
                continue
            logger.warning("%s still had a weight-update group %r (an earlier trainer's): destroyed it",
                           c.base_url, self.group_name)
            try:
                c.end_weight_update(timeout_s=self.timeout_s)
                logger.warning("%s: closed the weight-update session the earlier trainer left open", c.base_url)
            except RolloutServerError:
                pass
        posts = [
            self._pool.submit(
                c.init_weights_update_group,
                self.master_address,
                port,
                off,
                world_size,
                self.group_name,
                self.backend,
                timeout_s=self.timeout_s + 30,
            )
            for c, off in zip(self.clients, offsets)
        ]
        # the rendezvous runs in a daemon thread, not the pool: when a server refuses, this side
        # stays blocked until its timeout, and that must neither keep the process from exiting
        # nor hold one of the pool's workers
        join: Future = Future()

        device = torch.cuda.current_device() if self.transport == "vllm-nccl" else None  # this thread's

        def rendezvous() -> None:
            try:
                if self.transport == "vllm-nccl":
                    from megatron_rl.weight_sync.vllm_nccl import VllmNcclGroup

                    join.set_result(VllmNcclGroup.join(self.master_address, port, world_size,
                                                       timeout_s=self.timeout_s, device=device))
                    return
                join.set_result(init_custom_process_group(
                    backend=self.backend, host=self.master_address, port=port, world_size=world_size, rank=0,
                    group_name=self.group_name, timeout_s=self.timeout_s))
            except BaseException as e:  # noqa: BLE001  (handed to the waiting thread)
                join.set_exception(e)

        threading.Thread(target=rendezvous, name="weight-sync-rendezvous", daemon=True).start()
        self._wait_all(posts, join, "init_weights_update_group", group_op=False)
        self._pg = join.result()
        logger.info("weight-update group %r ready: world size %d, port %d", self.group_name, world_size, port)

    def _wait_all(self, posts: list[Future], pending: Future | object, what: str, group_op: bool) -> float:
        """Wait for the local side (``pending``: a Future or a ``dist.Work``) and the HTTP posts; fail fast.

        Returns the ``time.perf_counter()`` at which the local side completed (the rest of the wait
        is the servers loading what they received)."""
        deadline = time.monotonic() + self.timeout_s + 60
        is_done = pending.done if isinstance(pending, Future) else pending.is_completed
        while not is_done():
            for f in posts:
                if f.done() and f.exception() is not None:
                    raise WeightSyncError(
                        f"{what} refused by a server while the trainer was waiting for the collective: {f.exception()}",
                        group_broken=group_op,
                    ) from f.exception()
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{what}: collective did not complete in {self.timeout_s:.0f} s", group_broken=True
                )
            time.sleep(0.005)
        if isinstance(pending, Future) and pending.exception() is not None:
            raise WeightSyncError(
                f"{what}: trainer side failed: {pending.exception()}", group_broken=group_op
            ) from pending.exception()
        if not isinstance(pending, Future):
            pending.wait(timeout=timedelta(seconds=self.timeout_s))
        done_at = time.perf_counter()
        errors = []
        for f in posts:
            try:
                f.result(timeout=self.timeout_s + 60)
            except Exception as e:
                errors.append(e)
        if errors:
            raise WeightSyncError(f"{what} failed on {len(errors)} server(s): {errors[0]}") from errors[0]
        return done_at

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict[str, float]:
        """Push ``named_tensors`` (HF names, full unsharded tensors) and label them ``weight_version``.

        ``begin_update()``, ``send(...)`` and ``finish_update(...)`` in one call (one trainer rank
        holds all weights). Tensors must be on the backend's device (CPU for gloo). Floating
        tensors are cast to the servers' dtype first. The iterable is consumed lazily, one
        bucket at a time.

        Returns:
            metrics: ``weight_sync/time_s`` (whole sync, seconds), ``weight_sync/broadcast_time_s``,
            ``weight_sync/bytes`` (payload bytes broadcast), ``weight_sync/gbps`` (gigabits per second
            over the whole sync, 1e9 bits), ``weight_sync/gb_per_s`` (1e9 bytes per second, whole sync),
            ``weight_sync/bucket_prepare_time_s`` (producing the tensors: gathers, renames, cast and
            flattening), ``weight_sync/load_time_s`` (servers unflattening and loading after each
            broadcast), ``weight_sync/control_time_s`` (the HTTP calls around the buckets: pause,
            begin, end, flush, version check, continue), ``weight_sync/num_buckets``,
            ``weight_sync/num_tensors``.

        Raises:
            WeightSyncError: any step failed; the servers stay paused and may hold partly updated
                weights (the session is closed where possible). Run ``sync`` again (after
                ``destroy()`` + ``init_group()`` when ``group_broken``).
        """
        weight_version = str(weight_version)
        t0 = time.perf_counter()
        self.begin_update()
        t1 = time.perf_counter()
        try:
            stats = self.send(named_tensors)  # no label on the last bucket: finish_update labels after the flush
        except BaseException:
            self.close_session_after_error()
            raise
        t2 = time.perf_counter()
        self.finish_update(weight_version)
        elapsed = time.perf_counter() - t0
        metrics = sync_metrics(stats, elapsed, control_s=elapsed - (t2 - t1))
        logger.info(
            "weight sync to version %s: %d tensors, %.1f MiB in %d buckets, %.2f s",
            weight_version,
            stats["num_tensors"],
            stats["bytes"] / 2**20,
            stats["num_buckets"],
            elapsed,
        )
        return metrics

    def begin_update(self, pause_mode: str = "abort") -> None:
        """Pause generation on every server and open the weight-update session.

        HTTP only (no group needed): with several sending ranks (one per pipeline stage, each with
        its own ``WeightSyncSender`` and ``group_name``), the controller calls this once, the
        stages call ``send`` in a fixed order, and the controller calls ``finish_update``.

        Args:
            pause_mode: ``abort`` (the synchronous sync; requests in flight end aborted) or, for a
                live update, ``in_place`` (they stay frozen and continue on the new weights).

        Raises:
            WeightSyncError: a server refused (e.g. a session is already open).
        """
        try:
            self._all(lambda c: c.pause_generation(pause_mode))
            self._all(lambda c: c.begin_weight_update(timeout_s=self.timeout_s))
        except RolloutServerError as e:
            raise WeightSyncError(f"could not open the weight-update session: {e}") from e

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None = None
    ) -> dict[str, float]:
        """Broadcast ``named_tensors`` bucket by bucket inside an open session (see ``begin_update``).

        For each bucket, posts ``/update_weights_from_distributed`` (``flattened_bucket``,
        ``flush_cache=False``) to every server from threads while broadcasting the bucket from
        rank 0. ``weight_version``, when given, rides on the last bucket: the server takes the label
        before any flush, so the sync itself never passes it (``finish_update`` labels after the flush).

        Returns:
            ``bytes``, ``num_buckets``, ``num_tensors``, ``broadcast_time_s`` (from posting a
            bucket's HTTP calls to the end of its broadcast), ``load_time_s`` (from there to the
            servers' answers: unflattening and loading), ``prepare_time_s`` (producing the buckets:
            gathers, renames, cast, flattening), all summed over buckets (floats).

        Raises:
            WeightSyncError: no tensors, a server refused a bucket (``group_broken=True`` when it
                did so while the broadcast was pending), or the collective failed or timed out.
        """
        if self._pg is None:
            raise WeightSyncError("send() before init_group()")
        nbytes = num_buckets = num_tensors = 0
        broadcast_s = prepare_s = load_s = 0.0
        try:
            tp = time.perf_counter()
            flatten = self.load_format == "flattened_bucket"
            buckets = wire_buckets(named_tensors, dtype=self.dtype, bucket_size_mib=self.bucket_size_mib,
                                   flatten=flatten)
            current = next(buckets, None)
            prepare_s += time.perf_counter() - tp
            if current is None:
                raise WeightSyncError("no tensors to send")
            while current is not None:
                flat, meta, is_last = current
                posts = [
                    self._pool.submit(
                        c.update_weights_from_distributed,
                        meta.names,
                        meta.dtypes,
                        meta.shapes,
                        group_name=self.group_name,
                        flush_cache=False,
                        weight_version=weight_version if is_last else None,
                        load_format=self.load_format,
                        timeout_s=self.timeout_s,
                    )
                    for c in self.clients
                ]
                tb = time.perf_counter()
                if self.transport == "vllm-nccl":  # one ncclBroadcast per tensor, in the posted order
                    work = self._pg.broadcast(flat)
                elif flatten:
                    work = dist.broadcast(flat, src=0, group=self._pg, async_op=True)
                else:  # one collective per tensor, in list order
                    work = _AllWorks([dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in flat])
                # the next bucket is gathered and flattened while this one is on the wire
                tp = time.perf_counter()
                following = None if is_last else next(buckets)
                prepare_s += time.perf_counter() - tp
                self._inflight = work
                done_at = self._wait_all(posts, work, f"bucket {num_buckets} ({len(meta.names)} tensors)", group_op=True)
                self._inflight = None
                broadcast_s += done_at - tb
                load_s += time.perf_counter() - done_at
                nbytes += flat.numel() if flatten else sum(t.numel() * t.element_size() for t in flat)
                num_buckets += 1
                num_tensors += len(meta.names)
                current = following
        except (RolloutServerError, RuntimeError) as e:
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight broadcast failed: {e}", group_broken=True) from e
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
            # bad input from the tensor iterable (a repeated name, a non-tensor): a bucket may be on
            # the wire already, so the group is treated as broken (the caller re-creates it)
            raise WeightSyncError(f"cannot send the weights: {type(e).__name__}: {e}", group_broken=True) from e
        return {
            "bytes": float(nbytes),
            "num_buckets": float(num_buckets),
            "num_tensors": float(num_tensors),
            "broadcast_time_s": broadcast_s,
            "prepare_time_s": prepare_s,
            "load_time_s": load_s,
        }

    def finish_update(self, weight_version: str, *, flush_refusal_ok: bool = False,
                      before_continue: Callable[[], None] | None = None) -> None:
        """Close the session (no label), flush the cache, label every server ``weight_version``, check
        the labels, continue generation. The label comes last, so a refused flush leaves every
        server paused and reporting the version it had (DESIGN.md step 7).

        Args:
            weight_version: the label every server gets and must then report.
            flush_refusal_ok: a live update paused ``in_place``: the flush does not wait for the
                requests frozen in a server (they cannot finish while paused), and a server that
                refuses it for them (SGLang's rule: their KV cache is kept on purpose) is logged,
                not an error; those requests continue on the new weights.
            before_continue: called after the version check, right before the continue (the
                publisher records the version the engines now hold there).

        Raises:
            WeightSyncError: a call failed (a refused flush or label names the server; labels set
                before a failed one are rolled back) or a server reports another ``weight_version``
                (then the servers stay paused: never sample from weights the trainer does not hold).
        """
        weight_version = str(weight_version)

        def flush(c) -> None:
            try:
                c.flush_cache(timeout_s=0.0 if flush_refusal_ok else min(30.0, self.timeout_s))
            except RolloutServerError as e:
                if not (flush_refusal_ok and e.status_code == 400):
                    raise WeightSyncError(f"{c.base_url} refused the cache flush after the weight update: {e}; the "
                                          "engines stay paused and keep their old weight_version labels") from e
                level = logging.DEBUG if c.base_url in self._flush_refusals_logged else logging.INFO
                self._flush_refusals_logged.add(c.base_url)
                logger.log(level, "%s kept its prefix cache after the update: with rollout.pause_mode=in_place the "
                           "requests paused in place are still running, so the engine refuses /flush_cache as "
                           "expected (docs/ASYNC.md; logged once per engine): %s", c.base_url, str(e).strip())

        try:
            self._all(lambda c: c.end_weight_update(timeout_s=self.timeout_s))
            self._all(flush)
            label_engines(self.clients, weight_version)
            versions = self._all(lambda c: c.weight_version())
        except RolloutServerError as e:
            raise WeightSyncError(f"closing the weight update failed: {e}") from e
        stale = [(c.base_url, v) for c, v in zip(self.clients, versions, strict=True) if v != weight_version]
        if stale:
            raise WeightSyncError(f"servers report a weight_version other than {weight_version!r}: {stale}")
        if before_continue is not None:
            before_continue()
        try:
            self._all(lambda c: c.continue_generation())
        except RolloutServerError as e:
            raise WeightSyncError(f"continue_generation failed: {e}") from e

    def close_session_after_error(self) -> None:
        """Close the open update session on every server after a failed send (best effort, logged)."""
        for c in self.clients:
            try:
                c.end_weight_update(timeout_s=min(30.0, self.timeout_s))
            except RolloutServerError as e:  # reported; the original error is what the caller sees
                logger.warning("end_weight_update on %s after a failed sync: %s", c.base_url, e)

    def destroy(self) -> None:
        """Destroy the group on the servers and here (best effort on the servers; idempotent)."""
        if self._pg is None:
            return
        pg, self._pg = self._pg, None
        pending, self._inflight = self._inflight, None
        if pending is not None and pending.is_completed():
            pending = None
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except RolloutServerError as e:
                logger.warning("destroy_weights_update_group on %s: %s", c.base_url, e)
        try:
            if self.transport == "vllm-nccl":
                pg.destroy()
            else:
                destroy_custom_process_group(pg)
        except Exception as e:  # noqa: BLE001 - a group whose peer died may not tear down cleanly
            logger.warning("destroying the local side of weight-update group %r: %s", self.group_name, e)
        if pending is not None and self.transport != "vllm-nccl":
            # a server refused a bucket: its sends never complete, and gloo's destructor would wait for
            # them (until the timeout, or until the servers leave the group at the re-init that follows)
            logger.info("weight-update group %r had a broadcast pending (a server never joined it); released in "
                        "the background", self.group_name)
            box = [pg, pending]
            del pg, pending  # the daemon thread must drop the last references
            release_in_background(box)

    def checksums(self, named_tensors: Iterable[tuple[str, torch.Tensor]], into: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``named_tensors`` through unchanged while recording, in ``into``, each floating
        tensor's checksum after the sync's cast (``name -> (sha256, shape)``). Wrap the tensors of
        a ``sync`` with it, then call ``check_checksums(into)``: one pass over the weights."""
        for name, tensor in named_tensors:
            if tensor.is_floating_point():
                cast = tensor if self.dtype is None else tensor.to(self.dtype)
                into[name] = (_digest(cast), list(tensor.shape))
            yield name, tensor

    def check_checksums(self, expected: dict) -> dict[str, float]:
        """After a sync: compare a per-tensor checksum of what every server holds with the trainer's.

        ``expected`` comes from ``checksums``. The server's values come from
        ``/get_weights_by_name`` (every row); both sides hash the float32 bytes (SHA-256; exact,
        since the endpoint returns every value as a float). A server that does not know an HF name
        (SGLang keeps fused names such as ``qkv_proj``) counts it as unverifiable, not as a mismatch.

        Returns:
            ``weight_sync/checked_tensors``, ``weight_sync/unverifiable_tensors`` (summed over servers).

        Raises:
            WeightSyncError: a server's checksum differs (names the server and the tensors).
        """
        checked = unverifiable = 0
        mismatched: dict[str, list[str]] = {}
        for name, (want, shape) in expected.items():
            rows = shape[0] if shape else 1
            for c in self.clients:
                try:
                    values = c.get_weights_by_name(name, truncate_size=rows)
                except RolloutServerError as e:
                    if e.status_code == 400:
                        unverifiable += 1
                        continue
                    raise WeightSyncError(f"checksum check: {c.base_url} failed on {name}: {e}") from e
                got = torch.tensor(values, dtype=torch.float32)
                if got.numel() != math.prod(shape) or _digest(got) != want:
                    mismatched.setdefault(c.base_url, []).append(name)
                checked += 1
        if mismatched:
            detail = "; ".join(f"{url}: {names[:5]}{'...' if len(names) > 5 else ''} ({len(names)} tensors)"
                               for url, names in mismatched.items())
            raise WeightSyncError(f"checksum check after the sync: servers hold other weights than the trainer: {detail}")
        return {"weight_sync/checked_tensors": float(checked), "weight_sync/unverifiable_tensors": float(unverifiable)}

    def reinit(self, clients: list[BroadcastReceiver]) -> None:
        """Re-create the group over ``clients`` (after a server restart, a dropped server, or a
        ``group_broken`` error): destroy the old one (best effort: a dead server cannot answer),
        then ``init_group()``. The servers' dtype is read again.

        Raises:
            WeightSyncError: as ``init_group``.
        """
        if not clients:
            raise WeightSyncError("no rollout server is up to sync to")
        self.destroy()
        self.clients = list(clients)
        if self._pool._max_workers < len(self.clients) + 2:
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=len(self.clients) + 2, thread_name_prefix="weight-sync")
        self.init_group()

    def close(self) -> None:
        """``destroy()`` and stop the worker threads."""
        self.destroy()
        self._pool.shutdown(wait=False)
