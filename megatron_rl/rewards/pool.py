"""Process pool that evaluates reward functions with a per-call timeout (ALGORITHMS 1).

Processes, never threads: Math-Verify's timeouts use `signal.alarm`, which works only in a
process's main thread. Each worker runs reward calls one at a time in its main thread. A call
that raises, returns something that is not a dict, or runs past `timeout_s` gives a failed
result `{"score": 0.0, "acc": False, "pred": None, "failed": True, "error": str}`; a worker that
timed out or died is killed and replaced, so one hung verifier never blocks the batch.
Workers use the `spawn` start method (safe next to CUDA and torch threads).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


def _failed(error: str) -> dict[str, Any]:
    return {"score": 0.0, "acc": False, "pred": None, "failed": True, "error": error}


def _worker_main(conn: Connection, extra_fns: Mapping[str, Callable[..., dict]] | None, modules: tuple[str, ...]) -> None:
    """Worker loop (runs in the child's main thread): receive tasks, send results."""
    import signal

    from megatron_rl.rewards.registry import REWARD_FNS

    # The trainer decides when workers stop (close() or its exit closes the pipe): a SIGINT or
    # SIGTERM to the whole process group must not kill them under the step the trainer finishes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for m in modules:
        importlib.import_module(m)
    fns = dict(extra_fns or {})
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        idx, name, response, ground_truth, kwargs = msg
        try:
            fn = fns[name] if name in fns else REWARD_FNS.get(name)
            out = fn(response, ground_truth, **kwargs)
            if not isinstance(out, dict) or "score" not in out:
                raise TypeError(f"reward {name!r} returned {type(out).__name__}, expected a dict with 'score'")
            res = {"score": float(out["score"]), "acc": bool(out.get("acc", False)), "pred": out.get("pred"), "failed": False}
            res.update({k: v for k, v in out.items() if k not in res})
            conn.send(("result", idx, res))
        except Exception as e:  # a reward's own error becomes a failed result, never a crash
            conn.send(("result", idx, _failed(f"{type(e).__name__}: {e}")))


class _Worker:
    def __init__(self, ctx: Any, extra_fns: Mapping[str, Callable[..., dict]] | None, modules: tuple[str, ...]) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.proc = ctx.Process(target=_worker_main, args=(child, extra_fns, modules), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.task: int | None = None
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Evaluate `(reward_name, response, ground_truth)` items in worker processes.

    Args:
        num_workers: worker processes (>= 1).
        timeout_s: per-call limit in seconds (> 0), counted from when a worker takes the item.
        reward_fns: extra name -> module-level function, visible only to this pool (tests,
            custom rewards); looked up before `REWARD_FNS`. Functions travel by reference, so
            their module must be importable in the worker.
        import_modules: modules each worker imports at start (e.g. to register custom rewards).
        start_method: multiprocessing start method (default "spawn").

    Use as a context manager or call `close()`. Not thread-safe: call `map` from one thread.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        *,
        reward_fns: Mapping[str, Callable[..., dict]] | None = None,
        import_modules: Iterable[str] = (),
        start_method: str = "spawn",
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"reward pool num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._ctx = mp.get_context(start_method)
        self._fns = dict(reward_fns) if reward_fns else None
        self._modules = tuple(import_modules)
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]
        self.num_replaced = 0
        self._closed = False
        self._map_lock = threading.Lock()
        """One `map` at a time: the workers and their pipes are shared (asynchronous training scores
        the producer's groups and an evaluation's answers from two threads)."""

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._fns, self._modules)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._spawn()
        self.num_replaced += 1

    def map(self, items: Iterable[tuple]) -> list[dict[str, Any]]:
        """Evaluate items; results in input order. Thread-safe: concurrent calls run one after another.

        Args:
            items: tuples `(reward_name, response, ground_truth)` or
                `(reward_name, response, ground_truth, kwargs_dict)`.

        Returns:
            One dict per item: the reward's dict plus `failed: False`, or the failed result
            (`score 0.0, acc False, pred None, failed True, error`) on exception/timeout/crash.

        Raises:
            RuntimeError: the pool is closed, or a worker cannot start within 120 s.
        """
        with self._map_lock:
            return self._map(items)

    def _map(self, items: Iterable[tuple]) -> list[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        tasks = []
        for it in items:
            name, response, gt, *rest = it
            tasks.append((name, response, gt, dict(rest[0]) if rest else {}))
        results: list[dict[str, Any] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        remaining = len(tasks)
        while remaining:
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send((idx, *tasks[idx]))
                    except (BrokenPipeError, OSError):
                        pending.appendleft(idx)  # the worker died while idle: retry elsewhere
                        self._replace(i)
                        continue
                    w.task, w.deadline = idx, now + self.timeout_s
            next_deadline = min(
                [w.deadline for w in self._workers if w.task is not None]
                + [w.started_at + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            )
            ready_conns = wait([w.conn for w in self._workers], timeout=max(0.0, next_deadline - time.monotonic()))
            for i, w in enumerate(list(self._workers)):
                if w.conn in ready_conns:
                    try:
                        kind, idx, res = w.conn.recv()
                    except (EOFError, OSError):
                        if w.task is not None:
                            results[w.task] = _failed(f"reward worker died (exit code {w.proc.exitcode})")
                            remaining -= 1
                        elif not w.ready:
                            raise RuntimeError(f"reward worker failed to start (exit code {w.proc.exitcode})")
                        self._replace(i)
                        continue
                    if kind == "ready":
                        w.ready = True
                    else:
                        results[idx] = res
                        remaining -= 1
                        w.task, w.deadline = None, float("inf")
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                if w.task is not None and now >= w.deadline:
                    logger.warning("reward call %d timed out after %.1f s; replacing its worker", w.task, self.timeout_s)
                    results[w.task] = _failed(f"timeout after {self.timeout_s} s")
                    remaining -= 1
                    self._replace(i)
                elif not w.ready and now >= w.started_at + _STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S} s")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop all workers (graceful, then kill after 5 s)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=5)
            w.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
