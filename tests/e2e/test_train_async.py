"""Asynchronous training end to end (`trainer.max_staleness`, ALGORITHMS.md section 8): the CI
recipe with eta = 1 on the real stack (megatron-core trainer, embedded server process, weight
sync while the next step generates). Case N01 on the real loop: step s generates from version
max(0, s - 2) (start versions 0, 0, 1, 2), staleness never above 1; case N05's exactly-once rule:
the checkpoint of step 2 holds the data cursor right after step 2's prompts were drawn, although
the producer had drawn step 3's by then; the periodic evaluation runs in async mode and names the
weights it ran on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server_faults import kill_server_when

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def test_eta1_overlaps_generation_with_training_and_trains_every_prompt_once(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false", "trainer.max_staleness=1",
         "trainer.total_training_steps=4", "trainer.save_interval=2", "eval.interval=2", "eval.max_problems=16",
         "eval.before_train=false"],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/acc" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["rollout/weight_version_start"] for r in steps] == [0, 0, 1, 2]
    assert [r["weight_sync/version"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["train/staleness_max"] == 0
    assert all(0 <= r["train/staleness_max"] <= 1 and r["train/stale_discarded"] == 0 for r in steps)
    assert all(r["timing/wait_rollout_s"] >= 0 for r in steps)
    assert all(r["train/kept_groups"] == 8 for r in steps)  # dynamic sampling still fills each batch
    # token-level correction is on by default when eta > 0
    assert all("train/rollout_corr/behav_weight_mean" in r for r in steps)
    # exactly once: each checkpoint's cursor counts the prompts drawn up to its own step
    drawn = 0
    for r in steps:
        drawn += r["train/generated_groups"]
        if r["step"] in (2, 4):
            state = json.loads((run_dir / f"checkpoints/iter_{r['step']:07d}/run_state.json").read_text())
            assert state["data"]["position"] + state["data"]["epoch"] * state["data"]["num_rows"] == drawn, r["step"]
    assert "eval/avg@4" in steps[1]  # the periodic evaluation at step 2, while step 3 generates
    assert steps[1]["eval/weight_version"] == 2.0  # on the weights published after step 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval_after"]["weight_version"] == 4
    assert "weight version 2" in (run_dir / "train.log").read_text()


def test_eta1_server_killed_mid_step_is_restarted_and_resynced_by_the_main_thread(tmp_path):
    """The only server is killed (SIGKILL) after step 1, while step 2 trains and step 3 generates on the
    producer's thread: the rollout thread that finds it dead restarts it and hands the re-sync to the
    main thread (whose publish may not run inside a collective); requests wait until the server holds
    the trainer's weights. The run finishes every step with staleness <= 1 (a deadlock here once:
    the rollout thread held the fleet's lock while it waited for the main thread's publish)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false", "trainer.max_staleness=1",
         "trainer.total_training_steps=4", "trainer.save_interval=0", "eval.before_train=false",
         "eval.after_train=false", "rollout.max_server_restarts=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = kill_server_when(proc, run_dir, "step 1:", timeout_s=600)
    log = run_dir / "train.log"
    assert proc.returncode == 0, err[-4000:]
    text = log.read_text()
    assert "restarting rollout server 0" in text, text[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/acc" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["train/staleness_max"] <= 1 for r in steps)
    assert steps[-1]["rollout/server_restarts"] == 1


@pytest.mark.parametrize("tag, steps, version", [("eval_step1", 3, 1), ("eval_after", 2, 2)],
                         ids=["periodic_eval", "final_eval"])
def test_eta1_server_killed_during_an_evaluation_is_resynced(tmp_path, tag, steps, version):
    """The only server is SIGKILLed as an evaluation starts (a periodic one, while the producer generates
    ahead; the final one, after the producer closed). The evaluation's own requests find it dead, so the
    main thread, which waits for them, cannot take the re-sync: it runs on the requesting thread while
    the main thread evaluates (`AsyncProducer.evaluating`). Once, the periodic case hung for good (the
    re-sync waited for the main thread) and the final one evaluated the restarted server's base weights
    under the trained version's label (the closed producer refused the re-sync and nobody noticed)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false", "trainer.max_staleness=1",
         f"trainer.total_training_steps={steps}", "trainer.save_interval=0", "eval.before_train=false",
         "eval.after_train=true", f"eval.interval={1 if tag == 'eval_step1' else 0}", "eval.max_problems=16",
         "rollout.max_server_restarts=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err = kill_server_when(proc, run_dir, f"eval {tag}: ", timeout_s=600)
    assert proc.returncode == 0, err[-4000:]
    text = (run_dir / "train.log").read_text()
    after_kill = text[text.index(f"eval {tag}: "):]
    assert "restarting rollout server 0" in after_kill, text[-3000:]
    assert f"re-sync to weight version {version} done" in after_kill, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["eval_after"]["weight_version"] == steps
