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
    # summary.json's held-out metrics as before -> after (change); avg@8 and avg@4 get their own columns
    assert "<th>held-out avg@4 (before \u2192 after)</th><th>held-out avg@8 (before \u2192 after)</th>" in page
    assert "<td>0.300 \u2192 0.450 (+0.150)</td><td>-</td>" in page  # dapo (the second run) has no avg@8
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
    # the trainer's weight_version (an int in summary.json) is kept as a float metric
    assert eval_metric_row({"avg@4": 0.5, "weight_version": 7}) == {"eval/avg@4": 0.5, "eval/weight_version": 7.0}


def test_report_level_panel_reads_level_keys(tmp_path):
    _write_run(tmp_path / "a", 10, 0.0, 8)
    run = load_run(tmp_path / "a")
    assert run.series["eval/level_2/avg@8"] == ([0, 10], [pytest.approx(0.5), pytest.approx(0.6)])
    # numeric order (10 after 9), one plot per level, only avg@n keys count as levels
    run.series["eval/level_10/avg@8"] = ([0], [0.1])
    run.series["eval/level_9/pass@8"] = ([0], [0.1])
    assert level_metrics([run]) == [(f"eval/level_{lv}/avg@*", f"level {lv}", "avg@n") for lv in (1, 2, 3, 4, 5, 10)]


def _write_sampling_run(d: Path, ds: bool, daa: bool, gen_batch_size, logged_generated: bool) -> None:
    d.mkdir(parents=True)
    cfg = (f"data:\n  train_batch_size: 16\n  gen_batch_size: {gen_batch_size}\nalgorithm:\n"
           f"  filter_groups:\n    enable: {str(ds).lower()}\n    metric: acc\n  daa:\n    enable: {str(daa).lower()}\n")
    (d / "config.yaml").write_text(cfg)
    rows = [{"step": 1, "train/num_gen_batches": 2 if ds else 1, "train/kept_groups": 16, "train/solve_none": 6,
             "train/solve_all": 3, "train/daa_amplified_frac": 0.1 if daa else 0.0, "train/daa_factor_mean": 1.5},
            {"step": 2, "train/num_gen_batches": 1, "train/kept_groups": 16, "train/solve_none": 3,
             "train/solve_all": 1, "train/daa_amplified_frac": 0.2 if daa else 0.0, "train/daa_factor_mean": 1.25}]
    if logged_generated:
        rows[0]["train/generated_groups"], rows[1]["train/generated_groups"] = 40, 20
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_solve_shares_mixed_groups_and_features(tmp_path):
    # dynamic sampling with 24-group generation batches: 2 batches = 48 generated groups at step 1
    _write_sampling_run(tmp_path / "dapo", ds=True, daa=True, gen_batch_size=24, logged_generated=False)
    run = load_run(tmp_path / "dapo")
    assert run.features == {"DAA": True, "dynamic sampling": True}
    assert run.series["train/solve_none_frac"] == ([1, 2], [6 / 48, 3 / 24])
    assert run.series["train/solve_all_frac"] == ([1, 2], [3 / 48, 1 / 24])
    assert run.series["train/mixed_groups"] == ([1, 2], [16, 16])  # filtered on acc: every kept group is mixed
    # logged train/generated_groups wins over the config estimate
    _write_sampling_run(tmp_path / "logged", ds=True, daa=True, gen_batch_size=24, logged_generated=True)
    assert load_run(tmp_path / "logged").series["train/solve_none_frac"] == ([1, 2], [6 / 40, 3 / 20])
    # no dynamic sampling: gen_batch_size null -> train_batch_size 16; mixed = kept - all-wrong - all-correct
    _write_sampling_run(tmp_path / "grpo", ds=False, daa=False, gen_batch_size="null", logged_generated=False)
    grpo = load_run(tmp_path / "grpo")
    assert grpo.features == {"DAA": False, "dynamic sampling": False}
    assert grpo.series["train/solve_none_frac"] == ([1, 2], [6 / 16, 3 / 16])
    assert grpo.series["train/mixed_groups"] == ([1, 2], [16 - 6 - 3, 16 - 3 - 1])
    # without config.yaml: features unknown, no derived series
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metrics.jsonl").write_text((tmp_path / "grpo" / "metrics.jsonl").read_text())
    bare = load_run(tmp_path / "bare")
    assert bare.features == {} and "train/solve_none_frac" not in bare.series and "train/mixed_groups" not in bare.series


