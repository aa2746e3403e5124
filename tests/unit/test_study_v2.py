"""Study v2 (`benchmarks/study_v2.py`) without training: the statistics (Student's t, paired
differences with their 95% intervals, the residual spread of the arm x seed table, the seed count,
the area under the curve at fixed token points) on hand-computed numbers, the analysis of synthetic
result files, the evaluation points read from a run folder, and the `--dry-run` plan."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_v2 as v2  # noqa: E402


def test_student_t_quantiles_and_cdf():
    # table values: t_{0.975, df} and t_{0.8, df}
    for p, df, want in ((0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 5, 2.5706), (0.975, 30, 2.0423),
                        (0.8, 1, 1.3764), (0.8, 4, 0.9410), (0.8, 5, 0.9195), (0.995, 3, 5.8409)):
        assert v2.t_ppf(p, df) == pytest.approx(want, abs=1e-4), (p, df)
    assert v2.t_ppf(0.025, 5) == pytest.approx(-2.5706, abs=1e-4)
    # df = 2 closed form: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2)); df = 1: 1/2 + atan(t) / pi
    assert v2.t_cdf(1.5, 2) == pytest.approx(0.5 + 1.5 / (2 * math.sqrt(2 + 1.5 ** 2)))
    assert v2.t_cdf(-0.7, 1) == pytest.approx(0.5 + math.atan(-0.7) / math.pi)
    assert v2.t_cdf(0.0, 7) == 0.5


def test_auc_is_the_trapezoid_mean():
    # (0.15 * 100 + 0.30 * 100) / 200
    assert v2.auc([0, 100, 200], [0.1, 0.2, 0.4]) == pytest.approx(0.225)
    assert v2.auc([0, 160_000, 800_000], [0.1, 0.1, 0.1]) == pytest.approx(0.1)


def test_paired_difference_and_interval():
    a, b = {1: 0.20, 2: 0.25, 3: 0.18, 9: 0.5}, {1: 0.15, 2: 0.22, 3: 0.16}
    r = v2.paired(a, b)
    # d = 0.05, 0.03, 0.02 (seed 9 has no pair): mean 1/30, sd sqrt(7/30000), se sd/sqrt(3)
    assert r["seeds"] == [1, 2, 3] and r["n"] == 3
    assert r["mean"] == pytest.approx(1 / 30)
    assert r["sd"] == pytest.approx(0.0152753, abs=1e-7)
    assert r["se"] == pytest.approx(0.0088192, abs=1e-7)
    half = 4.302653 * 0.0088192
    assert r["ci95"] == pytest.approx([1 / 30 - half, 1 / 30 + half], abs=1e-5)
    assert r["t"] == pytest.approx(3.779645, abs=1e-5)
    # df 2: p = 1 - t / sqrt(2 + t^2)
    assert r["p"] == pytest.approx(1 - 3.779645 / math.sqrt(2 + 3.779645 ** 2), abs=1e-6)
    assert r["verdict"].startswith("95% interval includes 0")
    assert v2.paired({1: 0.3, 2: 0.31, 3: 0.32}, {1: 0.1, 2: 0.1, 3: 0.11})["verdict"] == "95% interval excludes 0"
    assert v2.paired({1: 0.3}, {1: 0.1})["ci95"] is None


def test_residual_sd_of_the_arm_by_seed_table():
    # two arms: sqrt(2) sigma equals the SD of the paired differences
    two = v2.residual_sd({"x": {1: 0.20, 2: 0.25, 3: 0.18}, "y": {1: 0.15, 2: 0.22, 3: 0.16}}, ["x", "y"])
    assert two["df"] == 2 and two["sd_diff"] == pytest.approx(0.0152753, abs=1e-7)
    # four arms, two seeds: seed-2 minus seed-1 per arm 0.04, 0, 0.02, 0.04 (mean 0.025); residual sum
    # of squares (0.015^2 + 0.025^2 + 0.005^2 + 0.015^2) / 2 = 5.5e-4 over df 3
    four = v2.residual_sd({"a": {1: 0.10, 2: 0.14}, "b": {1: 0.12, 2: 0.12}, "c": {1: 0.20, 2: 0.22},
                           "d": {1: 0.05, 2: 0.09, 3: 0.5}}, ["a", "b", "c", "d", "absent"])
    assert four["seeds"] == [1, 2] and four["df"] == 3 and four["arms"] == ["a", "b", "c", "d"]
    assert four["sigma"] == pytest.approx(math.sqrt(5.5e-4 / 3))
    assert four["sd_diff"] == pytest.approx(math.sqrt(2 * 5.5e-4 / 3))
    assert v2.residual_sd({"a": {1: 0.1}, "b": {1: 0.2}}, ["a", "b"])["sd_diff"] is None


def test_seed_count_and_detectable_difference():
    # sd_d 0.02, delta 0.03: normal ((1.960 + 0.842) * 2/3)^2 = 3.49 -> 4; paired t: n = 5 needs
    # ((2.776 + 0.941) * 2/3)^2 = 6.14 > 5, n = 6 needs ((2.571 + 0.920) * 2/3)^2 = 5.41 <= 6
    assert v2.seeds_needed(0.02) == {"t": 6, "normal": 4}
    assert v2.mde(0.02, 6) == pytest.approx((2.570582 + 0.919540) * 0.02 / math.sqrt(6), abs=1e-6)
    assert v2.mde(0.02, 1) is None
    assert v2.seeds_needed(0.001) == {"t": 2, "normal": 2}
    # twice the spread needs about four times the seeds
    assert v2.seeds_needed(0.04)["t"] in range(16, 20)


SLOPES = {"grpo": (0.010, 0.012), "dapo": (0.012, 0.016), "da3po": (0.016, 0.018),
          "da3po_balanced_history": (0.014, 0.014)}
"""Synthetic runs: levels 4-5 avg@16 = 0.08 + slope * k at token point k = 1..5 (seeds 1, 2)."""


def _point(avg: float) -> dict:
    return {"avg": avg, "pass": min(1.0, 3 * avg), "greedy": avg / 2, "format_valid": 1.0,
            "levels": {"4": {"avg": avg + 0.02}, "5": {"avg": avg - 0.02}}}


def _write_results(d: Path, st: dict, *, checksum_of=lambda arm, seed: seed) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "base.json").write_text(json.dumps({"kind": "base", "settings": st, "hard": _point(0.08),
                                             "overall": _point(0.30)}))
    for arm, slopes in SLOPES.items():
        for seed, slope in zip((1, 2), slopes):
            curve = [{"k": k, "nominal_tokens": k * st["token_interval"], "step": 10 * k,
                      "tokens": k * st["token_interval"] + 1000, **_point(0.08 + slope * k)}
                     for k in range(1, st["eval_points"] + 1)]
            rec = {"kind": "run", "status": "done", "name": f"{arm}_s{seed}", "arm": arm, "seed": seed, "settings": st,
                   "steps": 50, "total_generated_tokens": st["budget_tokens"] + 1000, "curve": curve,
                   "overall": _point(0.35 + slope), "wall_s": {"total": 700.0}, "s_per_token": 7e-4,
                   "train": {"step1_token_checksum": checksum_of(arm, seed)}}
            (d / f"{arm}_s{seed}.json").write_text(json.dumps(rec))


def test_analysis_of_synthetic_result_files(tmp_path):
    st = v2.settings_for(False)
    _write_results(tmp_path, st)
    other = json.loads((tmp_path / "dapo_s1.json").read_text()) | {"name": "dapo_s3", "seed": 3,
                                                                   "settings": v2.settings_for(True)}
    (tmp_path / "dapo_s3.json").write_text(json.dumps(other))  # another design: left out
    an = v2.analyze(tmp_path)
    assert an["excluded"] == ["dapo_s3"]
    run = an["runs"]["da3po_s1"]
    # linear curve: final 0.08 + 5 * 0.016, AUC (trapezoid mean over 0..800k) 0.08 + 2.5 * 0.016
    assert run["final_hard_avg"] == pytest.approx(0.16) and run["auc_hard_avg"] == pytest.approx(0.12)
    assert run["curve"]["x"] == [0, 160_000, 320_000, 480_000, 640_000, 800_000]
    assert run["overshoot_tokens"] == pytest.approx(1000)
    assert an["arms"]["dapo"]["final_hard_avg"]["mean"] == pytest.approx(0.15)
    comp = {(c["a"], c["b"], c["metric"]): c for c in an["comparisons"]}
    c = comp["da3po", "dapo", "final_hard_avg"]
    # d = 0.16 - 0.14, 0.17 - 0.16: mean 0.015, sd 0.01/sqrt(2), se 0.005, t_{0.975,1} 12.7062
    assert c["primary"] and c["n"] == 2
    assert c["mean"] == pytest.approx(0.015) and c["se"] == pytest.approx(0.005)
    assert c["ci95"] == pytest.approx([0.015 - 12.7062 * 0.005, 0.015 + 12.7062 * 0.005], abs=1e-5)
    c = comp["da3po", "dapo", "auc_hard_avg"]  # d = 0.01, 0.005
    assert c["mean"] == pytest.approx(0.0075) and c["se"] == pytest.approx(0.0025)
    assert not comp["dapo", "grpo", "final_hard_avg"]["primary"]
    assert comp["da3po", "grpo", "final_overall_avg"]["mean"] == pytest.approx(0.006)
    # seed count: per-arm seed-2 minus seed-1 of the final value 0.01, 0.02, 0.01, 0 (mean 0.01): residual
    # sum of squares 2e-4 / 2 over df 3; sd_d = sqrt(2) sigma = 0.008165 -> paired t needs 3 seeds
    sc = an["seed_count"]
    assert sc["final_hard_avg"]["sigma"] == pytest.approx(math.sqrt(1e-4 / 3))
    assert sc["final_hard_avg"]["n_needed"] == 3 and sc["final_hard_avg"]["n_needed_normal"] == 2
    assert sc["auc_hard_avg"]["sd_diff"] == pytest.approx(sc["final_hard_avg"]["sd_diff"] / 2)
    assert sc["auc_hard_avg"]["n_needed"] == 3
    assert sc["final_hard_avg"]["mde_now"] == pytest.approx((12.7062 + 1.3764) * math.sqrt(2e-4 / 3) / math.sqrt(2),
                                                            rel=1e-4)
    # 4 arms x 700 s a seed; (6 h - the base model's evaluations) // 2800 s
    assert sc["per_seed_wall_s"] == pytest.approx(2800)
    assert sc["seeds_affordable"] == int((6 * 3600 - v2.estimate_base_s(st)) // 2800) == 7
    assert sc["recommended_seeds"] == 3 and sc["enough_within_budget"]
    assert sc["next_command"].endswith("--seeds 1 2 3")
    assert an["pairing"]["1"]["identical"] and an["pairing"]["2"]["identical"]


def test_analysis_flags_unpaired_rollouts_and_missing_base(tmp_path):
    st = v2.settings_for(False)
    _write_results(tmp_path / "a", st, checksum_of=lambda arm, seed: f"{arm}{seed}" if arm == "da3po" else seed)
    an = v2.analyze(tmp_path / "a")
    assert not an["pairing"]["1"]["identical"]
    (tmp_path / "a" / "base.json").unlink()
    assert "error" in v2.analyze(tmp_path / "a")


def test_analyze_only_writes_json_and_plots(tmp_path, capsys):
    st = v2.settings_for(False)
    _write_results(tmp_path / "res", st)
    out = tmp_path / "analysis.json"
    code = v2.main(["--analyze-only", "--results-dir", str(tmp_path / "res"), "--analysis-out", str(out),
                    "--plots-dir", str(tmp_path / "plots")])
    assert code == 0
    an = json.loads(out.read_text())
    assert an["plots"] == ["curves.png", "paired.png", "secondary.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 1000 for p in an["plots"])
    text = capsys.readouterr().out
    assert "* da3po - dapo final_hard_avg: +0.0150" in text


def _row(step, total, gen, **extra):
    return {"step": step, "perf/total_generated_tokens": total, "perf/generated_tokens": gen, "train/acc": 0.1,
            "response_length/mean": 30.0, "train/num_gen_batches": 1, "timing/step_s": 2.0,
            "rollout/token_checksum": f"c{step}", **extra}


def test_record_takes_the_evaluation_after_the_first_step_reaching_each_token_point(tmp_path):
    st = v2.settings_for(True, 2000)   # 2 points: 1000 and 2000 tokens
    assert st["token_interval"] == 1000
    run = tmp_path / "runs" / "dapo_s1"
    (run / "overall").mkdir(parents=True)
    ev = {"eval/avg@2": 0.2, "eval/pass@2": 0.3, "eval/greedy_acc": 0.1, "eval/level_4/avg@2": 0.25, "eval/wall_s": 5.0}
    rows = [_row(1, 700, 700), _row(2, 1300, 600, **ev), _row(3, 1900, 600), _row(4, 2500, 600),
            {"step": 4, "eval/avg@2": 0.3, "eval/pass@2": 0.4, "eval/greedy_acc": 0.2, "eval/wall_s": 5.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = {"avg@2": 0.3, "pass@2": 0.4, "greedy_acc": 0.2, "by_level": {"4": {"avg@2": 0.35, "num_problems": 8}}}
    (run / "summary.json").write_text(json.dumps({"steps": 4, "total_generated_tokens": 2500, "eval_after": final}))
    (run / "overall" / "summary.json").write_text(json.dumps({"steps": 4, "eval_after": {
        "avg@2": 0.5, "pass@2": 0.7, "greedy_acc": 0.6}}))
    spec = v2.RunSpec("dapo_s1", "dapo", "dapo", 1, ["data.gen_batch_size=12"])
    rec = v2.build_record(spec, run, {"phases": [{"wall_s": 100.0}, {"wall_s": 20.0}]}, st,
                          [f"run_dir={run}", "data.gen_batch_size=12"])
    assert [(p["k"], p["step"], p["tokens"], p["avg"]) for p in rec["curve"]] == [(1, 2, 1300, 0.2), (2, 4, 2500, 0.3)]
    assert rec["curve"][0]["levels"]["4"]["avg"] == 0.25 and rec["curve"][1]["levels"]["4"]["avg"] == 0.35
    assert rec["overall"]["avg"] == 0.5 and rec["overall"]["greedy"] == 0.6
    assert rec["overrides"] == ["run_dir=$OUT/runs/dapo_s1", "data.gen_batch_size=12"]
    assert rec["train"]["prompts_drawn"] == 4 * 12 and rec["train"]["step1_token_checksum"] == "c1"
    assert rec["wall_s"]["total"] == 120.0 and rec["s_per_token"] == pytest.approx(8.0 / 2500)
    # a step that crosses both points at once (the last): both are the final evaluation
    (run / "metrics.jsonl").write_text(json.dumps(_row(1, 700, 700)) + "\n" + json.dumps(_row(2, 2100, 1400)) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 2, "total_generated_tokens": 2100, "eval_after": final}))
    rec = v2.build_record(spec, run, {}, st, [])
    assert [(p["step"], p["avg"]) for p in rec["curve"]] == [(2, 0.3), (2, 0.3)]
    # a crossing step without its evaluation is an error, not a silent gap
    (run / "metrics.jsonl").write_text("".join(json.dumps(_row(s, 600 * s, 600)) + "\n" for s in (1, 2, 3, 4)))
    (run / "summary.json").write_text(json.dumps({"steps": 4, "total_generated_tokens": 2400, "eval_after": final}))
    with pytest.raises(ValueError, match="step 2 reached 1000 tokens but has no evaluation"):
        v2.build_record(spec, run, {}, st, [])


def test_dry_run_plan(tmp_path, capsys):
    out = tmp_path / "study"
    assert v2.main(["--dry-run", "--pilot", "--out", str(out)]) == 0
    assert not out.exists()   # a dry run writes nothing
    text = capsys.readouterr().out
    runs = [line.split(":")[0] for line in text.splitlines() if ": examples/tiny/" in line]
    arms = ["grpo", "dapo", "da3po", "da3po_balanced_history"]
    assert runs == [f"{a}_s{s}" for s in (1, 2) for a in arms]   # seed by seed: complete pairs first
    lines = {line.split(":")[0]: line for line in text.splitlines() if line.split(":")[0] in runs}
    for name, line in lines.items():
        for key in ("rollout.n=16", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
                    "trainer.max_generated_tokens=800000", "eval.n=16", "eval.before_train=false",
                    "eval.token_interval=160000", "eval.interval=0",
                    f"trainer.seed={name[-1]}"):
            assert key in line.split(), (name, key)
    for key in ("algorithm.daa.factor=constant", "algorithm.daa.amplification=2.0", "algorithm.daa.hard_threshold=0.5",
                "algorithm.daa.difficulty=group"):
        assert key in lines["da3po_s1"].split()
    assert "algorithm.daa.factor=balanced" in lines["da3po_balanced_history_s2"]
    assert "algorithm.daa.difficulty=history" in lines["da3po_balanced_history_s2"]
    assert "data.gen_batch_size" not in lines["grpo_s1"] and "data.gen_batch_size=12" in lines["dapo_s2"]
    assert "daa=constant/group" in text and "daa=balanced/history" in text
    assert "'3': 32, '4': 64, '5': 64" in text and "idle estimate" in text
    # seeds added later, and a subset
    assert [r.name for r in v2.build_plan([3, 4], ["dapo", "da3po_s4"])] == ["dapo_s3", "dapo_s4", "da3po_s4"]
    with pytest.raises(SystemExit, match="no such run or arm"):
        v2.build_plan([1], ["ppo"])


def test_design_expectations():
    st = v2.settings_for(False)
    exp = v2.expectations(st)
    # base model avg@8 on levels 3/4/5 (eval_base.json): 0.3203, 0.0977, 0.0566 weighted 32/64/64
    assert exp["pool_base_success"] == pytest.approx((32 * 0.3203 + 64 * 0.0977 + 64 * 0.0566) / 160)
    assert 9 <= exp["visits_per_prompt"] <= 11 and 190 <= exp["grpo_steps"] <= 220
    assert exp["ds_steps"][0] >= 80
    # pilot (2 seeds x 4 arms + the base model) within 1.5-2 h on an idle machine
    pilot = 2 * sum(v2.estimate_run_s(a, st) for a in v2.ARM_NAMES) + v2.estimate_base_s(st)
    assert 1.5 * 3600 <= pilot <= 2 * 3600
    with pytest.raises(SystemExit, match="multiple of 5"):
        v2.settings_for(False, 800_001)


FAKE_TRAINER = """#!/bin/bash
# stands for `python -m megatron_rl.cli train ...`: records its start, and a SIGTERM as the trainer
# takes it (checkpoint, exit 75)
echo "$$" > "{mark}.started"
trap 'echo term > "{mark}.term"; kill $!; exit 75' TERM
sleep 60 & wait
"""


def _study_with_fake_trainer(tmp_path):
    import subprocess
    import time

    mark = tmp_path / "trainer"
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAINER.format(mark=mark))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/study_v2.py"), "--quick", "--out", str(out),
                             "--python", str(fake), "--poll-s", "0.5"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "trainer.started").is_file():
        if proc.poll() is not None:
            pytest.fail(f"the study ended before its trainer started: {proc.stdout.read()}")
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)  # the trap is set
    return proc, mark, out


def test_sigterm_stops_the_trainer_in_flight_and_releases_the_lock(tmp_path):
    import signal

    proc, _, out = _study_with_fake_trainer(tmp_path)
    assert (out / "study_v2.lock").read_text() == str(proc.pid)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, text   # interrupted: rerun to resume
    assert (tmp_path / "trainer.term").is_file()   # the trainer was asked to checkpoint and stop
    assert "interrupted: rerun the same command to resume" in (out / "study_v2.log").read_text()
    assert not (out / "study_v2.lock").exists()


def test_a_killed_study_takes_its_trainer_down(tmp_path):
    import time

    proc, _, out = _study_with_fake_trainer(tmp_path)
    proc.kill()   # SIGKILL: no handler runs; the child's parent-death signal is SIGTERM
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while not (tmp_path / "trainer.term").is_file():
        assert time.monotonic() < deadline, "the trainer outlived the study"
        time.sleep(0.1)
    # a rerun is not locked out by the dead study's lock file
    v2._lock(out / "study_v2.lock")
    assert (out / "study_v2.lock").read_text() == str(__import__("os").getpid())
