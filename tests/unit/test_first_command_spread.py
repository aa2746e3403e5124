"""benchmarks/first_command_spread.py: the numbers taken from summary.json and the spread table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fcs():
    return load_benchmark("first_command_spread")


def _ev(avg, greedy, l1):
    return {"avg@8": avg, "pass@8": 0.7, "greedy_acc": greedy, "format_valid": 1.0, "num_problems": 296,
            "by_level": {"1": {"avg@8": l1, "greedy_acc": 0.9, "num_problems": 40}}}


def test_flat_takes_the_overall_and_per_level_numbers(fcs):
    assert fcs._flat(_ev(0.3, 0.5, 0.6)) == {"avg@8": 0.3, "pass@8": 0.7, "greedy_acc": 0.5, "format_valid": 1.0,
                                             "level 1 avg@8": 0.6, "level 1 greedy_acc": 0.9}
    with pytest.raises(KeyError, match="greedy_acc"):
        fcs._flat({"avg@8": 0.3, "pass@8": 0.7, "format_valid": 1.0})


def test_table_gives_mean_sd_range_and_the_mean_change(fcs):
    runs = [{"run": i, "wall_s": 60.0 * (6 + i), "loadavg_before": (1.0, 1.0, 1.0),
             "before": fcs._flat(_ev(0.30, 0.56, 0.6)), "after": fcs._flat(_ev(a, g, 0.7))}
            for i, (a, g) in enumerate([(0.44, 0.50), (0.46, 0.56), (0.48, 0.53)], start=1)]
    text = fcs.table(runs)
    # after avg@8: mean 0.46, SD 0.02 (sample), range [0.44, 0.48]; change +0.16 with SD 0.02
    assert "| avg@8 | 0.300 (0.000) [0.300, 0.300] | 0.460 (0.020) [0.440, 0.480] | +0.160 (0.020) |" in text
    # greedy after: 0.50, 0.56, 0.53 -> mean 0.53, SD 0.03
    assert "| greedy_acc | 0.560 (0.000) [0.560, 0.560] | 0.530 (0.030) [0.500, 0.560] | -0.030 (0.030) |" in text
    assert "3 runs; wall 7.0-9.0 min a run" in text
