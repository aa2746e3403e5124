"""The embedded server's HTTP app: SGLang 0.5.23's endpoints, bodies, answers and auth over FastAPI.

Handlers are thin: parse the body (``megatron_rl.engine.bodies``), call the generation engine
(``megatron_rl.engine.batching``) or the update session (``megatron_rl.weight_sync.session``), answer.
Routes come in groups, one function each: auth, info and health, generation, generation control,
weight updates. ``RequestError`` answers with its own status and body; ``SessionError`` answers
400 ``{"success": false, "message": ...}``. Blocking calls (pause, abort, group rendezvous,
receiving weights) run on a small control thread pool, never on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from megatron_rl.engine.batching import GenerationEngine
from megatron_rl.engine.batching import Request as GenRequest
from megatron_rl.engine.bodies import (
    AbortBody,
    BeginBody,
    ContinueBody,
    DestroyGroupBody,
    EmptyBody,
    GenerateBody,
    InitGroupBody,
    PauseBody,
    RequestError,
    UpdateDistBody,
    UpdateVersionBody,
    WeightsByNameBody,
    validation_text,
)
from megatron_rl.engine.moe import encode_routed_experts
from megatron_rl.engine.sampling import SamplingParams, parse_sampling_params
from megatron_rl.weight_sync.session import ModelUpdateLock, SessionError, UpdateSession
from megatron_rl.weight_sync.buckets import dtype_name

logger = logging.getLogger(__name__)

__all__ = ["ServerState", "build_app", "close_session", "open_session", "pause_engine", "receive_update",
           "release_hold", "resume_engine", "start_update", "with_write_lock"]

_OPEN_PATHS = {"/health", "/health_generate", "/ready", "/metrics"}
_NORMAL_PATHS = {"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"}


@dataclass
class ServerState:
    """Everything the HTTP handlers share (one per server process)."""

    engine: GenerationEngine
    session: UpdateSession
    model_path: str
    dtype: torch.dtype
    args: argparse.Namespace
    """The server's flags (``megatron_rl.engine.server.build_arg_parser``): keys, host, port, seed."""
    refuse_flush: bool = False
    """Tests only: refuse every cache flush (``megatron_rl.engine.test_hooks.FAULT_REFUSE_FLUSH_ENV``)."""
    lock: ModelUpdateLock = field(default_factory=ModelUpdateLock)
    control_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="control")
    )

    async def in_control_thread(self, fn, *a):
        """Run the blocking ``fn(*a)`` on the control pool; returns its result."""
        return await asyncio.get_running_loop().run_in_executor(self.control_pool, fn, *a)


def build_app(state: ServerState) -> FastAPI:
    """Build the FastAPI app for ``state`` (SGLang's endpoints, bodies, answers and auth)."""
    app = FastAPI(title="megatron-rl embedded rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    _add_auth(app, state.args)
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generate_routes(app, state)
    _add_control_routes(app, state)
    _add_group_routes(app, state)
    _add_update_routes(app, state)
    from megatron_rl.engine.memory_routes import add_memory_routes  # colocated mode (issue 17)

    add_memory_routes(app, state)
    return app


# ---- answers and bodies ------------------------------------------------------------------


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as ``model``.

    Raises:
        RequestError: 400 ``{"object": "error", "message": ...}`` for an empty body or a bad field.
    """
    raw = await request.body()
    if not raw.strip():
        raise RequestError({"object": "error", "message": "1 validation error: body: 'Field required'"})
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestError({"object": "error", "message": validation_text(e)}) from None


def ok(message: str = "Success", **extra) -> JSONResponse:
    """200 ``{"success": true, "message": ...}`` (SGLang's control answer)."""
    return JSONResponse({"success": True, "message": message, **extra}, status_code=200)


def fail(message: str, **extra) -> JSONResponse:
    """400 ``{"success": false, "message": ...}`` (SGLang's control answer)."""
    return JSONResponse({"success": False, "message": message, **extra}, status_code=400)


def _key_ok(request: Request, key: str | None) -> bool:
    header = request.headers.get("authorization", "")
    return key is not None and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), key.encode())


