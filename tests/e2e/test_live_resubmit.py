"""Live weight updates while the rollout manager generates: no request lost or counted twice.

A real embedded server (the tiny model, slowed by its step-delay test hook), the real rollout
manager with real rewards, and the real weight publisher (controller of a world of one, its weights
the HF model's instead of a megatron model's) publishing live with `pause_mode: abort` several times
while `generate_groups` runs in another thread. Requests the pauses abort are resubmitted after each
continue: with `rollout.partial_rollout` with their prefix (spans of several versions), without it
from scratch (one span). Every prompt's group comes back with exactly n complete responses. Case N05:
a group with a member that fails for good (here an abort nobody in the rollout asked for) is
dropped whole and counted, never returned short.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.data.dataset import load_rows
from megatron_rl.rewards.pool import RewardPool
from megatron_rl.rollout.launcher import launch_servers
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.weight_sync.publisher import WeightPublisher
from megatron_rl.weight_sync.sender import WeightSyncSender

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"
MAX_NEW = 48
SAMPLING = {"temperature": 1.0, "min_new_tokens": 24}  # long enough for the pauses to land


class HFPublisher(WeightPublisher):
    """The real publisher (controller, world of one); its weights are an HF model's parameters."""

    def __init__(self, model, fleet) -> None:
        pgs = SimpleNamespace(rank=0, world_size=1, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0, tp_size=1)
        super().__init__(None, {}, pgs, fleet=fleet, pause_mode="abort", sender_factory=lambda urls, name:
                         WeightSyncSender([c for c in fleet.clients if c.base_url in urls], group_name=name,
                                          timeout_s=60))
        self.hf_model = model

    def _stage_weights(self):
        yield from ((n, p.detach()) for n, p in self.hf_model.named_parameters())

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()  # the clients are the manager's: not closed here


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log_dir = tmp_path_factory.mktemp("live_resubmit")
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_RL_TEST_STEP_DELAY_S="0.01")
    (server,) = launch_servers("embedded", TINY / "base_model", 1, log_dir=log_dir, startup_timeout_s=180, env=env,
                               embedded_args=["--max-batch-size", "8", "--weight-version", "0"])
    tok = AutoTokenizer.from_pretrained(TINY / "base_model")
    model = AutoModelForCausalLM.from_pretrained(TINY / "base_model")
    pool = RewardPool(1, 30.0)
    rows = load_rows(TINY / "data" / "train.parquet")[:8]
    yield SimpleNamespace(server=server, tok=tok, model=model, pool=pool, rows=rows)
    pool.close()
    server.stop()


def _manager(setup, partial: bool) -> RolloutManager:
    m = RolloutManager([setup.server.client(timeout_s=60, generate_timeout_s=300)], setup.tok, setup.pool,
                       reward_fn="dapo_math", max_prompt_length=64, max_response_length=MAX_NEW, seed=5,
                       eos_token_ids=[setup.tok.eos_token_id], partial_rollout=partial, pause_timeout_s=120)
    m.gate.set_version(int(m.clients[0].weight_version()))
    return m


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


def _live(client) -> int:
    info = client.server_info()
    return info["num_running_reqs"] + info["num_waiting_reqs"]


@pytest.mark.parametrize("partial", [False, True], ids=["from_scratch", "partial_rollout"])
def test_pause_abort_update_continue_loses_and_repeats_nothing(setup, partial):
    manager = _manager(setup, partial)
    publisher = HFPublisher(setup.model, manager.fleet)
    client = manager.clients[0]
    first = manager.gate.version
    try:
        t, box = _start(manager.generate_groups, setup.rows, n=4, sampling_params=SAMPLING, step=7, gen_batch=0)
        published = []
        while t.is_alive() and len(published) < 4:  # pause(abort) -> update -> continue, mid-generation
            deadline = time.monotonic() + 30
            while t.is_alive() and _live(client) == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.15)
            if not t.is_alive():
                break
            version = first + len(published) + 1
            publisher.publish(version, live=True)
            published.append(version)
        t.join(300)
        assert not t.is_alive() and "error" not in box, box.get("error")
        groups, stats = box["result"]
        assert len(published) >= 2, "generation ended before two updates landed"
        assert stats["rollout/resubmitted"] > 0 and stats["rollout/failed_groups"] == 0
        assert [g.group_uid for g in groups] == [f"s7-b0-p{i}" for i in range(len(setup.rows))]
        last = published[-1]
        for g, row in zip(groups, setup.rows):
            assert g.prompt_key == row.prompt_key and len(g.samples) == 4
            for s in g.samples:
                assert s.stop_reason != "abort" and 0 < len(s.response_ids) <= MAX_NEW
                assert len(s.rollout_logprobs) == len(s.response_ids)
                assert all(math.isfinite(lp) for lp in s.rollout_logprobs)
                versions = [v for v, _ in s.weight_version_spans]
                starts = [a for _, a in s.weight_version_spans]
                assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < len(s.response_ids)
                assert versions == sorted(set(versions)) and first <= versions[0] and versions[-1] <= last
                assert s.min_weight_version == versions[0]
                if not partial:
                    assert len(versions) == 1, s.weight_version_spans  # resubmitted from scratch
        spans = [len(s.weight_version_spans) for g in groups for s in g.samples]
        if partial:
            assert max(spans) > 1, "no response kept a prefix across an update"
        assert _live(client) == 0  # nothing left behind on the server
        assert client.weight_version() == str(last)
    finally:
        publisher.close()
        manager.close()


def test_a_group_with_a_failed_member_is_dropped_whole_and_counted(setup):
    manager = _manager(setup, False)
    client = manager.clients[0]
    rows = setup.rows[:6]
    try:
        client.pause_generation("in_place")  # hold every request on the server until p5's are aborted
        t, box = _start(manager.generate_groups, rows, n=2, sampling_params=SAMPLING, step=9, gen_batch=0)
        deadline = time.monotonic() + 60
        while _live(client) < 2 * len(rows):
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        client.abort_request("s9-b0-p5-")  # neither a pause of the rollout nor the manager's own abort
        client.continue_generation()
        t.join(300)
        assert not t.is_alive() and "error" not in box, box.get("error")
        groups, stats = box["result"]
        assert [g.group_uid for g in groups] == [f"s9-b0-p{i}" for i in range(5)]
        assert all(len(g.samples) == 2 and all(s.stop_reason != "abort" for s in g.samples) for g in groups)
        assert stats["rollout/failed_groups"] == 1 and stats["rollout/resubmitted"] == 0
    finally:
        client.continue_generation()
        manager.close()
