"""Colocated mode end to end (issue 17): the tiny CI recipe with `rollout.colocate: true` (engine
released / resumed around every update, weights handed over by shared-memory handles through
`/update_weights_from_tensor`) samples the same tokens and computes the same loss and gradient
norm as the disaggregated run (broadcast weight sync), step for step, in deterministic mode; the
colocated phases are timed and their memory logged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
STEPS = 3
EXACT = ("rollout/token_checksum", "train/acc", "train/score", "weight_sync/version", "weight_sync/num_tensors")
CLOSE = ("train/loss", "train/grad_norm", "train/entropy")


def _run(run_dir: Path, *overrides: str) -> dict[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false",
         "eval.before_train=false", "eval.after_train=false", "rollout.enable_deterministic_inference=true",
         "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
         *overrides],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/acc" in r}


def test_colocated_equals_disaggregated(tmp_path):
    base = _run(tmp_path / "disagg")
    coloc = _run(tmp_path / "coloc", "rollout.colocate=true")
    assert sorted(coloc) == sorted(base) == list(range(1, STEPS + 1))
    for step, want in base.items():
        for key in EXACT:
            assert coloc[step][key] == want[key], (step, key)
        for key in CLOSE:
            assert coloc[step][key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (step, key)
        row = coloc[step]
        for phase in ("engine_release", "trainer_onload", "trainer_offload", "engine_resume_weights",
                      "engine_resume_kv_cache"):
            assert row[f"colocate/{phase}_s"] >= 0, (step, phase)
        assert row["colocate/engine_release_trainer_rss_gib_before"] > 0
        # the engine gave its weights back on release and took them again on resume
        assert (row["colocate/engine_rss_gib_after_release_weights+kv_cache"]
                < row["colocate/engine_rss_gib_after_resume_weights"])
