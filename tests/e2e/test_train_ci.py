"""One short end-to-end DA3PO run of the real stack (megatron-core trainer, embedded server process,
broadcast weight sync, dynamic sampling, DAA, eval, checkpoint) from the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)

REQUIRED_STEP_KEYS = {
    "train/score", "train/acc", "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "train/entropy", "train/pg_clipfrac", "train/pg_clipfrac_lower", "train/ppo_kl", "train/grad_norm",
    "train/num_gen_batches", "train/kept_groups", "train/daa_amplified_frac", "train/daa_hard_group_frac",
    "timing/step_s", "timing/filter_s",
    "perf/generate_tokens_per_s", "weight_sync/version",
}


def test_ci_recipe_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false"],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["wall_s"] > 0
    for key in ("eval_before", "eval_after"):
        ev = summary[key]
        assert ev["num_problems"] == 64
        for m in ("greedy_acc", "avg@4", "pass@4", "format_valid"):
            assert 0.0 <= ev[m] <= 1.0
        assert set(ev["by_level"]) == {"1", "2", "3", "4", "5"}
    # the SFT'd base model is format-valid (the gain is not format learning)
    assert summary["eval_before"]["format_valid"] >= 0.9
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/acc" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert REQUIRED_STEP_KEYS <= set(r), REQUIRED_STEP_KEYS - set(r)
        assert r["train/kept_groups"] == 8
        assert r["weight_sync/version"] == r["step"]
        # the phases are disjoint parts of the step (benchmarks/step_time_split.py adds them up)
        phases = ("generate", "reward", "filter", "advantage", "old_logprob", "update", "weight_sync")
        assert all(r[f"timing/{p}_s"] >= 0 for p in phases)
        assert sum(r[f"timing/{p}_s"] for p in phases) <= r["timing/step_s"] + 1e-6
    # the eval rows (step 0: before, step 3: after) carry summary.json's per-level results
    evals = {r["step"]: r for r in rows if "eval/avg@4" in r}
    for step, key in ((0, "eval_before"), (3, "eval_after")):
        assert evals[step]["eval/avg@4"] == summary[key]["avg@4"]
        for level, rec in summary[key]["by_level"].items():
            for m in ("avg@4", "pass@4", "greedy_acc", "format_valid"):
                assert evals[step][f"eval/level_{level}/{m}"] == rec[m], (step, level, m)
    # checkpoints at step 2 (save_interval) and 3 (the end); the marker names the newest
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpt / "iter_0000003" / "run_state.json").is_file()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tensorboard").is_dir()
    left = subprocess.run(["pgrep", "-f", f"megatron_rl.engine.*{run_dir}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""


def test_ci_recipe_token_budget(tmp_path):
    """`trainer.max_generated_tokens`: step 1 alone generates more than 1,000 tokens (8 kept groups
    x 8 responses, at least one generation batch of 12 prompts), so the run stops after step 1 of 3
    with what the end of a run writes: the save_last checkpoint, the final evaluation, summary.json."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false", "trainer.max_generated_tokens=1000"],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/acc" in r]
    assert [r["step"] for r in steps] == [1]
    assert summary["steps"] == 1
    assert summary["total_generated_tokens"] == steps[0]["perf/total_generated_tokens"] >= 1000
    assert REQUIRED_STEP_KEYS <= set(steps[0])
    assert sorted(r["step"] for r in rows if "eval/avg@4" in r) == [0, 1]
    assert "eval_after" in summary
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    # the same command again: the run is finished, nothing trains
    again = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", "trainer.progress_bar=false", "trainer.max_generated_tokens=1000"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished all 1 steps" in again.stderr + again.stdout
    assert json.loads((run_dir / "summary.json").read_text()) == summary
