"""`megatron-rl report`: PNG panels and a self-contained HTML page from metrics.jsonl files."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.eval.evaluate import eval_metric_row
from megatron_rl.report import level_metrics, load_run, make_report

ROOT = Path(__file__).resolve().parents[2]


def _write_run(d: Path, n_steps: int, offset: float, eval_n: int) -> None:
    d.mkdir(parents=True)
    rows = [{"step": 0, f"eval/avg@{eval_n}": 0.3, f"eval/pass@{eval_n}": 0.7, "eval/greedy_acc": 0.5,
             **{f"eval/level_{lv}/avg@{eval_n}": 0.8 - 0.15 * lv for lv in range(1, 6)}}]
    for s in range(1, n_steps + 1):
        rows.append({"step": s, "train/score": -0.5 + offset + s / n_steps, "train/acc": 0.3 + s / (3 * n_steps),
                     "train/entropy": 0.2 - s / (10 * n_steps), "train/pg_clipfrac": 0.01,
                     "reward/overlong_penalty_mean": 0.0, "train/nan_metric": None,
                     "response_length/mean": 20 + s, "timing/step_s": 2.0, "train/daa_amplified_frac": 0.1})
    rows.append({"step": n_steps, f"eval/avg@{eval_n}": 0.45, f"eval/pass@{eval_n}": 0.75, "eval/greedy_acc": 0.55,
                 **{f"eval/level_{lv}/avg@{eval_n}": 0.9 - 0.15 * lv for lv in range(1, 6)}})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "cut')
    (d / "summary.json").write_text(json.dumps({"steps": n_steps, "wall_s": 120.0,
                                                "eval_before": {f"avg@{eval_n}": 0.3}, "eval_after": {f"avg@{eval_n}": 0.45}}))


def test_load_run_reads_series_and_skips_cut_line(tmp_path):
    _write_run(tmp_path / "a", 10, 0.0, 8)
    run = load_run(tmp_path / "a")
    steps, vals = run.series["train/score"]
    assert steps == list(range(1, 11)) and vals[-1] == pytest.approx(0.5)
    assert run.series["eval/avg@8"] == ([0, 10], [0.3, 0.45])
    assert "train/nan_metric" not in run.series  # nulls are skipped
    assert run.summary["steps"] == 10


def test_report_overlays_runs_in_one_page(tmp_path):
    _write_run(tmp_path / "grpo", 30, 0.0, 8)
    _write_run(tmp_path / "dapo", 20, 0.2, 4)
    res = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "report", str(tmp_path / "grpo"),
                          str(tmp_path / "dapo"), "--out", str(tmp_path / "rep")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    out = tmp_path / "rep"
    pngs = sorted(p.name for p in out.glob("*.png"))
    # panels with data; GPU (no gpu/* keys) is left out
    assert pngs == ["clipping.png", "eval.png", "eval_levels.png", "length.png", "policy.png", "reward.png", "sampling.png", "timings.png"]
    page = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(pngs)
    assert base64.b64decode(images[0])[:8] == b"\x89PNG\r\n\x1a\n"  # really embedded PNGs
    assert "<td>grpo</td>" in page and "<td>dapo</td>" in page
    assert "src=\"http" not in page and "<script" not in page  # self-contained
    from PIL import Image

    w, h = Image.open(out / "eval.png").size
    assert w >= 800 and h >= 300


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        make_report([tmp_path])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: invalid JSON"):
        make_report([tmp_path / "bad"])


def test_eval_metric_row_flattens_levels_like_summary():
    # an `evaluate` result as summary.json holds it (by_level keyed by str(extra_info.level))
    res = {"num_problems": 3, "avg@4": 7 / 12, "pass@4": 1.0, "format_valid": 1.0, "greedy_acc": 2 / 3,
           "wall_s": 1.5,
           "by_level": {"1": {"num_problems": 2, "avg@4": 0.75, "pass@4": 1.0, "format_valid": 1.0, "greedy_acc": 1.0},
                        "Level 10": {"num_problems": 1, "avg@4": 0.25, "pass@4": 1.0, "format_valid": 1.0,
                                     "greedy_acc": 0.0}}}
    row = eval_metric_row(res)
    assert row == {
        "eval/avg@4": 7 / 12, "eval/pass@4": 1.0, "eval/format_valid": 1.0, "eval/greedy_acc": 2 / 3, "eval/wall_s": 1.5,
        "eval/level_1/avg@4": 0.75, "eval/level_1/pass@4": 1.0, "eval/level_1/format_valid": 1.0,
        "eval/level_1/greedy_acc": 1.0,
        "eval/level_10/avg@4": 0.25, "eval/level_10/pass@4": 1.0, "eval/level_10/format_valid": 1.0,
        "eval/level_10/greedy_acc": 0.0,
    }
    # the overall avg@k is the problem-weighted mean of the levels' (2 * 0.75 + 1 * 0.25) / 3
    assert row["eval/avg@4"] == pytest.approx((2 * 0.75 + 0.25) / 3)
    assert eval_metric_row({"avg@4": 0.5}) == {"eval/avg@4": 0.5}  # rows without levels: no level keys


def test_report_level_panel_reads_level_keys(tmp_path):
    _write_run(tmp_path / "a", 10, 0.0, 8)
    run = load_run(tmp_path / "a")
    assert run.series["eval/level_2/avg@8"] == ([0, 10], [pytest.approx(0.5), pytest.approx(0.6)])
    # numeric order (10 after 9), one plot per level, only avg@n keys count as levels
    run.series["eval/level_10/avg@8"] = ([0], [0.1])
    run.series["eval/level_9/pass@8"] = ([0], [0.1])
    assert level_metrics([run]) == [(f"eval/level_{lv}/avg@*", f"level {lv}") for lv in (1, 2, 3, 4, 5, 10)]
