"""Colocated mode end to end (issue 17): the tiny CI recipe with `rollout.colocate: true` (engine
released / resumed around every update, weights handed over by shared-memory handles through
`/update_weights_from_tensor`) samples the same tokens and computes the same loss, gradient
norm and PPO KL, bit for bit, as the disaggregated run (broadcast weight sync), step for step, in
deterministic mode with the engine's log-probs as the old policy (the engine's numerics for equal
weights do not depend on its release / resume history: `engine/memory_routes.py` `empty_at`); the
colocated phases are timed and their memory logged. It also survives an engine killed mid-rollout
and resumes exactly after SIGTERM (both slow)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.server_faults import kill_server_when
from tests.e2e.test_resume import _no_server_left

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1500)
STEPS = 3
EXACT = ("rollout/token_checksum", "train/acc", "train/score", "weight_sync/version", "weight_sync/num_tensors",
         "train/loss", "train/grad_norm", "train/entropy", "train/ppo_kl")


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
            f"run_dir={run_dir}", f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false",
            "eval.before_train=false", "eval.after_train=false", "rollout.enable_deterministic_inference=true",
            "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "trainer.save_interval=1", "actor.old_logprob_source=rollout", *overrides]


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/acc" in r}


def _run(run_dir: Path, *overrides: str) -> dict[int, dict]:
    out = subprocess.run(_cmd(run_dir, *overrides), capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return _rows(run_dir)


def _same(got: dict[int, dict], want: dict[int, dict], steps=None) -> None:
    for step in steps or sorted(want):
        for key in EXACT:
            assert got[step][key] == want[step][key], (step, key)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("disagg") / "run")


def test_colocated_equals_disaggregated(disaggregated, tmp_path):
    coloc = _run(tmp_path / "coloc", "rollout.colocate=true")
    assert sorted(coloc) == sorted(disaggregated) == list(range(1, STEPS + 1))
    _same(coloc, disaggregated)
    for step, row in coloc.items():
        for phase in ("engine_release", "trainer_onload", "trainer_offload", "engine_resume_weights",
                      "engine_resume_kv_cache"):
            assert row[f"colocate/{phase}_s"] >= 0, (step, phase)
        assert row["colocate/engine_release_trainer_rss_gib_before"] > 0
        # the engine gave its weights back on release and took them again on resume
        assert (row["colocate/engine_rss_gib_after_release_weights+kv_cache"]
                < row["colocate/engine_rss_gib_after_resume_weights"])
    assert _no_server_left(tmp_path / "coloc")


@pytest.mark.slow
def test_colocated_engine_killed_mid_rollout_is_restarted(disaggregated, tmp_path):
    """SIGKILL of the engine while step 2 generates: restarted, re-synced by the colocated
    hand-over, the released/resumed cycle goes on with the new engine; tokens and metrics equal."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "rollout.colocate=true", "rollout.max_server_restarts=1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = kill_server_when(proc, run_dir, "step 1:")
    log = run_dir / "train.log"
    assert proc.returncode == 0, err[-4000:]
    assert "restarting rollout server 0" in log.read_text()
    got = _rows(run_dir)
    _same(got, disaggregated)
    assert got[STEPS]["rollout/server_restarts"] == 1
    assert _no_server_left(run_dir)


@pytest.mark.slow
def test_colocated_sigterm_then_resume_is_exact(disaggregated, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "rollout.colocate=true"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.monotonic() + 900
        while not latest.exists():
            assert proc.poll() is None, f"run exited with {proc.returncode} before a checkpoint"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    k = int(latest.read_text())
    if k < STEPS:
        out = subprocess.run(_cmd(run_dir, "rollout.colocate=true"), capture_output=True, text=True, timeout=840,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr[-4000:]
    _same(_rows(run_dir), disaggregated)
