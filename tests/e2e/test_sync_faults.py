"""Weight-sync failures with a multi-process trainer (TP=2, two ranks): the real CLI, a real embedded
rollout server told to refuse chosen ``/update_weights_from_distributed`` calls (its fault-injection
variable, ``megatron_rl.engine.test_hooks.FAULT_REFUSE_UPDATES_ENV``). One refused sync is retried with
a new group and the run's metrics equal those of a run without faults; two in a row stop every
rank promptly with the error naming the version, the last complete checkpoint intact, no server
left behind (issue 5: "a sync that fails is retried once, then the run stops with a clear error").
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.engine.test_hooks import FAULT_REFUSE_UPDATES_ENV
from tests.e2e.server_faults import kill_server_when
from tests.e2e.test_resume import _no_server_left, _wall_clock

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1500)
STEPS = 2


def _run(run_dir: Path, refuse: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(FAULT_REFUSE_UPDATES_ENV, None)
    if refuse:
        env[FAULT_REFUSE_UPDATES_ENV] = refuse
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false",
         "trainer.save_interval=1", "eval.max_problems=8", "eval.n=1", "eval.interval=0",
         "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "trainer.nproc_per_node=2", "trainer.tensor_model_parallel_size=2", "rollout.enable_deterministic_inference=true"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env,
    )


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/acc" in r}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    out = _run(run_dir, None)
    assert out.returncode == 0, out.stderr[-4000:]
    return _steps(run_dir)


def test_one_refused_sync_is_retried_and_changes_nothing(clean_run, tmp_path):
    run_dir = tmp_path / "run"
    out = _run(run_dir, "2")  # call 1 is the sync to version 0 at start-up; call 2 follows step 1
    assert out.returncode == 0, out.stderr[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "retrying once with a new group" in log and "succeeded on the retry" in log, log[-3000:]
    got = _steps(run_dir)
    assert sorted(got) == sorted(clean_run) == list(range(1, STEPS + 1))
    for step, want in clean_run.items():
        for key, value in want.items():
            if _wall_clock(key) or key == "train/rollout_logprob_abs_diff":
                continue
            assert got[step][key] == value, (step, key)
    assert _no_server_left(run_dir)


def test_two_refused_syncs_stop_every_rank_with_the_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"
    out = _run(run_dir, "3,4")  # versions 0 and 1 sync; version 2 (after step 2) fails, and its retry
    assert out.returncode != 0
    assert "weight sync to version 2 failed twice" in out.stderr, out.stderr[-4000:]
    assert "rerun the same command to resume" in out.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (ckpts / "iter_0000002").exists()
    assert _no_server_left(run_dir)


@pytest.mark.parametrize("backend", ["embedded", "vllm-embedded"])
def test_server_killed_mid_rollout_is_restarted_and_every_rank_resyncs(clean_run, tmp_path, backend):
    """The only rollout server is killed (SIGKILL) while step 2 generates: the controller restarts
    it and publishes the current weights at once; the other trainer rank, waiting for the step's
    batch, receives the weight publisher's plan instead and takes part in the TP gathers of the
    re-sync; the step completes and the run's sampled tokens and metrics equal a run without
    faults (deterministic inference, seeded requests retried with the same seeds). In SGLang's
    dialect and in vLLM's (`vllm-embedded`: VLLMClient, a fresh server joined through
    /init_weight_transfer_engine; its tokens equal the SGLang dialect's, tests/e2e/test_train_vllm_dialect.py,
    so the same clean run is the reference: with one request per response, the seeds the clean run
    has; a group request with `n` is retried as the same group, `RolloutManager._post`)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop(FAULT_REFUSE_UPDATES_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false",
         "trainer.save_interval=1", "eval.max_problems=8", "eval.n=1", "eval.interval=0",
         "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "trainer.nproc_per_node=2", "trainer.tensor_model_parallel_size=2",
         "rollout.enable_deterministic_inference=true", "rollout.max_server_restarts=1", f"rollout.backend={backend}",
         "rollout.parallel_sampling=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    err = kill_server_when(proc, run_dir, "step 1:", timeout_s=900)
    log = run_dir / "train.log"
    assert proc.returncode == 0, err[-4000:]
    text = log.read_text()
    assert "restarting rollout server 0" in text and "re-sync to weight version 1 done" in text, text[-3000:]
    dialect = "vllm" if backend == "vllm-embedded" else "sglang"
    assert (run_dir / "rollout_server_0.log").read_text().count(f"({dialect} dialect,") == 2  # started, restarted
    got = _steps(run_dir)
    for step, want in clean_run.items():
        for key in ("rollout/token_checksum", "train/acc", "train/loss", "train/grad_norm"):
            assert got[step][key] == want[key], (step, key)
    assert got[STEPS]["rollout/server_restarts"] == 1
    assert _no_server_left(run_dir)


def test_server_killed_during_an_evaluation_is_resynced_with_every_rank(tmp_path):
    """The only server is killed while the step-0 evaluation runs (the controller alone works then):
    it is restarted and re-synced with the other rank taking part (it waits on the controller's
    channel through every evaluation), and the run completes (before: every rank hung in a collective
    until the timeout)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop(FAULT_REFUSE_UPDATES_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.total_training_steps=1", "trainer.progress_bar=false", "eval.max_problems=8",
         "eval.n=1", "eval.interval=0", "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4",
         "actor.ppo_mini_batch_size=4", "trainer.nproc_per_node=2", "trainer.tensor_model_parallel_size=2",
         "trainer.distributed_timeout_s=120", "rollout.max_server_restarts=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    err = kill_server_when(proc, run_dir, "eval eval_before", timeout_s=600)
    log = run_dir / "train.log"
    assert proc.returncode == 0, err[-4000:]
    text = log.read_text()
    assert "re-sync to weight version 0 done" in text and "eval eval_after:" in text, text[-3000:]
    assert _no_server_left(run_dir)
