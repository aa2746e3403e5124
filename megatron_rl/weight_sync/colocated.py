"""Colocated mode's trainer side (issue 17): the engines' memory protocol and the IPC sender.

The order of one step (CASES.md N11), each phase timed with its memory logged (`PhaseLog`):

    generate -> engines.release(weights, kv_cache) [wait until freed] -> trainer onload -> train
    -> trainer offload -> empty cache -> engines.resume(weights) -> update_weights_from_tensor
    (bucket by bucket, ipc_collect after each) -> ipc_collect -> engines.resume(kv_cache) -> generate

`EngineMemory` (controller) does the engine phases; `ColocatedWeightSender` is the publisher's
sender in colocated mode (same interface as `WeightSyncSender`: `init_group`, `begin_update`,
`send`, `finish_update`, ...) and calls `EngineMemory.resume` around the update, so the weights
are never resumed before the trainer has offloaded (the publisher runs after `after_train`).
The trainer phases (onload / offload) are `megatron_rl.trainer.offload`'s.

Memory readings: `gpu/mem_used_gib` of this process's device on GPU; the RSS (GiB) of the trainer
and of each engine (the embedded server's `X-RSS-*` answers) on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Callable, Optional

import torch

from megatron_rl.errors import RolloutServerError, WeightSyncError
from megatron_rl.weight_sync.buckets import bucket_named_tensors, cast_named_tensors, server_weight_dtype
from megatron_rl.weight_sync.ipc import ColocatedSender, serialize_named_tensors
from megatron_rl.weight_sync.receiver import TensorReceiver, label_engines

logger = logging.getLogger(__name__)

__all__ = ["ColocatedWeightSender", "EngineMemory", "PhaseLog", "memory_gib", "wait_device_freed"]

GIB = float(2**30)


def memory_gib() -> dict[str, float]:
    """This process's memory now: `gpu/mem_used_gib` (device memory in use, CUDA) or
    `colocate/trainer_rss_gib` (resident set size, CPU)."""
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        return {"gpu/mem_used_gib": torch.cuda.device_memory_used() / GIB}
    try:
        import os

        with open("/proc/self/statm") as f:
            return {"colocate/trainer_rss_gib": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB}
    except (OSError, ValueError):
        return {}


class PhaseLog:
    """Seconds and memory before/after of each colocated phase of a step, as metrics
    `colocate/<phase>_s`, `colocate/<phase>_<reading>_before|after`."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.order: list[str] = []

    def run(self, phase: str, fn: Callable[[], object]) -> object:
        """Run `fn()` as `phase`; record its time and the memory before and after. Returns its result."""
        before = memory_gib()
        t0 = time.perf_counter()
        out = fn()
        self.metrics[f"colocate/{phase}_s"] = time.perf_counter() - t0
        after = memory_gib()
        for k, v in before.items():
            name = k.split("/", 1)[1]
            self.metrics[f"colocate/{phase}_{name}_before"] = v
            self.metrics[f"colocate/{phase}_{name}_after"] = after.get(k, v)
        self.order.append(phase)
        logger.debug("colocated phase %s: %.3f s, %s -> %s", phase, self.metrics[f"colocate/{phase}_s"],
                     {k: round(v, 3) for k, v in before.items()}, {k: round(v, 3) for k, v in after.items()})
        return out

    def take(self) -> dict[str, float]:
        """The metrics recorded since the last `take` (and forget them); logs them as one INFO line
        (each phase's line is DEBUG: `colocate/*` in metrics.jsonl has every number)."""
        out, order, self.metrics, self.order = self.metrics, self.order, {}, []
        if order:
            logger.info("colocated phases: %s", ", ".join(f"{p} {out[f'colocate/{p}_s']:.3f} s" for p in order))
        return out


def wait_device_freed(poll: Callable[[], float], threshold_gib: float, *, what: str, max_polls: int = 60,
                      poll_interval_s: float = 1.0) -> None:
    """Poll `poll()` (device GiB in use) until it is below `threshold_gib` (a release may return
    before the memory is free: slime #579).

    Raises:
        WeightSyncError: still at or above the threshold after `max_polls` polls (names `what`
            and the last reading).
    """
    reading = poll()
    for _ in range(max_polls):
        if reading < threshold_gib:
            return
        time.sleep(poll_interval_s)
        reading = poll()
    if reading >= threshold_gib:
        raise WeightSyncError(f"{what} released their memory but the device still uses {reading:.1f} GiB "
                              f"(>= {threshold_gib:.1f} GiB) after {max_polls} polls")


