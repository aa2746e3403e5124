"""The miniature reproduction study (`benchmarks/study.py --quick`) end to end: three real training
runs (GRPO, DAPO, DA3PO, one seed) under a generated-token budget, then the JSON and the plots.

Every number the study reports is checked against the run folders it came from: token counts
against the sum of `perf/generated_tokens` in metrics.jsonl, the stop step against the stop rule
recomputed from the rows, the final evaluation against summary.json, the hard-problem share
against the per-level results, the across-seed statistics against the runs.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # superseded by study v2; the slow tier


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_curve_helpers():
    # crossing of 0.5 between (10, 0.4) and (20, 0.6): 15; at the first point: its x; never: None
    assert study.first_crossing([0, 10, 20], [0.3, 0.4, 0.6], 0.5) == pytest.approx(15.0)
    assert study.first_crossing([0, 10], [0.5, 0.6], 0.5) == 0
    assert study.first_crossing([0, 10], [0.3, 0.4], 0.5) is None
    assert study._interp([0, 10], [0.2, 0.4], 2.5) == pytest.approx(0.25)
    s = study.stats([0.5, 0.7, None])
    assert (s["n"], s["mean"], s["std"]) == (2, pytest.approx(0.6), pytest.approx(0.1414213562))
    # hard share: (0.5 * 10 + 0.25 * 30) / 40
    point = {"levels": {"4": {"pass": 0.5, "avg": 0.2, "greedy": 0.1}, "5": {"pass": 0.25, "avg": 0.0, "greedy": 0.0},
                        "1": {"pass": 1.0, "avg": 1.0, "greedy": 1.0}}}
    assert study.hard_share(point, {"1": 5, "4": 10, "5": 30}, ["4", "5"])["pass"] == pytest.approx(12.5 / 40)


def test_pool_is_stratified(tmp_path):
    pool = study.make_pool(64, tmp_path / "pool.jsonl")
    lines = (tmp_path / "pool.jsonl").read_text().splitlines()
    assert pool["size"] == len(lines) == 64
    # train.jsonl levels 1-5 hold 40/200/200/250/250 of 940 rows: 2.72/13.6/13.6/17.0/17.0 of 64,
    # the largest remainders (.72, .62, .62) get the 2 rows left after 2+13+13+17+17 = 62
    assert pool["by_level"] == {"1": 3, "2": 14, "3": 13, "4": 17, "5": 17}
    source = (ROOT / "examples/tiny/data/train.jsonl").read_text().splitlines()
    positions = [source.index(line) for line in lines]
    assert positions == sorted(positions)  # file order kept, rows verbatim
    assert study.make_pool(0, tmp_path / "all.jsonl")["size"] == 940


def test_quick_study_end_to_end(tmp_path):
    out = tmp_path / "study"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/study.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=2300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "study.json").read_text())
    st = result["study"]
    assert st["mode"] == "quick" and st["budget_tokens"] == 6000 and st["seeds"] == [1, 2, 3]
    assert st["pool"]["size"] == 64 and len((out / "pool.jsonl").read_text().splitlines()) == 64
    assert set(result["runs"]) == {"grpo_s1", "dapo_s1", "da3po_s1"} and result["failed"] == []

    # the base model is evaluated once (the first run launched) and starts every curve
    base = result["base_eval"]
    assert base["from_run"] == "grpo_s1"
    base_row = next(r for r in _rows(out / "runs/grpo_s1") if r["step"] == 0)
    assert base["point"]["avg"] == base_row["eval/avg@2"]
    for name in ("dapo_s1", "da3po_s1"):
        assert not any(r["step"] == 0 for r in _rows(out / "runs" / name))

    for name, rec in result["runs"].items():
        run_dir = out / "runs" / name
        rows = _rows(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        train = [r for r in rows if "perf/generated_tokens" in r]
        # tokens: the sum over the steps' rows = the trainer's running total = summary.json
        assert rec["tokens_from_metrics"] == sum(r["perf/generated_tokens"] for r in train)
        assert rec["total_generated_tokens"] == summary["total_generated_tokens"] == \
            train[-1]["perf/total_generated_tokens"] == rec["tokens_from_metrics"] > 0
        # the trainer's stop (trainer.max_generated_tokens): s = the first step with T_s >= budget
        stop_step = next(r["step"] for r in train if r["perf/total_generated_tokens"] >= 6000)
        assert rec["stop"]["stopped_by_budget"] is True
        assert rec["steps"] == summary["steps"] == stop_step == train[-1]["step"]
        assert summary["config"]["trainer"]["max_generated_tokens"] == 6000
        assert [p["phase"] for p in rec["phases"]] == ["train"]
        assert [p["returncode"] for p in rec["phases"]] == [0]
        # the run trained on the pool with its seed and the study's eval settings
        cfg = summary["config"]
        assert cfg["trainer"]["seed"] == 1
        assert [Path(f).resolve() for f in cfg["data"]["train_files"]] == [(out / "pool.jsonl").resolve()]
        assert (cfg["eval"]["n"], cfg["eval"]["max_problems"]) == (2, 32)
        assert not (run_dir / "checkpoints").exists()  # removed once done (no --keep-checkpoints)
        # final evaluation = summary.json's eval_after, per level too
        ev = summary["eval_after"]
        fin = rec["final"]
        assert (fin["avg"], fin["pass"], fin["greedy"]) == (ev["avg@2"], ev["pass@2"], ev["greedy_acc"])
        assert fin["step"] == rec["steps"] and fin["tokens"] == rec["total_generated_tokens"]
        assert set(fin["levels"]) == {"1", "2", "3", "4", "5"}
        for lv, lrec in ev["by_level"].items():
            assert fin["levels"][lv]["avg"] == lrec["avg@2"] and fin["levels"][lv]["pass"] == lrec["pass@2"]
        hard = [ev["by_level"][lv] for lv in ("4", "5")]
        assert fin["hard"]["pass"] == pytest.approx(sum(h["pass@2"] * h["num_problems"] for h in hard)
                                                    / sum(h["num_problems"] for h in hard))
        # the curve: base at (0, 0), the periodic eval rows, the final eval at the last step
        curve = rec["curve"]
        assert (curve[0]["step"], curve[0]["tokens"], curve[0]["avg"]) == (0, 0, base["point"]["avg"])
        assert curve[-1]["step"] == rec["steps"] and curve[-1]["avg"] == fin["avg"]
        assert curve[-1]["tokens"] == rec["total_generated_tokens"]
        assert [p["step"] for p in curve] == sorted({0} | {r["step"] for r in rows if "eval/avg@2" in r})
        for p in curve[1:]:
            assert p["tokens"] == next(r["perf/total_generated_tokens"] for r in train if r["step"] == p["step"])
            assert set(p["levels"]) == {"1", "2", "3", "4", "5"}

    # one seed a label: the statistics are that run's numbers, no spread
    for label in ("grpo", "dapo", "da3po"):
        g = result["groups"][label]
        rec = result["runs"][f"{label}_s1"]
        assert g["runs"] == [f"{label}_s1"]
        assert g["final_avg"]["mean"] == rec["final"]["avg"] and g["final_avg"]["std"] is None
        assert g["tokens"]["mean"] == rec["total_generated_tokens"]
        assert g["gain_avg"]["mean"] == pytest.approx(rec["final"]["avg"] - base["point"]["avg"])
        c = g["curves"]["tokens"]
        assert c["x"][0] == 0 and c["x"][-1] == rec["total_generated_tokens"]
        assert c["avg"]["mean"][0] == base["point"]["avg"] and c["avg"]["mean"][-1] == rec["final"]["avg"]
    for name in ("accuracy.png", "accuracy_by_level.png", "final.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second invocation launches nothing: every run dir holds its summary.json
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/study.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train (trainer.total_training_steps" not in proc.stdout
    again = json.loads((out / "study.json").read_text())
    assert again["runs"]["dapo_s1"]["phases"] == result["runs"]["dapo_s1"]["phases"]
