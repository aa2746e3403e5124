"""Rollout servers as a fleet: the SGLang launch path, distinct ports, and servers killed mid-rollout.

SGLang cannot serve on this CPU machine (docs/SGLANG_API.md section 4), so the SGLang test runs the
real launch path (``launch_servers("sglang", ...)``: the command line, ports, health wait) against
a FAKE ``sglang.launch_server`` module written below: it accepts exactly the SGLang flags the
launcher passes, holds its ``--nccl-port`` bound as SGLang's NCCL init would (so a port collision
fails as it would), records its argv, and serves with the embedded server, whose HTTP contract is
SGLang's. The fault tests use real embedded server processes, killed with SIGKILL mid-rollout, and a
real weight sync from this process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.data.dataset import PromptRow
from megatron_rl.rollout.fleet import ServerFleet
from megatron_rl.rollout.launcher import launch_servers
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.errors import WeightSyncError
from megatron_rl.weight_sync.sender import WeightSyncSender
from tests.e2e.random_qwen2 import EOS, save_random_qwen2

REPO = Path(__file__).resolve().parents[2]

FAKE_SGLANG = textwrap.dedent('''
    """FAKE sglang.launch_server for CPU tests: SGLang's flags in, the embedded server out."""
    import argparse, json, os, socket, sys

    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--nccl-port", type=int, required=True)  # never left to SGLang's random offset
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--dtype")
    p.add_argument("--weight-version")
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    args = p.parse_args()  # an unknown flag exits 2, as SGLang's parser does
    assert args.tp_size == 1, "the embedded server has one rank"
    nccl = socket.socket()
    nccl.bind((args.host, args.nccl_port))  # taken -> "Address already in use", as SGLang's NCCL init
    nccl.listen()
    with open(os.path.join(os.environ["FAKE_SGLANG_RECORD"], f"{args.port}.json"), "w") as f:
        json.dump(sys.argv[1:], f)
    from megatron_rl.engine.server import main
    argv = ["--model-path", args.model_path, "--host", args.host, "--port", str(args.port),
            "--parent-pid", str(os.getppid())]
    for flag in ("random_seed", "dtype", "weight_version", "api_key", "admin_api_key"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.enable_deterministic_inference:
        argv.append("--enable-deterministic-inference")
    sys.exit(main(argv))
''')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet_qwen2")
    return save_random_qwen2(path, vocab_size=512, hidden_size=64, intermediate_size=128)


def _rows(count: int) -> list[PromptRow]:
    return [PromptRow(prompt_key=f"t:{i}", messages=[], ground_truth="", data_source="t") for i in range(count)]


def _manager(fleet, count: int) -> RolloutManager:
    m = RolloutManager(fleet, tokenizer=None, reward_pool=None, reward_fn="dapo_math", max_prompt_length=64,
                       max_response_length=40, seed=5, max_concurrency=32, eos_token_ids=[EOS])
    for i, row in enumerate(_rows(count)):  # token prompts: no tokenizer needed
        m._prompt_cache[row.prompt_key] = [5 + i, 17, 42 + i]
    return m


def _greedy(manager, count: int, tag: str) -> list[list[int]]:
    out = manager.generate(_rows(count), n=1, sampling_params={"temperature": 0.0}, tag=tag, seed_parts=(0,),
                           max_new_tokens=10)
    return [g[0].output_ids for g in out]


def test_sglang_backend_two_servers_distinct_ports(model_dir, tmp_path):
    shim = tmp_path / "shim"
    (shim / "sglang").mkdir(parents=True)
    (shim / "sglang" / "__init__.py").write_text('"""FAKE sglang package for CPU tests."""\n')
    (shim / "sglang" / "launch_server.py").write_text(FAKE_SGLANG)
    record = tmp_path / "record"
    record.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{shim}{os.pathsep}{REPO}", FAKE_SGLANG_RECORD=str(record))
    servers = launch_servers("sglang", model_dir, 2, sglang_python=sys.executable, env=env, log_dir=tmp_path,
                             random_seed=3, mem_fraction_static=0.5, sglang_args=["--dtype", "float32"],
                             startup_timeout_s=180)
    try:
        argvs = {int(p.stem): json.loads(p.read_text()) for p in record.glob("*.json")}
        assert sorted(argvs) == sorted(s.port for s in servers)
        ports = []
        for s in servers:
            argv = argvs[s.port]
            flags = dict(zip(argv[::1], argv[1::1]))
            assert flags["--port"] == str(s.port) and flags["--nccl-port"] == str(s.ports[1])
            assert flags["--tp-size"] == "1" and flags["--mem-fraction-static"] == "0.5"
            assert "--skip-tokenizer-init" in argv and flags["--random-seed"] == "3"
            ports += [s.port, s.ports[1]]
        assert len(set(ports)) == 4, ports  # two servers launched together share no port
        fleet = ServerFleet([s.client() for s in servers], servers)
        manager = _manager(fleet, 4)
        greedy = _greedy(manager, 4, "sg")
        assert all(len(g) > 0 for g in greedy)
        # the same prompt gives the same greedy answer on either server (routing is invisible)
        assert _greedy(manager, 4, "sg2") == greedy
    finally:
        for s in servers:
            s.stop()


def _sampled_rollout(manager, count: int, result: dict) -> None:
    try:
        out = manager.generate(_rows(count), n=4, sampling_params={"temperature": 1.0}, tag="roll", seed_parts=(1,))
        result["groups"] = out
    except BaseException as e:  # noqa: BLE001 - reported to the test thread
        result["error"] = e


def _kill_when_busy(server, fleet_client) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if fleet_client.server_info()["num_running_reqs"] > 0:
            break
        time.sleep(0.05)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


@pytest.fixture
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_killed_only_server_is_restarted_and_resynced(model_dir, hf_model, tmp_path, caplog):
    """Killing the only server mid-rollout: it is restarted, re-synced to the trainer's weights
    (version "1"), its requests retried; the rollout completes with no aborted response."""
    caplog.set_level(logging.WARNING)
    servers = launch_servers("embedded", model_dir, 1, log_dir=tmp_path, startup_timeout_s=180,
                             embedded_args=["--dtype", "float32", "--max-batch-size", "4"])
    clients = [s.client(timeout_s=60, generate_timeout_s=120) for s in servers]
    fleet = ServerFleet(clients, servers, max_restarts=2)
    manager = _manager(fleet, 8)
    sender = WeightSyncSender(clients, group_name="fleet1", timeout_s=60)
    try:
        base = _greedy(manager, 8, "base")
        sender.init_group()
        sender.sync(hf_model.state_dict().items(), weight_version="1")

        def resync(up):
            sender.reinit(up)
            sender.sync(hf_model.state_dict().items(), weight_version="1")

        fleet.set_resync(resync)
        synced = _greedy(manager, 8, "v1")
        assert synced != base  # the sync changed the outputs, so the comparison below means something
        result: dict = {}
        t = threading.Thread(target=_sampled_rollout, args=(manager, 8, result))
        t.start()
        _kill_when_busy(servers[0], clients[0])
        t.join(timeout=300)
        assert "error" not in result, result.get("error")
        groups = result["groups"]
        assert len(groups) == 8 and all(r.finish_type != "abort" for g in groups for r in g)
        assert fleet.restarts == 1 and servers[0].alive() and servers[0].restarts == 1
        assert clients[0].weight_version() == "1"
        assert _greedy(manager, 8, "after") == synced
        text = caplog.text
        assert "is down" in text and "restarting rollout server 0" in text and "re-synced" in text
    finally:
        sender.close()
        manager.close()
        for s in servers:
            s.stop()


def test_killed_server_is_dropped_then_restarted_at_the_next_sync(model_dir, hf_model, tmp_path, caplog):
    """Two servers, one killed mid-rollout: its requests finish on the other (dropped with a
    warning); at the next sync it is restarted, joins a new group and serves the trainer's weights;
    between its restart and the end of that sync no request is placed on any server."""
    caplog.set_level(logging.WARNING)
    servers = launch_servers("embedded", model_dir, 2, log_dir=tmp_path, startup_timeout_s=180,
                             embedded_args=["--dtype", "float32", "--max-batch-size", "4"])
    clients = [s.client(timeout_s=60, generate_timeout_s=120) for s in servers]
    fleet = ServerFleet(clients, servers, max_restarts=2)
    manager = _manager(fleet, 8)
    sender = WeightSyncSender(clients, group_name="fleet2", timeout_s=60)
    try:
        sender.init_group()
        sender.sync(hf_model.state_dict().items(), weight_version="1")
        synced = _greedy(manager, 8, "v1")
        result: dict = {}
        t = threading.Thread(target=_sampled_rollout, args=(manager, 8, result))
        t.start()
        _kill_when_busy(servers[1], clients[1])
        t.join(timeout=300)
        assert "error" not in result, result.get("error")
        assert all(r.finish_type != "abort" for g in result["groups"] for r in g)
        assert fleet.up_indices() == [0] and fleet.restarts == 0
        assert "rollout server 1 dropped until the next weight sync" in caplog.text
        # the next sync: restart, new group over both, push
        fleet.check_all()
        assert fleet.recover() is True and fleet.up_indices() == [0, 1] and fleet.restarts == 1
        # the restarted server holds the checkpoint's weights: no request is placed until the sync ends
        picked = threading.Event()
        threading.Thread(target=lambda: (fleet.pick(1), picked.set()), daemon=True).start()
        assert not picked.wait(1.0)
        sender.reinit(fleet.up_clients())
        sender.sync(hf_model.state_dict().items(), weight_version="2")
        fleet.sync_done()  # the publisher's call after the sync
        assert picked.wait(30)
        assert [c.weight_version() for c in clients] == ["2", "2"]
        # every prompt on either server: the restarted one serves the synced weights too
        assert _greedy(manager, 8, "v2") == synced
        swapped = _manager(ServerFleet(clients[::-1], None), 8)
        assert _greedy(swapped, 8, "v2s") == synced
        swapped.close()
        # optional checksum check (weight_sync.check_checksums): equal after a sync, and a tensor
        # the servers do not hold is named
        expected: dict = {}
        sender.sync(sender.checksums(iter(hf_model.state_dict().items()), expected), weight_version="3")
        n = len(expected)
        assert sender.check_checksums(expected) == {"weight_sync/checked_tensors": 2.0 * n,
                                                    "weight_sync/unverifiable_tensors": 0.0}
        with torch.no_grad():
            hf_model.model.norm.weight[3] += 1.0
        stale: dict = {}
        list(sender.checksums(iter(hf_model.state_dict().items()), stale))  # not synced
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*\(1 tensors\)"):
            sender.check_checksums(stale)
    finally:
        sender.close()
        manager.close()
        for s in servers:
            s.stop()


def test_an_engine_that_comes_back_misconfigured_stays_out(model_dir, tmp_path, caplog):
    """A given URL that was down and answers again is checked like at start-up before it rejoins
    (issue 32): one that came back reporting temperature-scaled log-probs stays out, named in the
    log with the setting that fixes it; the fleet goes on with the engine that passed."""
    from megatron_rl.engine.test_hooks import PROCESSED_LOGPROBS_ENV
    from megatron_rl.ports import find_free_port
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.engine_checks import check_engines
    from megatron_rl.rollout.launcher import launch_rollout_server

    caplog.set_level(logging.WARNING)
    args = ["--dtype", "float32"]
    port = find_free_port()
    with launch_rollout_server(model_dir, log_path=tmp_path / "a.log", extra_args=args) as good:
        clients = [RolloutClient(good.base_url, timeout_s=30), RolloutClient(f"http://127.0.0.1:{port}", timeout_s=30)]
        fleet = ServerFleet(clients, None)
        fleet.set_admit(lambda c: check_engines([c], vocab_size=512, backend="sglang"))
        fleet.check_all()  # nothing listens at the second URL yet
        assert fleet.up_indices() == [0]
        env = dict(os.environ, **{PROCESSED_LOGPROBS_ENV: "1"})
        with launch_rollout_server(model_dir, port=port, log_path=tmp_path / "b.log", extra_args=args, env=env):
            fleet.recover()
            assert fleet.up_indices() == [0]
            assert fleet.pick(1) == (0, fleet._epoch[0])  # requests go on, to the engine that passed
        text = caplog.text
        assert f"rollout server 1 (http://127.0.0.1:{port}) came back but fails the start-up checks" in text
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB=1" in text
        for c in clients:
            c.close()
