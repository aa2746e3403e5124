"""The embedded server in vLLM's dialect (``--api-dialect vllm``): a CPU stand-in for a vLLM 0.33.x server.

A real vLLM server cannot run on the CPU machines the tests run on, so the `vllm-embedded` rollout
backend starts this: the same generation engine and ``UpdateSession`` as the SGLang dialect
(``megatron_rl.engine.app``), behind vLLM's paths and bodies (docs/VLLM_API.md records them with
vLLM's source files), so that ``VLLMClient`` and the trainer's whole vLLM path run for real.

Paths: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (token-id prompts; ``n`` > 1
runs child j seeded ``seed`` + j, as vLLM's parallel sampling, answered as ``choices[j]``; answers
``choices[j].token_ids``, ``logprobs.token_logprobs``/``tokens`` as ``token_id:<id>``,
``prompt_logprobs`` (``prompt_logprobs: 0`` only: each prompt token's own log-prob),
``finish_reason`` stop|length|abort, ``stop_reason``, ``usage``, and with ``--enable-return-routed-experts``
on a Mixture-of-Experts model ``choices[0].routed_experts``: base64 ``.npy`` of uint8/uint16
[prompt + completion - 1 - ``routed_experts_prompt_start``, L, K], vLLM 0.33's encoding),
``POST /pause?mode=abort|wait|keep``,
``POST /resume``, ``GET /is_paused``, ``POST /abort_requests``, ``POST /reset_prefix_cache``,
``GET /get_world_size``, ``GET /weight_info``, ``POST /update_weight_version``,
``POST /init_weight_transfer_engine``, ``POST /start_weight_update``,
``POST /start_draft_weight_update``, ``POST /update_weights``, ``POST /finish_weight_update``,
``POST /sleep?level=&mode=``, ``POST /wake_up?tags=``, ``GET /is_sleeping``.

Where the stand-in differs from vLLM (on purpose, and only there): it has no tokenizer, so a
completion must ask ``return_tokens_as_token_ids`` and gets ``text: ""``; a completion body with a
field vLLM would ignore is refused (400), so that a client sending something vLLM drops is caught;
the transfer group is a gloo group of ``megatron_rl.weight_sync.group`` on CPU (vLLM's is NCCL,
``StatelessProcessGroup`` + ``PyNcclCommunicator``), and ``packed`` transfer is refused; no
``/weight_checker``. ``--stand-in-data-parallel-size N`` makes it count as N data-parallel replicas of one
worker each, as vLLM's ``--data-parallel-size`` does: ``/get_world_size`` answers N (1 with
``include_dp=false``) and it joins the transfer group at ranks ``rank_offset .. rank_offset + N - 1``
(``engine.dp_replicas``; an offset and world size that cannot hold them are refused, 400). ``--api-key`` guards ``/v1/*`` only, as vLLM's. Sleep mode is a state only (no
memory is released; that is the colocation helper's job): ``/sleep`` pauses as ``/pause`` does and
marks the parts asleep, ``/wake_up`` wakes the named parts and resumes once all are awake, and a
completion is refused while any part sleeps (503, vLLM's "Generation is paused" error) and, after a
level-2 sleep, until a weight update finished (409 naming level 2 and the missing reload: case N13;
a real vLLM would answer garbage there). It is served without ``--enable-sleep-mode``. A refused or
failed ``/update_weights`` ends the update session, as vLLM's worker does (the next
``/finish_weight_update`` is refused; docs/VLLM_API.md section 8).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_rl.engine.app import (
    ServerState,
    _Prompt,
    close_session,
    open_session,
    pause_engine,
    receive_update,
    response_of,
    resume_engine,
    run_requests,
    start_update,
    with_write_lock,
)
from megatron_rl.engine.bodies import RequestError, validation_text
from megatron_rl.engine.dp_replicas import ReplicaMembers
from megatron_rl.engine.moe import encode_routed_experts_npy
from megatron_rl.engine.sampling import parse_sampling_params
from megatron_rl.weight_sync.ranks import engine_transfer_ranks
from megatron_rl.weight_sync.session import SessionError

__all__ = ["GROUP_NAME", "REPLICA_WORLD_SIZE", "build_vllm_app"]

REPLICA_WORLD_SIZE = 1
"""TP x PP of one of the stand-in's data-parallel replicas: one worker (``engine.dp_replicas``)."""

