"""MetricsWriter: JSONL rows, TensorBoard and custom backends behind one interface, W&B selection
without wandb installed, GPU stats skipped on CPU."""

from __future__ import annotations

import importlib.util
import json

import pytest

from megatron_rl.metrics.gpu import gpu_stats
from megatron_rl.metrics.writer import MetricsWriter


class _Recorder:
    """A MetricsBackend that keeps what it was given (a real backend of the interface, in memory)."""

    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, step, scalars):
        self.logged.append((step, dict(scalars)))

    def close(self):
        self.closed = True


def test_jsonl_tensorboard_and_backend_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = _Recorder()
    w = MetricsWriter(tmp_path, tensorboard=True, backends=(rec,))
    w.write(1, {"train/acc": 0.25, "train/kept_groups": 8, "flag": True, "bad": float("nan"), "note": "x"})
    w.write(2, {"train/acc": 0.5})
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "train/acc": 0.25, "train/kept_groups": 8, "flag": True, "bad": None, "note": "x"}
    assert rec.closed and rec.logged == [(1, {"train/acc": 0.25, "train/kept_groups": 8}), (2, {"train/acc": 0.5})]
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("train/acc")] == [(1, 0.25), (2, 0.5)]


def test_resume_keeps_rows_up_to_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for s in range(1, 5):
        w.write(s, {"a": float(s)})
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=False, resume_from_step=2)
    w.write(3, {"a": 30.0})
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_selected_but_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ImportError, match="wandb package is not installed.*trainer.wandb=false"):
        MetricsWriter(tmp_path, wandb_project="megatron-rl")


def test_gpu_stats_skipped_without_cuda():
    import torch

    if torch.cuda.is_available():
        s = gpu_stats()
        assert s == {} or 0 <= s["gpu/util_pct"] <= 100 and 0 < s["gpu/mem_used_gib"] <= s["gpu/mem_total_gib"]
    else:
        assert gpu_stats() == {}
