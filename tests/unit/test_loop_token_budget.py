"""`trainer.max_generated_tokens` in the training loop (`trainer/loop.py`): the run stops after the
first step whose running token total reaches the budget, exactly as after the last step
(checkpoint with save_last, final evaluation, summary.json with the steps run). The model, the
engines and the metrics are stubbed; the loop's decisions are the real ones. The e2e variant on
the CI recipe is tests/e2e/test_train_ci.py::test_ci_recipe_token_budget."""

import contextlib
import json
import time
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.trainer import loop
from megatron_rl.trainer.signals import ExitSignal, TrainingInterrupted

BASE = ["model.path=/models/x", "data.val_files=[/data/test.jsonl]"]  # held-out rows: the evaluations run
TOKENS = [1000, 1500, 1200, 900, 1100, 1300]
"""Generated tokens of steps 1-6 (running totals 1000, 2500, 3700, 4600, 5700, 7000)."""


class _Writer:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def write(self, step: int, row: dict) -> None:
        self.rows.append((step, row))


def _run(tmp_path, overrides, *, start_step=1, total_tokens=0):
    cfg = load_config(None, BASE + [f"run_dir={tmp_path}", "trainer.total_training_steps=6",
                                    "trainer.save_interval=0", "eval.interval=2", *overrides])
    return SimpleNamespace(
        cfg=cfg, is_controller=True, run_dir=tmp_path, pgs=SimpleNamespace(world_size=1), val_rows=[{"x": 1}],
        resumed_from=None if start_step == 1 else start_step - 1, start_step=start_step, total_tokens=total_tokens,
        weight_version=0, wall_before=0.0, t_start=time.perf_counter(), summary={}, writer=_Writer(), ahead=None,
        engines=SimpleNamespace(fleet=SimpleNamespace(set_resync=lambda fn: None)),
        publisher=SimpleNamespace(publish=lambda version: {}),
    )


@pytest.fixture
def stubbed(monkeypatch):
    """The loop's stages replaced by recorders: steps trained, checkpoints, evaluations."""
    calls = {"steps": [], "checkpoints": [], "evals": [], "records": []}

    def produce(run, step):
        calls["steps"].append(step)
        return SimpleNamespace(generated_tokens=TOKENS[step - 1]), None

    def record(run, step, produced, batch, times, progress, ev):
        calls["records"].append((step, bool(ev)))  # ev: the step's periodic evaluation (none at the last step)

    def evaluate(run, tag):
        calls["evals"].append(tag)
        return {"avg@8": 0.5}

    monkeypatch.setattr(loop, "_produce", produce)
    monkeypatch.setattr(loop, "_train_step", lambda run, batch, produced, t: {})
    monkeypatch.setattr(loop, "_record", record)
    monkeypatch.setattr(loop, "save_run_checkpoint", lambda run, step: calls["checkpoints"].append(step))
    monkeypatch.setattr(loop, "_evaluate", evaluate)
    monkeypatch.setattr(loop, "progress_bar", lambda run, stack: None)
    return calls


def _train(run):
    with contextlib.ExitStack() as stack:
        return loop._train(run, ExitSignal(enabled=False), stack)


def test_budget_stops_after_the_step_that_reaches_it(tmp_path, stubbed):
    # 3700 >= 3600 first at step 3: step 3 is the last, like total_training_steps=3
    run = _run(tmp_path, ["trainer.max_generated_tokens=3600"])
    summary = _train(run)
    assert stubbed["steps"] == [1, 2, 3]
    assert stubbed["records"] == [(1, False), (2, True), (3, False)]
    assert stubbed["checkpoints"] == [3]  # save_last
    assert stubbed["evals"] == ["eval_before", "eval_step2", "eval_after"]
    assert summary["steps"] == 3 and summary["total_generated_tokens"] == 3700
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    assert run.writer.rows[-1][0] == 3  # the final evaluation's row is at the last step run
    # reached exactly: 2500 at step 2
    stubbed["steps"].clear()
    assert _train(_run(tmp_path, ["trainer.max_generated_tokens=2500"]))["steps"] == 2


def test_no_budget_or_a_large_one_runs_every_step(tmp_path, stubbed):
    for budget in (0, 10**9):
        stubbed["steps"].clear()
        stubbed["evals"].clear()
        summary = _train(_run(tmp_path, [f"trainer.max_generated_tokens={budget}"]))
        assert stubbed["steps"] == [1, 2, 3, 4, 5, 6] and summary["steps"] == 6
        assert summary["total_generated_tokens"] == 7000
        assert stubbed["evals"] == ["eval_before", "eval_step2", "eval_step4", "eval_after"]


def test_save_last_false_and_interval_checkpoints(tmp_path, stubbed):
    _train(_run(tmp_path, ["trainer.max_generated_tokens=3600", "trainer.save_last=false", "trainer.save_interval=2"]))
    assert stubbed["checkpoints"] == [2]


def test_resume_continues_to_the_budget_and_a_spent_one_only_finishes(tmp_path, stubbed):
    # resumed after step 2 (2500 tokens): steps 3 and 4 run, 4600 >= 4000
    summary = _train(_run(tmp_path, ["trainer.max_generated_tokens=4000"], start_step=3, total_tokens=2500))
    assert stubbed["steps"] == [3, 4] and summary["steps"] == 4 and summary["total_generated_tokens"] == 4600
    # resumed from the budget's own checkpoint (the summary was never written): no step, the final eval
    stubbed["steps"].clear()
    stubbed["evals"].clear()
    summary = _train(_run(tmp_path, ["trainer.max_generated_tokens=4000"], start_step=5, total_tokens=4600))
    assert stubbed["steps"] == [] and stubbed["evals"] == ["eval_after"] and summary["steps"] == 4


