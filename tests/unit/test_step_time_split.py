"""benchmarks/step_time_split.py: the phase split of metrics.jsonl rows, hand-computed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("step_time_split", REPO / "benchmarks" / "step_time_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(step, gen, rew, adv, lp, upd, sync, total, filt=None):
    row = {"step": step, "timing/generate_s": gen, "timing/reward_s": rew, "timing/advantage_s": adv,
           "timing/old_logprob_s": lp, "timing/update_s": upd, "timing/weight_sync_s": sync,
           "timing/step_s": total, "train/num_gen_batches": step}
    if filt is not None:
        row["timing/filter_s"] = filt
    return row


def test_split_means_shares_and_remainder():
    m = _module()
    rows = [_row(1, 2.0, 0.2, 0.1, 1.0, 4.0, 0.5, 8.0, filt=0.15),    # remainder 0.05
            _row(2, 4.0, 0.4, 0.1, 1.0, 6.0, 0.5, 12.4, filt=0.25)]   # remainder 0.15
    r = m.split(rows)
    p = r["phases"]
    assert r["steps"] == 2
    assert p["rollout"]["mean_s"] == pytest.approx(3.0)
    assert p["reward"]["mean_s"] == pytest.approx(0.3)
    assert p["filter"]["mean_s"] == pytest.approx(0.2)
    assert p["other"]["mean_s"] == pytest.approx(0.1)
    assert p["update"]["mean_s"] == pytest.approx(5.0)
    assert r["step_s"] == pytest.approx(10.2) and r["step_s_measured"] == pytest.approx(10.2)
    assert p["update"]["share"] == pytest.approx(5.0 / 10.2)
    assert sum(x["share"] for x in p.values()) == pytest.approx(1.0)
    assert r["means"]["train/num_gen_batches"] == pytest.approx(1.5)
    assert list(p) == ["rollout", "reward", "filter", "advantages", "log-probs", "update", "sync", "other"]


def test_remainder_never_negative_and_old_rows_without_filter_key():
    m = _module()
    r = m.split([_row(1, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.9)])  # timed phases exceed the step by rounding
    assert r["phases"]["other"]["mean_s"] == 0.0
    r = m.split([_row(1, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 2.5)])  # a run from before timing/filter_s
    assert r["phases"]["filter"]["mean_s"] == 0.0 and r["phases"]["other"]["mean_s"] == pytest.approx(0.5)


def test_load_step_rows_keeps_last_of_repeated_step_and_skips_eval_rows(tmp_path):
    m = _module()
    lines = [{"step": 0, "eval/avg@8": 0.3}, _row(1, 1, 0, 0, 0, 1, 0, 2), _row(2, 9, 0, 0, 0, 1, 0, 10),
             _row(2, 2, 0, 0, 0, 1, 0, 3), {"step": 2, "eval/avg@8": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = m.load_step_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["timing/generate_s"] == 2


def test_load_step_rows_errors_name_the_file(tmp_path):
    m = _module()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        m.load_step_rows(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/avg@8": 0.3}) + "\n")
    with pytest.raises(ValueError, match="timing/step_s"):
        m.load_step_rows(tmp_path)
