"""Progress a person can follow: step k/N with elapsed and ETA, eval progress lines, the before -> after table."""

import logging

import pytest

from megatron_rl.eval.evaluate import EvalProgress, format_before_after, progress_due
from megatron_rl.trainer.step_metrics import format_duration, step_progress


@pytest.mark.parametrize("s, want", [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (185, "3m05s"),
                                     (3725, "1h02m"), (-1, "?"), (float("nan"), "?")])
def test_format_duration(s, want):
    assert format_duration(s) == want


def test_step_progress_eta():
    # 5 steps in 50 s: 10 s a step, 75 left
    assert step_progress(5, 80, 1, 50.0, 62.0) == "step 5/80 elapsed 1m02s ETA 12m30s"
    assert step_progress(80, 80, 1, 800.0, 810.0) == "step 80/80 elapsed 13m30s ETA 0s"
    # resumed at step 41: the ETA uses this process's steps only, elapsed the whole run's
    assert step_progress(42, 80, 41, 20.0, 1000.0) == "step 42/80 elapsed 16m40s ETA 6m20s"


def test_progress_due():
    assert progress_due(30, 296, 0, 1.0)                       # 10% of the problems
    assert not progress_due(28, 296, 0, 1.0)
    assert progress_due(3, 296, 2, 15.0)                       # 15 s since the last line
    assert not progress_due(2, 296, 2, 100.0)                  # nothing new
    assert progress_due(296, 296, 290, 0.1)                    # the end
    assert progress_due(1, 5, 0, 1.0)
    assert not progress_due(1, 5, 0, 0.5)                      # not twice within a second


def test_eval_progress_counts_problems(caplog):
    p = EvalProgress("eval_before sampled", total=4, n=2, frac=0.5, every_s=1e9, min_s=0.0)
    with caplog.at_level(logging.INFO, logger="megatron_rl.eval.evaluate"):
        for i in (0, 1, 0, 2, 1, 3, 2, 3):
            p.response_done(i)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines] == ["eval eval_before sampled: 2/4 problems (50%)",
                                                       "eval eval_before sampled: 4/4 problems (100%)"]


def test_before_after_table():
    before = {"avg@8": 0.307, "pass@8": 0.72, "format_valid": 1.0, "greedy_acc": 0.568, "num_problems": 296,
              "wall_s": 20.0, "by_level": {"1": {"avg@8": 0.5, "pass@8": 0.9, "greedy_acc": 0.8, "format_valid": 1.0}}}
    after = {"avg@8": 0.469, "pass@8": 0.753, "format_valid": 1.0, "greedy_acc": 0.571, "num_problems": 296,
             "wall_s": 18.0, "by_level": {"1": {"avg@8": 0.7, "pass@8": 0.95, "greedy_acc": 0.75, "format_valid": 1.0}}}
    table = format_before_after(before, after).splitlines()
    assert table[0].split() == ["held-out", "eval", "before", "after", "change"]
    assert table[1].split() == ["avg@8", "0.307", "0.469", "+0.162"]
    assert "wall_s" not in "\n".join(table) and "num_problems" not in "\n".join(table)
    assert table[-1].split() == ["level", "1", "greedy_acc", "0.800", "0.750", "-0.050"]
    assert len(table) == 1 + 4 + 3
