"""VLLMClient against mocked answers in vLLM 0.33.x's shapes (docs/VLLM_API.md records them with
the vLLM source files they come from)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from megatron_rl.config.schema import ROLLOUT_BACKEND_PORTS
from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.vllm_client import VLLMClient, completion_body, result_from_vllm

EOS = 151645


def _completion(token_ids, finish="stop", stop_reason=None, *, rid="r0", logprobs=None, completion_tokens=None,
                tokens=None):
    """A /v1/completions answer as vLLM 0.33.x's OpenAIServingCompletion writes it (one choice)."""
    logprobs = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(token_ids))]
    tokens = tokens if tokens is not None else [f"token_id:{t}" for t in token_ids]
    return {
        "id": f"cmpl-{rid}", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": stop_reason,
                     "token_ids": list(token_ids), "prompt_logprobs": None, "prompt_token_ids": None,
                     "logprobs": {"text_offset": [0] * len(token_ids), "token_logprobs": logprobs, "tokens": tokens,
                                  "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": len(token_ids) if completion_tokens is None
                  else completion_tokens, "total_tokens": 4 + len(token_ids)},
    }


class FakeVLLM:
    """Records every request; answers each path like vLLM 0.33.x."""

    def __init__(self, completion=None):
        self.calls: list[tuple[str, str, dict, object]] = []
        self.completion = completion or _completion([11, 12, EOS])
        self.version = None
        self.block = threading.Event()
        self.started = threading.Event()
        self.flush_ok = True
        self.asleep: set[str] = set()

    def _wake(self, tags: list[str]) -> dict:
        """vLLM's /wake_up: no tags wakes everything; "awake" once nothing sleeps."""
        self.asleep = set() if not tags else self.asleep - set(tags)
        return {"status": "sleeping" if self.asleep else "awake", "tags": tags or None}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, path, dict(request.url.params), body))
        if path == "/v1/completions":
            if body.get("request_id") == "slow":
                self.started.set()
                self.block.wait(5)
            return httpx.Response(200, json=self.completion)
        answers = {
            "/health": (200, None),
            "/v1/models": (200, {"object": "list", "data": [{"id": "Qwen/x", "root": "/models/x",
                                                             "max_model_len": 4096, "object": "model"}]}),
            "/weight_info": (200, {"weight_version": self.version}),
            "/get_world_size": (200, {"world_size": 2}),
            "/is_paused": (200, {"is_paused": False}),
            "/pause": (200, {"status": "paused"}),
            "/resume": (200, {"status": "resumed"}),
            "/abort_requests": (200, {"status": "aborted", "aborted": len((body or {}).get("request_ids") or [])}),
            "/reset_prefix_cache": (200, {"success": self.flush_ok}),
            "/sleep": (200, {"status": "sleeping", "level": int(request.url.params.get("level", 1))}),
            "/is_sleeping": (200, {"is_sleeping": bool(self.asleep)}),
            "/init_weight_transfer_engine": (200, {"message": "Weight transfer initialized"}),
            "/start_weight_update": (200, {"message": "Weight update started"}),
            "/start_draft_weight_update": (200, {"message": "Draft weight update started"}),
            "/update_weights": (200, {"message": "Weights updated"}),
            "/finish_weight_update": (200, {"message": "Weight update finished"}),
        }
        if path == "/sleep":
            self.asleep = {"weights", "kv_cache"}
        if path == "/wake_up":
            return httpx.Response(200, json=self._wake(request.url.params.get_list("tags")))
        if path == "/finish_weight_update" and body:
            self.version = body["weight_version"]
        status, payload = answers.get(path, (404, {"detail": "Not Found"}))
        return httpx.Response(status, json=payload) if payload is not None else httpx.Response(status)


def _client(fake, url="http://vllm:8000", **kw):
    return VLLMClient(url, transport=httpx.MockTransport(fake), max_retries=0, **kw)


def test_backend_names_match_the_config_list():
    from megatron_rl.rollout.engine import ENGINE_BACKENDS, engine_backend

    engine_backend("vllm")  # registers the built-in ones
    assert set(ENGINE_BACKENDS.names()) == set(ROLLOUT_BACKEND_PORTS)
    for name, ports in ROLLOUT_BACKEND_PORTS.items():
        assert ENGINE_BACKENDS.get(name).ports_per_server == ports
    assert ENGINE_BACKENDS.get("vllm").client is VLLMClient is ENGINE_BACKENDS.get("vllm-embedded").client
    assert dict(ENGINE_BACKENDS.get("vllm").env) == {"VLLM_SERVER_DEV_MODE": "1"}


