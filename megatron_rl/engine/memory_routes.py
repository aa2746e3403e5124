"""Colocated-mode endpoints of the embedded server (issue 17; SGLANG_API.md 2.4 and 2.6):
`POST /release_memory_occupation`, `POST /resume_memory_occupation`,
`POST /update_weights_from_tensor`, and `GET /memory_occupation` (this server's own: what is
resident and the process RSS).

Memory states (CASES.md N11). `weights`: resident -> released (every parameter's storage replaced
by an empty one, then `gc` and glibc `malloc_trim`, so the pages go back to the OS before the call
returns; the RSS before and after is logged and sent in the `X-RSS-Before` / `X-RSS-After`
headers, bytes) -> stale (resumed: allocated again, values undefined, as SGLang without
`--enable-weights-cpu-backup`) -> resident again once every parameter has been rewritten by
`/update_weights_from_tensor` or `/update_weights_from_distributed`. A resumed parameter gets the
same offset from a 64-byte boundary as the one it had (`empty_at`): a one-row decode GEMV
rounds by the weights' alignment (safetensors' loaded tensors sit 8 bytes off a line; up to ~1e-5
per log-prob), so without it the engine's log-probs changed after its first release, and a
colocated run with `actor.old_logprob_source: rollout` neither equalled the disaggregated one nor
resumed bit-exactly. Buffers (e.g. rotary `inv_freq`) are
kept. `kv_cache`: resident <-> released (this server keeps no KV between requests: releasing it
flushes nothing and frees nothing, but generation is refused until it is resumed). `cuda_graph`
is accepted and ignored. Release requires an idle server (no running or waiting request), as
SGLang's scheduler asserts.

Generation (`/generate`) is refused with 503 and a message naming the state unless both weights
and KV are resident; `/health_generate` answers 200 without a forward meanwhile (as when paused),
so a watchdog does not restart a released engine. A flush (`/flush_cache` or `flush_cache: true`
in an update) while `kv_cache` is released is a no-op (SGLang PR 19029's crash): the server is
idle then and holds no KV.

`/update_weights_from_tensor` accepts handles only from 127.0.0.1 and from a peer process in the
tree of the server's `--parent-pid` (the trainer that launched it); see
`megatron_rl.weight_sync.ipc` for the payload checks. It needs an open weight-update session
(`/begin_weight_update`), as SGLang 0.5.23.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
import time
from typing import Any, Literal, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from megatron_rl.engine.app import ServerState, fail, ok, parse_body, with_write_lock
from megatron_rl.engine.bodies import RequestError
from megatron_rl.weight_sync.ipc import HandleError, deserialize_named_tensors, loopback, peer_pid, process_tree

logger = logging.getLogger(__name__)

__all__ = ["MemoryState", "add_memory_routes", "rss_bytes"]

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class MemoryBody(BaseModel):
    """Body of `/release_memory_occupation` and `/resume_memory_occupation`: `tags` null = all."""

    model_config = ConfigDict(extra="ignore")
    tags: Optional[list[Literal["kv_cache", "weights", "cuda_graph"]]] = None


class UpdateTensorBody(BaseModel):
    """Body of `POST /update_weights_from_tensor` (SGLANG_API.md 2.4)."""

    model_config = ConfigDict(extra="ignore")
    serialized_named_tensors: list[str]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: Literal["all", "target", "draft"] = "all"
    torch_empty_cache: bool = False


def rss_bytes() -> int:
    """Resident set size of this process, bytes (/proc/self/statm; 0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def empty_at(shape: torch.Size, dtype: torch.dtype, device: torch.device, offset: int) -> torch.Tensor:
    """`torch.empty(shape)` whose data starts `offset` bytes past a 64-byte boundary (CPU; on other
    devices, or with an offset that is not a multiple of the element size, a plain `torch.empty`)."""
    item = dtype.itemsize
    if device.type != "cpu" or offset % 64 == 0 or offset % item:
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buf = torch.empty(numel + 128 // item, dtype=dtype, device=device)
    start = ((offset - buf.data_ptr()) % 64) // item
    return buf[start : start + numel].view(shape)


def _trim() -> None:
    """Return freed heap pages to the OS (glibc `malloc_trim(0)`; no-op elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryState:
    """What of the engine's memory is resident (module docstring) and the release/resume steps.

    Not thread-safe by itself: the routes run it under the model-update write lock."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.weights = "resident"
        self.kv_cache = "resident"
        self._shapes: dict[int, tuple[torch.Size, torch.dtype, torch.device, int]] = {}
        """id -> shape, dtype, device and data-pointer offset from a 64-byte boundary of each released parameter."""
        self._stale: set = set()
        """What was resumed but not yet rewritten, as `GenerationEngine.weight_units` keys: a parameter's
        id (tied weights share one), or (id, expert, part) per part of a Mixture-of-Experts layer's
        fused experts, which the trainer rewrites one expert at a time (per-expert HF names)."""

    def _params(self) -> dict[int, torch.nn.Parameter]:
        return {id(p): p for p in self.state.engine.model.parameters()}

    def refusal(self) -> Optional[str]:
        """Why generation is refused now, or None when it may run."""
        if self.weights == "released":
            return "the weights are released (/release_memory_occupation); resume and update them first"
        if self.weights == "stale":
            return (f"the weights were resumed but {len(self._stale)} tensor(s) were not rewritten yet; send every "
                    "weight (/update_weights_from_tensor) before generating")
        if self.kv_cache == "released":
            return "the KV cache is released (/release_memory_occupation); resume it (tags ['kv_cache']) first"
        return None

    def release(self, tags: list[str]) -> dict[str, int]:
        """Release `tags`; returns `{"rss_before", "rss_after", "released_bytes"}` (bytes).

        Raises:
            RequestError: requests are running or waiting (release needs an idle server).
        """
        running, waiting = self.state.engine.counts()
        if running or waiting:
            raise RequestError({"error": {"message": f"release_memory_occupation needs an idle server: {running} "
                                                     f"running and {waiting} waiting requests"}})
        before, freed = rss_bytes(), 0
        if "weights" in tags and self.weights != "released":
            params = self._params()
            with self.state.engine.model_lock, torch.no_grad():
                for pid, p in params.items():
                    self._shapes[pid] = (p.shape, p.dtype, p.device, p.data_ptr() % 64)
                    freed += p.numel() * p.element_size()
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.weights, self._stale = "released", set()
            if any(dev.type == "cuda" for _, _, dev, _ in self._shapes.values()):  # pragma: no cover - GPU only
                torch.cuda.empty_cache()
        if "kv_cache" in tags:
            self.kv_cache = "released"
        _trim()
        after = rss_bytes()
        logger.info("released %s: %.1f MiB of weights, RSS %.1f -> %.1f MiB", tags, freed / 2**20, before / 2**20,
                    after / 2**20)
        return {"rss_before": before, "rss_after": after, "released_bytes": freed}

    def resume(self, tags: list[str]) -> dict[str, int]:
        """Resume `tags`; returns `{"rss_before", "rss_after"}` (bytes). Resumed weights are
        allocated but undefined until rewritten (`rewritten`)."""
        before = rss_bytes()
        if "weights" in tags and self.weights == "released":
            params = self._params()
            with self.state.engine.model_lock, torch.no_grad():
                for pid, p in params.items():
                    shape, dtype, device, offset = self._shapes[pid]
                    p.data = empty_at(shape, dtype, device, offset)  # the alignment it was loaded at
            engine = self.state.engine
            names = [n for n, _ in engine.model.named_parameters(remove_duplicate=False)]
            self._stale = {u for n in names for u in engine.weight_units(n)}
            self.weights = "stale" if self._stale else "resident"
        if "kv_cache" in tags:
            self.kv_cache = "resident"
        after = rss_bytes()
        logger.info("resumed %s: RSS %.1f -> %.1f MiB", tags, before / 2**20, after / 2**20)
        return {"rss_before": before, "rss_after": after}

    def rewritten(self, names: list[str]) -> None:
        """Mark the parameters named `names` (HF names: in-memory ones, or per-expert names of fused
        experts) as rewritten; weights are resident again once every resumed parameter (every part
        of fused experts) was."""
        if self.weights != "stale":
            return
        self._stale -= {u for n in names for u in self.state.engine.weight_units(n)}
        if not self._stale:
            self.weights = "resident"

    def status(self) -> dict[str, Any]:
        """What `GET /memory_occupation` answers."""
        return {"weights": self.weights, "kv_cache": self.kv_cache, "stale_tensors": len(self._stale),
                "rss_bytes": rss_bytes()}


def _tags(body: MemoryBody) -> list[str]:
    return list(MEMORY_TAGS) if body.tags is None else list(body.tags)


def _rss_headers(report: dict[str, int]) -> dict[str, str]:
    return {"X-RSS-Before": str(report["rss_before"]), "X-RSS-After": str(report["rss_after"])}


def _guard_generation(state: ServerState, memory: MemoryState) -> None:
    """Refuse every request submitted to the engine while it is not servable (503), and mark the
    parameters every weight load writes (tensor or distributed update) as rewritten."""
    engine = state.engine
    submit = engine.submit

    def guarded(req):
        why = memory.refusal()
        if why is not None:
            raise RequestError({"error": f"Generation refused: {why}"}, status_code=503)
        return submit(req)

    engine.submit = guarded  # type: ignore[method-assign]
    load_weights, direct_targets = engine.load_weights, engine.direct_targets

    def load_and_mark(named_tensors):
        load_weights(named_tensors)
        memory.rewritten([n for n, _ in named_tensors])

    def direct_and_mark(names, dtypes, shapes):
        out = direct_targets(names, dtypes, shapes)
        if out is not None:  # the caller broadcasts into every one of them next
            memory.rewritten(list(names))
        return out

    engine.load_weights = load_and_mark  # type: ignore[method-assign]
    engine.direct_targets = direct_and_mark  # type: ignore[method-assign]


def _trusted_peer(request: Request, state: ServerState) -> frozenset[int]:
    """The trusted process tree when the request comes from it; raises `RequestError` (403) else."""
    client = request.client
    if client is None or not loopback(client.host):
        raise RequestError({"success": False, "message": "update_weights_from_tensor accepts handles from 127.0.0.1 "
                                                         f"only (request from {client.host if client else None})"}, 403)
    root = getattr(state.args, "parent_pid", None)
    if root is None or not os.path.isdir("/proc"):
        raise RequestError({"success": False, "message": "update_weights_from_tensor needs the server started with "
                                                         "--parent-pid (the trainer) on Linux: handles are accepted "
                                                         "only from that process tree"}, 403)
    tree = process_tree(root)
    local_port = request.scope.get("server", (None, state.args.port))[1]
    pid = peer_pid(int(local_port), int(client.port), sorted(tree))
    if pid is None:
        raise RequestError({"success": False, "message": "update_weights_from_tensor: the requesting process is not "
                                                         f"in the process tree of the trainer (pid {root}); handles "
                                                         "rejected"}, 403)
    return tree


def add_memory_routes(app: FastAPI, state: ServerState) -> MemoryState:
    """Register the colocated-mode routes on `app` (module docstring); returns their state."""
    memory = MemoryState(state)
    state.memory = memory  # type: ignore[attr-defined]
    _guard_generation(state, memory)
    engine, session = state.engine, state.session

    @app.middleware("http")
    async def no_forward_while_released(request: Request, call_next):
        if request.url.path == "/health_generate" and memory.refusal() is not None:
            return Response(status_code=200)
        return await call_next(request)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        body = await parse_body(request, MemoryBody)

        async def run():
            return await state.in_control_thread(memory.release, _tags(body))

        report = await with_write_lock(state, run)
        return JSONResponse(None, headers=_rss_headers(report))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        body = await parse_body(request, MemoryBody)

        async def run():
            return await state.in_control_thread(memory.resume, _tags(body))

        report = await with_write_lock(state, run)
        return JSONResponse(None, headers=_rss_headers(report))

    @app.get("/memory_occupation")
    async def memory_occupation():
        return JSONResponse(memory.status())

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await parse_body(request, UpdateTensorBody)
        tree = _trusted_peer(request, state)
        if not session.is_open:
            return fail("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        if body.selector == "draft":
            return fail("Failed to update weights: the server has no draft model")
        if body.load_format not in (None, "direct", "flattened_bucket"):
            return fail(f"Failed to update weights: load_format {body.load_format!r} is not supported "
                        "(null, 'direct' or 'flattened_bucket')")
        if len(body.serialized_named_tensors) != 1:
            return fail(f"Failed to update weights: {len(body.serialized_named_tensors)} serialized_named_tensors "
                        "entries for a server of tp_size 1 (one entry per TP rank)")
        if memory.weights == "released":
            return fail("Failed to update weights: the weights are released; resume them first "
                        "(/resume_memory_occupation with tags ['weights'])")

        def load() -> list[str]:
            named = deserialize_named_tensors(body.serialized_named_tensors[0], trusted_pids=tree,
                                              load_format=body.load_format)
            try:
                engine.load_weights(named)  # copies into the parameters: no view of the sender's buffer is kept
                return [n for n, _ in named]
            finally:
                del named  # drop every handle before replying (N12)

        async def run():
            t0 = time.perf_counter()
            try:
                names = await state.in_control_thread(load)
            except HandleError as e:
                raise RequestError({"success": False, "message": f"Failed to update weights: {e}"}, 400) from None
            except ValueError as e:
                raise session.refusal(f"Failed to update weights: {e}") from None
            session.wrote = True
            if body.weight_version is not None:
                engine.weight_version = body.weight_version
                session.wrote = False
            msg = "Succeeded to update parameter online from tensor."
            if body.flush_cache and memory.kv_cache == "released":
                msg += " Cache flush skipped: the KV cache is released."
            elif body.flush_cache:
                can, why = engine.can_flush()
                if not can:
                    return fail(f"Weights updated but the cache flush failed: {why}")
            logger.info("update_weights_from_tensor: %d tensors in %.3f s", len(names), time.perf_counter() - t0)
            return ok(msg)

        return await with_write_lock(state, run, abort_all=body.abort_all_requests)

    return memory