GROUP_NAME = "weight_update_group"
"""The stand-in's one transfer group. vLLM's is unnamed (one weight-transfer engine per server);
the stand-in joins the trainer's torch group (``megatron_rl.weight_sync.group``), whose store
prefix is the group name, so it takes the name the trainer gives stage 0's group."""


def error(message: str, status_code: int = 400) -> JSONResponse:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "BadRequestError" if status_code < 500 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status_code}},
                        status_code=status_code)


class CompletionBody(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` the stand-in honours (others: 400, see module docstring)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: list[int] = Field(min_length=1)
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    stream: bool | None = False
    echo: bool | None = False
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)


class InitInfo(BaseModel):
    """vLLM's ``NCCLWeightTransferInitInfo`` (``nccl_common.py``)."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None


class UpdateInfo(BaseModel):
    """vLLM's ``NCCLWeightTransferUpdateInfo`` (``nccl_engine.py``)."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


async def _json_body(request: Request, *, optional: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if optional:
            return {}
        raise RequestError({"error": {"message": "Invalid JSON format", "type": "BadRequestError", "code": 400}})
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise RequestError({"error": {"message": "Invalid JSON format", "type": "BadRequestError", "code": 400}})
    if not isinstance(data, dict):
        raise RequestError({"error": {"message": "Expected a JSON object", "type": "BadRequestError", "code": 400}})
    return data


def _parse(model: type[BaseModel], data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestError({"error": {"message": f"{what}: {validation_text(e)}", "type": "BadRequestError",
                                      "code": 400}}) from None


def _sampling(body: CompletionBody, child: int = 0):
    """The SGLang-keyed sampling parameters of a completion body, validated by the engine's own gate;
    ``child`` j of a body with ``n`` > 1 is seeded ``seed`` + j, as vLLM's ``ParentRequest`` does."""
    if body.n < 1:
        raise RequestError({"error": {"message": f"n must be at least 1, got {body.n}", "code": 400}})
    if body.stream or body.echo:
        raise RequestError({"error": {"message": "stream and echo are not supported by the stand-in", "code": 400}})
    if not body.return_tokens_as_token_ids:
        raise RequestError({"error": {"message": "the stand-in has no tokenizer: send return_tokens_as_token_ids",
                                      "code": 400}})
    sp: dict[str, Any] = {
        "max_new_tokens": 16 if body.max_tokens is None else body.max_tokens,
        "min_new_tokens": body.min_tokens,
        "stop_token_ids": body.stop_token_ids or None,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "no_stop_trim": body.include_stop_str_in_output,
        "sampling_seed": None if body.seed is None else body.seed + child,
        "logit_bias": body.logit_bias,
        "stop": body.stop,
    }
    for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if getattr(body, key) is not None:
            sp[key] = getattr(body, key)
    if body.top_k is not None:
        sp["top_k"] = -1 if body.top_k in (0, -1) else body.top_k  # vLLM's "off" is 0 (or -1)
    return parse_sampling_params({k: v for k, v in sp.items() if v is not None})


def completion_response(out: dict, *, request_id: str, model: str, stop_token_ids: list[int], eos: set[int],
                        with_logprobs: bool, routed_experts: str | None = None) -> dict:
    """vLLM's ``CompletionResponse`` for one finished request, from the engine's SGLang-shaped answer;
    ``routed_experts`` is the choice's field as vLLM encodes it (``moe.encode_routed_experts_npy``;
    None: the server runs without ``--enable-return-routed-experts`` or no forward ran).
    ``prompt_logprobs`` (asked with ``prompt_logprobs: 0``: the answer's ``input_token_logprobs`` from
    position 0) is vLLM's list, one entry per prompt token, None for the first, else
    ``{"<id>": {"logprob", "rank": null, "decoded_token": null}}`` (no tokenizer, no rank here)."""
    meta, ids = out["meta_info"], list(out["output_ids"])
    finish = meta["finish_reason"] or {}
    ftype, matched = finish.get("type"), finish.get("matched")
    stop_reason = None  # vLLM: the stop token id or stop string; null for EOS and length
    if ftype == "stop" and matched is not None and not (isinstance(matched, int) and matched in eos):
        if not isinstance(matched, int) or matched in stop_token_ids:
            stop_reason = matched
    logprobs = None
    if with_logprobs:
        lps = [float(e[0]) for e in meta["output_token_logprobs"]]
        tokens = [f"token_id:{t}" for t in ids]
        logprobs = {"text_offset": [0] * len(ids), "token_logprobs": lps, "tokens": tokens,
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)]}
    prompt_logprobs = None
    if "input_token_logprobs" in meta:
        prompt_logprobs = [None if lp is None else {str(tok): {"logprob": float(lp), "rank": None,
                                                               "decoded_token": None}}
                           for lp, tok, _ in meta["input_token_logprobs"]]
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": logprobs, "finish_reason": ftype, "stop_reason": stop_reason,
                     "token_ids": ids, "prompt_logprobs": prompt_logprobs, "prompt_token_ids": None,
                     "routed_experts": routed_experts}],
        "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                  "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]},
    }


def merge_choices(answers: list[dict]) -> dict:
    """One ``CompletionResponse`` of the n answers (one choice each) of a request's children: choice
    j is child j's (``index`` j), ``usage.completion_tokens`` their sum (vLLM's parallel sampling)."""
    if len(answers) == 1:
        return answers[0]
    choices = [dict(a["choices"][0], index=j) for j, a in enumerate(answers)]
    made = sum(a["usage"]["completion_tokens"] for a in answers)
    prompt = answers[0]["usage"]["prompt_tokens"]
    return dict(answers[0], choices=choices,
                usage={"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made})


def build_vllm_app(state: ServerState) -> FastAPI:
    """The FastAPI app of the stand-in (vLLM 0.33.x's paths, bodies and answers; see the module docstring)."""
    app = FastAPI(title="megatron-rl embedded rollout server (vLLM dialect stand-in)", docs_url=None, redoc_url=None,
                  openapi_url=None)
    engine, session, args = state.engine, state.session, state.args
    replicas = ReplicaMembers(int(getattr(args, "stand_in_data_parallel_size", 1)),
                              timeout_s=float(getattr(args, "weight_sync_timeout_s", 600.0)))

    def _loaded_weight(name: str):
        param = engine.get_parameter(name)
        if param is None:
            return None
        with engine.model_lock:
            return param.detach().clone()
    sleeping: dict[str, Any] = {"asleep": set(), "lost_weights": False}  # sleep mode: a state only (module doc)

    @app.middleware("http")
    async def auth(request: Request, call_next):  # vLLM: --api-key guards /v1/* only
        if args.api_key is not None and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if not (header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), args.api_key.encode())):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        body = exc.body
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            return error(body["error"], exc.status_code)
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error(str(exc.errors()))

    @app.exception_handler(SessionError)
    async def on_session_error(request: Request, exc: SessionError):
        return error(str(exc))

    # ---- health and info ---------------------------------------------------------------

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_path, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": state.model_path, "parent": None, "max_model_len": engine.max_context_len, "permission": []}]})

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):  # vLLM: TP x PP x DP, or TP x PP without include_dp
        return JSONResponse({"world_size": REPLICA_WORLD_SIZE * (replicas.dp_size if include_dp else 1)})

    @app.get("/weight_info")
    async def weight_info():
        return JSONResponse({"weight_version": engine.weight_version})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        data = await _json_body(request)
        if not isinstance(data.get("new_version"), str):
            return error("new_version: a string is required")
        engine.weight_version = data["new_version"]
        return JSONResponse({"success": True, "new_version": data["new_version"]})

    # ---- generation --------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse(CompletionBody, await _json_body(request), "CompletionRequest")
        params = [_sampling(body, j) for j in range(body.n)]  # vLLM's parallel sampling: child j seeded seed + j
        if sleeping["asleep"]:
            return error("Generation is paused. Please retry after it resumes. (the server sleeps: "
                         f"{', '.join(sorted(sleeping['asleep']))} not awake)", 503)
        if sleeping["lost_weights"]:
            return error("the weights were discarded by sleep level 2 and not reloaded since (case N13): "
                         "push every weight (and buffer) through the weight-transfer routes first", 409)
        request_id = body.request_id or f"{time.monotonic_ns():x}"
        routed = bool(getattr(args, "enable_return_routed_experts", False)) and engine.routers.supported
        if routed and body.routed_experts_prompt_start > len(body.prompt):
            return error(f"routed_experts_prompt_start={body.routed_experts_prompt_start} is longer than the prompt "
                         f"({len(body.prompt)} tokens)")
        if body.prompt_logprobs not in (None, 0):
            return error(f"prompt_logprobs={body.prompt_logprobs}: the stand-in returns each prompt token's own "
                         "log-prob only (prompt_logprobs: 0)")
        scored = body.prompt_logprobs is not None
        engine_id = f"cmpl-{request_id}-0"  # children: one abort of this id (a prefix) ends them all
        prompts = [_Prompt(prompt=list(body.prompt), params=p, rid=engine_id if body.n == 1 else f"{engine_id}-c{j}",
                           return_logprob=body.logprobs is not None or scored, logprob_start_len=0 if scored else -1,
                           return_routed_experts=routed, routed_start=body.routed_experts_prompt_start if routed else 0)
                   for j, p in enumerate(params)]
        answers = []
        for gen in await run_requests(state, prompts, raw=True):
            rows = gen.routed_experts()
            answers.append(completion_response(
                response_of(gen, routed=False), request_id=request_id, model=body.model or state.model_path,
                stop_token_ids=list(body.stop_token_ids or []), eos=set(engine.eos_token_ids),
                with_logprobs=body.logprobs is not None,
                routed_experts=None if rows is None else encode_routed_experts_npy(rows, engine.routers.num_experts)))
        return JSONResponse(merge_choices(answers))

    # ---- generation control ------------------------------------------------------------

    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", wait_for_inflight_requests: bool = False,
                    clear_cache: bool = True):
        if mode == "wait" or wait_for_inflight_requests:
            while engine.counts() != (0, 0):  # let the requests in flight finish, then freeze the rest
                await asyncio.sleep(0.05)
        await pause_engine(state, "abort" if mode == "abort" else "in_place")
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume():
        await resume_engine(state)  # answers once no weight update is half applied (case N10 C)
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return JSONResponse({"is_paused": engine.paused})

    @app.post("/abort_requests")
    async def abort_requests(request: Request):
        ids = (await _json_body(request, optional=True)).get("request_ids")
        if ids:
            count = 0
            for rid in ids:  # exact engine ids, as vLLM's (the engine matches a prefix; ids end in -0)
                count += await state.in_control_thread(lambda r=str(rid): engine.abort(r, False))
        else:
            count = await state.in_control_thread(lambda: engine.abort("", True))
        return JSONResponse({"status": "aborted", "aborted": count})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        return JSONResponse({"success": not state.refuse_flush})  # no cache across requests; refused: tests only

    # ---- sleep mode (a state only: see the module docstring) ---------------------------

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2), mode: Literal["abort", "wait", "keep"] = "abort"):
        if mode == "wait":
            while engine.counts() != (0, 0):
                await asyncio.sleep(0.05)
        await state.in_control_thread(engine.pause, "abort" if mode == "abort" else "in_place")
        sleeping["asleep"] = {"scheduling"} if level == 0 else {"weights", "kv_cache"}
        sleeping["lost_weights"] = sleeping["lost_weights"] or level == 2
        return JSONResponse({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request):
        tags = request.query_params.getlist("tags") or None  # vLLM: no tags wakes everything
        sleeping["asleep"] = set() if tags is None else sleeping["asleep"] - set(tags)
        if not sleeping["asleep"]:
            engine.resume()
        return JSONResponse({"status": "sleeping" if sleeping["asleep"] else "awake", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": bool(sleeping["asleep"])})

    # ---- weight transfer ---------------------------------------------------------------

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        data = await _json_body(request)
        if data.get("init_info") is None:
            return error("Missing 'init_info' in request body")
        info = _parse(InitInfo, data["init_info"], "init_info")
        if info.packed:
            return error("the stand-in receives one broadcast per tensor; packed transfer is not supported")

        try:  # vLLM's rank arithmetic, checked before joining: a wrong count would hang the rendezvous
            ranks = engine_transfer_ranks(info.rank_offset, info.world_size, replica_world_size=REPLICA_WORLD_SIZE,
                                          dp_size=replicas.dp_size, engine="this server")
        except ValueError as e:
            return error(str(e))

        def join():
            if GROUP_NAME in session.groups:  # vLLM replaces its transfer group on a new init
                replicas.leave()
                try:
                    session.destroy_group(GROUP_NAME)
                except SessionError:
                    pass
            wait = replicas.start_join(host=info.master_address, port=info.master_port, world_size=info.world_size,
                                       ranks=ranks[1:], group_name=GROUP_NAME) if len(ranks) > 1 else None
            session.init_group(name=GROUP_NAME, backend="gloo", host=info.master_address, port=info.master_port,
                               world_size=info.world_size, rank=ranks[0])
            if wait is not None:
                try:
                    wait()
                except RuntimeError as e:
                    raise SessionError(f"Failed to init group: {e}") from e

        await state.in_control_thread(join)
        return JSONResponse({"message": "Weight transfer initialized"})

    @app.post("/start_weight_update")
    async def start_weight_update():
        async def run():
            await open_session(state, "all")
            return JSONResponse({"message": "Weight update started"})

        return await with_write_lock(state, run)

    @app.post("/start_draft_weight_update")
    async def start_draft_weight_update():
        async def run():
            await open_session(state, "draft")  # refused: no draft model
            return JSONResponse({"message": "Draft weight update started"})

        return await with_write_lock(state, run)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        data = await _json_body(request)
        if data.get("update_info") is None:
            return error("Missing 'update_info' in request body")
        try:
            info = _parse(UpdateInfo, data["update_info"], "update_info")
            call = await start_update(state, names=info.names, dtypes=info.dtype_names, shapes=info.shapes,
                                      group_name=GROUP_NAME, load_format=None)

            async def run():
                check = replicas.start_receive(info.names, info.dtype_names, info.shapes) if replicas.members else None
                await receive_update(state, call)
                if check is not None:
                    try:
                        await state.in_control_thread(check, _loaded_weight)
                    except RuntimeError as e:
                        raise SessionError(f"Failed to update weights: {e}") from e
                return JSONResponse({"message": "Weights updated"})

            return await with_write_lock(state, run)
        except BaseException:
            # vLLM's worker ends the session when an update fails (gpu_worker.update_weights:
            # _weight_update_active = False), so the next /finish_weight_update is refused (issue 30, live)
            if state.session.is_open:
                state.session.end()
            raise

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        version = (await _json_body(request, optional=True)).get("weight_version")

        async def run():
            await close_session(state, None if version is None else str(version))
            sleeping["lost_weights"] = False  # N13: the caller reloaded the weights
            return JSONResponse({"message": "Weight update finished"})

        return await with_write_lock(state, run)

    return app
