"""The parent-death watchdog that SGLang servers run under (megatron_rl/rollout/watchdog.py): real
processes, killed with real signals. A server and everything it spawned (SGLang's scheduler and
detokenizer processes; here a stand-in child that spawns a grandchild) must not outlive a trainer
killed with SIGKILL, and ``ServerProcess.stop()``'s SIGTERM must reach the server through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_rl.rollout.launcher import with_parent_watchdog

REPO = Path(__file__).resolve().parents[2]

# a stand-in server: spawns a grandchild (like SGLang's scheduler), records both pids, then waits;
# with IGNORE_TERM it ignores SIGTERM (a hung server)
SERVER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        json.dump({"server": os.getpid(), "grandchild": grandchild.pid}, f)
    time.sleep(600)
""")

# a stand-in trainer: launches the watchdog-wrapped server as the launcher does (own session), then
# waits to be killed
TRAINER = textwrap.dedent("""
    import subprocess, sys, time
    from megatron_rl.rollout.launcher import with_parent_watchdog
    cmd = with_parent_watchdog([sys.executable, sys.argv[1], sys.argv[2]]) + []
    p = subprocess.Popen(cmd[:5] + ["--interval-s", "0.2", "--grace-s", sys.argv[3]] + cmd[5:], start_new_session=True)
    print(p.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(path: Path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"{path} not written in {timeout_s} s")


def _gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def scripts(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "trainer.py").write_text(TRAINER)
    return tmp_path


def _cleanup(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("ignore_term", [False, True], ids=["server-stops", "server-hangs"])
def test_trainer_killed_outright_takes_server_and_its_children_along(scripts, ignore_term):
    env = dict(os.environ, PYTHONPATH=str(REPO), **({"IGNORE_TERM": "1"} if ignore_term else {}))
    pids_file = scripts / "pids.json"
    trainer = subprocess.Popen([sys.executable, str(scripts / "trainer.py"), str(scripts / "server.py"), str(pids_file), "1"],
                               stdout=subprocess.PIPE, text=True, env=env)
    wrapper = int(trainer.stdout.readline())
    pids = _wait_for(pids_file)
    all_pids = [wrapper, pids["server"], pids["grandchild"]]
    try:
        assert all(_alive(p) for p in all_pids)
        time.sleep(0.5)
        assert all(_alive(p) for p in all_pids), "the watchdog stopped the server while the trainer lived"
        trainer.kill()  # SIGKILL: the trainer cannot stop its servers itself
        trainer.wait()
        # 0.2 s poll + (hung server) 1 s grace, then the process group is killed
        assert _gone(all_pids, timeout_s=10.0), {p: _alive(p) for p in all_pids}
    finally:
        trainer.kill()
        _cleanup(*all_pids)


def test_sigterm_to_the_wrapper_reaches_the_server(scripts):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    pids_file = scripts / "pids.json"
    cmd = with_parent_watchdog([sys.executable, str(scripts / "server.py"), str(pids_file)])
    wrapper = subprocess.Popen(cmd[:5] + ["--interval-s", "0.2", "--grace-s", "5"] + cmd[5:], env=env,
                               start_new_session=True, stderr=subprocess.PIPE, text=True)
    pids = _wait_for(pids_file)
    try:
        wrapper.send_signal(signal.SIGTERM)  # what ServerProcess.stop() sends
        wrapper.wait(timeout=10)
        # the grandchild ignores SIGTERM: only the group kill after the server exited removes it
        assert _gone([pids["server"], pids["grandchild"]], timeout_s=10.0)
        assert "got SIGTERM" in wrapper.stderr.read()
    finally:
        _cleanup(wrapper.pid, pids["server"], pids["grandchild"])


def test_server_killed_outright_takes_its_children_along(scripts):
    """The server itself dies of SIGKILL (issue 30: a vLLM API server killed so left its ``EngineCore``
    and ``resource_tracker`` running, re-parented to init, beside the restarted engine): the wrapper
    SIGKILLs what the server left in its group, then exits."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    pids_file = scripts / "pids.json"
    cmd = with_parent_watchdog([sys.executable, str(scripts / "server.py"), str(pids_file)])
    wrapper = subprocess.Popen(cmd[:5] + ["--interval-s", "0.2", "--grace-s", "5"] + cmd[5:], env=env,
                               start_new_session=True, stderr=subprocess.PIPE, text=True)
    pids = _wait_for(pids_file)
    try:
        os.kill(pids["server"], signal.SIGKILL)
        wrapper.wait(timeout=10)
        assert _gone([pids["grandchild"]], timeout_s=10.0)
        assert "left behind" in wrapper.stderr.read()
    finally:
        _cleanup(wrapper.pid, pids["server"], pids["grandchild"])


def test_wrapper_exits_with_the_commands_code_and_checks_its_arguments():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ok = subprocess.run(with_parent_watchdog([sys.executable, "-c", "import sys; sys.exit(7)"]), env=env, timeout=30)
    assert ok.returncode == 7
    bad = subprocess.run([sys.executable, "-m", "megatron_rl.rollout.watchdog", "--parent-pid", str(os.getpid())],
                         env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "no command given" in bad.stderr


def test_sglang_backend_runs_under_the_watchdog():
    cmd = with_parent_watchdog(["python", "-m", "sglang.launch_server", "--port", "1"], parent_pid=4242)
    assert cmd[:6] == [sys.executable, "-m", "megatron_rl.rollout.watchdog", "--parent-pid", "4242", "--"]
    assert cmd[6:] == ["python", "-m", "sglang.launch_server", "--port", "1"]
