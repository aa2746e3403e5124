"""benchmarks/trl_compare.py: the TRL settings mirror the grpo recipe; results parsing; rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_module import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tc():
    return load_benchmark("trl_compare")


def test_trl_settings_mirror_the_grpo_recipe(tc):
    from megatron_rl.config.loader import load_config

    g = tc.trl_settings(load_config(str(REPO / "examples/tiny/grpo.yaml")))
    # 16 prompts x 8 a step, mini-batches of 8 prompts -> 2 updates of 64 completions; warm-up 2 RL steps = 4 updates
    assert g == {"per_device_train_batch_size": 64, "steps_per_generation": 2, "num_generations": 8,
                 "max_completion_length": 64, "temperature": 1.0, "top_p": 1.0, "learning_rate": 1e-4,
                 "warmup_steps": 4, "weight_decay": 0.0, "max_grad_norm": 1.0, "epsilon": 0.2, "epsilon_high": 0.2,
                 "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}


def test_trl_settings_refuse_what_trl_cannot_mirror(tc):
    from megatron_rl.config.loader import load_config

    with pytest.raises(ValueError, match="actor.loss_agg_mode=.token-mean.: the TRL comparison mirrors only"):
        tc.trl_settings(load_config(str(REPO / "examples/tiny/dapo.yaml")))
    with pytest.raises(ValueError, match="actor.ppo_micro_batch_size=16"):
        tc.trl_settings(load_config(str(REPO / "examples/tiny/grpo.yaml"), ["actor.ppo_micro_batch_size=16"]))


def test_read_eval_results(tc, tmp_path):
    res = {"settings": {"n": 8}, "datasets": {"test": {
        "avg@8": {"value": 0.3, "ci": [0.27, 0.33]}, "pass@8": {"value": 0.71, "ci": [0.6, 0.8]},
        "format_valid": 1.0, "num_problems": 296}}}
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert tc.read_eval_results(tmp_path / "results.json", 8) == {
        "avg@8": 0.3, "avg@8_ci": [0.27, 0.33], "pass@8": 0.71, "format_valid": 1.0, "num_problems": 296}
    with pytest.raises(ValueError, match="avg@4"):
        tc.read_eval_results(tmp_path / "results.json", 4)


def test_rates(tc):
    s = tc.summarise({"rl_steps": 12, "train_s": 240.0, "generated_tokens": 24_000, "responses": 1536,
                      "step_s": [10.0, 30.0, 20.0]})
    assert s["rl_steps_per_min"] == pytest.approx(3.0)
    assert s["generated_tokens_per_s"] == pytest.approx(100.0)
    assert s["responses_per_s"] == pytest.approx(6.4)
    assert s["median_step_s"] == 20.0


def test_load_guard_refuses_the_readme_table_above_2_5_on_2_cpus(tc):
    # issue 22: on the 2-core machine a run counts as idle only if its load average stayed <= 2.5
    idle, why = tc.load_verdict({"megatron-rl": {"loadavg_max": 1.9}, "trl": {"loadavg_max": 2.5}}, 2)
    assert idle and "limit 2.5" in why
    idle, why = tc.load_verdict({"megatron-rl": {"loadavg_max": 2.6}, "trl": {"loadavg_max": 1.0}}, 2)
    assert not idle and "2.6 (megatron-rl) > 2.5" in why
    idle, why = tc.load_verdict({"megatron-rl": {"loadavg_max": 1.0}, "trl": {}}, 2)  # an old --reuse side file
    assert not idle and "no load samples for trl" in why


def test_load_monitor_samples_while_running(tc):
    import time

    with tc.LoadMonitor(period_s=0.01) as load:
        time.sleep(0.1)
    assert len(load.values) >= 3 and load.max >= load.mean >= 0


def test_foreign_verdict(tc):
    idle, why = tc.foreign_verdict({"eta0": {"foreign_cpus_mean": 0.05}, "eta1": {"foreign_cpus_mean": 0.2}})
    assert idle and "<= 0.20 CPUs" in why
    idle, why = tc.foreign_verdict({"eta0": {"foreign_cpus_mean": 0.05}, "eta1": {"foreign_cpus_mean": 0.9}})
    assert not idle and why == "other processes used more than 0.2 CPUs on average: 0.90 (eta1)"
    assert tc.foreign_verdict({"eta0": {"loadavg_max": 1.0}}) == (False, "no foreign-CPU samples for eta0")


def test_tree_cpu_counts_own_children_not_detached_processes(tc, tmp_path):
    """`_tree_jiffies` holds a waited-for child's CPU time (0.5 s of it, whatever the machine's
    load) and not that of a process detached from the tree (setsid + background: init adopts it)."""
    import os
    import subprocess
    import sys
    import time

    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    hz = os.sysconf("SC_CLK_TCK")
    done = tmp_path / "done"
    busy = f"import time\nwhile time.process_time() < 0.5: pass\nopen({str(done)!r}, 'w').close()"
    before = tc._tree_jiffies(os.getpid())
    subprocess.run([sys.executable, "-c", busy], check=True)
    own = (tc._tree_jiffies(os.getpid()) - before) / hz
    assert own >= 0.45
    done.unlink()
    before = tc._tree_jiffies(os.getpid())
    subprocess.run(["setsid", "sh", "-c", f"'{sys.executable}' -c \"$0\" &", busy], check=True)
    deadline = time.monotonic() + 120
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()
    assert (tc._tree_jiffies(os.getpid()) - before) / hz < 0.3  # the 0.5 s of the detached loop are not ours


def test_load_monitor_foreign_is_machine_busy_minus_the_tree(tc, monkeypatch):
    """foreign CPUs per interval = (busy ticks - tree ticks) / HZ / seconds, never negative."""
    ticks = iter([(0, 0), (400, 100), (600, 400)])  # (machine busy, own tree) in ticks
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(tc.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(tc.time, "monotonic", lambda: next(clock))
    pairs = []
    monkeypatch.setattr(tc, "_busy_jiffies", lambda: pairs.append(next(ticks)) or pairs[-1][0])
    monkeypatch.setattr(tc, "_tree_jiffies", lambda pid: pairs[-1][1])
    mon = tc.LoadMonitor(period_s=3600)
    mon._sample()
    mon._sample()
    assert mon.foreign == [3.0, 0.0] and mon.foreign_max == 3.0 and mon.foreign_mean == 1.5


def test_readme_table(tc):
    side = {"rl_steps_per_min": 60.0, "generated_tokens_per_s": 3000.0, "median_step_s": 1.0}
    result = {"megatron_rl": side, "trl": {**side, "rl_steps_per_min": 50.0},
              "ratio_megatron_rl_over_trl": {"rl_steps_per_min": 1.2, "generated_tokens_per_s": 1.0},
              "eval_settings": {"n": 8}, "eval": {}}
    table = tc.readme_table(result)
    assert "| RL steps / min | 60.0 | 50.0 | 1.20x |" in table


def test_idle_verdict_falls_back_to_the_foreign_cpu(tc):
    """Our own 4 processes lift the load average over 2.5 on an idle 2-core machine: idle when the
    other processes' CPU stayed low on both sides; not idle when either side saw other jobs."""
    quiet = {"megatron-rl": {"loadavg_max": 2.7, "foreign_cpus_mean": 0.04},
             "trl": {"loadavg_max": 2.6, "foreign_cpus_mean": 0.1}}
    idle, why = tc.idle_verdict(quiet, 2)
    assert idle and "load average reached" in why and "<= 0.10 CPUs" in why
    busy = {**quiet, "trl": {"loadavg_max": 2.6, "foreign_cpus_mean": 0.9}}
    assert tc.idle_verdict(busy, 2)[0] is False
    assert tc.idle_verdict({"megatron-rl": {"loadavg_max": 2.0}, "trl": {"loadavg_max": 2.4}}, 2)[0] is True
    assert tc.idle_verdict({"megatron-rl": {"loadavg_max": 3.0}, "trl": {"loadavg_max": 2.4}}, 2)[0] is False


