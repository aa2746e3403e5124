"""Case N10: pause and weight-update races on a running engine (the embedded server, SGLang dialect).

A real server process serves a 2-layer model; this process is rank 0 of a real gloo weight-update
group with it and pushes updates of 2 buckets (bucket 1 = layer 0, bucket 2 = layer 1). Requests
decode 1000 tokens slowly (the server's step-delay test hook), and the server logs the weights of
both layers seen by every forward (its forward-log test hook), so the tests can tell that no
forward ever saw layer 0 at one version and layer 1 at another. Timelines A-D of case N10; the
times are upper bounds, not measurements. Tests read the server's current version, so each one
stands alone (they share one server to save start-ups).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.live import UNKNOWN_START
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.weight_sync.publisher import WeightPublisher
from megatron_rl.weight_sync.sender import WeightSyncSender
from tests.e2e.random_qwen2 import save_random_qwen2

TOKENS = 1000
D_TOKENS = 400  # timeline D's r_a: shorter, since it runs twice
PROMPT = [5, 6, 7]


class Weights:
    """Every version's layer tensors (version 0 = the saved model), and each layer's fingerprint:
    the float64 sum of its first parameter, what the server's forward log records."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.base = {n: p.detach().clone() for n, p in model.named_parameters() if ".layers." in n}
        firsts: dict[int, str] = {}
        for n in self.base:
            firsts.setdefault(int(n.split(".layers.")[1].split(".")[0]), n)
        self.probes = [firsts[k] for k in sorted(firsts)]

    def layer(self, k: int, v: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 + v)
        out = []
        for n, p in self.base.items():
            noise = torch.randn(p.shape, generator=g)
            if f".layers.{k}." in n:
                out.append((n, p + 0.02 * v * noise))
        return out

    def version_of(self, k: int, value: float, upto: int = 16) -> int | None:
        if not hasattr(self, "_prints"):
            self._prints = [[float(dict(self.layer(j, v))[self.probes[j]].double().sum()) for v in range(upto)]
                            for j in range(len(self.probes))]
        return next((v for v, want in enumerate(self._prints[k])
                     if math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-9)), None)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    d = tmp_path_factory.mktemp("n10")
    model_dir = save_random_qwen2(d / "model", vocab_size=256, hidden_size=32, intermediate_size=64,
                                  max_position_embeddings=TOKENS + 64)
    log = d / "forwards.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_RL_TEST_STEP_DELAY_S="0.004",
               MEGATRON_RL_TEST_FORWARD_LOG=str(log))
    server = launch_rollout_server(model_dir, extra_args=["--weight-version", "0", "--max-batch-size", "4",
                                                          "--weight-sync-timeout-s", "60"],
                                   env=env, startup_timeout_s=180, log_path=d / "server.log")
    client = server.client(timeout_s=60, generate_timeout_s=180)
    sender = WeightSyncSender([client], group_name="n10", timeout_s=60)
    sender.init_group()
    yield SimpleNamespace(server=server, client=client, sender=sender, weights=Weights(model_dir), log=log,
                          model_dir=model_dir)
    sender.close()
    client.close()
    server.stop()


def _forwards(rig) -> list[dict]:
    if not rig.log.exists():
        return []
    return [json.loads(line) for line in rig.log.read_text().splitlines() if line.strip()]


def _count(rig) -> int:
    """Forwards logged so far."""
    return rig.log.read_bytes().count(b"\n") if rig.log.exists() else 0


