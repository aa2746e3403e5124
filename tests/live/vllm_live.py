"""Shared by the live tier's modules (issue 30): where the vLLM CPU environment is, how a real engine is
started through megatron-rl's launcher, how a training run is driven against real engines, and how a
running engine's processes are found and killed.

Every engine is started with ``--enforce-eager`` (no ``torch.compile``: 20-30 s to healthy instead of
30-100 s on 2 cores) and vLLM's CPU KV cache at 1 GiB (the launcher's default, `VLLM_CPU_ENV`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "tiny" / "base_model"
CI_RECIPE = REPO / "examples" / "tiny" / "ci.yaml"
PLUGIN = "megatron-rl-vllm-gloo"
FAST_START = ("--enforce-eager",)
"""`vllm serve` flags of every live engine: no torch.compile of the model (start-up time only)."""
FAULT_FILE_ENV = "MEGATRON_RL_VLLM_GLOO_FAULT_FILE"
"""The gloo plugin's test hook (plugins/vllm_gloo: every ``/update_weights`` fails while the file exists)."""


def vllm_cpu_python() -> tuple[str | None, str]:
    """(interpreter, "") of the first venv with vllm-cpu and the gloo plugin, or (None, why not).

    Looked for in ``$VLLM_VENV``, then ``<repo>/.venv-vllm-cpu`` (where .ci/run makes it), then
    ``/work/venv-vllm-cpu`` (scripts/setup_vllm_cpu.sh's default)."""
    candidates = [v for v in (os.environ.get("VLLM_VENV"), str(REPO / ".venv-vllm-cpu"), "/work/venv-vllm-cpu") if v]
    why = []
    for venv in dict.fromkeys(candidates):
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            why.append(f"{venv}: no bin/python")
            continue
        code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', %r):\n"
                "    try:\n        m.version(d)\n    except m.PackageNotFoundError:\n        print(d)\n" % PLUGIN)
        missing = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
        if missing:
            why.append(f"{venv}: {', '.join(missing)} not installed")
            continue
        return str(python), ""
    return None, "no vLLM CPU environment (" + "; ".join(why) + "); make one with scripts/setup_vllm_cpu.sh"


VLLM_PYTHON, WHY = vllm_cpu_python()


def launch_engines(num: int, log_dir: Path, env: dict[str, str] | None = None) -> list:
    """Start ``num`` vLLM CPU engines of the tiny model through `launch_servers` (gloo transfer,
    `FAST_START`), waited for together; returns their ``ServerProcess`` handles (stop them)."""
    from megatron_rl.rollout.launcher import launch_servers

    return launch_servers("vllm", str(MODEL), num, log_dir=log_dir, startup_timeout_s=900.0, env=env,
                          vllm_python=VLLM_PYTHON, weight_transfer_backend="gloo", vllm_device="cpu",
                          vllm_args=FAST_START, random_seed=0)


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    """``megatron-rl train`` on the CI recipe with ``rollout.backend=vllm`` on this environment's
    engines (gloo weight sync, `FAST_START` for the engines a run starts itself), plus ``overrides``."""
    return [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(CI_RECIPE), f"run_dir={run_dir}",
            "trainer.progress_bar=false", "rollout.backend=vllm", f"rollout.vllm_python={VLLM_PYTHON}",
            "weight_sync.backend=gloo", f"rollout.vllm_extra_args=[{','.join(FAST_START)}]", "eval.max_problems=16",
            *overrides]


def train(run_dir: Path, *overrides: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run `train_args` to the end (stdout and stderr captured)."""
    return subprocess.run(train_args(run_dir, *overrides), capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def metric_rows(run_dir: Path) -> list[dict]:
    """The run's ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir: Path) -> list[dict]:
    """The training steps' rows of ``metrics.jsonl`` (those with ``train/acc``)."""
    return [r for r in metric_rows(run_dir) if "train/acc" in r]


def wait_for_log(proc: subprocess.Popen, run_dir: Path, marker: str, timeout_s: float = 600) -> str:
    """Wait until ``marker`` is in ``<run_dir>/train.log``; returns the log text.

    Raises:
        AssertionError: the run ended first, or ``timeout_s`` passed."""
    log = run_dir / "train.log"
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text() if log.exists() else ""
        if marker in text:
            return text
        assert proc.poll() is None, f"run exited with {proc.returncode} before {marker!r}"
        assert time.monotonic() < deadline, f"no {marker!r} in {log} after {timeout_s} s"
        time.sleep(0.1)


def _proc_table() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, argv) of every live, non-zombie process (from /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), argv)
    return table


def vllm_server_pid(port: int) -> int:
    """Pid of the ``vllm serve`` process (the API server, not its watchdog) listening on ``port``.

    Raises:
        AssertionError: not exactly one such process."""
    pids = [pid for pid, (_, argv) in _proc_table().items()
            if argv[1:3] == ["-m", "vllm.entrypoints.cli.main"] and "--port" in argv
            and argv[argv.index("--port") + 1] == str(port)]
    assert len(pids) == 1, f"vllm serve processes on port {port}: {pids}"
    return pids[0]


def descendants(pid: int) -> list[int]:
    """Pids of every process below ``pid`` (children, grandchildren, ...)."""
    table = _proc_table()
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _) in table.items() if pp == parent]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    return pid in _proc_table()


def kill(pid: int) -> None:
    """SIGKILL ``pid`` (nothing when it is gone)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