def test_step_split_before_and_after(tc, tmp_path):
    """Per-step means of the phase sums; the committed before-issue-22 run sits beside this one."""
    side = {"rl_steps": 4, "train_s": 4.0, "phase_s": {"timing/generate_s": 1.2, "timing/update_s": 2.0,
                                                      "timing/weight_sync_s": 0.2}}
    split = tc.step_split(side)
    assert split == pytest.approx({"generate": 0.3, "reward": 0.0, "advantage": 0.0, "old_logprob": 0.0,
                                   "update": 0.5, "weight_sync": 0.05, "step": 1.0, "rl_steps": 4})
    assert list(tc.split_before_and_after(side, tmp_path / "missing.json")) == ["this run"]
    both = tc.split_before_and_after(side)   # the committed results/trl_compare_before_issue22.json
    before = both["before issue 22 (trl_compare_before_issue22.json)"]
    # that run: 12 steps, 4.22 s of old-log-prob recompute in all, 29.1 s of steps
    assert before["old_logprob"] == pytest.approx(4.217642392999551 / 12)
    assert before["step"] > 2.0 and both["this run"] == split


def _result(m_steps=40, t_steps=32, skip_eval=False):
    return {"megatron_rl": {"rl_steps": m_steps}, "trl": {"rl_steps": t_steps}, "skip_eval": skip_eval,
            "eval": {} if skip_eval else {"base": {}, "megatron-rl": {}, "trl": {}}}