class EngineMemory:
    """The controller's view of what the colocated engines hold, and the release / resume calls.

    Args:
        clients: `() -> the engines' clients` (SGLang API; the fleet's clients that are up now).
        log: where phases are timed.
        release_poll: GPU only: `() -> device GiB in use`, polled after a release until it falls
            below `release_threshold_gib` (a release may return before the memory is free:
            slime #579); None skips the poll (CPU: the embedded server frees before it answers).
        release_threshold_gib: see `release_poll`.
        max_polls, poll_interval_s: how long to poll (`WeightSyncError` naming the engine and the
            reading after that).
    """

    def __init__(self, clients: Callable[[], list[TensorReceiver]], log: PhaseLog, *,
                 release_poll: Optional[Callable[[], float]] = None, release_threshold_gib: float = 0.0,
                 max_polls: int = 60, poll_interval_s: float = 1.0) -> None:
        self.clients = clients
        self.log = log
        self.released: set[str] = set()
        self.release_poll = release_poll
        self.release_threshold_gib = release_threshold_gib
        self.max_polls = max_polls
        self.poll_interval_s = poll_interval_s
        self.engine_rss: dict[str, float] = {}

    def _call(self, what: str, tags: list[str]) -> None:
        for c in self.clients():
            try:
                rep = getattr(c, what)(tags)
            except RolloutServerError as e:
                raise WeightSyncError(f"{what}({tags}) on {c.base_url} failed: {e}") from e
            if "rss_after" in rep:
                self.engine_rss[c.base_url] = rep["rss_after"] / GIB
                self.log.metrics[f"colocate/engine_rss_gib_after_{what.split('_')[0]}_{'+'.join(tags)}"] = (
                    sum(self.engine_rss.values()))

    def release(self) -> None:
        """Release weights and KV cache on every engine (they must be idle) and wait until freed."""
        def run():
            self._call("release_memory_occupation", ["weights", "kv_cache"])
            self.released = {"weights", "kv_cache"}
            if self.release_poll is not None:
                self._wait_freed()

        self.log.run("engine_release", run)

    def _wait_freed(self) -> None:
        wait_device_freed(self.release_poll, self.release_threshold_gib,
                          what="engines " + ", ".join(c.base_url for c in self.clients()),
                          max_polls=self.max_polls, poll_interval_s=self.poll_interval_s)


    def resume(self, tag: str) -> None:
        """Resume `tag` ("weights" or "kv_cache") on every engine, if it was released."""
        if tag not in self.released:
            return
        if tag == "kv_cache" and torch.cuda.is_available():  # pragma: no cover - GPU only
            torch.cuda.empty_cache()  # VMM allocations cannot see PyTorch's cached pages (verl #6912)

        def run():
            self._call("resume_memory_occupation", [tag])
            self.released.discard(tag)

        self.log.run(f"engine_resume_{tag}", run)