def _add_auth(app: FastAPI, args: argparse.Namespace) -> None:
    """SGLang's auth: open health paths; ``--api-key`` or the admin key for generation and info;
    ``--admin-api-key`` (or, without one, ``--api-key``) for everything else. 401 otherwise."""

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if path not in _OPEN_PATHS:
            if path in _NORMAL_PATHS:
                allowed = args.api_key is None or _key_ok(request, args.api_key) or _key_ok(request, args.admin_api_key)
            elif args.admin_api_key is not None:
                allowed = _key_ok(request, args.admin_api_key)
            else:
                allowed = args.api_key is None or _key_ok(request, args.api_key)
            if not allowed:
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return JSONResponse(exc.body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"object": "error", "message": str(exc.errors())}, status_code=400)

    @app.exception_handler(SessionError)
    async def on_session_error(request: Request, exc: SessionError):
        return fail(str(exc))


# ---- health and info ---------------------------------------------------------------------


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    engine, args = state.engine, state.args

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if engine.paused or engine.held or state.lock.writer_active:
            return Response(status_code=200)
        probe = _Prompt([0], SamplingParams(max_new_tokens=1, temperature=0.0), f"HEALTH_CHECK_{uuid.uuid4().hex}")
        try:
            outs = await asyncio.wait_for(run_requests(state, [probe]), timeout=60)
        except (TimeoutError, RequestError):
            return Response(status_code=503)
        return Response(status_code=200 if outs and outs[0]["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        cfg = engine.model.config
        return JSONResponse({
            "model_path": state.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "dtype": dtype_name(state.dtype),
        })

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        from megatron_rl import __version__

        return JSONResponse({
            "server": "megatron-rl embedded HF server",
            "version": __version__,
            "model_path": state.model_path,
            "host": args.host,
            "port": args.port,
            "dtype": dtype_name(state.dtype),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "max_running_requests": engine.max_batch_size,
            "random_seed": args.random_seed,
            "skip_tokenizer_init": True,
            "enable_deterministic_inference": bool(args.enable_deterministic_inference),
            "weight_version": engine.weight_version,
            "eos_token_ids": list(engine.eos_token_ids),
            "context_length": engine.max_context_len,
            "paused": engine.paused,
            "num_running_reqs": engine.counts()[0],
            "num_waiting_reqs": engine.counts()[1],
        })


# ---- generation --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Prompt:
    """One sequence to generate (a ``/generate`` prompt expanded by ``n``)."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_start: int = 0


async def run_requests(state: ServerState, prompts: list[_Prompt], *, raw: bool = False) -> list:
    """Generate every prompt under the model-update read lock; one SGLang answer dict per prompt, in
    order (``raw``: the finished engine ``Request`` objects instead).

    Raises:
        RequestError: a prompt the engine refuses (too long, ids outside the vocabulary).
    """
    if any(p.return_routed_experts for p in prompts) and not state.engine.routers.supported:
        raise RequestError({"error": f"return_routed_experts: the model ({type(state.engine.model).__name__}) has no "
                                     "Mixture-of-Experts router"})
    if any(p.params.stop for p in prompts) and state.engine.decode is None:
        raise RequestError({"error": f"sampling_params.stop: the model folder {state.model_path} has no tokenizer, "
                                     "so stop strings cannot be matched; send stop_token_ids, or add the tokenizer "
                                     "files to the folder"})
    loop = asyncio.get_running_loop()
    futures = []
    reqs = []
    for p in prompts:
        fut = loop.create_future()

        def on_done(req, fut=fut):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

        reqs.append(GenRequest(rid=p.rid, prompt_ids=list(p.prompt), params=p.params, return_logprob=p.return_logprob,
                               logprob_start_len=p.logprob_start_len,
                               generator=state.engine.new_generator(p.params.sampling_seed), on_done=on_done,
                               return_routed_experts=p.return_routed_experts, routed_start=p.routed_start))
        futures.append(fut)
    await state.lock.acquire_read()
    try:
        for req in reqs:
            state.engine.submit(req)
        done = await asyncio.gather(*futures)
    finally:
        await state.lock.release_read()
    return list(done) if raw else [response_of(r) for r in done]


def response_of(req: GenRequest, *, routed: bool = True) -> dict:
    """SGLang's ``/generate`` answer for one finished request: ``{"output_ids", "meta_info"}``.

    With ``return_routed_experts``, ``meta_info.routed_experts`` is SGLang 0.5.23's encoding of the
    routing (``megatron_rl.engine.moe.encode_routed_experts``): base64 of int32 [T, L, K], T = prompt +
    completion - 1 - ``routed_experts_start_len``; absent when no forward processed the request (aborted
    while queued) and when ``routed`` is False (the vLLM dialect encodes it its own way)."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "num_retractions": req.num_retractions,
        "weight_version": req.weight_version,
        # SGLang 0.5.23's per-token spans (sglang/srt/utils/weight_versions.py): every finished request
        # has at least one; a request that made no token gets its version at finish over [0, 0)
        "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in req.version_spans]
        or [{"version": req.weight_version, "start": 0, "end": 0}],
        "e2e_latency": time.monotonic() - req.created_s,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)]
        meta["output_token_logprobs_length"] = len(req.output_ids)
        if req.input_logprobs is not None:
            start = len(req.prompt_ids) - len(req.input_logprobs)
            meta["input_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(req.input_logprobs, req.prompt_ids[start:])
            ]
    rows = req.routed_experts() if routed else None
    if rows is not None:  # SGLang 0.5.23: base64 of int32 [prompt + completion - 1 - start, L, K]
        meta["routed_experts"] = encode_routed_experts(rows)
    return {"output_ids": list(req.output_ids), "meta_info": meta}


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError({"error": f"{name} has {len(value)} entries for a batch of {n} prompts"})
        return list(value)
    return [value] * n