def _start(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _params(seed: int, tokens: int = TOKENS) -> dict:
    return {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "sampling_seed": seed}


def _generate(rig, rid: str, seed: int = 1):
    return _start(rig.client.generate, PROMPT, _params(seed), rid)


def _wait_running(rig, count: int = 1, forwards: int = 20, timeout_s: float = 60.0) -> None:
    """Until `count` requests run and at least `forwards` more forwards happened."""
    deadline = time.monotonic() + timeout_s
    while rig.client.server_info()["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    start = _count(rig)
    while _count(rig) < start + forwards:
        assert time.monotonic() < deadline, "the request does not decode"
        time.sleep(0.02)


def _push(rig, v: int, between=None) -> None:
    """One update to version `v` in 2 buckets: layer 0, then layer 1 with the version label."""
    rig.client.begin_weight_update()
    try:
        rig.sender.send(rig.weights.layer(0, v))
        if between is not None:
            between()
        rig.sender.send(rig.weights.layer(1, v), weight_version=str(v))
    except BaseException:
        rig.sender.close_session_after_error()  # a failed test leaves the server usable for the next
        raise
    rig.client.end_weight_update()


def _joined(t: threading.Thread, box: dict, timeout_s: float = 120.0):
    t.join(timeout_s)
    assert not t.is_alive(), "the request never ended"
    assert "error" not in box, box.get("error")
    return box["result"]


def _check_two_spans(res, old: int, new: int) -> int:
    assert res.finish_type == "length" and len(res.output_ids) == TOKENS
    (v0, s0), (v1, k) = res.weight_versions
    assert (v0, s0, v1) == (str(old), 0, str(new)) and 0 < k < TOKENS, res.weight_versions
    assert res.weight_version == str(new)
    assert all(math.isfinite(lp) for lp in res.output_logprobs)
    return k


def _check_no_mixed_forward(rig) -> None:
    seen = {(rig.weights.version_of(0, a), rig.weights.version_of(1, b))
            for a, b in {tuple(f["layers"]) for f in _forwards(rig)}}
    assert seen, "no forward logged"
    mixed = [s for s in seen if s[0] is None or s[0] != s[1]]
    assert not mixed, f"forwards saw half-applied updates (layer 0, layer 1): {mixed[:5]}"


def test_a_update_while_paused_in_place_completes_and_the_request_spans_two_versions(rig):
    old = int(rig.client.weight_version())
    t, box = _generate(rig, "r1")
    _wait_running(rig)
    rig.client.pause_generation("in_place")
    frozen = _count(rig)
    t0 = time.monotonic()
    _push(rig, old + 1)
    assert time.monotonic() - t0 < 5.0, "the update under an in-place pause took too long (deadlock?)"
    assert _count(rig) == frozen, "a forward ran while paused"
    assert t.is_alive(), "r1 ended while paused in place"
    rig.client.continue_generation()
    _check_two_spans(_joined(t, box), old, old + 1)


def test_b_an_update_waiting_behind_a_request_is_woken_by_a_later_pause(rig):
    old = int(rig.client.weight_version())
    t, box = _generate(rig, "r2", seed=2)
    _wait_running(rig)
    began = threading.Event()

    def update() -> None:
        rig.client.begin_weight_update()  # waits: r2 is in flight and the server is not paused
        began.set()
        rig.sender.send(rig.weights.layer(0, old + 1))
        rig.sender.send(rig.weights.layer(1, old + 1), weight_version=str(old + 1))
        rig.client.end_weight_update()

    u, ubox = _start(update)
    time.sleep(0.5)
    assert not began.is_set() and t.is_alive(), "the update did not wait for the running request"
    t0 = time.monotonic()
    rig.client.pause_generation("in_place")
    u.join(5.0)
    assert not u.is_alive(), "the waiting update was not woken by the pause (SGLang #25319)"
    assert "error" not in ubox, ubox.get("error")
    assert time.monotonic() - t0 < 5.0
    rig.client.continue_generation()
    _check_two_spans(_joined(t, box), old, old + 1)


def test_c_continue_waits_for_the_whole_update_and_no_forward_sees_half_of_it(rig):
    old = int(rig.client.weight_version())
    t, box = _generate(rig, "r3", seed=3)
    _wait_running(rig)
    rig.client.pause_generation("in_place")
    frozen = _count(rig)
    times: dict = {}

    def continue_early() -> None:  # bucket 1 applied: continue arrives before bucket 2
        c, cbox = _start(lambda: (rig.client.continue_generation(), times.setdefault("continued", time.monotonic())))
        time.sleep(1.0)
        assert c.is_alive(), "/continue_generation returned between the buckets"
        assert _count(rig) == frozen, "a forward ran between the buckets"
        times["thread"] = (c, cbox)

    _push(rig, old + 1, between=continue_early)
    times["ended"] = time.monotonic()
    c, cbox = times["thread"]
    _joined(c, cbox, 10.0)
    assert times["continued"] >= times["ended"] - 0.05  # answered only once the session ended
    _check_two_spans(_joined(t, box), old, old + 1)
    _check_no_mixed_forward(rig)


def test_c_a_request_sent_into_an_unpaused_update_waits_for_its_end(rig):
    """Without a pause: a request arriving between the buckets neither runs on half the update nor
    keeps bucket 2 waiting for it (the scheduler holds from the first bucket to the end)."""
    old = int(rig.client.weight_version())
    frozen = _count(rig)
    late: dict = {}

    def send_request() -> None:
        late["t"], late["box"] = _start(rig.client.generate, PROMPT, dict(_params(4), max_new_tokens=20), "r4")
        time.sleep(0.5)
        assert late["t"].is_alive() and _count(rig) == frozen, "a request ran inside the update"

    t0 = time.monotonic()
    _push(rig, old + 1, between=send_request)
    assert time.monotonic() - t0 < 5.0, "bucket 2 waited for the request that arrived between the buckets"
    res = _joined(late["t"], late["box"])
    assert res.weight_versions == ((str(old + 1), 0),) and len(res.output_ids) == 20
    _check_no_mixed_forward(rig)


class RecordingClient(RolloutClient):
    """A real client of the server that also logs its control calls in order: (name, "start" |
    "end", argument)."""

    def __init__(self, url: str, log: list) -> None:
        super().__init__(url, timeout_s=60, generate_timeout_s=180)
        self.calls = log

    def _logged(self, name: str, arg, fn):
        self.calls.append((name, "start", arg))
        out = fn()
        self.calls.append((name, "end", arg))
        return out

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        return self._logged("abort_request", rid, lambda: super(RecordingClient, self).abort_request(rid, abort_all))

    def pause_generation(self, mode="abort") -> dict:
        return self._logged("pause_generation", mode, lambda: super(RecordingClient, self).pause_generation(mode))

    def begin_weight_update(self, selector="all", *, timeout_s=None) -> dict:
        return self._logged("begin_weight_update", None,
                            lambda: super(RecordingClient, self).begin_weight_update(selector, timeout_s=timeout_s))

    def end_weight_update(self, *, weight_version=None, timeout_s=None) -> dict:
        return self._logged("end_weight_update", None, lambda: super(RecordingClient, self).end_weight_update(
            weight_version=weight_version, timeout_s=timeout_s))

    def continue_generation(self) -> dict:
        return self._logged("continue_generation", None, lambda: super(RecordingClient, self).continue_generation())


class LayerPublisher(WeightPublisher):
    """The real publisher (controller, world of one) whose weights are `Weights` at the version it
    publishes, instead of a megatron model's."""

    def __init__(self, weights: Weights, fleet, calls: list, client_class=None) -> None:
        pgs = SimpleNamespace(rank=0, world_size=1, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0, tp_size=1)

        def clients(urls):
            return [client_class(u) if client_class else RecordingClient(u, calls) for u in urls]

        super().__init__(None, {}, pgs, fleet=fleet, pause_mode="in_place", sender_factory=lambda urls, name:
                         WeightSyncSender(clients(urls), group_name=name, timeout_s=60))
        self.weights = weights
        self.publishing = 0

    def publish(self, version: int, **kw) -> dict:
        self.publishing = version
        return super().publish(version, **kw)

    def _stage_weights(self):
        yield from self.weights.layer(0, self.publishing) + self.weights.layer(1, self.publishing)


def test_d_stale_requests_are_aborted_before_the_pause_and_resubmitted(rig, caplog):
    """eta = 1, an update to v+2 pending: r_a started at v (its age at v+2 would be 2) is aborted,
    its abort answered before the pause is sent, and resubmitted from scratch after the continue;
    r_b, started at v+1, continues in place with spans v+1 then v+2.

    The scenario needs r_b still decoding when the publisher pauses (>= 4 s of decode left when it
    starts); a machine that stalls the test process longer than that lets r_b finish at v+1 (seen
    once in CI), which is not what is tested: the scenario then runs once more, and a second miss fails."""
    caplog.set_level("INFO", logger="megatron_rl")  # a retried request (a lost answer) shows in a failure
    for attempt in range(2):
        if _scenario_d(rig, caplog, last=attempt == 1):
            return


def _scenario_d(rig, caplog, last: bool) -> bool:
    """One run of timeline D; False when r_b ended before the pause (the premise missed, see above)."""
    old = int(rig.client.weight_version())
    calls: list = []  # the manager's client (stale aborts) and the publisher's (pause, update, continue)
    manager = RolloutManager([RecordingClient(rig.server.base_url, calls)], None, None, reward_fn="dapo_math",
                             max_prompt_length=8, max_response_length=TOKENS)
    publisher = LayerPublisher(rig.weights, manager.fleet, calls)
    try:
        manager.gate.set_version(old)
        ta, box_a = _start(manager.generate_ids, PROMPT, _params(11, D_TOKENS), "r_a")
        _wait_running(rig)
        assert publisher.publish(old + 1, live=True, stale_below=old)["weight_sync/stale_aborted"] == 0
        tb, box_b = _start(manager.generate_ids, PROMPT, _params(12), "r_b")  # long: still running at v+2
        _wait_running(rig, count=2)
        calls.clear()
        t0 = time.monotonic()
        metrics = publisher.publish(old + 2, live=True, stale_below=old + 1)
        publish_s = time.monotonic() - t0
        assert metrics["weight_sync/stale_aborted"] == 1
        order = [(name, when) for name, when, _ in calls]
        assert calls[0] == ("abort_request", "start", "r_a") and calls[1] == ("abort_request", "end", "r_a")
        assert order[2] == ("pause_generation", "start") and calls[2][2] == "in_place"
        assert order[-1] == ("continue_generation", "end")
        assert order.index(("end_weight_update", "end")) < order.index(("continue_generation", "start"))
        res_a, res_b = _joined(ta, box_a), _joined(tb, box_b)
        assert res_a.finish_type == "length" and len(res_a.output_ids) == D_TOKENS
        assert res_a.version_spans == ((old + 2, 0),) and res_a.resubmissions == 1
        assert res_b.resubmissions == 0 and len(res_b.output_ids) == TOKENS
        diagnosis = (old, res_b.version_spans, res_b.weight_versions, f"publish took {publish_s:.2f} s", calls,
                     caplog.text)
        if res_b.version_spans == ((old + 1, 0),) and not last:
            return False
        assert len(res_b.version_spans) == 2, diagnosis
        (v1, s1), (v2, k) = res_b.version_spans
        assert (v1, s1, v2) == (old + 1, 0, old + 2) and 0 < k < TOKENS, diagnosis
        assert all(math.isfinite(lp) for r in (res_a, res_b) for lp in r.output_logprobs)
        assert rig.client.server_info()["num_running_reqs"] == 0
        _check_no_mixed_forward(rig)
        return True
    finally:
        publisher.close()
        manager.close()
        for c in manager.clients:
            c.close()


def test_vllm_dialect_in_place_update_and_the_spans_of_a_server_without_versions(rig, tmp_path):
    """The vLLM stand-in follows the same rules (no forward sees half an update), and, like vLLM, answers
    without weight versions: the manager records the version published at submission from token 0 and
    the newer one with an unknown start, so the sample's oldest version is the one it started under."""
    log = tmp_path / "forwards.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_RL_TEST_STEP_DELAY_S="0.004",
               MEGATRON_RL_TEST_FORWARD_LOG=str(log))
    server = launch_rollout_server(rig.model_dir, extra_args=["--api-dialect", "vllm", "--weight-version", "0"],
                                   env=env, startup_timeout_s=180, log_path=tmp_path / "server.log")
    vrig = SimpleNamespace(log=log, weights=rig.weights)
    manager = RolloutManager([VLLMClient(server.base_url, timeout_s=60, generate_timeout_s=180)], None, None,
                             reward_fn="dapo_math", max_prompt_length=8, max_response_length=D_TOKENS)
    publisher = LayerPublisher(rig.weights, manager.fleet, [], client_class=lambda u: VLLMClient(u, timeout_s=60))
    try:
        manager.gate.set_version(0)
        t, box = _start(manager.generate_ids, PROMPT, _params(21, D_TOKENS), "v1")
        deadline = time.monotonic() + 60
        while _count(vrig) < 20:
            assert time.monotonic() < deadline, "the request does not decode"
            time.sleep(0.02)
        publisher.publish(1, live=True)
        res = _joined(t, box)
        assert res.finish_type == "length" and len(res.output_ids) == D_TOKENS and res.weight_versions is None
        assert res.version_spans == ((0, 0), (1, UNKNOWN_START)) and res.resubmissions == 0
        assert all(math.isfinite(lp) for lp in res.output_logprobs)
        assert manager.clients[0].weight_version() == "1" and not manager.clients[0].is_paused()
        _check_no_mixed_forward(vrig)
    finally:
        publisher.close()
        manager.close()
        server.stop()
