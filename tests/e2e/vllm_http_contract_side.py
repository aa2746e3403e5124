"""The vLLM side of tests/e2e/test_vllm_contract_http.py: run with vLLM 0.33's python, never imported
by the project (it imports vllm). Reads {"requests": [...], "completions": [...],
"controls": [...]} as JSON on stdin and
prints one line ``RESULT <json>``.

- ``requests``: what ``VLLMClient`` sent (method, path, query pairs, JSON body or null). A
  ``/v1/completions`` body is validated by vLLM's ``CompletionRequest`` (fields it would ignore are
  reported) and turned into vLLM's ``SamplingParams`` (``to_sampling_params``: its own checks). Every
  other request is replayed through vLLM's own FastAPI routers (RL, sleep, cache, health) mounted on
  an app whose engine is a recording stand-in of ``AsyncLLM``: FastAPI validates the query and body
  with vLLM's declared parameters, and the answer is the route's own. Query or body keys the route
  does not declare (FastAPI ignores them silently) are reported.
- ``completions``: engine outputs (token ids, log-probs, finish_reason, stop_reason, and optionally
  ``prompt_logprobs``: one per prompt token after the first) turned into a ``/v1/completions`` answer
  by vLLM's own ``OpenAIServingCompletion.request_output_to_completion_response``.
Also a ``/v1/models`` answer from vLLM's ``ModelList`` / ``ModelCard``.
"""

import dataclasses
import json
import sys
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.rl.online import api_router as rl_router
from vllm.entrypoints.serve.dev.cache import api_router as cache_router
from vllm.entrypoints.serve.dev.sleep import api_router as sleep_router
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
from vllm.entrypoints.serve.instrumentator import health as health_router
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

#: keys a route reads from the raw request instead of declaring them (FastAPI cannot check these)
READ_BY_HAND = {("/wake_up", "query"): {"tags"}, ("/abort_requests", "body"): {"request_ids"}}

calls: list = []


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


class RecordingEngine(AsyncLLM):
    """An ``AsyncLLM`` (the RL router asserts the type) that records what the routes ask of it."""

    def __init__(self):  # no engine core: nothing runs
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=8, world_size=4))
        self.output_processor = SimpleNamespace(request_states={"internal-1": None}, parent_requests={})
        self.asleep: set = set()

    def __del__(self):
        pass

    def shutdown(self, *a, **k):
        pass


def _recorder(name, answer=None):
    async def method(self, *args, **kwargs):
        calls.append([name, [_jsonable(a) for a in args], {k: _jsonable(v) for k, v in kwargs.items()}])
        return answer(self, *args, **kwargs) if callable(answer) else answer
    return method


def _sleep(self, level=1, mode="abort"):
    self.asleep = {"scheduling"} if level == 0 else {"weights", "kv_cache"}


def _wake(self, tags=None):
    self.asleep = set() if tags is None else self.asleep - set(tags) - {"scheduling"}
    return not self.asleep


for _name, _answer in [("pause_generation", None), ("resume_generation", None), ("abort", None),
                       ("is_paused", False), ("sleep", _sleep), ("wake_up", _wake),
                       ("is_sleeping", lambda self: bool(self.asleep)), ("reset_prefix_cache", True),
                       ("check_health", None), ("init_weight_transfer_engine", None), ("start_weight_update", None),
                       ("start_draft_weight_update", None), ("update_weights", None), ("finish_weight_update", None),
                       ("update_weight_version", None), ("get_weight_version", "7")]:
    setattr(RecordingEngine, _name, _recorder(_name, _answer))


def build_app():
    app = FastAPI()
    for module in (rl_router, sleep_router, cache_router, health_router):
        app.include_router(module.router)
    app.state.engine_client = RecordingEngine()
    return app


def _declared(app, method, path):
    for route in app.routes:
        if getattr(route, "path", None) == path and method in getattr(route, "methods", ()):
            dep = route.dependant
            query = {p.alias for p in dep.query_params} | READ_BY_HAND.get((path, "query"), set())
            body = {p.alias for p in dep.body_params} | READ_BY_HAND.get((path, "body"), set())
            return query, body
    return None


