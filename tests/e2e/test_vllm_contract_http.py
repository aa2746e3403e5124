"""Every HTTP body and query ``VLLMClient`` sends, and every answer it parses, checked against vLLM 0.33's
own code (the contract tier; the weight-transfer group itself: test_vllm_contract.py).

Runs where vLLM is installed in its own venv (``VLLM_VENV``, else ``/work/venv-vllm``; see
test_vllm_contract.py), otherwise skips. The client's requests are captured here with an
``httpx.MockTransport`` (no server) and checked in vLLM's python by ``vllm_http_contract_side.py``:

1. ``/v1/completions`` bodies pass vLLM's ``CompletionRequest`` with no field it would ignore, and
   ``to_sampling_params`` turns them into the ``SamplingParams`` written out below by hand;
2. every other request (``/pause``, ``/resume``, ``/abort_requests``, ``/sleep``, ``/wake_up``,
   ``/is_sleeping``, ``/is_paused``, ``/reset_prefix_cache``, ``/health``, ``/get_world_size``,
   ``/weight_info``, ``/update_weight_version`` and the weight-transfer routes) is replayed
   through vLLM's own routers on an app whose engine records the calls: each answers 200, declares
   every query/body key sent, and calls the engine with the arguments listed below;
3. the answers those routes gave, a ``/v1/models`` answer built with vLLM's ``ModelList``, and
   ``/v1/completions`` answers assembled by vLLM's ``request_output_to_completion_response`` are
   parsed by the client, which must get the values written out below.
Not checked here: the generation itself, what the engine does with the calls (a recording
stand-in answers them), the 503 a paused or sleeping vLLM gives a completion, and ``/v1/models``
through its route (it needs vLLM's model registry).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.vllm_client import VLLMClient, result_from_vllm


def _vllm_python() -> str | None:
    venv = os.environ.get("VLLM_VENV") or ("/work/venv-vllm" if Path("/work/venv-vllm").is_dir() else None)
    python = Path(venv) / "bin" / "python" if venv else None
    return str(python) if python is not None and python.exists() else None


VLLM_PYTHON = _vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM venv (set VLLM_VENV, see test_vllm_contract.py)")
SIDE = Path(__file__).with_name("vllm_http_contract_side.py")

SAMPLING = {"max_new_tokens": 64, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
            "frequency_penalty": 0.1, "presence_penalty": 0.2, "repetition_penalty": 1.05, "stop": ["</answer>"],
            "stop_token_ids": [99], "ignore_eos": False, "skip_special_tokens": False,
            "spaces_between_special_tokens": True, "no_stop_trim": True, "sampling_seed": 42,
            "logit_bias": {"7": -1.5}, "n": 1}
#: SamplingParams vLLM builds from that body (by hand: SGLang key -> vLLM field, top_k -1 -> 0 = off)
EXPECTED_SAMPLING = {"max_tokens": 64, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
                     "seed": 42, "stop": ["</answer>"], "stop_token_ids": [99], "ignore_eos": False,
                     "include_stop_str_in_output": True, "skip_special_tokens": False,
                     "spaces_between_special_tokens": True, "logprobs": 0, "presence_penalty": 0.2,
                     "frequency_penalty": 0.1, "repetition_penalty": 1.05, "n": 1, "logit_bias": {"7": -1.5}}
EOS = 151645
#: engine outputs -> (stop_reason, matched_stop) the client must read from vLLM's assembled answer
COMPLETIONS = [
    ({"token_ids": [11, 12, EOS], "logprobs": [-0.5, -1.0, -0.25], "finish_reason": "stop", "stop_reason": None},
     ("eos", EOS)),
    ({"token_ids": [11, 99], "logprobs": [-0.5, -2.0], "finish_reason": "stop", "stop_reason": 99}, ("stop_token", 99)),
    ({"token_ids": [11, 12], "logprobs": [-0.5, -0.75], "finish_reason": "stop", "stop_reason": "</answer>"},
     ("stop_string", "</answer>")),
    ({"token_ids": [11, 12, 13], "logprobs": [-0.5, -1.0, -1.5], "finish_reason": "length", "stop_reason": None},
     ("length", None)),
    ({"token_ids": [11], "logprobs": [-0.5], "finish_reason": "abort", "stop_reason": None}, ("abort", None)),
]


def _session(c: VLLMClient) -> list:
    """Every call of the client but ``generate`` (captured separately), in an order vLLM accepts."""
    c._inflight["rid-7"] = "cmpl-rid-7-0"  # a generation in flight, so that abort by prefix names its engine id
    return [
        c.is_healthy(), c.transfer_world_size(), c.weight_version(), c.model_info(), c.is_paused(),
        c.pause_generation("abort"), c.pause_generation("in_place"), c.pause_generation("retract"),
        c.continue_generation(), c.abort_request(rid="rid-"), c.abort_request(abort_all=True), c.flush_cache(),
        c.sleep(level=0), c.wake_up(["scheduling"]), c.sleep(level=1, mode="wait"), c.wake_up(["weights"]),
        c.is_sleeping(), c.wake_up(["kv_cache"]), c.sleep(level=2, will_reload_weights=True, mode="keep"),
        c.wake_up(), c.is_sleeping(),
        c.init_weights_update_group("10.0.0.1", 29500, 1, 9), c.begin_weight_update(),
        c.begin_weight_update("draft"),
        c.update_weights_from_distributed(["model.norm.weight", "lm_head.weight"], ["float32", "bfloat16"],
                                          [[8], [16, 8]]),
        c.end_weight_update(weight_version="7"), c.end_weight_update(), c.update_weight_version("8"),
    ]


PLAUSIBLE = {  # answers for the capture run (only so that the client goes on; vLLM's come later)
    "/health": None, "/get_world_size": {"world_size": 8}, "/weight_info": {"weight_version": "7"},
    "/v1/models": {"object": "list", "data": [{"id": "Qwen/x", "root": "/models/x", "max_model_len": 4096}]},
    "/is_paused": {"is_paused": False}, "/pause": {"status": "paused"}, "/resume": {"status": "resumed"},
    "/abort_requests": {"status": "aborted", "aborted": 1}, "/reset_prefix_cache": {"success": True},
    "/sleep": {"status": "sleeping", "level": 1}, "/wake_up": {"status": "awake", "tags": None},
    "/is_sleeping": {"is_sleeping": False}, "/init_weight_transfer_engine": {"message": "Weight transfer initialized"},
    "/start_weight_update": {"message": "Weight update started"},
    "/start_draft_weight_update": {"message": "Draft weight update started"},
    "/update_weights": {"message": "Weights updated"}, "/finish_weight_update": {"message": "Weight update finished"},
    "/update_weight_version": {"success": True, "new_version": "8"},
}


def _req(method, path, query=(), body=None) -> dict:
    return {"method": method, "path": path, "query": [list(q) for q in query], "body": body}


#: requests vLLM must refuse or partly ignore (so a passing check means something)
CONTROLS = [
    _req("POST", "/v1/completions", body={"prompt": [1, 2], "max_new_tokens": 3}),  # SGLang's key: ignored
    _req("POST", "/v1/completions", body={"prompt": [1, -2]}),  # negative token id
    _req("POST", "/v1/completions", body={"prompt": [1], "top_p": 1.5}),  # SamplingParams refuses it
    _req("POST", "/pause", [("mode", "keep"), ("wait_for_inflight_requests", "true")]),  # gone in 0.33
    _req("POST", "/pause", [("mode", "retract")]),  # SGLang's mode
    _req("POST", "/sleep", [("level", "3")]),
    _req("POST", "/update_weights", body={"names": ["a"]}),  # not wrapped in update_info
    _req("POST", "/flush_cache"),  # SGLang's route
]


def _record(request: httpx.Request) -> dict:
    return {"method": request.method, "path": request.url.path, "query": list(request.url.params.multi_items()),
            "body": json.loads(request.content) if request.content else None}


def _capture() -> tuple[list[dict], list[dict]]:
    """(requests of ``_session``, ``/v1/completions`` bodies of ``generate``) as the client sends them."""
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(_record(request))
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            n, k = 3, body.get("n", 1)
            return httpx.Response(200, json={"choices": [{"index": j, "token_ids": [5] * n, "finish_reason": "length",
                                                          "stop_reason": None, "logprobs": {
                                                              "token_logprobs": [-1.0] * n,
                                                              "tokens": ["token_id:5"] * n}} for j in range(k)],
                                             "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n * k}})
        payload = PLAUSIBLE[request.url.path]
        return httpx.Response(200, json=payload) if payload is not None else httpx.Response(200)

    c = VLLMClient("http://vllm-contract-capture:8000", transport=httpx.MockTransport(handler), max_retries=0)
    c.generate([1, 2, 3], dict(SAMPLING), "rid-1")
    c.generate([4, 5], {"max_new_tokens": 8, "top_k": 5}, "rid-2", return_logprob=False)
    c.generate_batch([[1, 2, 3]] * 4, [dict(SAMPLING, sampling_seed=42 + j) for j in range(4)],
                     [f"grp-r{j}" for j in range(4)])  # parallel sampling: one body with n=4 (rollout/vllm_group.py)
    completions = [r for r in sent if r["path"] == "/v1/completions"]
    del sent[:]
    _session(c)
    c.close()
    return sent, completions


@pytest.fixture(scope="module")
def vllm_side():
    requests, completions = _capture()
    completions, group = completions[:2], completions[2]
    payload = {"requests": completions + requests, "controls": CONTROLS,
               "completions": [{"request": completions[0]["body"], "output": out} for out, _ in COMPLETIONS],
               "groups": [{"request": group["body"], "output": {"choices": [out for out, _ in COMPLETIONS[:4]]}}]}
    proc = subprocess.run([VLLM_PYTHON, str(SIDE)], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return requests, completions + [group], json.loads(lines[-1][len("RESULT "):])


def test_completion_bodies_pass_vllms_request_model(vllm_side):
    _, completions, got = vllm_side
    first, second = got["requests"][:2]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["ignored"] == [] and second["ignored"] == []  # no field vLLM would drop
    for key, want in EXPECTED_SAMPLING.items():
        assert first["sampling"][key] == pytest.approx(want) if isinstance(want, float) else \
            first["sampling"][key] == want, key
    assert first["request_id"] == "rid-1" and second["request_id"] == "rid-2"
    assert second["sampling"]["top_k"] == 5 and second["sampling"]["max_tokens"] == 8
    assert second["sampling"]["logprobs"] is None  # return_logprob=False sends no logprobs


def test_a_parallel_sampling_group_passes_vllms_request_model_and_answer(vllm_side):
    """A prompt's 4 responses with seeds 42..45 go as one body (`VLLMClient.generate_batch`): vLLM's
    `CompletionRequest` takes it whole, with `n` = 4 and `seed` 42 (vLLM seeds child j with 42 + j);
    the answer vLLM's `request_output_to_completion_response` assembles for 4 children (choice j =
    child j) is split back into 4 results in entry order, each with its finish reason."""
    _, completions, got = vllm_side
    [group] = got["groups"]
    check, answer = group["check"], group["answer"]
    assert "error" not in check and check["ignored"] == [], check
    assert check["sampling"]["n"] == 4 and check["sampling"]["seed"] == 42
    assert check["request_id"] == "grp-r0-n4" and completions[2]["body"]["n"] == 4
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    c = VLLMClient("http://vllm-contract-replay:8000", transport=httpx.MockTransport(handler), max_retries=0)
    out = c.generate_batch([[1, 2, 3]] * 4, [dict(SAMPLING, sampling_seed=42 + j) for j in range(4)],
                           [f"grp-r{j}" for j in range(4)], eos_token_ids=[EOS])
    assert [r.rid for r in out] == [f"grp-r{j}" for j in range(4)]
    for r, (spec, (reason, matched)) in zip(out, COMPLETIONS):
        assert r.output_ids == spec["token_ids"] and r.output_logprobs == spec["logprobs"]
        assert (r.stop_reason, r.matched_stop) == (reason, matched) and r.completion_tokens == len(spec["token_ids"])


def test_the_checks_can_fail(vllm_side):
    got = vllm_side[2]["controls"]
    assert got[0]["ignored"] == ["max_new_tokens"]
    assert "prompt" in got[1]["error"] and "top_p" in got[2]["error"]
    assert got[3]["status"] == 200 and got[3]["ignored_query"] == ["wait_for_inflight_requests"]
    assert got[4]["status"] == got[5]["status"] == got[6]["status"] == 422
    assert got[7]["error"].startswith("no such route")


def test_control_and_sleep_requests_pass_vllms_routes(vllm_side):
    requests, _, got = vllm_side
    replies = got["requests"][2:]
    assert len(replies) == len(requests)
    for sent, reply in zip(requests, replies):
        assert reply.get("status") == 200, (sent, reply)
        assert reply["ignored_query"] == [] and reply["ignored_body"] == [], (sent, reply)
    engine_calls = [(s["path"], r["calls"]) for s, r in zip(requests, replies)]
    want = {  # what vLLM's routes ask of the engine, by hand from api_router.py
        ("/pause", 0): [["pause_generation", [], {"mode": "abort", "clear_cache": True}]],
        ("/pause", 1): [["pause_generation", [], {"mode": "keep", "clear_cache": True}]],
        ("/pause", 2): [["pause_generation", [], {"mode": "keep", "clear_cache": True}]],
        ("/abort_requests", 0): [["abort", [["cmpl-rid-7-0"]], {}]],
        ("/abort_requests", 1): [["abort", [["internal-1"]], {"internal": True}]],  # empty list: everything
        ("/reset_prefix_cache", 0): [["reset_prefix_cache", [False, False], {}]],
        ("/sleep", 0): [["sleep", [0, "abort"], {}]],
        ("/wake_up", 0): [["wake_up", [["scheduling"]], {}]],
        ("/sleep", 1): [["sleep", [1, "wait"], {}]],
        ("/wake_up", 1): [["wake_up", [["weights"]], {}]],
        ("/wake_up", 2): [["wake_up", [["kv_cache"]], {}]],
        ("/sleep", 2): [["sleep", [2, "keep"], {}]],
        ("/wake_up", 3): [["wake_up", [None], {}]],
        ("/init_weight_transfer_engine", 0): [["init_weight_transfer_engine", [{"init_info": {
            "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 9,
            "packed": False}}], {}]],
        ("/update_weights", 0): [["update_weights", [], {"request": {"update_info": {
            "names": ["model.norm.weight", "lm_head.weight"], "dtype_names": ["float32", "bfloat16"],
            "shapes": [[8], [16, 8]]}}}]],
        ("/finish_weight_update", 0): [["finish_weight_update", ["7"], {}]],
        ("/finish_weight_update", 1): [["finish_weight_update", [None], {}]],
        ("/update_weight_version", 0): [["update_weight_version", ["8"], {}]],
        ("/start_draft_weight_update", 0): [["start_draft_weight_update", [], {}]],
    }
    seen: dict = {}
    checked = set()
    for path, calls in engine_calls:
        key = (path, seen.setdefault(path, 0))
        seen[path] += 1
        if key in want:
            assert calls == want[key], (key, calls)
            checked.add(key)
    assert checked == set(want)


def test_client_parses_vllms_own_answers(vllm_side):
    requests, _, got = vllm_side
    answers = iter(got["requests"][2:])

    def handler(request: httpx.Request) -> httpx.Response:
        reply = next(answers)
        assert reply["path"] == request.url.path
        return httpx.Response(reply["status"], content=reply["text"].encode(),
                              headers={"content-type": "application/json"} if reply["answer"] is not None else {})

    c = VLLMClient("http://vllm-contract-replay:8000", transport=httpx.MockTransport(handler), max_retries=0)
    out = _session(c)
    assert out[:5] == [True, 8, "7", {"model_path": "/models/x", "max_model_len": 4096, "weight_version": "7"}, False]
    assert out[5:9] == [{"status": "paused"}] * 3 + [{"status": "resumed"}]
    assert out[11] == "{'success': True}"
    assert out[12:16] == [{"status": "sleeping", "level": 0}, {"status": "awake", "tags": ["scheduling"]},
                          {"status": "sleeping", "level": 1}, {"status": "sleeping", "tags": ["weights"]}]
    assert out[16] is True and out[17] == {"status": "awake", "tags": ["kv_cache"]}
    assert out[19:21] == [{"status": "awake", "tags": None}, False]
    assert out[21]["message"] == "Weight transfer initialized" and out[25]["message"] == "Weight update finished"
    assert out[27] == {"success": True, "new_version": "8"}


def test_client_parses_vllms_completion_answers(vllm_side):
    _, _, got = vllm_side
    for answer, (spec, (reason, matched)) in zip(got["completions"], COMPLETIONS):
        assert answer["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in spec["token_ids"]]
        r = result_from_vllm(answer, rid="rid-1", stop_token_ids=[99], eos_token_ids=[EOS])
        assert (r.stop_reason, r.matched_stop) == (reason, matched)
        assert r.output_ids == spec["token_ids"] and r.output_logprobs == spec["logprobs"]
        assert r.prompt_tokens == 3 and r.completion_tokens == len(spec["token_ids"]) and r.weight_version is None


def test_score_tokens_body_and_answer_against_vllm():
    """Issue 32: the log-prob check's re-scoring call (`VLLMClient.score_tokens`) sends a body vLLM takes
    whole (`prompt_logprobs: 0`, temperature 1, one token, no output log-probs), and the client reads the
    prompt log-probs out of the answer vLLM's own `request_output_to_completion_response` assembles
    (`{"<id>": {"logprob", "rank", "decoded_token"}}` per prompt token, null first)."""
    sent: list[dict] = []

    def capture(request: httpx.Request) -> httpx.Response:
        sent.append(_record(request))
        return httpx.Response(500, json={"error": "capture only"})

    c = VLLMClient("http://vllm-contract-capture:8000", transport=httpx.MockTransport(capture), max_retries=0)
    with pytest.raises(RolloutServerError, match="HTTP 500"):
        c.score_tokens([1, 2, 3], [5, 7])
    body = sent[0]["body"]
    spec = {"token_ids": [9], "logprobs": [-0.5], "finish_reason": "length", "stop_reason": None,
            "prompt_logprobs": [-1.0, -2.0, -1.5, -0.25]}  # tokens 2, 3, 5, 7
    payload = {"requests": [sent[0]], "controls": [], "completions": [{"request": body, "output": spec}]}
    proc = subprocess.run([VLLM_PYTHON, str(SIDE)], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    checked = got["requests"][0]
    assert "error" not in checked and checked["ignored"] == [], checked
    assert {k: checked["sampling"][k] for k in ("prompt_logprobs", "logprobs", "temperature", "top_p", "max_tokens")} \
        == {"prompt_logprobs": 0, "logprobs": None, "temperature": 1.0, "top_p": 1.0, "max_tokens": 1}
    answer = got["completions"][0]
    c = VLLMClient("http://vllm-contract-replay:8000", max_retries=0,
                   transport=httpx.MockTransport(lambda request: httpx.Response(200, json=answer)))
    assert c.score_tokens([1, 2, 3], [5, 7]) == [-1.5, -0.25]
