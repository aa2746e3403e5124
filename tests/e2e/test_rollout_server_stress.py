"""Stress: many concurrent /generate calls through one client while weight syncs pause and resume the server.

Reproduces the hang seen at the first evaluation of a training run (256 rollout threads waiting for
response headers, the server idle, finally ``ReadError(EBADF)``): a connection pool shared by many
threads (httpcore) closes connections it sees as idle *outside* its lock, so under CPU contention it
can close a connection another thread has just been given and already sent its request on. The
socket is closed under that thread's blocked ``recv``; the fd number is reused by a new connection,
so the thread waits for the wrong socket until its read timeout, though the server answered.
``slow_pool_close`` widens that window the way a descheduled thread does; the client must not let
one thread's pool bookkeeping touch another thread's connection.

Also: ``pause_generation(abort)`` must abort requests that are being prefilled when it arrives
(else they sit in the paused batch and the sync's ``flush_cache`` fails), and a request the server
cannot serve surfaces as an error within the client's timeout.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import httpcore
import pytest
import torch

from tests.e2e.random_qwen2 import save_random_qwen2

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.launcher import launch_rollout_server

EOS = 2


def _save_tiny_qwen2(path):
    return save_random_qwen2(path, vocab_size=128, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_stress"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    extra = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "60"]
    with launch_rollout_server(model_dir, log_path=log, extra_args=extra, startup_timeout_s=120) as proc:
        yield proc


@pytest.fixture
def slow_pool_close(monkeypatch):
    """Delay every connection close done by httpcore's pool bookkeeping (a thread descheduled
    between deciding to close and closing, as under heavy CPU load); record each close that hits a
    connection with a request in flight."""
    from httpcore._sync.connection_pool import ConnectionPool
    from httpcore._sync.http11 import HTTP11Connection

    closed_in_use: list[str] = []
    in_pool_close = threading.local()
    orig_close_connections = ConnectionPool._close_connections
    orig_close = HTTP11Connection.close

    def close_connections(self, closing):
        if closing:
            time.sleep(0.02)
        in_pool_close.on = True
        try:
            return orig_close_connections(self, closing)
        finally:
            in_pool_close.on = False

    def close(self):
        if getattr(in_pool_close, "on", False) and self._state == httpcore._sync.http11.HTTPConnectionState.ACTIVE:
            closed_in_use.append(threading.current_thread().name)
        return orig_close(self)

    monkeypatch.setattr(ConnectionPool, "_close_connections", close_connections)
    monkeypatch.setattr(HTTP11Connection, "close", close)
    return closed_in_use


def test_generate_storm_with_weight_syncs(server, model_dir, slow_pool_close):
    from transformers import AutoModelForCausalLM

    from megatron_rl.weight_sync.sender import WeightSyncSender

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    client = RolloutClient(server.base_url, timeout_s=20, generate_timeout_s=8, max_retries=0)
    sender = WeightSyncSender([client], bucket_size_mib=1, timeout_s=30)
    sender.init_group()
    deadline = time.monotonic() + 12.0
    errors: list[str] = []
    counts = {"answered": 0, "aborted": 0, "syncs": 0, "pauses": 0}
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = random.Random(i)
        k = 0
        while time.monotonic() < deadline and not errors:
            k += 1
            prompt = [rng.randrange(3, 128) for _ in range(rng.randint(1, 6))]
            params = {"max_new_tokens": rng.randint(1, 8), "sampling_seed": k}
            try:
                r = client.generate(prompt, params, rid=f"w{i}-{k}", eos_token_ids=[EOS])
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                errors.append(f"w{i}-{k}: {e!r}")
                return
            with lock:
                counts["aborted" if r.finish_type == "abort" else "answered"] += 1

    def controller() -> None:
        rng = random.Random(7)
        version = 0
        try:
            while time.monotonic() < deadline and not errors:
                time.sleep(rng.uniform(0.05, 0.4))
                if rng.random() < 0.3:  # a bare pause/continue in another mode
                    client.pause_generation(rng.choice(["retract", "in_place"]))
                    time.sleep(rng.uniform(0.0, 0.05))
                    client.continue_generation()
                    counts["pauses"] += 1
                    continue
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0 + 1e-3)
                sender.sync(model.state_dict().items(), weight_version=str(version))  # pause(abort) ... continue
                counts["syncs"] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"controller: {e!r}")

    threads = [threading.Thread(target=worker, args=(i,), name=f"gen-{i}", daemon=True) for i in range(96)]
    threads.append(threading.Thread(target=controller, name="controller", daemon=True))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic() + 15))
        hung = [t.name for t in threads if t.is_alive()]
        assert not slow_pool_close and not errors and not hung, (
            f"connections closed under a request in flight: {slow_pool_close[:5]}; errors: {errors[:5]}; "
            f"still waiting: {hung[:5]}\n{server.log_tail()}"
        )
        assert counts["syncs"] >= 3 and counts["answered"] > 100, counts
        info = client.server_info()
        assert not info["paused"] and info["weight_version"] == str(counts["syncs"])
    finally:
        sender.close()
        client.close()


def test_unservable_request_fails_within_timeout(server):
    """A /generate the server holds (paused) is an error after the client's timeout, not a hang."""
    with RolloutClient(server.base_url, timeout_s=10, generate_timeout_s=2, max_retries=0) as client:
        client.pause_generation("abort")
        try:
            t0 = time.monotonic()
            with pytest.raises(RolloutServerError, match="timed out"):
                client.generate([5, 6, 7], {"max_new_tokens": 2}, rid="never")
            assert time.monotonic() - t0 < 6
        finally:
            client.continue_generation()
        r = client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0}, rid="after")
        assert r.completion_tokens >= 1