def check_completion(body):
    out = {"path": "/v1/completions"}
    try:
        req = CompletionRequest.model_validate(body)
        params = req.to_sampling_params(req.max_tokens, {})
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["ignored"] = sorted(set(body) - CompletionRequest.model_fields.keys())
    out["sampling"] = {k: getattr(params, k) for k in (
        "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
        "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "n")}
    out["sampling"]["logit_bias"] = {str(k): v for k, v in (params.logit_bias or {}).items()}
    out["request_id"] = req.request_id
    return out


def replay(client, app, request):
    method, path, query, body = request["method"], request["path"], request["query"], request["body"]
    declared = _declared(app, method, path)
    if declared is None:
        return {"path": path, "error": "no such route in vLLM 0.33's routers"}
    before = len(calls)
    resp = client.request(method, path, params=query, json=body)
    try:
        answer = resp.json()
    except ValueError:
        answer = None
    return {"path": path, "status": resp.status_code, "answer": answer, "text": resp.text,
            "calls": calls[before:],
            "ignored_query": sorted({k for k, _ in query} - declared[0]),
            "ignored_body": sorted(set(body or {}) - declared[1]) if isinstance(body, dict) else []}


def completion_answer(req_body, spec):
    serving = object.__new__(OpenAIServingCompletion)  # the answer assembly only, no engine
    serving.enable_prompt_tokens_details = False
    serving.enable_per_request_metrics = False
    serving.system_fingerprint = None
    serving.return_tokens_as_token_ids = False
    req = CompletionRequest.model_validate(req_body)

    def output_of(index, one):
        ids = one["token_ids"]
        logprobs = [{t: Logprob(logprob=lp, rank=1, decoded_token=None)} for t, lp in zip(ids, one["logprobs"])]
        return CompletionOutput(index=index, text="", token_ids=ids, cumulative_logprob=None,
                                logprobs=logprobs if req.logprobs is not None else None,
                                finish_reason=one["finish_reason"], stop_reason=one["stop_reason"])

    # spec "choices": the n children of a parallel-sampling request, as the parent's aggregator orders them
    outputs = [output_of(j, one) for j, one in enumerate(spec["choices"])] if "choices" in spec else [output_of(0, spec)]
    engine_id = f"cmpl-{req.request_id}"
    prompt_logprobs = None  # spec "prompt_logprobs": one log-prob per prompt token after the first
    if spec.get("prompt_logprobs") is not None:
        prompt_logprobs = [None] + [{t: Logprob(logprob=lp, rank=1, decoded_token=None)}
                                    for t, lp in zip(list(req.prompt)[1:], spec["prompt_logprobs"])]
    final = RequestOutput(request_id=f"{engine_id}-0", prompt=None, prompt_token_ids=list(req.prompt),
                          prompt_logprobs=prompt_logprobs, outputs=outputs, finished=True)
    resp = serving.request_output_to_completion_response(
        [final], req, engine_id, 1, "Qwen/x", None, RequestResponseMetadata(request_id=engine_id))
    return json.loads(resp.model_dump_json())


def main():
    data = json.load(sys.stdin)
    app = build_app()
    client = TestClient(app)

    def check(request):
        return check_completion(request["body"]) if request["path"] == "/v1/completions" else \
            replay(client, app, request)

    controls = [check(r) for r in data.get("controls", [])]  # requests that must fail: the checks can fail
    results = []
    models = ModelList(data=[ModelCard(id="Qwen/x", root="/models/x", max_model_len=4096)]).model_dump_json()
    for request in data["requests"]:
        if request["path"] == "/v1/models":  # its route needs vLLM's model registry: the answer model only
            results.append({"path": "/v1/models", "status": 200, "answer": json.loads(models), "text": models,
                            "calls": [], "ignored_query": [], "ignored_body": [], "via": "ModelList"})
        elif request["path"] == "/v1/completions":
            results.append(check_completion(request["body"]))
        else:
            results.append(replay(client, app, request))
    answers = [completion_answer(c["request"], c["output"]) for c in data["completions"]]
    groups = [{"check": check_completion(g["request"]), "answer": completion_answer(g["request"], g["output"])}
              for g in data.get("groups", [])]
    print("RESULT " + json.dumps({"requests": results, "completions": answers, "controls": controls,
                                  "groups": groups}))


if __name__ == "__main__":
    main()