def test_vllm_command_has_the_weight_transfer_flags():
    from megatron_rl.rollout.launcher import LaunchSpec
    from megatron_rl.rollout.engine import engine_backend

    spec = LaunchSpec(model_path="/m", vllm_python="/venv-vllm/bin/python", tp_size=2, mem_fraction_static=0.8,
                      random_seed=7, vllm_args=("--enforce-eager",))
    cmd = engine_backend("vllm").build_command(spec, (8123,))
    assert cmd[:5] == ["/venv-vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]  # `vllm serve /m`
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--port"] == "8123" and flags["--tensor-parallel-size"] == "2"
    assert flags["--gpu-memory-utilization"] == "0.8" and flags["--seed"] == "7"
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
    assert cmd[-1] == "--enforce-eager"
    stand_in = engine_backend("vllm-embedded").build_command(LaunchSpec(model_path="/m"), (8124,))
    assert stand_in[1:3] == ["-m", "megatron_rl.engine"] and stand_in[-2:] == ["--api-dialect", "vllm"]


def test_completion_body_maps_sglang_keys():
    body = completion_body([1, 2, 3], {"max_new_tokens": 64, "temperature": 1.0, "top_p": 0.9, "top_k": -1,
                                       "sampling_seed": 42, "stop_token_ids": [99], "n": 1}, "rid-1")
    assert body == {"prompt": [1, 2, 3], "request_id": "rid-1", "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "stream": False, "logprobs": 0, "max_tokens": 64,
                    "temperature": 1.0, "top_p": 0.9, "seed": 42, "stop_token_ids": [99]}
    assert completion_body([1], {"top_k": 5}, "r", return_logprob=False)["top_k"] == 5
    assert "logprobs" not in completion_body([1], {}, "r", return_logprob=False)
    with pytest.raises(ValueError, match="unknown key 'max_tokens'"):
        completion_body([1], {"max_tokens": 3}, "r")
    with pytest.raises(ValueError, match="no such parameter"):
        completion_body([1], {"regex": "a+"}, "r")
    with pytest.raises(ValueError, match="one response"):
        completion_body([1], {"n": 2}, "r")
    with pytest.raises(ValueError, match="empty"):
        completion_body([], {}, "r")


def test_result_eos_stop_token_stop_string_length_abort():
    r = result_from_vllm(_completion([11, 12, EOS]), rid="r0", eos_token_ids=[EOS])
    assert r.output_ids == [11, 12, EOS] and r.stop_reason == "eos" and r.matched_stop == EOS
    assert r.output_logprobs == pytest.approx([-0.1, -0.2, -0.3]) and r.completion_tokens == 3 == len(r.output_ids)
    assert r.prompt_tokens == 4 and r.weight_version is None and r.finish_type == "stop"
    r = result_from_vllm(_completion([11, 99], stop_reason=99), rid="r0", stop_token_ids=[99], eos_token_ids=[EOS])
    assert r.stop_reason == "stop_token" and r.matched_stop == 99
    r = result_from_vllm(_completion([11, 12], stop_reason="</answer>"), rid="r0")
    assert r.stop_reason == "stop_string" and r.matched_stop == "</answer>"
    assert result_from_vllm(_completion([11, 12], "length"), rid="r0").stop_reason == "length"
    r = result_from_vllm(_completion([11], "abort"), rid="r0")
    assert r.finish_type == "abort" and r.stop_reason == "abort" and r.abort_message


def test_result_refuses_inconsistent_and_foreign_answers():
    with pytest.raises(RolloutServerError, match="inconsistent"):
        result_from_vllm(_completion([11, 12], completion_tokens=3), rid="r0")
    with pytest.raises(RolloutServerError, match="not the last token"):
        result_from_vllm(_completion([11, 12], stop_reason=99), rid="r0", stop_token_ids=[99])
    with pytest.raises(RolloutServerError, match="do not follow"):
        result_from_vllm(_completion([11, 12], tokens=["token_id:11", "token_id:13"]), rid="r0")
    # a server that does not return token ids (return_tokens_as_token_ids ignored): names the version
    with pytest.raises(RolloutServerError, match=r"vLLM 0\.33\.x's shape"):
        result_from_vllm(_completion([11, 12], tokens=["a", "b"]), rid="r0")
    bad = _completion([11])
    del bad["choices"][0]["token_ids"]
    with pytest.raises(RolloutServerError, match=r"not in vLLM 0\.33\.x's shape.*token_ids"):
        result_from_vllm(bad, rid="r0")
    with pytest.raises(RolloutServerError, match="unknown finish_reason"):
        result_from_vllm(_completion([11], "weird"), rid="r0")
    with pytest.raises(RolloutServerError, match="unfinished"):
        result_from_vllm(_completion([11], None), rid="r0")


def test_generate_posts_one_completion():
    fake = FakeVLLM()
    with _client(fake, api_key="k") as c:
        r = c.generate([1, 2, 3, 4], {"max_new_tokens": 8, "sampling_seed": 5}, "rid-7", eos_token_ids=[EOS])
    assert r.rid == "rid-7" and r.output_ids == [11, 12, EOS]
    method, path, _, body = fake.calls[-1]
    assert (method, path) == ("POST", "/v1/completions")
    assert body["prompt"] == [1, 2, 3, 4] and body["seed"] == 5 and body["request_id"] == "rid-7"
    assert body["max_tokens"] == 8 and body["logprobs"] == 0 and body["return_token_ids"] is True


def test_http_error_and_foreign_info_answers_raise():
    def answer(request):
        if request.url.path == "/v1/completions":
            return httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
        return httpx.Response(200, json={"version": 3})  # not /get_world_size's shape
    c = VLLMClient("http://vllm:8000", transport=httpx.MockTransport(answer), max_retries=0)
    with pytest.raises(RolloutServerError, match="HTTP 400") as e:
        c.generate([1], {}, "r")
    assert e.value.status_code == 400
    with pytest.raises(RolloutServerError, match=r"vLLM 0\.33\.x's shape"):
        c.transfer_world_size()


def test_info_control_and_abort_by_prefix():
    fake = FakeVLLM()
    c = _client(fake)
    assert c.transfer_world_size() == 2 and c.is_healthy() and not c.is_paused()
    fake.version = "3"
    assert c.model_info() == {"model_path": "/models/x", "max_model_len": 4096, "weight_version": "3"}
    assert c.pause_generation("abort") == {"status": "paused"}
    assert fake.calls[-1][1:3] == ("/pause", {"mode": "abort"})
    c.pause_generation("in_place")
    assert fake.calls[-1][2] == {"mode": "keep"}
    c.continue_generation()
    assert fake.calls[-1][1] == "/resume"
    c.flush_cache()
    assert fake.calls[-1][1] == "/reset_prefix_cache"
    with pytest.raises(ValueError):
        c.pause_generation("nope")
    # abort by rid prefix: the client knows its requests in flight and sends their engine ids
    t = threading.Thread(target=lambda: c.generate([1], {}, "slow"))
    t.start()
    assert fake.started.wait(5)
    c.abort_request(rid="sl")
    assert fake.calls[-1][1] == "/abort_requests" and fake.calls[-1][3] == {"request_ids": ["cmpl-slow-0"]}
    n = len(fake.calls)
    c.abort_request(rid="other")  # nothing of ours matches: no call
    c.abort_request(rid="")  # SGLang's rule: an empty rid without abort_all does nothing
    assert len(fake.calls) == n
    c.abort_request(abort_all=True)
    assert fake.calls[-1][3] == {"request_ids": []}
    fake.block.set()
    t.join(5)
    with pytest.raises(RolloutServerError) as e:
        c.get_weights_by_name("lm_head.weight")
    assert e.value.status_code == 400  # counted as unverifiable by the checksum check


def test_weight_update_session_maps_onto_vllm_routes():
    fake = FakeVLLM()
    c = _client(fake)
    with pytest.raises(RolloutServerError):  # no group joined yet: as SGLang's "no such group"
        c.destroy_weights_update_group("weight_update_group")
    c.init_weights_update_group("10.0.0.1", 29500, 1, 3, "weight_update_group", "nccl")
    assert fake.calls[-1][1] == "/init_weight_transfer_engine"
    assert fake.calls[-1][3] == {"init_info": {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                               "world_size": 3, "packed": False}}
    c.begin_weight_update()
    assert fake.calls[-1][1] == "/start_weight_update"
    c.update_weights_from_distributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], weight_version="5")
    assert fake.calls[-1][1:] == ("/update_weights", {}, {"update_info": {
        "names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}})
    with pytest.raises(ValueError, match="load_format"):
        c.update_weights_from_distributed(["a"], ["float32"], [[1]], load_format="flattened_bucket")
    c.end_weight_update(weight_version="5")
    assert fake.calls[-1][1] == "/finish_weight_update" and fake.calls[-1][3] == {"weight_version": "5"}
    assert c.weight_version() == "5"
    c.end_weight_update()  # closing after an error: no label
    assert fake.calls[-1][3] is None
    assert c.destroy_weights_update_group("weight_update_group")["success"] is True
    c.begin_weight_update("draft")
    assert fake.calls[-1][1] == "/start_draft_weight_update"


def test_config_accepts_vllm_and_checks_what_vllm_cannot_do():
    from megatron_rl.config.loader import load_config  # noqa: F401  (import check only)
    from megatron_rl.config.schema import Config, RolloutConfig
    from megatron_rl.config.validate import _check_vllm
    from megatron_rl.errors import ConfigError

    for name in ("vllm", "vllm-embedded"):
        assert RolloutConfig(backend=name).backend == name
    RolloutConfig(backend="vllm", server_ports=[1234])
    with pytest.raises(ConfigError, match="needs 1"):
        RolloutConfig(backend="vllm", server_ports=[1234, 1235])
    cfg = Config()
    cfg.rollout.backend = "vllm-embedded"
    _check_vllm(cfg)
    cfg.weight_sync.load_format = "flattened_bucket"
    with pytest.raises(ConfigError, match="load_format"):
        _check_vllm(cfg)
    cfg.weight_sync.load_format = None
    cfg.rollout.backend = "vllm"
    _check_vllm(cfg)  # gloo: megatron-rl's transfer engine in vLLM's environment (plugins/vllm_gloo; issue 30)
    cfg.weight_sync.backend = "nccl"
    _check_vllm(cfg)
    cfg.trainer.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match="one weight-transfer group"):
        _check_vllm(cfg)


def test_vllm_config_problems_are_reported_all_at_once():
    """A recipe switched to rollout.backend=vllm with four problems names all four in one error
    (the first one used to hide the others); its weight_sync.backend gloo is none of them (issue 30)."""
    from megatron_rl.config.schema import Config
    from megatron_rl.config.validate import _check_vllm
    from megatron_rl.errors import ConfigError

    cfg = Config()
    cfg.rollout.backend = "vllm"
    cfg.weight_sync.load_format = "flattened_bucket"
    cfg.rollout.admin_api_key = "adm"
    cfg.rollout.colocate = True
    cfg.rollout.enable_deterministic_inference = True
    with pytest.raises(ConfigError) as e:
        _check_vllm(cfg)
    msg = str(e.value)
    assert msg.startswith("rollout.backend=vllm: 4 problems:")  # weight_sync.backend gloo is allowed (issue 30)
    for key in ("weight_sync.load_format", "rollout.admin_api_key", "rollout.colocate",
                "rollout.enable_deterministic_inference"):
        assert f"\n  - {key}:" in msg
    assert "weight_sync.backend" not in msg


def test_checksums_with_vllm_warn_that_nothing_is_checked(caplog):
    from megatron_rl.config.schema import Config
    from megatron_rl.config.validate import _check_vllm

    cfg = Config()
    cfg.rollout.backend = "vllm-embedded"
    cfg.weight_sync.check_checksums = True
    with caplog.at_level("WARNING", logger="megatron_rl.config.validate"):
        _check_vllm(cfg)
    assert "checks nothing" in caplog.text and "unverifiable_tensors" in caplog.text


def test_flush_cache_reports_vllms_refusal():
    fake = FakeVLLM()
    c = _client(fake)
    assert c.flush_cache() == "{'success': True}"
    fake.flush_ok = False  # vLLM 0.33: blocks still held (running requests)
    with pytest.raises(RolloutServerError, match="refused") as e:
        c.flush_cache()
    assert e.value.status_code == 400


def test_sleep_levels_and_the_level2_guard():
    """Case N13: level 2 only with the reload promise; no generation until the reload finished."""
    fake = FakeVLLM()
    c = _client(fake, url="http://vllm-sleep-a:8000")
    with pytest.raises(ValueError, match="N13"):
        c.sleep(level=2)
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match="0, 1 or 2"):
            c.sleep(level=bad)
    with pytest.raises(ValueError, match="mode"):
        c.sleep(mode="retract")
    assert fake.calls == []  # nothing refused was sent
    assert c.sleep() == {"status": "sleeping", "level": 1}
    assert fake.calls[-1][:3] == ("POST", "/sleep", {"level": "1", "mode": "abort"})
    assert c.is_sleeping() is True
    with pytest.raises(RolloutServerError, match="kv_cache, weights not awake") as e:
        c.generate([1], {}, "r-asleep")
    assert e.value.status_code == 503 and fake.calls[-1][1] == "/is_sleeping"  # not sent
    assert c.wake_up() == {"status": "awake", "tags": None}
    assert fake.calls[-1][1:3] == ("/wake_up", {})
    c.generate([1], {}, "r-awake")
    assert c.sleep(level=2, will_reload_weights=True, mode="keep")["level"] == 2
    assert fake.calls[-1][2] == {"level": "2", "mode": "keep"}
    c.wake_up()
    other = _client(fake, url="http://vllm-sleep-a:8000/")  # a second client of that server (the rollout's)
    with pytest.raises(RolloutServerError, match="level 2") as e:
        other.generate([1], {}, "r-l2")
    assert e.value.status_code == 409 and fake.calls[-1][1] == "/wake_up"
    c.begin_weight_update()
    c.update_weights_from_distributed(["w"], ["float32"], [[1]])
    c.end_weight_update(weight_version="2")  # the promised reload
    other.generate([1], {}, "r-reloaded")
    assert fake.calls[-1][1] == "/v1/completions"
    assert _client(fake, url="http://vllm-sleep-b:8000").sleep(level=0) == {"status": "sleeping", "level": 0}


def test_staged_wake_sends_repeated_tags_and_holds_generation():
    fake = FakeVLLM()
    c = _client(fake, url="http://vllm-sleep-c:8000")
    c.sleep(level=1)
    assert c.wake_up(["weights"]) == {"status": "sleeping", "tags": ["weights"]}
    method, path, _, _ = fake.calls[-1]
    assert (method, path) == ("POST", "/wake_up")
    with pytest.raises(RolloutServerError, match="kv_cache not awake"):
        c.generate([1], {}, "r-staged")
    assert c.wake_up(["kv_cache"])["status"] == "awake"
    c.generate([1], {}, "r-after")
    for bad in ([], ["weight"], ["kv_cache", "gpu"]):
        with pytest.raises(ValueError, match="tags"):
            c.wake_up(bad)
    c.sleep(level=1)
    assert c.wake_up(["weights", "kv_cache"])["status"] == "awake"
    assert c.is_sleeping() is False


def test_wake_up_query_repeats_tags():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json={"status": "awake", "tags": request.url.params.get_list("tags")})

    c = VLLMClient("http://vllm-sleep-d:8000", transport=httpx.MockTransport(handler), max_retries=0)
    c.wake_up(["weights", "kv_cache"])
    assert seen == ["http://vllm-sleep-d:8000/wake_up?tags=weights&tags=kv_cache"]
    with pytest.raises(RolloutServerError, match="0.33"):
        VLLMClient("http://vllm-sleep-e:8000", max_retries=0, transport=httpx.MockTransport(
            lambda r: httpx.Response(200, json={"is_sleeping": "yes"}))).is_sleeping()


def test_a_server_without_vllms_rl_routes_is_named_as_such():
    """An OpenAI-only server (another vLLM, no VLLM_SERVER_DEV_MODE, or not vLLM) answers the RL
    routes with 404: the error names vLLM's version and the dev-mode flags, not a bare 404."""
    def openai_only(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    c = VLLMClient("http://openai-only:8000", transport=httpx.MockTransport(openai_only), max_retries=0)
    with pytest.raises(RolloutServerError, match=r"GET /get_world_size .*HTTP 404.*vLLM 0\.33\.x.*"
                                                 r"VLLM_SERVER_DEV_MODE=1") as e:
        c.transfer_world_size()
    assert e.value.status_code == 404
    with pytest.raises(RolloutServerError) as e:  # a sleep route's 404 keeps its own meaning
        c.is_sleeping()
    assert "VLLM_SERVER_DEV_MODE" not in str(e.value)