def _generate_body(raw: bytes) -> tuple[GenerateBody, Any]:
    """Check a ``/generate`` body as SGLang does; returns it and its raw ``sampling_params``.

    Raises:
        RequestError: 400 for bad JSON, bad ``sampling_params`` (checked first, so that an unknown
            key names itself), bad top-level fields, or a feature this server lacks.
    """
    try:
        data = json.loads(raw or b"null")
    except json.JSONDecodeError as e:
        raise RequestError({"error": f"invalid JSON body: {e}"}) from None
    if not isinstance(data, dict):
        raise RequestError({"error": "the body must be a JSON object"})
    sp_raw = data.get("sampling_params")
    for sp in sp_raw if isinstance(sp_raw, list) else [sp_raw]:
        parse_sampling_params(sp)
    try:
        body = GenerateBody.model_validate(data)
    except ValidationError as e:
        raise RequestError({"error": validation_text(e)}) from None
    if body.text is not None or body.input_embeds is not None:
        raise RequestError({"error": "the embedded server runs without a tokenizer (ids in, ids out): send input_ids"})
    if body.input_ids is None:
        raise RequestError({"error": "Either text, input_ids or input_embeds should be provided."})
    if body.stream:
        raise RequestError({"error": "stream=true is not supported by the embedded server"})
    for name, val, neutral in (
        ("top_logprobs_num", body.top_logprobs_num, 0),
        ("token_ids_logprob", body.token_ids_logprob, None),
    ):
        if any(v not in (neutral, None) for v in (val if isinstance(val, list) else [val])):
            raise RequestError({"error": f"{name} is not supported by the embedded server"})
    return body, sp_raw


