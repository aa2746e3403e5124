"""Case N13 (vLLM sleep level 2 loses weights and buffers; staged wake) against the vLLM-dialect stand-in.

The stand-in (``megatron_rl.engine.vllm_dialect``) keeps sleep mode as a state only (it frees no
memory), so these tests check the HTTP contract and the client's guards, not vLLM's allocator: a
completion is refused while any part sleeps (503) and, after a level-2 sleep, until a weight update
finished (409 naming level 2); ``VLLMClient`` never sends a generation in either state; and a
level-2 sleep with a full reload of ``named_parameters()`` (no buffers) returns the reference
tokens. The stand-in never discards a buffer, so the buffer half of N13 (``inv_freq`` max
|delta| = 0 after the wake) is not observable here (vLLM's ``/weight_checker`` is not served); the
test checks only that the reload leaves ``inv_freq`` out, and its hand-computed value. The model: a
seeded random 2-layer Qwen2, hidden 32 with 4 heads (head_dim 8), rope_theta 10000, so ``inv_freq``
= 10000^(-2i/8) = [1, 0.1, 0.01, 0.001].
On a GPU the same sequence would run against ``vllm serve --enable-sleep-mode`` (not done here).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.weight_sync.sender import WeightSyncSender
from tests.e2e.random_qwen2 import EOS, save_random_qwen2

PROMPT = [1, 2, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
INV_FREQ = [1.0, 0.1, 0.01, 0.001]  # 10000 ** (-2i/8), i = 0..3: by hand


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """(base_url, model): the stand-in server (``--api-dialect vllm``, its own process: the trainer's
    gloo group and the server's cannot share one process) and a local copy of its model."""
    from transformers import AutoModelForCausalLM

    path = save_random_qwen2(tmp_path_factory.mktemp("tiny_qwen2_n13"), vocab_size=128, hidden_size=32,
                             intermediate_size=64)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    extra = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "60", "--api-dialect", "vllm"]
    with launch_rollout_server(path, log_path=log, extra_args=extra, startup_timeout_s=120) as proc:
        yield proc.base_url, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(stand_in):
    c = VLLMClient(stand_in[0], max_retries=0, timeout_s=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sender(client):
    """The trainer's side: a gloo group with the stand-in, as for `rollout.backend: vllm-embedded`."""
    s = WeightSyncSender([client], backend="gloo", timeout_s=60)
    s.init_group()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(stand_in, client):
    """T0: greedy tokens of PROMPT before any sleep, and the model's parameters then."""
    return _tokens(client, "t0"), {n: p.detach().clone() for n, p in stand_in[1].named_parameters()}


def _tokens(c: VLLMClient, rid: str) -> list[int]:
    r = c.generate(PROMPT, dict(GREEDY), rid)
    assert r.completion_tokens == 8
    return r.output_ids


def _raw_generate(base_url: str) -> httpx.Response:
    """A completion sent around the client's guard (what another client could send)."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True, "request_id": "raw"}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60)


def _inv_freq(model) -> torch.Tensor:
    return dict(model.named_buffers())["model.rotary_emb.inv_freq"]


def test_level1_sleep_and_wake_returns_the_reference(stand_in, client, reference):
    t0 = reference[0]
    assert client.sleep(level=1) == {"status": "sleeping", "level": 1}
    assert client.is_sleeping() is True
    with pytest.raises(RolloutServerError, match="sleeps") as e:  # the client does not send it
        client.generate(PROMPT, dict(GREEDY), "asleep")
    assert e.value.status_code == 503
    r = _raw_generate(stand_in[0])  # and the server refuses it with vLLM's error shape
    assert r.status_code == 503 and "Generation is paused" in r.json()["error"]["message"]
    assert client.wake_up() == {"status": "awake", "tags": None}
    assert client.is_sleeping() is False
    assert _tokens(client, "l1") == t0


def test_level2_without_reload_is_refused_everywhere(stand_in, client, sender, reference):
    with pytest.raises(ValueError, match="N13"):  # not sent without the promise
        client.sleep(level=2)
    assert client.is_sleeping() is False
    assert client.sleep(level=2, will_reload_weights=True) == {"status": "sleeping", "level": 2}
    assert client.wake_up()["status"] == "awake"
    with pytest.raises(RolloutServerError, match="level 2") as e:
        client.generate(PROMPT, dict(GREEDY), "l2a")
    assert e.value.status_code == 409
    r = _raw_generate(stand_in[0])
    assert r.status_code == 409
    assert "level 2" in r.json()["error"]["message"] and "N13" in r.json()["error"]["message"]
    sender.sync(list(reference[1].items()), weight_version="reloaded")  # the reload lifts both refusals
    assert _tokens(client, "after-reload") == reference[0]


def test_level2_with_staged_wake_and_full_reload_returns_the_reference(stand_in, client, sender, reference):
    base_url, model = stand_in
    assert _inv_freq(model).tolist() == pytest.approx(INV_FREQ, rel=1e-6)  # the buffer the reload leaves out
    assert not any(n.endswith("inv_freq") for n in reference[1])
    client.sleep(level=2, will_reload_weights=True)
    assert client.wake_up(["weights"]) == {"status": "sleeping", "tags": ["weights"]}
    assert client.is_sleeping() is True  # until every part is awake
    sender.sync(list(reference[1].items()), weight_version="n13")  # named_parameters() only: no buffers
    assert _raw_generate(base_url).status_code == 503  # KV still asleep: no forward runs
    with pytest.raises(RolloutServerError, match="kv_cache"):
        client.generate(PROMPT, dict(GREEDY), "staged")
    assert client.wake_up(["kv_cache"]) == {"status": "awake", "tags": ["kv_cache"]}
    assert client.is_sleeping() is False
    assert _tokens(client, "l2b") == reference[0]
    assert client.weight_version() == "n13"


def test_level1_staged_wake(stand_in, client, reference):
    t0 = reference[0]
    client.sleep(level=1)
    assert client.wake_up(["weights"])["status"] == "sleeping"
    assert client.is_sleeping() is True
    assert _raw_generate(stand_in[0]).status_code == 503
    assert client.wake_up(["kv_cache"])["status"] == "awake"
    assert client.is_sleeping() is False
    assert _tokens(client, "staged") == t0
