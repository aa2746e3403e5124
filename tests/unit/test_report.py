"""`megatron-rl report`: PNG panels and a self-contained HTML page from metrics.jsonl files."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.report import load_run, make_report

ROOT = Path(__file__).resolve().parents[2]


def _write_run(d: Path, n_steps: int, offset: float, eval_n: int) -> None:
    d.mkdir(parents=True)
    rows = [{"step": 0, f"eval/avg@{eval_n}": 0.3, f"eval/pass@{eval_n}": 0.7, "eval/greedy_acc": 0.5}]
    for s in range(1, n_steps + 1):
        rows.append({"step": s, "train/score": -0.5 + offset + s / n_steps, "train/acc": 0.3 + s / (3 * n_steps),
                     "train/entropy": 0.2 - s / (10 * n_steps), "train/pg_clipfrac": 0.01,
                     "reward/overlong_penalty_mean": 0.0, "train/nan_metric": None,
                     "response_length/mean": 20 + s, "timing/step_s": 2.0, "train/daa_amplified_frac": 0.1})
    rows.append({"step": n_steps, f"eval/avg@{eval_n}": 0.45, f"eval/pass@{eval_n}": 0.75, "eval/greedy_acc": 0.55})
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
    assert pngs == ["clipping.png", "eval.png", "length.png", "policy.png", "reward.png", "sampling.png", "timings.png"]
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
