"""Study v2 (`benchmarks/study_v2.py --quick`) end to end: the base model's evaluations, then GRPO,
DAPO, DA3PO (paper's rule) and DA3PO (balanced + history) at seed 1, each under a 6,000-token budget
with evaluations at 3,000 and 6,000 tokens (`eval.token_interval`), and the secondary evaluation of
the final checkpoint; then the analysis from the result files alone.

Checked against the run folders: every evaluation point is the one after the first step whose
running total reaches it, the last one is summary.json's final evaluation, the secondary evaluation
resumed the final checkpoint without training, the dynamic-sampling arms sampled the same step-1
rollouts (same seed), checkpoints are gone, and a second invocation launches nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_v2 as v2  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
ARMS = ["grpo", "dapo", "da3po", "da3po_balanced_history"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_quick_study_v2_end_to_end(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, str(ROOT / "benchmarks/study_v2.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = out / "results"
    st = v2.settings_for(True)
    base = json.loads((res / "base.json").read_text())
    assert base["settings"] == st and 0 <= base["hard"]["avg"] <= 1 and set(base["hard"]["levels"]) <= {"4", "5"}
    assert set(base["overall"]["levels"]) > {"4", "5"}   # the secondary evaluation covers every level
    for arm in ARMS:
        rec = json.loads((res / f"{arm}_s1.json").read_text())
        run = out / "runs" / f"{arm}_s1"
        rows = _rows(run / "metrics.jsonl")
        train = {r["step"]: r for r in rows if "perf/total_generated_tokens" in r}
        summary = json.loads((run / "summary.json").read_text())
        assert rec["total_generated_tokens"] == summary["total_generated_tokens"] >= st["budget_tokens"]
        assert rec["total_generated_tokens"] == sum(r["perf/generated_tokens"] for r in train.values())
        for p in rec["curve"]:
            first = min(s for s, r in train.items() if r["perf/total_generated_tokens"] >= p["nominal_tokens"])
            assert p["step"] == first and p["tokens"] == train[first]["perf/total_generated_tokens"]
        assert rec["curve"][-1]["step"] == summary["steps"]
        assert rec["curve"][-1]["avg"] == summary["eval_after"][f"avg@{st['hard_eval']['n']}"]
        periodic = [p for p in rec["curve"] if p["step"] != summary["steps"]]
        for p in periodic:   # a periodic point is the eval carried by its step's row
            assert train[p["step"]][f"eval/avg@{st['hard_eval']['n']}"] == p["avg"]
        overall = json.loads((run / "overall" / "summary.json").read_text())
        assert overall["steps"] == summary["steps"]   # resumed at the spent budget: no step trained
        assert not any("perf/generated_tokens" in r for r in _rows(run / "overall" / "metrics.jsonl"))
        assert rec["overall"]["avg"] == overall["eval_after"][f"avg@{st['overall_eval']['n']}"]
        assert not (run / "checkpoints").exists() and not (run / "overall" / "checkpoints").exists()
        assert "$OUT/pool.jsonl" in " ".join(rec["overrides"])
    an = json.loads((out / "analysis.json").read_text())
    assert set(an["arms"]) == set(ARMS) and an["pairing"]["1"]["identical"], an["pairing"]
    assert {(c["a"], c["b"]) for c in an["comparisons"]} == set(v2.PAIRS)
    assert all((out / "plots" / p).is_file() for p in an["plots"])
    # everything is done: a second invocation launches nothing
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "(0 to do)" in again.stdout, again.stdout[-2000:]
    assert "start (" not in again.stdout