def test_only_an_idle_evaluated_run_of_3_steps_a_side_writes_the_readme_table(tc):
    assert tc.table_allowed(_result(), True, "idle") == (True, "")
    assert tc.table_allowed(_result(), False, "load 3.1")[1] == "not an idle machine (load 3.1)"
    assert "--skip-eval" in tc.table_allowed(_result(skip_eval=True), True, "idle")[1]
    assert tc.table_allowed(_result(t_steps=0), True, "idle") == (False, "only 0 RL step(s) on one side (need >= 3)")
    assert tc.table_allowed(_result(m_steps=2), True, "idle")[0] is False


def test_reuse_does_not_take_the_evaluation_of_an_older_model_in_the_same_folder(tc, tmp_path, monkeypatch):
    ckpt = tmp_path / "trl" / "final"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"old weights")
    out = tmp_path / "eval-trl"
    out.mkdir()
    old = {"avg@8": 0.1}
    (out / "eval.side.json").write_text(json.dumps({"checkpoint": str(ckpt), "stamp": tc.checkpoint_stamp(str(ckpt)),
                                                    "n": 8, "seed": 1, "result": old}))
    assert tc.run_eval(str(ckpt), out, 8, 1, print, reuse=True) == old          # the same model: reused
    (ckpt / "model.safetensors").write_bytes(b"new weights, retrained")
    calls = []

    class Ran(Exception):
        pass

    def fake_run(cmd, **kw):
        calls.append(cmd)
        raise Ran

    monkeypatch.setattr(tc.subprocess, "run", fake_run)
    with pytest.raises(Ran):
        tc.run_eval(str(ckpt), out, 8, 1, print, reuse=True)                    # retrained: evaluated again
    assert calls and calls[0][1] == "eval" and str(ckpt) in calls[0]


def test_reuse_takes_the_reused_runs_step_count_and_refuses_another(tc, tmp_path):
    side = {"rl_steps": 40}
    assert tc.reused_steps(side, None, tmp_path / "megatron-rl.side.json") == 40
    assert tc.reused_steps(side, 40, tmp_path / "megatron-rl.side.json") == 40
    with pytest.raises(SystemExit, match="has 40 steps, not --steps 12; pass --steps 40"):
        tc.reused_steps(side, 12, tmp_path / "megatron-rl.side.json")
