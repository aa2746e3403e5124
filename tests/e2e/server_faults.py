"""Shared by the e2e tests that kill a run's rollout server mid-run (sync faults, async, colocated)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def kill_server_when(proc: subprocess.Popen, run_dir: Path, marker: str, *, timeout_s: float = 900) -> str:
    """Wait until `marker` appears in `<run_dir>/train.log`, SIGKILL the run's only rollout server
    (found by its `--run-dir`), wait for the run to end; returns its stderr. The run is killed if
    anything here fails."""
    log = run_dir / "train.log"
    try:
        deadline = time.monotonic() + timeout_s
        while marker not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, f"run exited with {proc.returncode} before {marker!r}"
            assert time.monotonic() < deadline, f"no {marker!r} in {log} after {timeout_s} s"
            time.sleep(0.05)
        pid = subprocess.run(["pgrep", "-f", f"megatron_rl.engine.*--run-dir {run_dir}"], capture_output=True,
                             text=True).stdout.split()
        assert len(pid) == 1, pid
        os.kill(int(pid[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=timeout_s)
        return err
    finally:
        if proc.poll() is None:
            proc.kill()
