"""The live tier (issue 30), the whole loop: ``megatron-rl train`` on the tiny CI recipe with
``rollout.backend: vllm`` starts 2 real vLLM CPU engines itself (the launcher, gloo weight sync),
evaluates through them before and after training, and survives one of them being killed.

One run checks both, to pay for the engines' start-up once (about a minute on 2 cores):

* the recipe trains its 3 steps against the 2 engines, every weight sync reaching both, and both
  evaluations (``eval_before``, ``eval_after``) run on vLLM;
* once step 1 is logged, engine 1's ``vllm serve`` process is SIGKILLed: the fleet finds it down at the
  next sync, restarts it on the same port (the watchdog has killed what the dead server left behind:
  its ``EngineCore``), and the sync re-creates the weight-update group over both, so the restarted
  engine reports the trainer's weight version; the run finishes.

Needs the vLLM CPU environment (tests/live/vllm_live.py says where it is looked for); skipped without it.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from tests.live.vllm_live import (
    VLLM_PYTHON,
    WHY,
    alive,
    descendants,
    kill,
    metric_rows,
    step_rows,
    train_args,
    vllm_server_pid,
    wait_for_log,
)

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.skipif(VLLM_PYTHON is None, reason=WHY)]


def _watch_versions(url: str, stop: threading.Event, seen: list) -> None:
    """Append every new ``weight_version`` the engine at ``url`` reports (None while it does not answer)."""
    from megatron_rl.rollout.vllm_client import VLLMClient

    client = VLLMClient(url, timeout_s=5.0, max_retries=0)
    while not stop.is_set():
        try:
            version = client.weight_version()
        except Exception:  # noqa: BLE001 - down or restarting
            version = None
        if not seen or seen[-1] != version:
            seen.append(version)
        time.sleep(0.2)


def test_recipe_trains_on_two_vllm_engines_and_a_killed_one_is_restarted_and_resynced(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.Popen(train_args(run_dir, "rollout.num_servers=2", "rollout.max_server_restarts=1",
                                       "trainer.total_training_steps=3", "trainer.save_interval=0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop, seen = threading.Event(), []
    watcher = None
    try:
        text = wait_for_log(proc, run_dir, "step 1:")
        ports = [int(line.split("starting rollout server on 127.0.0.1:")[1].split()[0])
                 for line in text.splitlines() if "starting rollout server on 127.0.0.1:" in line]
        assert len(ports) == 2, ports
        victim = vllm_server_pid(ports[1])
        left_behind = descendants(victim)  # its EngineCore and resource_tracker
        assert left_behind
        kill(victim)
        watcher = threading.Thread(target=_watch_versions, args=(f"http://127.0.0.1:{ports[1]}", stop, seen),
                                   daemon=True)
        watcher.start()
        _, err = proc.communicate(timeout=600)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    wall_s = time.perf_counter() - t0
    assert proc.returncode == 0, err[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "restarting rollout server 1" in log and "rollout server 1 restarted" in log, log[-3000:]
    assert not any(alive(p) for p in left_behind), "the killed server's EngineCore outlived it"
    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["weight_sync/version"] for r in steps] == [1, 2, 3]
    assert [r["rollout/servers_up"] for r in steps] == [2, 2, 2]
    assert [r["rollout/server_restarts"] for r in steps] == [0, 1, 1]
    assert all(r["train/kept_groups"] == 8 and r["rollout/failed_groups"] == 0 for r in steps)
    # the restarted engine came back on the checkpoint's weights, then took every sync from step 2 on
    assert "2" in seen and "3" in seen, seen
    assert seen.index("3") > seen.index("2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["eval_before"]["weight_version"] == 0 and summary["eval_after"]["weight_version"] == 3
    evals = [r for r in metric_rows(run_dir) if "eval/avg@4" in r]
    assert len(evals) == 2 and all(0.0 <= r["eval/avg@4"] <= 1.0 for r in evals)
    print(f"train on 2 vLLM engines with a kill: {wall_s:.0f} s wall; step times "
          f"{[round(r['timing/step_s'], 1) for r in steps]} s; restarted engine's versions {seen}")