def test_daa_metrics_not_drawn_for_runs_with_daa_off(tmp_path):
    from megatron_rl.report import PANELS, plot_panel

    _write_sampling_run(tmp_path / "grpo", ds=False, daa=False, gen_batch_size="null", logged_generated=False)
    metrics = next(m for _, stem, m in PANELS if stem == "sampling")
    daa_only = [m for m in metrics if m[0].startswith("train/daa")]
    # only a DAA-off run: its constant DAA series (factor 1.5 here) are left out, so no panel
    assert not plot_panel([load_run(tmp_path / "grpo")], "Dynamic sampling and DAA", daa_only, tmp_path / "x.png")
    _write_sampling_run(tmp_path / "da3po", ds=True, daa=True, gen_batch_size=24, logged_generated=False)
    assert plot_panel([load_run(tmp_path / "grpo"), load_run(tmp_path / "da3po")], "Dynamic sampling and DAA",
                      metrics, tmp_path / "y.png")
    assert (tmp_path / "y.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_identical_runs_named_not_hidden():
    from megatron_rl.report import Run, _identical_runs

    a, b, c = Run("a", Path("a")), Run("b", Path("b")), Run("c", Path("c"))
    a.series["train/lr"] = b.series["train/lr"] = ([1, 2], [0.5, 1.0])
    c.series["train/lr"] = ([1, 2], [0.5, 0.9])
    assert _identical_runs([a, b, c], ["train/lr"]) == [["a", "b"]]
    assert _identical_runs([a, c], ["train/lr"]) == []


def _write_metrics(d: Path, content: bytes | str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_bytes(content.encode() if isinstance(content, str) else content)
    return d


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from megatron_rl.cli import main

    rc = main(["report", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ('{"step": 1, "a": 1}\n[1, 2]\n{"step": 2, "a": 2}\n', r"metrics.jsonl:2: expected a JSON object per line, got list"),
    ('{"step": 1, "a": 1}\n"text"\n', r"metrics.jsonl:2: expected a JSON object per line, got str"),
    (b'{"step": 1, "a": 1}\n{"step": 2, "a": "\xff\xfe"}\n{"step": 3, "a": 3}\n', r"metrics.jsonl:2: not UTF-8 text"),
    ('{"step": 1, "a": 1}\n{"step": true, "a": 2}\n', r"metrics.jsonl:2: expected an integer 'step', got True"),
    ('{"step": 1}\n' + "[" * 100000 + "\n" + '{"step": 2}\n', r"metrics.jsonl:2: invalid JSON"),
])
def test_bad_metrics_lines_name_file_and_line(tmp_path, capsys, content, message):
    d = _write_metrics(tmp_path / "bad", content)
    with pytest.raises(ValueError, match=message):
        load_run(d)
    rc, err = _cli([str(d), "--out", str(tmp_path / "rep")], capsys)  # the CLI: one line, exit 1
    assert rc == 1 and err.count("\n") == 1 and err.startswith("megatron-rl report: error: ")
    assert re.search(message, err) and str(d) in err


def test_values_beyond_float_range_skipped_like_nan(tmp_path):
    d = _write_metrics(tmp_path / "big", '{"step": 1, "a": 1, "b": 2}\n{"step": 2, "a": 1%s, "b": NaN}\n'
                       '{"step": 3, "a": 3, "b": "x"}\n' % ("0" * 400))
    run = load_run(d)
    assert run.series["a"] == ([1, 3], [1.0, 3.0]) and run.series["b"] == ([1], [2.0])


def test_cut_last_line_skipped_with_blank_lines_after_it(tmp_path):
    d = _write_metrics(tmp_path / "cut", '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a\n\n  \n')
    assert load_run(d).series["a"] == ([1, 2], [1.0, 2.0])
    # cut inside a multi-byte character (a writer with ensure_ascii=False): skipped too
    d = _write_metrics(tmp_path / "cut_utf8", b'{"step": 1, "a": 1}\n{"step": 2, "name": "\xc3')
    assert load_run(d).series["a"] == ([1], [1.0])
    # but a cut line that is not the last one is still an error
    d = _write_metrics(tmp_path / "mid", '{"step": 1, "a": 1}\n{"step": 2, "a\n\n{"step": 3, "a": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: invalid JSON"):
        load_run(d)


@pytest.mark.parametrize("summary, key", [
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"steps": 2, "wall_s": "12"}', "'wall_s' ignored (expected a number >= 0, got '12')"),
    ('{"steps": "2", "wall_s": 1%s}' % ("0" * 400), "'steps' ignored (expected an integer >= 0, got '2')"),
    ('{"steps": 2, "eval_before": [0.5], "eval_after": {"avg@4": 0.5}}', "'eval_before' ignored (expected an object"),
    (b'{"steps": 2, "x": "\xff"}', "ignored (not UTF-8)"),
    ('{"steps": 2,', "ignored (Expecting"),
])
def test_bad_summary_ignored_with_warning(tmp_path, caplog, summary, key):
    d = _write_metrics(tmp_path / "run", '{"step": 1, "train/score": 0.1}\n{"step": 2, "train/score": 0.2}\n')
    (d / "summary.json").write_bytes(summary.encode() if isinstance(summary, str) else summary)
    with caplog.at_level("WARNING", logger="megatron_rl.report"):
        run = load_run(d)
    assert any(key in r.getMessage() and str(d / "summary.json") in r.getMessage() for r in caplog.records), \
        caplog.text
    assert isinstance(run.summary, dict)
    page = make_report([d], tmp_path / "rep").read_text()  # the report is still written
    assert "<td>run</td>" in page


def test_summary_good_keys_kept_bad_ones_dropped(tmp_path):
    d = _write_metrics(tmp_path / "run", '{"step": 1, "train/score": 0.1}\n')
    (d / "summary.json").write_text('{"steps": 7, "wall_s": "12", "eval_after": {"avg@4": 0.5}, "eval_before": null}')
    assert load_run(d).summary == {"steps": 7, "eval_after": {"avg@4": 0.5}}


def test_out_is_a_file(tmp_path, capsys):
    d = _write_metrics(tmp_path / "run", '{"step": 1, "train/score": 0.1}\n')
    (tmp_path / "taken").write_text("x")
    with pytest.raises(NotADirectoryError, match="taken is a file, expected a folder"):
        make_report([d], tmp_path / "taken")
    rc, err = _cli([str(d), "--out", str(tmp_path / "taken")], capsys)
    assert rc == 2 and err == f"megatron-rl report: error: --out {tmp_path / 'taken'} is a file, expected a folder\n"
    # a folder that cannot be created (a file on its path): one line, exit 1
    rc, err = _cli([str(d), "--out", str(tmp_path / "taken" / "sub")], capsys)
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith(f"megatron-rl report: error: cannot create the report folder {tmp_path / 'taken' / 'sub'}")


def test_missing_run_dir_and_negative_smooth_on_cli(tmp_path, capsys):
    rc, err = _cli([str(tmp_path / "nope")], capsys)
    assert rc == 1 and err.count("\n") == 1 and "no metrics.jsonl" in err
    d = _write_metrics(tmp_path / "run", '{"step": 1, "train/score": 0.1}\n')
    rc, err = _cli([str(d), "--smooth", "-3"], capsys)
    assert rc == 2 and err == "megatron-rl report: error: --smooth -3: expected a window >= 0 (0: automatic)\n"


def test_run_dot_named_after_the_folder(tmp_path, monkeypatch):
    d = _write_metrics(tmp_path / "my_run", '{"step": 1, "train/score": 0.1}\n{"step": 2, "train/score": 0.2}\n')
    monkeypatch.chdir(d)
    assert load_run(".").name == "my_run"
    assert load_run("./").name == "my_run"
    monkeypatch.chdir(d / "..")
    assert load_run("my_run/../my_run").name == "my_run"
    monkeypatch.chdir(d)
    page = make_report(["."], tmp_path / "rep").read_text()
    assert "<title>megatron-rl report: my_run</title>" in page and "<td>my_run</td>" in page


def test_missing_runs_skipped_and_named(tmp_path, capsys):
    # the README's comparison with only the DA3PO run made: that one is drawn, the others named
    d = _write_metrics(tmp_path / "tiny-da3po", '{"step": 1, "train/score": 0.1}\n{"step": 2, "train/score": 0.3}\n')
    grpo, dapo = tmp_path / "tiny-grpo", tmp_path / "tiny-dapo"
    rc = __import__("megatron_rl.cli", fromlist=["main"]).main(
        ["report", str(grpo), str(dapo), str(d), "--out", str(tmp_path / "cmp")])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err.splitlines() == [f"megatron-rl report: skipped {grpo}: {grpo / 'metrics.jsonl'}: no metrics.jsonl "
                                f"(is {grpo} a run dir?)",
                                f"megatron-rl report: skipped {dapo}: {dapo / 'metrics.jsonl'}: no metrics.jsonl "
                                f"(is {dapo} a run dir?)"]
    assert out.strip() == f"report: {tmp_path / 'cmp' / 'report.html'} (drew 1 run: {d})"
    page = (tmp_path / "cmp" / "report.html").read_text()
    assert "Skipped (not drawn)" in page and str(grpo) in page
    skipped = []
    assert make_report([grpo, d], skipped=skipped) == d / "report" / "report.html"  # default out: the drawn run
    assert [s for s, _ in skipped] == [str(grpo)]


def test_no_run_drawn_is_an_error(tmp_path, capsys):
    rc, err = _cli([str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert rc == 1 and err.count("\n") == 1
    assert err.startswith("megatron-rl report: error: ") and str(tmp_path / "a") in err and str(tmp_path / "b") in err
    assert "nothing to draw" in err
