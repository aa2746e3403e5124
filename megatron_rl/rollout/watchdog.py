"""Run a server command so that it dies with the process that launched it.

SGLang's ``launch_server`` has no parent-death watchdog (the embedded server has ``--parent-pid``),
and the launcher starts every server in a session of its own (so that Ctrl-C or ``scancel`` reach
the trainer, which then stops its servers itself). A trainer killed outright (SIGKILL, OOM killer)
would leave SGLang engines holding their GPUs and ports. This wrapper sits between the two:

    python -m megatron_rl.rollout.watchdog --parent-pid PID [--grace-s 15] -- python -m sglang.launch_server ...

It starts the command in its own process group (the wrapper is that session's leader, so the
command and everything it spawns share the wrapper's group), then every ``--interval-s``:

- the command exited: whatever it left behind in the group (vLLM's ``EngineCore``, SGLang's
  scheduler, their ``resource_tracker``: orphans once the command died of SIGKILL) gets SIGKILL,
  then the wrapper exits with the command's code (so a restarted engine never sits beside the
  orphans of the one it replaces);
- ``PID`` is gone (or is no longer the wrapper's parent): SIGTERM to the command (SGLang then stops
  its scheduler and detokenizer processes), SIGKILL to the whole process group after ``--grace-s``.

SIGTERM / SIGINT to the wrapper are forwarded to the command, with the same SIGKILL after the grace
period, so ``ServerProcess.stop()`` works unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _parent_alive(parent_pid: int) -> bool:
    """True while ``parent_pid`` exists and is still this process's parent (pid reuse is ruled out
    by the second check: an orphan is re-parented to init or a subreaper)."""
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return os.getppid() == parent_pid


def _stop(child: subprocess.Popen, grace_s: float, why: str) -> int:
    """SIGTERM the child, wait ``grace_s``, then SIGKILL our whole process group (children included)."""
    print(f"[watchdog] {why}: stopping pid {child.pid}", file=sys.stderr, flush=True)
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"[watchdog] pid {child.pid} ignored SIGTERM for {grace_s:.0f} s; killing the process group",
                  file=sys.stderr, flush=True)
    # whatever the command left behind (SGLang's scheduler processes) goes with the group
    if os.getpgid(0) == os.getpid():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.killpg(os.getpid(), signal.SIGKILL)  # also ends this process
        except ProcessLookupError:
            pass
    child.wait()
    return child.returncode if child.returncode is not None else 1


def _group_members(pgid: int) -> list[int]:
    """Pids in process group ``pgid`` other than this process (from ``/proc``; empty where there is none)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _kill_leftovers() -> int:
    """SIGKILL every other process of this wrapper's group (it leads its own group); returns how many."""
    pgid = os.getpgid(0)
    if pgid != os.getpid():
        return 0  # not the group's leader: the group is not ours to clean
    killed = 0
    for pid in _group_members(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the command's exit code (or 1 after a watchdog stop).

    Raises:
        SystemExit: bad arguments (no command after ``--``, a non-positive interval).
    """
    p = argparse.ArgumentParser(prog="python -m megatron_rl.rollout.watchdog", description=__doc__.split("\n\n")[0])
    p.add_argument("--parent-pid", type=int, required=True, help="stop the command once this process is gone")
    p.add_argument("--grace-s", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between parent checks")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command line")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given after --")
    if args.interval_s <= 0:
        p.error(f"--interval-s must be > 0, got {args.interval_s}")

    child = subprocess.Popen(cmd)  # same process group as the wrapper
    stop_reason: list[str] = []

    def on_signal(signum, _frame) -> None:
        stop_reason.append(f"got {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        code = child.poll()
        if code is not None:
            killed = _kill_leftovers()
            if killed:
                print(f"[watchdog] pid {child.pid} exited with {code}; killed {killed} process(es) it left behind",
                      file=sys.stderr, flush=True)
            return code
        if stop_reason:
            return _stop(child, args.grace_s, stop_reason[0])
        if not _parent_alive(args.parent_pid):
            return _stop(child, args.grace_s, f"parent process {args.parent_pid} is gone")
        time.sleep(args.interval_s)


if __name__ == "__main__":
    sys.exit(main())
