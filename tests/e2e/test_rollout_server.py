"""The embedded rollout server as a real subprocess: SGLang shapes, errors, auth, seeds, greedy, abort."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from megatron_rl.rollout.client import GenerateRequest, RolloutClient
from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.launcher import launch_rollout_server

EOS = 2


def save_tiny_qwen2(path, *, vocab_size=128, hidden_size=32, max_position_embeddings=4096, seed=0):
    """A random 2-layer Qwen2ForCausalLM with peaked logits (large init), saved with save_pretrained."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with launch_rollout_server(
        model_dir,
        log_path=log,
        extra_args=["--dtype", "float32", "--weight-version", "v0", "--random-seed", "1"],
        startup_timeout_s=120,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout_s=30, generate_timeout_s=60) as c:
        yield c


def _post(server, path, body=None, **kw):
    kwargs = {"json": body} if body is not None else {}
    return httpx.post(server.base_url + path, timeout=30, **kwargs, **kw)


def test_generate_answer_shape(server):
    r = _post(
        server,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "rid": "shape-1",
            "return_logprob": True,
        },
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["id"] == "shape-1" and meta["prompt_tokens"] == 3 and meta["weight_version"] == "v0"
    assert meta["completion_tokens"] == len(body["output_ids"]) == len(meta["output_token_logprobs"])
    assert "text" not in body  # ids in, ids out (like --skip-tokenizer-init)
    for (lp, tok, text), out in zip(meta["output_token_logprobs"], body["output_ids"]):
        assert tok == out and text is None and lp <= 0
    fr = meta["finish_reason"]
    assert fr in ({"type": "length", "length": 6}, {"type": "stop", "matched": body["output_ids"][-1]})

    # a batch with n=2 answers one object per output, grouped by prompt
    r = _post(
        server,
        "/generate",
        {"input_ids": [[5, 6, 7], [9]], "sampling_params": {"max_new_tokens": 3, "n": 2}, "rid": ["a", "b"]},
    )
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1"]
    assert all("output_token_logprobs" not in o["meta_info"] for o in outs)


def test_eos_stop_is_kept_in_output_ids(client):
    # min_new_tokens=0, temperature 1 with many seeds: some response ends on EOS; its id stays
    reqs = [GenerateRequest([3, 4], {"max_new_tokens": 40, "sampling_seed": s}, rid=f"eos-{s}") for s in range(24)]
    results = client.generate_many(reqs, max_concurrency=8, eos_token_ids=[EOS])
    stopped = [r for r in results if r.finish_type == "stop"]
    assert stopped, "no response hit EOS; pick other seeds"
    for r in stopped:
        assert r.output_ids[-1] == EOS and r.matched_stop == EOS and r.stop_reason == "eos"
        assert len(r.output_ids) == len(r.output_logprobs) == r.completion_tokens
    # stop_token_ids end a request the same way (same seed, so the same draws), reported as a stop token
    first = results[0].output_ids
    stop_tok = first[1]
    r = client.generate(
        [3, 4], {"max_new_tokens": 40, "sampling_seed": 0, "stop_token_ids": [stop_tok]}, rid="st", eos_token_ids=[EOS]
    )
    k = next(i for i, t in enumerate(first) if t in (stop_tok, EOS))
    assert r.output_ids == first[: k + 1] and r.matched_stop == first[k]
    assert r.stop_reason == ("eos" if first[k] == EOS else "stop_token")


def test_unknown_sampling_param_is_a_400_naming_it(server):
    for key in ("max_tokens", "seed"):
        r = _post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {key: 3}})
        assert r.status_code == 400
        assert r.json()["error"].startswith(f"unknown field `{key}`, expected one of `max_new_tokens`")


def test_control_endpoints_need_a_json_body(server):
    for path in (
        "/begin_weight_update",
        "/end_weight_update",
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_distributed",
    ):
        r = _post(server, path)
        assert r.status_code == 400, path
        assert r.json()["object"] == "error" and "Field required" in r.json()["message"]


def test_weight_update_session_errors(server):
    upd = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}
    r = _post(server, "/update_weights_from_distributed", upd)
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
    }
    r = _post(server, "/end_weight_update", {})
    assert r.status_code == 400 and r.json()["success"] is False
    assert _post(server, "/begin_weight_update", {}).json()["success"] is True
    r = _post(server, "/begin_weight_update", {"selector": "all"})
    assert r.status_code == 400 and r.json()["success"] is False
    # inside a session, an update naming a group that does not exist fails cleanly
    r = _post(server, "/update_weights_from_distributed", {**upd, "group_name": "nope"})
    assert r.status_code == 400 and "nope" in r.json()["message"]
    assert _post(server, "/end_weight_update", {}).json()["success"] is True