class ColocatedWeightSender:
    """The publisher's sender in colocated mode: the trainer's HF-named tensors handed to every
    engine by IPC handles (`/update_weights_from_tensor`), in one of SGLang's two formats:

    - `load_format` None (`weight_sync.load_format: null`, the default in runs; verl's colocated
      SGLang path): lists of `(name, tensor)` pairs, each tensor pickled as a handle to its own
      storage. The publisher then hands over views of the trainer's parameters
      (`iter_hf_weights(copy=False)`), so the engine's copy into its parameters is the only copy: on
      CPU the first update moves each parameter storage into shared memory in place
      (`UntypedStorage.share_memory_`; the parameters keep their values and every view of them), later
      updates find it there; on GPU (untested here) the handles are CUDA IPC handles of the
      parameters. Tensors that need a conversion (q/k/v regrouped, a dtype cast) are fresh and
      copied once into a segment freed after the update.
    - `flattened_bucket`: buckets packed into reused buffers (`buffers`, `keep_buffer`), two copies
      (into the buffer, out of it).

    Args:
        clients: the clients of the engines this process hands tensors to (its own node's,
            through the loopback address); may be empty on a node whose engines are all down.
        control_clients: the engines whose sessions this process opens and closes (the
            controller: every node's engines); default `clients`.
        memory: the controller's `EngineMemory` (resume weights before, KV after), None on a
            source that is not the controller.
        bucket_size_mib: bytes per bucket (each of the `buffers` reusable buffers has this size).
        timeout_s: timeout of each HTTP call, seconds.
        dtype: the engines' weight dtype; None reads `/model_info`.
        keep_buffer: keep the bucket buffers between updates (freed at `close`): no fresh pages to
            fault in per update, but the bucket-sized segments stay alive between updates. Default
            False: nothing the trainer created outlives an update (CASES.md N12).
        buffers: bucket buffers used in turn: 1 (default) packs a bucket, waits for every engine,
            packs the next; 2 double-buffers (bucket k+1 is packed while the engines copy bucket k
            out of the other buffer; the calls go out in order from one helper thread), which hides
            per-bucket latency but doubles the staging memory. Measured on CPU it gains nothing:
            the trainer's packing and the engine's copy are both bound by the same memory
            bandwidth (benchmarks/README.md, "colocated hand-over").
        load_format: "flattened_bucket" (the default here) or None / "direct" (named tensors, above).

    Raises:
        ValueError: no clients at all, `buffers` not 1 or 2, or an unknown `load_format`.
    """

    def __init__(self, clients: list[TensorReceiver], *, control_clients: Optional[list[TensorReceiver]] = None,
                 memory: Optional[EngineMemory] = None,
                 bucket_size_mib: float = 512.0, timeout_s: float = 600.0, dtype: torch.dtype | None = None,
                 keep_buffer: bool = False, buffers: int = 1, load_format: Optional[str] = "flattened_bucket") -> None:
        if not clients and not control_clients:
            raise ValueError("ColocatedWeightSender needs at least one rollout client")
        if buffers not in (1, 2):
            raise ValueError(f"ColocatedWeightSender: buffers must be 1 or 2, got {buffers}")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise ValueError(f"ColocatedWeightSender: load_format must be null, 'direct' or 'flattened_bucket', "
                             f"got {load_format!r}")
        self.load_format = load_format
        self.buffers = buffers
        self.clients = list(clients)
        self.control_clients = list(control_clients) if control_clients is not None else self.clients
        self.memory = memory
        self.bucket_size_mib = bucket_size_mib
        self.timeout_s = timeout_s
        self.dtype = dtype
        self._ready = False
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.keep_buffer = keep_buffer
        self._kept: Optional[list[ColocatedSender]] = None

    @property
    def takes_views(self) -> bool:
        """True when the tensors to send may be views of the trainer's parameters (named tensors:
        the handles point at the parameters themselves); the publisher then skips its copies."""
        return self.load_format != "flattened_bucket"

    @property
    def initialized(self) -> bool:
        """True after `init_group` (there is no process group: the engines' dtype is known)."""
        return self._ready

    def init_group(self) -> None:
        """No group to create: read the engines' weight dtype (`/model_info` of this node's first
        engine; none to read on a node whose engines are all down: it sends nothing)."""
        if self.dtype is None and self.clients:
            first = self.clients[0]
            try:
                self.dtype = server_weight_dtype(first.model_info(), url=first.base_url)
            except RolloutServerError as e:
                raise WeightSyncError(f"cannot read the engines' dtype: {e}") from e
        self._ready = True

    def begin_update(self, pause_mode: str = "abort") -> None:
        """Resume the engines' weights (if released), pause them (`pause_mode`, the publisher's; always
        `abort` here since colocation needs `trainer.max_staleness: 0`) and open the update session."""
        try:
            if self.memory is not None:
                self.memory.resume("weights")
            for c in self.control_clients:
                c.pause_generation(pause_mode)
                c.begin_weight_update(timeout_s=self.timeout_s)
        except RolloutServerError as e:
            raise WeightSyncError(f"could not open the weight-update session: {e}") from e

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
             weight_version: str | None = None) -> dict[str, float]:
        """Hand `named_tensors` over bucket by bucket through `buffers` reused buffers (the calls of
        one bucket go to every engine in turn, buckets in order, from one helper thread while the
        next bucket is packed; a buffer is packed again only once every engine has answered for it
        and its handles are collected; the buffers are freed at the end unless `keep_buffer`).
        Returns the stats of `WeightSyncSender.send`: `prepare_time_s` = packing on this thread,
        `broadcast_time_s` = the rest of the hand-over's wall time (calls not hidden behind
        packing), so the two add up to the hand-over's wall time as in the broadcast path.

        Raises:
            WeightSyncError: no tensors, or an engine refused a bucket: the first failure in bucket
                order is raised, after the buckets in flight ended; buckets queued behind a failed
                one are not sent (no engine gets the version label without every bucket before it).
        """
        import threading
        from concurrent.futures import Future, ThreadPoolExecutor

        if self.takes_views:
            return self._send_named(named_tensors, weight_version)
        t_all = time.perf_counter()
        senders = self._kept or [ColocatedSender(int(self.bucket_size_mib * 2**20), self.device)
                                 for _ in range(self.buffers)]
        if self.keep_buffer:
            self._kept = senders
        stats = dict.fromkeys(("bytes", "num_buckets", "num_tensors", "broadcast_time_s", "prepare_time_s",
                               "load_time_s"), 0.0)
        inflight: list[Optional[Future]] = [None] * len(senders)
        failed = threading.Event()  # a bucket failed: the ones queued behind it are not sent

        def post(payloads: list[str], version: str | None) -> None:
            if failed.is_set():
                raise WeightSyncError("not sent: an earlier bucket failed")
            try:
                for c, payload in zip(self.clients, payloads, strict=True):
                    c.update_weights_from_tensor([payload], load_format="flattened_bucket", flush_cache=False,
                                                 weight_version=version, timeout_s=self.timeout_s)
            except BaseException:
                failed.set()
                raise

        def settle(slot: int) -> None:
            """Wait for the bucket in `slot` (raises its error) and collect its handles."""
            fut, inflight[slot] = inflight[slot], None
            if fut is not None:
                try:
                    fut.result()
                finally:
                    senders[slot].after_bucket()  # ipc_collect (CUDA) once every engine has answered

        pool = ThreadPoolExecutor(1, thread_name_prefix="colocated-handover") if len(senders) > 1 else None
        try:
            buckets = bucket_named_tensors(cast_named_tensors(named_tensors, self.dtype), self.bucket_size_mib)
            current = next(buckets, None)
            if current is None:
                raise WeightSyncError("no tensors to send")
            index = 0
            while current is not None:
                following = next(buckets, None)
                slot = index % len(senders)
                settle(slot)
                tp = time.perf_counter()
                payloads = senders[slot].payloads(current, len(self.clients))
                stats["prepare_time_s"] += time.perf_counter() - tp
                version = weight_version if following is None else None
                if pool is None:
                    done = Future()
                    try:
                        post(payloads, version)
                        done.set_result(None)
                    except BaseException as e:  # noqa: BLE001 - raised by settle, in bucket order
                        done.set_exception(e)
                    inflight[slot] = done
                else:
                    inflight[slot] = pool.submit(post, payloads, version)
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in current)
                stats["num_buckets"] += 1
                stats["num_tensors"] += len(current)
                current, index = following, index + 1
            for k in range(index, index + len(senders)):  # oldest bucket first: its error is the one raised
                settle(k % len(senders))
        except RolloutServerError as e:
            raise WeightSyncError(f"colocated weight hand-over failed: {e}") from e
        except (ValueError, TypeError) as e:  # bad input from the tensor iterable
            raise WeightSyncError(f"cannot hand the weights over: {type(e).__name__}: {e}") from e
        finally:
            for slot, fut in enumerate(inflight):  # after an error: nothing may still read a buffer we free
                if fut is not None:
                    try:
                        fut.result()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
                    senders[slot].after_bucket()
            if pool is not None:
                pool.shutdown(wait=True)
            if not self.keep_buffer:
                for sender in senders:
                    sender.close()
        elapsed = time.perf_counter() - t_all
        stats["broadcast_time_s"] = max(elapsed - stats["prepare_time_s"], 0.0)
        logger.debug("colocated hand-over: %d tensors, %.1f MiB in %.3f s", stats["num_tensors"],
                    stats["bytes"] / 2**20, elapsed)
        return stats

    def _send_named(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> dict:
        """`send` with named tensors (`load_format` None): chunks of at most `bucket_size_mib` of
        referenced bytes, each serialised once (handles to the tensors' own storages, moved into
        shared memory if they are not there yet) and posted to every engine in turn; the version
        label goes with the last chunk. Same stats and errors as `send`."""
        t_all = time.perf_counter()
        stats = dict.fromkeys(("bytes", "num_buckets", "num_tensors", "broadcast_time_s", "prepare_time_s",
                               "load_time_s"), 0.0)
        try:
            chunks = bucket_named_tensors(cast_named_tensors(named_tensors, self.dtype), self.bucket_size_mib)
            current = next(chunks, None)
            if current is None:
                raise WeightSyncError("no tensors to send")
            while current is not None:
                following = next(chunks, None)
                tp = time.perf_counter()
                # one serialisation per engine: each takes one reference on the segments and each engine
                # drops one (`ipc.serialize_named_tensors`); one payload read by two engines would let a
                # parameter's segment be unlinked while the parameters still live in it
                payloads = [serialize_named_tensors(current) for _ in self.clients]
                stats["prepare_time_s"] += time.perf_counter() - tp
                for c, payload in zip(self.clients, payloads, strict=True):
                    c.update_weights_from_tensor([payload], load_format=self.load_format, flush_cache=False,
                                                 weight_version=weight_version if following is None else None,
                                                 timeout_s=self.timeout_s)
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in current)
                stats["num_buckets"] += 1
                stats["num_tensors"] += len(current)
                current = following
        except RolloutServerError as e:
            raise WeightSyncError(f"colocated weight hand-over failed: {e}") from e
        except (ValueError, TypeError) as e:  # bad input from the tensor iterable
            raise WeightSyncError(f"cannot hand the weights over: {type(e).__name__}: {e}") from e
        finally:
            if self.device != "cpu":  # pragma: no cover - GPU only
                torch.cuda.ipc_collect()
        elapsed = time.perf_counter() - t_all
        stats["broadcast_time_s"] = max(elapsed - stats["prepare_time_s"], 0.0)
        logger.debug("colocated hand-over (named tensors): %d tensors, %.1f MiB in %.3f s", stats["num_tensors"],
                    stats["bytes"] / 2**20, elapsed)
        return stats

    def finish_update(self, weight_version: str, *, flush_refusal_ok: bool = False,
                      before_continue=None) -> None:
        """Close the session (no label), resume the KV cache, flush, label every engine
        `weight_version` (rolled back if one fails), check the labels, continue (the
        `WeightSyncSender.finish_update` signature and order: `before_continue()` runs just before the
        continue; `flush_refusal_ok` never applies, nothing is in flight in colocated mode).

        Raises:
            WeightSyncError: a call failed (a refused flush or label names the engine; the engines
                stay paused with their old labels) or an engine reports another version.
        """
        weight_version = str(weight_version)
        try:
            for c in self.control_clients:
                c.end_weight_update(timeout_s=self.timeout_s)
            if self.memory is not None:
                self.memory.resume("kv_cache")
            for c in self.control_clients:
                try:
                    c.flush_cache(timeout_s=min(30.0, self.timeout_s))
                except RolloutServerError as e:
                    raise WeightSyncError(f"{c.base_url} refused the cache flush after the weight update: {e}; the "
                                          "engines stay paused and keep their old weight_version labels") from e
            label_engines(self.control_clients, weight_version)
            stale = [(c.base_url, v) for c in self.control_clients if (v := c.weight_version()) != weight_version]
            if stale:
                raise WeightSyncError(f"engines report a weight_version other than {weight_version!r}: {stale}")
            if before_continue is not None:
                before_continue()
            for c in self.control_clients:
                c.continue_generation()
        except RolloutServerError as e:
            raise WeightSyncError(f"closing the colocated weight update failed: {e}") from e

    def close_session_after_error(self) -> None:
        """Close the open session on every engine after a failed hand-over (best effort)."""
        for c in self.control_clients:
            try:
                c.end_weight_update(timeout_s=min(30.0, self.timeout_s))
            except RolloutServerError as e:
                logger.warning("end_weight_update on %s after a failed hand-over: %s", c.base_url, e)

    def checksums(self, named_tensors, into: dict):
        """As `WeightSyncSender.checksums` (pass-through that records checksums)."""
        from megatron_rl.weight_sync.sender import _digest

        for name, tensor in named_tensors:
            if tensor.is_floating_point():
                into[name] = (_digest(tensor if self.dtype is None else tensor.to(self.dtype)), list(tensor.shape))
            yield name, tensor

    def check_checksums(self, expected: dict) -> dict[str, float]:
        """As `WeightSyncSender.check_checksums`."""
        from megatron_rl.weight_sync.sender import WeightSyncSender

        return WeightSyncSender.check_checksums(self, expected)  # type: ignore[arg-type]

    def destroy(self) -> None:
        """No process group to tear down; frees a kept buffer."""
        self._ready = False
        for sender in self._kept or []:
            sender.close()
        self._kept = None

    def close(self) -> None:
        """As `destroy`."""
        self.destroy()