def parse_generate(raw: bytes) -> tuple[bool, list[_Prompt]]:
    """A ``/generate`` body as ``(batch, prompts)``: whether ``input_ids`` was a batch, and every
    sequence to generate (each prompt ``n`` times, seeds ``sampling_seed + j``, rids ``rid_j``).

    Raises:
        RequestError: 400 for anything SGLang refuses or this server lacks (see ``_generate_body``).
    """
    body, sp_raw = _generate_body(raw)
    batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
    prompts = body.input_ids if batch else [body.input_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise RequestError({"error": "input_ids must not be empty"})
    k = len(prompts)
    params = [parse_sampling_params(sp) for sp in _per_prompt(sp_raw, k, "sampling_params")]
    if batch:
        rids = (
            _per_prompt(body.rid, k, "rid")
            if isinstance(body.rid, list)
            else ([f"{body.rid}_{i}" for i in range(k)] if body.rid is not None else [None] * k)
        )
    else:
        if isinstance(body.rid, list):
            raise RequestError({"error": "rid must be a string for a single prompt"})
        rids = [body.rid]
    short = [len(p) for p in prompts if body.return_routed_experts and body.routed_experts_start_len > len(p)]
    if body.routed_experts_start_len < 0 or short:
        raise RequestError({"error": f"routed_experts_start_len={body.routed_experts_start_len} must be in [0, "
                                     f"{min(short) if short else 'the number of input tokens'}] (the number of "
                                     "input tokens)"})
    rls = _per_prompt(body.return_logprob, k, "return_logprob")
    sls = _per_prompt(body.logprob_start_len, k, "logprob_start_len")
    out = []
    for prompt, p, rid, rl, sl in zip(prompts, params, rids, rls, sls):
        base = rid if rid is not None else uuid.uuid4().hex
        for j in range(p.n):
            seed = None if p.sampling_seed is None else p.sampling_seed + j
            out.append(_Prompt(prompt=prompt, params=SamplingParams(**{**p.__dict__, "n": 1, "sampling_seed": seed}),
                               rid=base if p.n == 1 else f"{base}_{j}", return_logprob=bool(rl),
                               logprob_start_len=int(sl), return_routed_experts=body.return_routed_experts,
                               routed_start=body.routed_experts_start_len))
    return batch, out


def _add_generate_routes(app: FastAPI, state: ServerState) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        batch, prompts = parse_generate(await request.body())
        outs = await run_requests(state, prompts)
        if not batch and len(outs) == 1:
            return JSONResponse(outs[0])
        return JSONResponse(outs)


# ---- generation control ------------------------------------------------------------------


def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse_body(request, AbortBody)
        await state.in_control_thread(lambda: engine.abort(body.rid, body.abort_all))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await parse_body(request, PauseBody)
        await pause_engine(state, body.mode)
        return ok("Generation paused")

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await parse_body(request, ContinueBody)
        if not await resume_engine(state):
            return ok("Generation continues once the open weight-update session ends")
        return ok("Generation continued")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request, timeout: float = 0.0):
        await parse_body(request, EmptyBody)
        if state.refuse_flush:
            return PlainTextResponse("Cache not flushed: refused by MEGATRON_RL_FAULT_REFUSE_FLUSH (tests only).\n",
                                     status_code=400)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            can, why = engine.can_flush()
            if can or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if not can:
            return PlainTextResponse(f"Cache not flushed: {why}.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await parse_body(request, UpdateVersionBody)
        if body.abort_all_requests:
            await state.in_control_thread(lambda: engine.abort("", True))
        engine.weight_version = body.new_version
        return ok(f"Weight version updated to {body.new_version}", new_version=body.new_version)

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request):
        body = await parse_body(request, WeightsByNameBody)
        param = engine.get_parameter(body.name)
        if param is None:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)

        def read():
            with engine.model_lock:
                return param.detach().float().cpu()[: body.truncate_size].tolist()

        return JSONResponse(await state.in_control_thread(read))


# ---- weight updates ----------------------------------------------------------------------