def test_a_signal_at_the_budget_step_finishes_normally(tmp_path, stubbed):
    run = _run(tmp_path, ["trainer.max_generated_tokens=2500"])
    stop = ExitSignal(enabled=False)
    requested = iter([False, False, True])  # before step 1, after step 1, after step 2 (the last)
    stop.requested = lambda: next(requested)
    with contextlib.ExitStack() as stack:
        summary = loop._train(run, stop, stack)
    assert summary["steps"] == 2 and stubbed["checkpoints"] == [2]
    # a signal before the budget: checkpoint and TrainingInterrupted, as always
    stubbed["checkpoints"].clear()
    requested = iter([False, True])
    stop.requested = lambda: next(requested)
    with contextlib.ExitStack() as stack, pytest.raises(TrainingInterrupted):
        loop._train(_run(tmp_path, ["trainer.max_generated_tokens=3600"]), stop, stack)
    assert stubbed["checkpoints"] == [1]


def test_finished_summary_knows_a_budget_stop(tmp_path):
    from megatron_rl.checkpoint.save import RUN_STATE_FILE, latest_checkpoint

    it = tmp_path / "checkpoints" / "iter_0000003"  # a complete checkpoint folder (checkpoint/save.py)
    (it / "model_optim").mkdir(parents=True)
    (it / "model_optim" / "metadata.json").write_text("{}")
    (it / RUN_STATE_FILE).write_text("{}")
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3, "total_generated_tokens": 3700}))
    assert latest_checkpoint(tmp_path) == 3

    def cfg(budget):
        return load_config(None, BASE + [f"run_dir={tmp_path}", "trainer.total_training_steps=6",
                                         f"trainer.max_generated_tokens={budget}"])

    assert loop._finished_summary(cfg(3600), tmp_path)["steps"] == 3
    assert loop._finished_summary(cfg(5000), tmp_path) is None  # a raised budget trains on
    assert loop._finished_summary(cfg(0), tmp_path) is None  # 3 of 6 steps without a budget


def test_config_key():
    assert load_config(None, BASE).trainer.max_generated_tokens == 0
    with pytest.raises(ValueError, match=r"trainer.max_generated_tokens: -1 must be >= 0"):
        load_config(None, BASE + ["trainer.max_generated_tokens=-1"])


# `eval.token_interval`: periodic evaluations at the first step whose running total crosses each
# multiple (running totals 1000, 2500, 3700, 4600, 5700, 7000)


def test_token_interval_evaluates_at_the_first_step_crossing_each_multiple(tmp_path, stubbed):
    # multiples of 1200: 1200 and 2400 both crossed by step 2 (one evaluation), 3600 by step 3,
    # 4800 by step 5; 6000 by step 6, the last step: its evaluation is the final one
    summary = _train(_run(tmp_path, ["eval.interval=0", "eval.token_interval=1200"]))
    assert stubbed["evals"] == ["eval_before", "eval_step2", "eval_step3", "eval_step5", "eval_after"]
    assert stubbed["records"] == [(1, False), (2, True), (3, True), (4, False), (5, True), (6, False)]
    assert summary["steps"] == 6


def test_token_interval_with_a_budget_of_a_multiple_and_with_interval(tmp_path, stubbed):
    # budget 5 x 1000: multiples 1000 (step 1), 2000 (step 2), 3000 (step 3), 4000 (step 4); 5000
    # is reached at step 5, the last step (the final evaluation is the fifth point)
    summary = _train(_run(tmp_path, ["eval.interval=0", "eval.token_interval=1000", "trainer.max_generated_tokens=5000"]))
    assert stubbed["evals"] == ["eval_before", "eval_step1", "eval_step2", "eval_step3", "eval_step4", "eval_after"]
    assert summary["steps"] == 5 and summary["total_generated_tokens"] == 5700
    # with eval.interval: either rule, one evaluation a step (step 4 is due under both)
    stubbed["evals"].clear()
    _train(_run(tmp_path, ["eval.interval=4", "eval.token_interval=2000"]))
    assert stubbed["evals"] == ["eval_before", "eval_step2", "eval_step4", "eval_after"]


def test_token_interval_broadcasts_the_running_total(tmp_path, stubbed, monkeypatch):
    # without a budget the total is still broadcast every step, so every rank decides alike
    sent = []
    monkeypatch.setattr(loop, "broadcast_object", lambda obj, src, world_size: sent.append(obj) or obj)
    _train(_run(tmp_path, ["eval.interval=0", "eval.token_interval=2000"]))
    assert sent == [1000, 2500, 3700, 4600, 5700]  # not after step 6: the last step needs no decision
    sent.clear()
    _train(_run(tmp_path, ["eval.interval=2"]))  # neither budget nor token interval: no collective
    assert sent == []


def test_eval_due_and_token_interval_key():
    ev = load_config(None, BASE + ["eval.token_interval=100"]).eval
    assert [ev.due(1, a, b) for a, b in ((0, 99), (0, 100), (99, 100), (100, 199), (150, 450))] == [
        False, True, True, False, True]
    assert load_config(None, BASE).eval.token_interval == 0
    assert not load_config(None, BASE).eval.due(3, 0, 10**9)
    with pytest.raises(ValueError, match=r"eval.token_interval: -5 must be >= 0"):
        load_config(None, BASE + ["eval.token_interval=-5"])
