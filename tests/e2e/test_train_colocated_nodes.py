"""Colocated mode on two nodes (issue 17): two torchrun "nodes" of one trainer rank each on this
host, `rollout.colocate: true` with one engine per node. Each node's local rank 0 starts its own
engine (bound to 0.0.0.0, logs in `run_dir/node<k>/` for k > 0) and hands it the whole model by
shared-memory handles through the loopback address; the controller generates on both, releases
and resumes both, and opens / closes the weight-update session on both. In deterministic mode the
run equals, bit for bit, the disaggregated run on one node with the same data-parallel layout (2
ranks, 2 engines), also when node 1's engine is killed mid-rollout (its node leader restarts it
after the update and the next sync feeds it)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.ports import find_free_port
from tests.e2e.test_resume import _no_server_left

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)
STEPS = 3
EXACT = ("rollout/token_checksum", "train/acc", "train/score", "train/loss", "train/grad_norm", "train/entropy",
         "train/ppo_kl", "weight_sync/version")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads per rank and per engine in both layouts


def _args(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", "--config", str(ROOT / "examples/tiny/ci.yaml"), f"run_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false", "eval.before_train=false",
            "eval.after_train=false", "rollout.enable_deterministic_inference=true", "data.train_batch_size=4",
            "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.save_interval=0",
            "actor.old_logprob_source=rollout", *overrides]


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/acc" in r}


def _same(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        for key in EXACT:
            assert got[step][key] == want[step][key], (step, key)


def _two_nodes(run_dir: Path, *overrides: str) -> list[subprocess.Popen]:
    """Two torchrun processes (node ranks 0 and 1, one rank each) rendezvousing on 127.0.0.1."""
    port = find_free_port("127.0.0.1")
    args = _args(run_dir, "trainer.nproc_per_node=1", "rollout.colocate=true", "rollout.num_servers=1", *overrides)
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                              "--node-rank", str(k), "--master-addr", "127.0.0.1", "--master-port", str(port),
                              "--max-restarts", "0", "-m", "megatron_rl.cli", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
            for k in (0, 1)]


def _finish(procs: list[subprocess.Popen]) -> None:
    try:
        errs = [p.communicate(timeout=900)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for k, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, f"node {k}: {err[-4000:]}"


def _engine_log(run_dir: Path, node: int) -> str:
    return (run_dir / (f"node{node}" if node else "") / "rollout_server_0.log").read_text()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-node") / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli",
                          *_args(run_dir, "trainer.nproc_per_node=2", "rollout.num_servers=2")],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return _rows(run_dir)


def test_two_nodes_colocated_equal_one_node_disaggregated(one_node, tmp_path):
    run_dir = tmp_path / "run"
    _finish(_two_nodes(run_dir))
    got = _rows(run_dir)
    _same(got, one_node)
    assert all(row["rollout/servers_up"] == 2 for row in got.values())
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train_rank1.log").is_file()
    # each node leader hands over the whole model (the one-node run broadcasts it once to both engines)
    assert all(row["weight_sync/num_tensors"] == 2 * one_node[s]["weight_sync/num_tensors"] for s, row in got.items())
    for node in (0, 1):  # each engine: the first sync plus one a step, released and resumed around each update
        log = _engine_log(run_dir, node)
        assert log.count("update_weights_from_tensor: 50 tensors") == STEPS + 1, node
        assert log.count("released ['weights', 'kv_cache']") == STEPS, node
    assert _no_server_left(run_dir)


def test_node_leader_restarts_its_dead_engine(one_node, tmp_path):
    run_dir = tmp_path / "run"
    procs = _two_nodes(run_dir, "rollout.max_server_restarts=1")
    log, node1 = run_dir / "train.log", run_dir / "node1" / "rollout_server_0.log"
    try:
        deadline = time.monotonic() + 600
        while "step 1:" not in (log.read_text() if log.exists() else ""):
            assert all(p.poll() is None for p in procs), "a node exited before step 1 ended"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pid = int(node1.read_text().split("[rollout-server:", 1)[1].split("]", 1)[0])
        os.kill(pid, signal.SIGKILL)  # node 1's engine dies while step 2 generates
    except BaseException:
        for p in procs:
            p.kill()
        raise
    _finish(procs)
    _same(_rows(run_dir), one_node)
    assert "node 1: restarting rollout server 0" in (run_dir / "train_rank1.log").read_text()
    assert node1.read_text().count("megatron_rl.engine.server: loading") == 2  # started, then restarted
    assert _rows(run_dir)[STEPS]["rollout/servers_up"] == 2
    assert _rows(run_dir)[STEPS]["colocate/node_engine_restarts"] == 1  # the controller counts node 1's restart
    assert _no_server_left(run_dir)