def _add_group_routes(app: FastAPI, state: ServerState) -> None:
    session = state.session

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await parse_body(request, InitGroupBody)
        session.check_new_group(body.group_name, body.backend)  # refused at once, before any rendezvous
        await state.in_control_thread(lambda: session.init_group(
            name=body.group_name, backend=body.backend, host=body.master_address, port=body.master_port,
            world_size=body.world_size, rank=body.rank_offset,
        ))
        return ok("Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await parse_body(request, DestroyGroupBody)
        await state.in_control_thread(session.destroy_group, body.group_name)
        return ok("Succeeded to destroy custom process group.")


async def pause_engine(state: ServerState, mode: str) -> None:
    """Pause the engine (returns at a step boundary), then wake an update waiting for the requests
    in flight: it no longer has to (case N10 B)."""
    await state.in_control_thread(state.engine.pause, mode)
    await state.lock.wake()


async def resume_engine(state: ServerState) -> bool:
    """Resume after a pause; answers only once no weight-update session is open (at most
    ``--weight-sync-timeout-s``), so generation never resumes on half-updated weights (case N10 C).
    Returns False when the session was still open at the timeout (generation resumes when it ends)."""
    state.engine.resume()
    timeout = float(getattr(state.args, "weight_sync_timeout_s", 600.0))
    return await state.in_control_thread(state.engine.wait_unheld, timeout)


async def with_write_lock(state: ServerState, fn, abort_all: bool = False):
    """Run ``await fn()`` holding the model-update write lock (after aborting every request when
    ``abort_all``); it waits for the generation requests in flight unless the engine is paused or
    held by an open update session, including when the pause arrives while it waits."""
    if abort_all:
        await state.in_control_thread(lambda: state.engine.abort("", True))
    await state.lock.acquire_write(skip_readers=lambda: state.engine.paused or state.engine.held)
    try:
        return await fn()
    finally:
        await state.lock.release_write()


async def open_session(state: ServerState, selector: str) -> None:
    """Open the update session (under the write lock). Raises ``SessionError`` when it refuses."""
    state.session.begin(selector)


async def start_update(state: ServerState, **kwargs):
    """``UpdateSession.start_update(**kwargs)``; a refusal also ends the hold (``receive_update``).

    Raises:
        SessionError: the call is refused (answered at once, before the lock and any broadcast).
    """
    try:
        return state.session.start_update(**kwargs)
    except SessionError:
        await release_hold(state)
        raise


async def receive_update(state: ServerState, call) -> None:
    """Receive and write one update call (under the write lock). From the first call of a session
    until ``close_session`` the scheduler runs no step (``GenerationEngine.hold``), so no forward
    sees a half-applied multi-bucket update (case N10 C); a failed or refused call ends the hold
    early: the weights are then labelled ``+partial`` where they are, and served so.

    Raises:
        SessionError: the session refused the tensors or the receive failed.
    """
    await state.in_control_thread(state.engine.hold)
    try:
        await state.in_control_thread(state.session.receive, call)
    except BaseException:
        await release_hold(state)
        raise


async def release_hold(state: ServerState) -> None:
    """Let the scheduler step again and wake those waiting on it."""
    state.engine.release_hold()
    await state.lock.wake()


async def close_session(state: ServerState, weight_version: str | None = None) -> None:
    """Close the update session, label the weights ``weight_version`` when given (vLLM's dialect
    labels them here; the weights are one version again), then let the scheduler step again.
    Raises ``SessionError`` when no session is open (nothing changed)."""
    state.session.end()
    if weight_version is not None:
        state.engine.weight_version = weight_version
        state.session.wrote = False
    await release_hold(state)


def _add_update_routes(app: FastAPI, state: ServerState) -> None:
    engine, session = state.engine, state.session

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        body = await parse_body(request, BeginBody)

        async def run():
            await open_session(state, body.selector)
            return ok("Weight update session started")

        return await with_write_lock(state, run)

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await parse_body(request, EmptyBody)

        async def run():
            await close_session(state)
            return ok("Weight update session ended")

        return await with_write_lock(state, run)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await parse_body(request, UpdateDistBody)
        call = await start_update(  # refusals answer at once, before the lock and any broadcast
            state,
            names=body.names, dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name,
            load_format=body.load_format, selector=body.selector, weight_version=body.weight_version,
        )

        async def run():
            await receive_update(state, call)
            if body.flush_cache:
                can, why = engine.can_flush()
                if not can:
                    return fail(f"Weights updated but the cache flush failed: {why}")
            return ok("Succeeded to update parameter online from distributed.")

        return await with_write_lock(state, run, abort_all=body.abort_all_requests)
