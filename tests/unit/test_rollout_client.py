"""RolloutClient and the GenerateResult adapter against mocked SGLang answers (case B21)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from megatron_rl.rollout.client import GenerateRequest, GenerateResult, RolloutClient
from megatron_rl.errors import RolloutServerError

QWEN_IM_END = 151645


def _answer(output_ids, finish, *, completion_tokens=None, logprobs=None, rid="r0"):
    logprobs = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(output_ids))]
    return {
        "output_ids": list(output_ids),
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": 4,
            "completion_tokens": len(output_ids) if completion_tokens is None else completion_tokens,
            "cached_tokens": 0,
            "weight_version": "7",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
            "output_token_logprobs_length": len(logprobs),
        },
    }


def test_b21_eos_is_kept_and_counted():
    resp = _answer([11, 12, QWEN_IM_END], {"type": "stop", "matched": QWEN_IM_END})
    r = GenerateResult.from_sglang(resp, eos_token_ids=[QWEN_IM_END])
    assert r.output_ids == [11, 12, QWEN_IM_END]
    assert len(r.output_logprobs) == 3 == r.completion_tokens
    assert r.finish_type == "stop" and r.matched_stop == QWEN_IM_END and r.stop_reason == "eos"
    assert r.weight_version == "7" and r.prompt_tokens == 4
    # without the model's EOS list a matched id that is not a requested stop token is an EOS
    assert GenerateResult.from_sglang(resp).stop_reason == "eos"


def test_b21_stop_token_and_stop_string_are_told_apart():
    resp = _answer([11, 12, 99], {"type": "stop", "matched": 99})
    assert (
        GenerateResult.from_sglang(resp, stop_token_ids=[99], eos_token_ids=[QWEN_IM_END]).stop_reason == "stop_token"
    )
    # variant: the matched item is a stop string (SGLang keeps the ids it generated)
    resp = _answer([11, 12, 13], {"type": "stop", "matched": "</answer>"})
    r = GenerateResult.from_sglang(resp, eos_token_ids=[QWEN_IM_END])
    assert r.stop_reason == "stop_string" and r.matched_stop == "</answer>" and r.output_ids == [11, 12, 13]


def test_b21_stripped_stop_token_is_refused():
    # A layer removed the EOS from the ids but completion_tokens still counts it (the bug of B21).
    resp = _answer([11, 12], {"type": "stop", "matched": QWEN_IM_END}, completion_tokens=3)
    with pytest.raises(RolloutServerError, match="inconsistent"):
        GenerateResult.from_sglang(resp)
    # ids and count agree but the matched id is gone from the ids
    resp = _answer([11, 12], {"type": "stop", "matched": QWEN_IM_END})
    with pytest.raises(RolloutServerError, match="not the last output id"):
        GenerateResult.from_sglang(resp)
    # one logprob short
    resp = _answer([11, 12, QWEN_IM_END], {"type": "stop", "matched": QWEN_IM_END})
    resp["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(RolloutServerError, match="inconsistent"):
        GenerateResult.from_sglang(resp)


def test_length_and_abort_shapes():
    r = GenerateResult.from_sglang(_answer([1, 2], {"type": "length", "length": 2}))
    assert (r.finish_type, r.stop_reason, r.matched_stop) == ("length", "length", None)
    abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    r = GenerateResult.from_sglang(_answer([5], abort))
    assert (r.finish_type, r.stop_reason, r.abort_message, r.output_ids) == ("abort", "abort", "Aborted", [5])
    with pytest.raises(RolloutServerError, match="no output_token_logprobs"):
        resp = _answer([1], {"type": "length", "length": 1})
        del resp["meta_info"]["output_token_logprobs"]
        GenerateResult.from_sglang(resp)


def _mock_client(handler, **kw) -> RolloutClient:
    return RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5, **kw)


def test_generate_posts_the_sglang_body_and_parses():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, json=_answer([11, 12, QWEN_IM_END], {"type": "stop", "matched": QWEN_IM_END}))

    c = _mock_client(handler, api_key="k1", admin_api_key="adm")
    r = c.generate([1, 2, 3, 4], {"max_new_tokens": 8, "sampling_seed": 5}, rid="s-0-1")
    assert seen["path"] == "/generate" and seen["auth"] == "Bearer k1"
    assert seen["body"] == {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 8, "sampling_seed": 5},
        "rid": "s-0-1",
        "return_logprob": True,
    }
    assert r.output_ids[-1] == QWEN_IM_END
    with pytest.raises(ValueError):
        c.generate([1], {"n": 2}, rid="x")


def test_control_calls_use_admin_key_and_send_bodies():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content), request.headers.get("authorization")))
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        return httpx.Response(200, json={"success": True, "message": "ok"})

    c = _mock_client(handler, api_key="k1", admin_api_key="adm")
    c.pause_generation("retract")
    c.continue_generation()
    c.end_weight_update()
    assert c.flush_cache().startswith("Cache flushed")
    assert seen[0] == ("/pause_generation", {"mode": "retract"}, "Bearer adm")
    assert seen[1][1] == {} and seen[2][1] == {} and seen[3][1] == {}


def test_success_false_and_http_400_raise():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            return httpx.Response(400, json={"error": "unknown field `max_tokens`, expected one of ..."})
        return httpx.Response(400, json={"success": False, "message": "no session"})

    c = _mock_client(handler)
    with pytest.raises(RolloutServerError, match="max_tokens") as e:
        c.generate([1], {"max_tokens": 3}, rid="x")
    assert e.value.status_code == 400
    with pytest.raises(RolloutServerError, match="no session"):
        c.end_weight_update()


def test_retries_only_when_the_request_never_arrived():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"weight_version": "3", "model_path": "m"})

    c = _mock_client(handler, max_retries=3)
    assert c.weight_version() == "3" and calls["n"] == 3

    def slow(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ReadTimeout("slow", request=request)

    calls["n"] = 0
    with pytest.raises(RolloutServerError, match="timed out"):
        _mock_client(slow, max_retries=3).generate([1], {}, rid="x")
    assert calls["n"] == 1  # a POST that may have arrived is never re-sent


@pytest.mark.parametrize("error", [httpx.RemoteProtocolError("Server disconnected without sending a response."),
                                   httpx.ReadError("[Errno 104] Connection reset by peer")])
def test_stale_keepalive_connection_is_retried_once(error):
    """uvicorn closes idle keep-alive connections after 5 s; a request sent on one as it closes is
    reset before it runs. It is sent again once; a second reset is an error."""
    calls = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise type(error)(str(error), request=request)
        return httpx.Response(200, json=_answer([11, QWEN_IM_END], {"type": "stop", "matched": QWEN_IM_END}))

    assert _mock_client(flaky).generate([1, 2], {}, rid="r").output_ids == [11, QWEN_IM_END]
    assert calls["n"] == 2

    def dead(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise type(error)(str(error), request=request)

    calls["n"] = 0
    with pytest.raises(RolloutServerError, match="failed"):
        _mock_client(dead).generate([1, 2], {}, rid="r")
    assert calls["n"] == 2


def test_pooled_connections_expire_before_the_servers_keepalive():
    from megatron_rl.rollout.client import KEEPALIVE_EXPIRY_S

    assert KEEPALIVE_EXPIRY_S < 5.0  # uvicorn's (and SGLang's) default timeout_keep_alive


def test_generate_many_keeps_input_order():
    lock = threading.Lock()
    arrival = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        i = int(body["rid"].split("-")[1])
        time.sleep(0.02 * (8 - i))  # later requests answer first
        with lock:
            arrival.append(i)
        return httpx.Response(200, json=_answer([i, 100 + i], {"type": "length", "length": 2}, rid=body["rid"]))

    c = _mock_client(handler)
    reqs = [GenerateRequest([1, 2], {"max_new_tokens": 2}, rid=f"r-{i}") for i in range(8)]
    results = c.generate_many(reqs, max_concurrency=8)
    assert [r.rid for r in results] == [f"r-{i}" for i in range(8)]
    assert [r.output_ids[0] for r in results] == list(range(8))
    assert arrival != sorted(arrival)  # they really did arrive out of order


def test_every_thread_and_client_verifies_with_one_ssl_context():
    """httpx loads the CA bundle for each Client (~20 ms of CPU) unless given a context: the
    per-thread Clients of every RolloutClient share one (issue 22: the thread pools' first uses)."""
    from megatron_rl.rollout.client import shared_ssl_context

    a, b = RolloutClient("http://127.0.0.1:1"), RolloutClient("https://example.invalid")
    seen = []

    def use():
        seen.extend(c._http._transport._pool._ssl_context for c in (a, b))

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 6 and all(ctx is shared_ssl_context() for ctx in seen)
    assert shared_ssl_context().verify_mode.name == "CERT_REQUIRED"   # still verifies https servers
    a.close()
    b.close()


def test_a_callers_transport_needs_no_ssl_context(monkeypatch):
    """With `transport=` the Client builds no SSL context (plain httpx does not either), so an
    unreadable CA bundle cannot fail it."""
    import megatron_rl.rollout.client as client_mod

    def broken():
        raise FileNotFoundError("no CA bundle")

    monkeypatch.setattr(client_mod, "shared_ssl_context", broken)
    c = RolloutClient("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    c.health()   # answered through the transport; raised FileNotFoundError when the context was built
    c.close()


def test_update_weight_version_does_not_abort_by_default():
    """Issue 32 (seams): a relabel after an in-place update must not abort the requests paused in
    place, so the request body a caller gets without passing `abort_all_requests` says false; a
    caller that wants the abort says so."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    c = RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5)
    c.update_weight_version("3")
    c.update_weight_version("4", abort_all_requests=True)
    assert bodies == [("/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
                      ("/update_weight_version", {"new_version": "4", "abort_all_requests": True})]


@pytest.mark.parametrize("info, expected", [
    ({"tp_size": 4}, 4), ({}, 1), ({"tp_size": 2, "pp_size": 1, "dp_size": 1}, 2),
    ({"tp_size": None}, "tp_size is None, expected a whole number >= 1"),
    ({"tp_size": 1.5}, "tp_size is 1.5"), ({"tp_size": True}, "tp_size is True"),
    ({"tp_size": 2, "pp_size": 2}, "runs pp_size 2: SGLang's workers join .* rank_offset \\+ tp_rank only"),
    ({"tp_size": 1, "dp_size": 2}, "runs dp_size 2"),
])
def test_transfer_world_size_is_checked_and_names_the_server(info, expected):
    """SGLang's workers join the weight-update group at rank_offset + tp_rank: a bad tp_size or
    PP / DP replicas (which would share ranks and hang the rendezvous) are refused naming the server."""
    client = _mock_client(lambda request: httpx.Response(200, json=info))
    if isinstance(expected, int):
        assert client.transfer_world_size() == expected
    else:
        with pytest.raises(RolloutServerError, match=f"rollout server http://mock.*{expected}"):
            client.transfer_world_size()
