"""Asynchronous (off-policy) rollout production: generate step s+1 while step s trains.

ALGORITHMS.md section 8 / DESIGN.md "Stages and engines". With `trainer.max_staleness` = eta > 0
the controller runs the `RolloutProducer` on a thread of its own, one step after another, ahead
of the trainer. Admission is controlled per step, not by discarding stale samples afterwards
(case N03): the generation of step s starts only once the published weight version is
>= s - 1 - eta. Step s trains with version s - 1, so every sample of it was produced by weights at
most eta versions old, every prompt is trained exactly once and in dataset order, and nothing is
thrown away for staleness (`train/stale_discarded` reads 0 by construction). eta = 0 admits step s
only after step s-1's weights are published: no generation on W0 while W0's batch trains (case
N01), the synchronous step exactly - the loop then does not use this thread at all.

This is AReaL's admission rule (arXiv 2505.24298; DESIGN.md "Stages and engines": capacity at
version v = (eta + v + 1) x batch) counted in whole steps: at version v the steps admitted so far
are at most v + eta + 1. Deliberate deviation: the steps are produced one after another, so step
s+1 starts once step s's generation is done even where the gate would admit it earlier (eta >= 2);
dynamic sampling's extra generation batches belong to the step that needs them.

The queue holds at most eta + 1 produced steps (backpressure: the producer waits at the gate, the
engines' callbacks never block). The trainer takes steps in order; its wait is logged
(`timing/wait_rollout_s`).

The run state saved with a checkpoint of step s must describe the data cursor and difficulty
history right after step s was produced, not wherever the producer has got to since: each
`ProducedStep` carries that snapshot (`state`), and a resumed run produces step s+1 anew (with the
resumed weights; nothing is lost or counted twice, the regenerated samples are fresher).

A weight publish from the producer's thread (an engine restarted mid-rollout must be re-synced
before it serves) would race the trainer's collectives, so it is handed to the main thread: the
producer blocks in `request_resync` until the main thread's next publish (a step's end, or
`take` while the trainer waits) has re-synced every engine. Except while the main thread
evaluates (`evaluating`): it then waits for requests of its own, in no collective, with the other
ranks listening for the publisher's plans, so a re-sync asked for from any thread runs right
there on that thread (`resync_from_thread`), and one already pending when the evaluation starts
runs first on the main thread; otherwise an engine that died during an evaluation would never be
re-synced (the main thread waits for the evaluation's requests, which wait for the re-sync).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Optional

from megatron_rl.errors import RolloutServerError

logger = logging.getLogger(__name__)

__all__ = ["AsyncProducer", "StalenessGate", "start_async_producer"]


class StalenessGate:
    """Admission control at step granularity: step s may start generating once the published
    weight version v satisfies v >= s - 1 - eta.

    Args:
        max_staleness: eta (`trainer.max_staleness`), >= 0.
        version: the weight version published when the gate is built (the trainer's
            `weight_version`: 0 at the start, the checkpoint's on resume).

    Raises:
        ValueError: eta < 0.
    """

    def __init__(self, max_staleness: int, version: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0, got {max_staleness}")
        self.eta = int(max_staleness)
        self._version = int(version)
        self._closed = False
        self._cv = threading.Condition()

    @property
    def version(self) -> int:
        """The newest published weight version."""
        with self._cv:
            return self._version

    def may_start(self, step: int) -> bool:
        """True when step `step` (1-based) may start generating at the current version."""
        with self._cv:
            return self._version >= step - 1 - self.eta

    def wait_start(self, step: int, timeout: Optional[float] = None) -> bool:
        """Block until step `step` may start; False when the gate was closed (or `timeout` s passed)."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self._closed or self._version >= step - 1 - self.eta, timeout)
            return bool(ok) and not self._closed

    def published(self, version: int) -> None:
        """The trainer published `version` (monotone; an older one is ignored)."""
        with self._cv:
            self._version = max(self._version, int(version))
            self._cv.notify_all()

    def close(self) -> None:
        """Wake and refuse every waiter (the run is stopping)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class AsyncProducer:
    """Runs `produce(step)` for steps `first..last` on a thread, ahead of the trainer by the gate.

    Args:
        produce: `step -> ProducedStep` (`RolloutProducer.produce`); called on the producer thread
            only, in step order.
        snapshot: `() -> dict`, the run state to save with a checkpoint of the step just produced
            (data cursor, difficulty history); called on the producer thread right after `produce`.
        gate: the `StalenessGate`.
        first / last: the steps to produce (inclusive). `last` may be beyond where the run stops
            (a token budget): surplus steps are simply never taken.
        abort: called by `close` to abort the engines' in-flight requests (may be None).
        poll_s: how often `take` looks for a pending re-sync while it waits, seconds.
    """

    def __init__(self, produce: Callable[[int], object], snapshot: Callable[[], dict], gate: StalenessGate, *,
                 first: int, last: int, abort: Optional[Callable[[], None]] = None, poll_s: float = 0.05) -> None:
        self._produce, self._snapshot, self.gate = produce, snapshot, gate
        self.first, self.last = int(first), int(last)
        self._abort = abort
        self._poll_s = poll_s
        self._q: queue.Queue = queue.Queue()
        self._resync_lock = threading.Lock()
        self._resync_cv = threading.Condition(self._resync_lock)
        self._resync_pending: Optional[threading.Event] = None
        self._evaluating = False  # the main thread is inside `evaluating`
        self._direct_resyncs = 0  # re-syncs running on other threads meanwhile
        self._direct_serial = threading.Lock()
        self._closed = False
        self.start_versions: dict[int, int] = {}
        """step -> the published version when its generation started."""
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> "AsyncProducer":
        self._thread.start()
        return self

    # ---- producer thread -------------------------------------------------------------------

    def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            if not self.gate.wait_start(step):
                return
            self.start_versions[step] = self.gate.version
            try:
                produced = self._produce(step)
                produced.state = self._snapshot()
                produced.start_version = self.start_versions[step]
            except BaseException as e:  # handed to the trainer, which raises it at `take`
                self._q.put((step, e))
                return
            self._q.put((step, produced))
            if self._closed:
                return

    def request_resync(self, timeout: Optional[float] = None) -> bool:
        """Producer thread: ask the main thread to publish the current weights to every engine
        (one restarted mid-rollout) and wait until it has. False when the producer is closing or
        `timeout` s passed."""
        with self._resync_lock:
            if self._resync_pending is None:
                self._resync_pending = threading.Event()
            ev = self._resync_pending
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ev.wait(0.1):
            if self._closed or (deadline is not None and time.monotonic() > deadline):
                return False
        return True

    def resync_from_thread(self, publish: Callable[[], None]) -> None:
        """Any thread but the main one: re-sync every engine to the current weights. While the main
        thread evaluates, `publish()` runs here at once (one at a time); otherwise the main thread
        is asked (`request_resync`) and this waits for it.

        Raises:
            RolloutServerError: the producer closed before the main thread could re-sync (the
                engine would otherwise serve weights the trainer does not hold).
        """
        with self._resync_cv:
            direct = self._evaluating
            if direct:
                self._direct_resyncs += 1
            elif self._resync_pending is None:
                self._resync_pending = threading.Event()
        if direct:
            try:
                with self._direct_serial:
                    publish()
            finally:
                with self._resync_cv:
                    self._direct_resyncs -= 1
                    self._resync_cv.notify_all()
            return
        if not self.request_resync():
            raise RolloutServerError("a restarted rollout server could not be re-synced: the rollout producer "
                                     "closed before the trainer's main thread could publish the weights")

    # ---- main thread -----------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluating(self, resync: Callable[[], None]) -> Iterator[None]:
        """Main thread, around an evaluation every rank takes part in: a re-sync already asked
        for runs first (`resync()`, here); inside, re-syncs run on the thread that asks
        (`resync_from_thread`); leaving waits for any still running."""
        with self._resync_cv:
            self._evaluating = True
            pending = self._resync_pending is not None
        try:
            if pending:
                resync()
                self.resynced()
            yield
        finally:
            with self._resync_cv:
                self._resync_cv.wait_for(lambda: self._direct_resyncs == 0)
                self._evaluating = False

    def resync_pending(self) -> bool:
        with self._resync_lock:
            return self._resync_pending is not None

    def resynced(self) -> None:
        """Main thread: a publish to every engine just completed; release waiting producers."""
        with self._resync_lock:
            ev, self._resync_pending = self._resync_pending, None
        if ev is not None:
            ev.set()

    def published(self, version: int) -> None:
        """Main thread, after every publish: open the gate to `version`, release a waiting re-sync
        (the publish reached every engine, a restarted one included)."""
        self.gate.published(version)
        self.resynced()

    def take(self, step: int, resync: Callable[[], None]) -> tuple[object, float]:
        """Main thread: the `ProducedStep` of `step` and the seconds waited for it. While waiting,
        a re-sync the producer asked for is run here (`resync()`, then the producer is released).

        Raises:
            whatever `produce` raised for this step; RuntimeError if the producer stopped without it.
        """
        t0 = time.perf_counter()
        while True:
            if self.resync_pending():
                resync()
                self.resynced()
            try:
                got_step, item = self._q.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise RuntimeError(f"the rollout producer stopped before producing step {step}")
        if isinstance(item, BaseException):
            raise item
        if got_step != step:
            raise RuntimeError(f"rollout producer out of order: expected step {step}, got {got_step}")
        return item, time.perf_counter() - t0

    def close(self, join_s: float = 30.0) -> None:
        """Stop producing: close the gate, abort in-flight requests, join the thread."""
        self._closed = True
        self.gate.close()
        self.resynced()
        if self._thread.is_alive() and self._abort is not None:
            try:
                self._abort()
            except Exception:  # the engines may already be gone
                logger.debug("abort of in-flight rollouts failed", exc_info=True)
        if self._thread.is_alive():
            self._thread.join(join_s)


def start_async_producer(run, last: int, stack) -> Optional[AsyncProducer]:
    """The controller's `AsyncProducer` for steps `run.start_step..last` when
    `trainer.max_staleness` > 0 (closed by `stack`); None otherwise and on other ranks."""
    eta = run.cfg.trainer.max_staleness
    if not run.is_controller or eta == 0 or run.start_step > last:
        return None

    def snapshot() -> dict:
        return {"data": run.dataset.state_dict(), "difficulty": run.tracker.state_dict()}

    def abort() -> None:
        run.producer.manager.abort("s")  # every training rollout's rid starts with its tag "s<step>-b<batch>"

    ahead = AsyncProducer(run.producer.produce, snapshot, StalenessGate(eta, run.weight_version),
                          first=run.start_step, last=last, abort=abort)
    stack.callback(ahead.close)
    logger.info("asynchronous rollouts: trainer.max_staleness %d (step s generates once version >= s-1-%d)",
                eta, eta)
    return ahead.start()