def test_pause_abort_reaches_requests_being_prefilled(model_dir):
    """pause(abort) arriving while the scheduler prefills new requests aborts them too."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.engine.batching import GenerationEngine, Request as _Request
    from megatron_rl.engine.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = GenerationEngine(model, eos_token_ids=[EOS])
    entered, release = threading.Event(), threading.Event()
    orig_prefill = engine._prefill

    def slow_prefill(reqs):
        entered.set()
        assert release.wait(10)
        return orig_prefill(reqs)

    engine._prefill = slow_prefill
    done: list[_Request] = []
    finished = threading.Event()

    def on_done(req):
        done.append(req)
        if len(done) == 4:
            finished.set()

    try:
        for i in range(4):
            engine.submit(
                _Request(
                    rid=f"r{i}",
                    prompt_ids=[5, 6, 7 + i],
                    params=SamplingParams(max_new_tokens=200, ignore_eos=True),
                    return_logprob=False,
                    logprob_start_len=-1,
                    generator=engine.new_generator(i),
                    on_done=on_done,
                )
            )
        assert entered.wait(10)
        pauser = threading.Thread(target=engine.pause, args=("abort",))
        pauser.start()
        time.sleep(0.1)  # pause() has flagged what it sees and waits for the step boundary
        release.set()
        pauser.join(10)
        assert finished.wait(5), f"requests left running in the paused batch: {engine.counts()}"
        assert all(r.finish_reason["type"] == "abort" for r in done)
        assert engine.can_flush() == (True, "")
    finally:
        release.set()
        engine.close()


def test_abort_and_hold_return_while_other_requests_keep_decoding(model_dir):
    """abort() and hold() wait for the step running when they were called, not for a step boundary
    at which nothing runs: the scheduler starts the next step right after one ends, so a waiter that
    only looked for "no step running" could be starved until the whole batch finished (seen in CI
    as a stale abort blocking a live weight update for ~6 s while another request decoded)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.engine.batching import GenerationEngine, Request as _Request
    from megatron_rl.engine.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = GenerationEngine(model, eos_token_ids=[EOS], step_delay_s=0.004)
    done: dict[str, _Request] = {}
    ended = threading.Event()
    drops = [f"drop{i}" for i in range(6)]  # each abort is one more chance for a starved waiter

    def on_done(req):
        done[req.rid] = req
        if len(done) == 1 + len(drops):
            ended.set()

    def request(rid: str, seed: int) -> _Request:
        return _Request(rid=rid, prompt_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=480, ignore_eos=True),
                        return_logprob=False, logprob_start_len=-1, generator=engine.new_generator(seed),
                        on_done=on_done)

    # 480 tokens of 4+ ms: 'keep' decodes for >= 2 s; an abort or hold waits one step (~5 ms)
    keep = request("keep", 100)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # the scheduler keeps the GIL from a step's end to the next one's start
    try:
        for k, rid in enumerate(["keep", *drops]):
            engine.submit(keep if rid == "keep" else request(rid, k))
        deadline = time.monotonic() + 10
        while len(keep.output_ids) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        for call, arg in [(engine.abort, rid) for rid in drops] + [(engine.hold, None)]:
            t = threading.Thread(target=call, args=() if arg is None else (arg,), daemon=True)
            t0 = time.monotonic()
            t.start()
            t.join(1.0)
            assert not t.is_alive(), f"{call.__name__}({arg}) still waiting after 1 s; 'keep' made {len(keep.output_ids)}"
            assert "keep" not in done, f"{call.__name__}({arg}) returned once 'keep' ended ({time.monotonic() - t0:.1f} s)"
        assert all(done[rid].finish_reason["type"] == "abort" for rid in drops)
        made = len(keep.output_ids)
        time.sleep(0.2)
        assert len(keep.output_ids) == made  # held: no step runs
        engine.release_hold()
        assert ended.wait(30) and len(done["keep"].output_ids) == 480
    finally:
        sys.setswitchinterval(switch)
        engine.close()