def test_info_and_small_endpoints(client, server):
    info = client.model_info()
    assert info["dtype"] == "float32" and info["model_path"] and info["weight_version"] == "v0"
    assert client.server_info()["tp_size"] == 1
    assert "api_key" not in str(client.server_info())
    assert client.flush_cache().startswith("Cache flushed")
    client.health()
    client.health_generate()
    assert client.get_weights_by_name("model.norm.weight", truncate_size=3) == [1.0, 1.0, 1.0]
    r = _post(server, "/get_weights_by_name", {"name": "no.such.weight"})
    assert r.status_code == 400
    client.update_weight_version("v0b")
    r = client.generate([5], {"max_new_tokens": 1}, rid="ver")
    assert r.weight_version == "v0b"
    client.update_weight_version("v0")


def test_same_seed_same_tokens_alone_and_in_a_batch(client, server):
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "sampling_seed": 1234}
    alone = client.generate([7, 8, 9, 10], params, rid="alone")
    # the same request amid others of other lengths and seeds, all in one batch
    prompts = [[7, 8, 9, 10], [1], [20, 21, 22, 23, 24, 25, 26], [7, 8, 9, 10], [3, 3]]
    sps = [
        params,
        {"max_new_tokens": 5, "sampling_seed": 1},
        {"max_new_tokens": 30, "sampling_seed": 2},
        {**params, "sampling_seed": 99},
        {"max_new_tokens": 3, "temperature": 0},
    ]
    outs = _post(server, "/generate", {"input_ids": prompts, "sampling_params": sps, "return_logprob": True}).json()
    batched = outs[0]
    # exact token equality; rollout log-probs equal up to batched-matmul rounding (see the server docstring)
    assert batched["output_ids"] == alone.output_ids
    got = torch.tensor([e[0] for e in batched["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, torch.tensor(alone.output_logprobs), rtol=0, atol=1e-4)
    assert outs[3]["output_ids"] != alone.output_ids  # another seed, another sample
    again = client.generate([7, 8, 9, 10], params, rid="again")
    assert again.output_ids == alone.output_ids and again.output_logprobs == alone.output_logprobs


def test_a_group_in_one_call_equals_its_responses_alone(client):
    """The manager's group call (one batch /generate: the same prompt n times, one seed and rid
    each): the prompt is prefilled once and its KV cache shared (engine/batching.py), yet every
    response has exactly the tokens it gets alone; log-probs up to batched-matmul rounding."""
    prompt = [4, 9, 16, 25, 36]
    params = [{"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 500 + j} for j in range(6)]
    group = client.generate_batch([prompt] * 6, params, [f"grp-{j}" for j in range(6)])
    alone = [client.generate(prompt, p, rid=f"alone-{j}") for j, p in enumerate(params)]
    assert [r.rid for r in group] == [f"grp-{j}" for j in range(6)]
    assert [r.output_ids for r in group] == [r.output_ids for r in alone]
    assert len({tuple(r.output_ids) for r in group}) > 1  # the seeds differ: not one response 6 times
    for g, a in zip(group, alone):
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(a.output_logprobs), rtol=0, atol=1e-4)


def test_greedy_equals_hf_generate(client, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt in ([5, 6, 7], [11, 3, 90, 17, 4], [100]):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=EOS,
                pad_token_id=0,
            )
        want = hf[0, len(prompt) :].tolist()
        got = client.generate(prompt, {"max_new_tokens": 16, "temperature": 0}, rid=f"greedy-{prompt[0]}")
        assert got.output_ids == want
        # rollout log-probs are the raw model distribution
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(want)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.output_logprobs), ref, rtol=0, atol=1e-4)


def _wait_for(client, running=0, waiting=0, timeout_s=60.0):
    """Poll /server_info until at least ``running`` sequences decode and ``waiting`` wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.server_info()
        if info["num_running_reqs"] >= running and info["num_waiting_reqs"] >= waiting:
            return
        assert time.monotonic() < deadline, f"server never had {running} running / {waiting} waiting: {info}"
        time.sleep(0.02)


def test_abort_running_and_queued_requests(client):
    results = {}

    def run(rid):
        results[rid] = client.generate([4, 5], {"max_new_tokens": 4000, "ignore_eos": True}, rid=rid)

    threads = [threading.Thread(target=run, args=(f"abort-me-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    _wait_for(client, running=2)
    time.sleep(0.1)
    client.abort_request("abort-me")  # prefix match: both
    for t in threads:
        t.join(timeout=60)
    for rid, r in results.items():
        assert r.finish_type == "abort" and r.stop_reason == "abort", rid
        assert 0 < len(r.output_ids) < 4000 and len(r.output_logprobs) == len(r.output_ids)
    assert len(results) == 2

    # queued while paused, then aborted by rid: abort shape with no tokens
    client.pause_generation("abort")
    t = threading.Thread(target=run, args=("queued-1",))
    t.start()
    _wait_for(client, waiting=1)
    client.abort_request("queued-1")
    t.join(timeout=30)
    client.continue_generation()
    assert results["queued-1"].finish_type == "abort" and results["queued-1"].output_ids == []


def test_pause_abort_ends_requests_in_flight(client):
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "r", client.generate([4, 5], {"max_new_tokens": 4000, "ignore_eos": True}, rid="pause-victim")
        )
    )
    t.start()
    _wait_for(client, running=1)
    client.pause_generation("abort")
    t.join(timeout=30)
    assert out["r"].finish_type == "abort"
    assert client.flush_cache().startswith("Cache flushed")
    client.continue_generation()
    assert client.generate([4, 5], {"max_new_tokens": 2}, rid="after").completion_tokens == 2


def test_api_keys(model_dir, tmp_path):
    extra = ["--dtype", "float32", "--api-key", "user-key", "--admin-api-key", "admin-key"]
    with launch_rollout_server(model_dir, log_path=tmp_path / "auth.log", extra_args=extra) as srv:
        url = srv.base_url
        gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # always open
        assert httpx.post(url + "/generate", json=gen, timeout=10).status_code == 401
        assert (
            httpx.post(
                url + "/generate", json=gen, headers={"Authorization": "Bearer user-key"}, timeout=10
            ).status_code
            == 200
        )
        # control endpoints need the admin key; the plain key is refused
        for key, code in ((None, 401), ("user-key", 401), ("wrong", 401), ("admin-key", 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(url + "/flush_cache", json={}, headers=headers, timeout=10)
            assert r.status_code == code, key
        c = srv.client()
        assert c.generate([1, 2], {"max_new_tokens": 1}, rid="k").completion_tokens == 1
        c.pause_generation()
        c.continue_generation()
        with pytest.raises(RolloutServerError) as e:
            RolloutClient(url, api_key="user-key").pause_generation()
        assert e.value.status_code == 401
    assert "admin-key" not in (tmp_path / "auth.log").read_text()


def test_failed_start_raises_with_log_tail(tmp_path):
    with pytest.raises(RolloutServerError) as e:
        launch_rollout_server(tmp_path / "no-such-model", log_path=tmp_path / "bad.log", startup_timeout_s=60)
    assert "no-such-model" in str(e.value) and "exited with code" in str(e.value)


def _long_request(server, rid, out, max_new_tokens=1500):
    body = {
        "input_ids": [4, 5, 6],
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling_seed": 7},
    }
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    out[rid] = (time.monotonic(), r.json())


def test_retract_resumes_with_the_same_tokens(server, client):
    out = {}
    _long_request(server, "ref", out, max_new_tokens=600)
    t = threading.Thread(target=_long_request, args=(server, "retracted", out, 600))
    t.start()
    _wait_for(client, running=1)
    time.sleep(0.1)
    client.pause_generation("retract")
    assert client.flush_cache().startswith("Cache flushed")  # retracted requests hold no KV
    time.sleep(0.2)
    client.continue_generation()
    t.join(timeout=120)
    ref, got = out["ref"][1], out["retracted"][1]
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 600}
    assert got["meta_info"]["num_retractions"] >= 1  # it was running when paused (KV recomputed on resume)
    assert got["output_ids"] == ref["output_ids"]


def test_in_place_pause_blocks_flush(server, client):
    out = {}
    t = threading.Thread(target=_long_request, args=(server, "frozen", out, 600))
    t.start()
    _wait_for(client, running=1)
    client.pause_generation("in_place")
    with pytest.raises(RolloutServerError) as e:
        client.flush_cache()
    assert e.value.status_code == 400
    client.continue_generation()
    t.join(timeout=120)
    assert out["frozen"][1]["meta_info"]["finish_reason"]["type"] == "length"


def test_weight_update_waits_for_requests_in_flight(server, client):
    out = {}
    t = threading.Thread(target=_long_request, args=(server, "inflight", out, 1500))
    t.start()
    _wait_for(client, running=1)
    client.begin_weight_update(timeout_s=300)  # not paused: waits for the write lock (minutes on a loaded machine)
    begun = time.monotonic()
    client.end_weight_update()
    t.join(timeout=120)
    done_at, body = out["inflight"]
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert begun >= done_at - 0.5  # begin returned only once the request had finished


def test_joining_a_running_batch_keeps_everyones_tokens(server, client):
    params = {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 55}
    alone_short = client.generate([7, 8, 9, 10], params, rid="join-alone")
    ref = {}
    _long_request(server, "join-ref", ref, 800)
    out = {}
    t = threading.Thread(target=_long_request, args=(server, "join-long", out, 800))
    t.start()
    _wait_for(client, running=1)
    time.sleep(0.1)
    joined = client.generate([7, 8, 9, 10], params, rid="join-short")  # joins the running batch
    short_done = time.monotonic()
    t.join(timeout=120)
    assert short_done < out["join-long"][0]  # it ran beside the long request, not after it
    assert joined.output_ids == alone_short.output_ids
    # the long request's KV cache was left-padded when the short one joined: same tokens as alone
    assert out["join-long"][1]["output_ids"] == ref["join-ref"][1]["output_ids"]
