"""benchmarks/async_overlap.py's numbers from hand-made metrics.jsonl rows: the ideal overlap bound
`step_sync / max(rollout, train)` of the eta = 0 run, steps/min, tokens/s, share of the bound, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ao():
    return load_benchmark("async_overlap")


def _row(step, step_s, gen=5.0, reward=1.0, filt=0.5, lp=1.0, upd=2.0, sync=0.5, tokens=1000, wait=0.0,
         stale_mean=0.0, stale_max=0, resub=0):
    return {"step": step, "timing/step_s": step_s, "timing/generate_s": gen, "timing/reward_s": reward,
            "timing/filter_s": filt, "timing/advantage_s": 0.2, "timing/old_logprob_s": lp, "timing/update_s": upd,
            "timing/weight_sync_s": sync, "perf/generated_tokens": tokens, "timing/wait_rollout_s": wait,
            "train/staleness_mean": stale_mean, "train/staleness_max": stale_max, "rollout/resubmitted": resub}


def test_bound_from_the_synchronous_timings(ao):
    """rollout = 5 + 1 + 0.5 = 6.5 s, train = 1 + 2 + 0.5 = 3.5 s, step 10 s: bound 10 / 6.5."""
    b = ao.overlap_bound([_row(1, 10.0), _row(2, 10.0)])
    assert (b["rollout_s"], b["train_s"], b["step_sync_s"]) == (6.5, 3.5, 10.0)
    assert b["bound"] == pytest.approx(10 / 6.5)  # 1.538
    train_bound = ao.overlap_bound([_row(1, 12.0, gen=2.0, upd=6.0)])  # rollout 3.5, train 7.5
    assert train_bound["bound"] == pytest.approx(12 / 7.5)
    with pytest.raises(ValueError):
        ao.overlap_bound([])


def test_compare_scores_each_arm_against_the_bound(ao):
    """With skip_first=1, step 1 of every arm is left out; eta 0: 2 steps of 10 s = 6 steps/min, 100 tokens/s;
    eta 1: 2 steps of 7 s = 8.57 steps/min, speed-up 10 / 7 = 1.429 = 92.9 % of the 1.538 bound."""
    arms = {0: [_row(1, 30.0), _row(2, 10.0), _row(3, 10.0)],
            1: [_row(1, 40.0), _row(2, 7.0, wait=3.0, stale_mean=0.5, stale_max=1),
                _row(3, 7.0, wait=3.0, stale_mean=0.7, stale_max=1, resub=5)]}
    r = ao.compare(arms, skip_first=1)
    a0, a1 = r["arms"][0], r["arms"][1]
    assert r["skipped_first_steps"] == 1 and a0["steps"] == a1["steps"] == 2
    assert a0["rl_steps_per_min"] == pytest.approx(6.0) and a0["generated_tokens_per_s"] == pytest.approx(100.0)
    assert a1["rl_steps_per_min"] == pytest.approx(120 / 14)
    assert a1["generated_tokens_per_s"] == pytest.approx(2000 / 14)
    assert a1["speedup"] == pytest.approx(10 / 7)
    assert a1["share_of_bound"] == pytest.approx((10 / 7) / (10 / 6.5))  # 0.929
    assert (a1["wait_rollout_s"], a1["staleness_mean"], a1["staleness_max"]) == (3.0, pytest.approx(0.6), 1.0)
    assert a0["speedup"] == 1.0 and a1["resubmitted"] == 5
    whole = ao.compare(arms)["arms"]  # default: every step, the 40 s fill included: 54 s against 50 s
    assert whole[1]["speedup"] == pytest.approx(50 / 54) and whole[1]["steps"] == 3
    # a 2-step smoke keeps its second step; a 1-step arm keeps its only one
    assert ao.compare({0: [_row(1, 10.0)]}, skip_first=1)["arms"][0]["steps"] == 1

    r.update(idle=False, load_verdict="load average reached 9.0 (eta0) > 2.5 (1.25 x 2 CPUs)", eval_n=8,
             eval={"0": {"avg@8": 0.41}, "1": {"avg@8": 0.4}})
    r["arms"][0]["foreign_cpus_mean"] = 1.25
    table = ao.format_table(json.loads(json.dumps(r)))  # as written to the JSON: string keys
    assert "bound" in table and "= 1.54x" in table and "LOADED MACHINE" in table
    lines = table.splitlines()
    assert lines[3].startswith("| 0 | 2 | 10.00 | 6.00 | 100 | 0.00 | 1.00x | 65% |")
    assert "| 0 | 0.410 | 1.25 |" in lines[3]
    assert lines[4].startswith("| 1 | 2 | 7.00 | 8.57 | 143 | 3.00 | 1.43x | 93% | 0.60/1 | 5 | 0.400 | - |")


def test_step_rows_keep_the_last_row_of_a_step(ao, tmp_path):
    rows = [{"step": 0, "eval/x": 1}, _row(1, 5.0), _row(2, 6.0), _row(1, 4.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = ao.step_rows(tmp_path)
    assert [(r["step"], r["timing/step_s"]) for r in got] == [(1, 4.0), (2, 6.0)]


def test_arm_labels(ao):
    assert [ao.arm_eta(x) for x in ("0", "1", "1p", "1i", "12")] == [0, 1, 1, 1, 12]
    assert ao.arm_overrides("1p") == ["rollout.partial_rollout=true"]
    assert ao.arm_overrides("2i") == ["rollout.pause_mode=in_place"] and ao.arm_overrides("2") == []
    for bad in ("x", "1q", "p", ""):
        with pytest.raises(ValueError, match="expected an integer eta"):
            ao.arm_eta(bad)
    with pytest.raises(ValueError, match="needs the eta = 0 arm"):
        ao.compare({"1": [_row(1, 10.0)]})
