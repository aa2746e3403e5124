"""Stopping a run cleanly: SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) finish the step in flight,
checkpoint, exit 75; a second signal stops the process at once."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["ExitSignal", "TrainingInterrupted"]


class TrainingInterrupted(Exception):
    """The run stopped on SIGTERM/SIGUSR1 after writing the checkpoint of `step` (resume by rerunning).

    Args:
        step: the last step trained (0: none).
        run_dir: the run directory (named in the message).
        trained: False when the signal came before `step + 1` was trained (no new checkpoint).
    """

    def __init__(self, step: int, run_dir: Path, trained: bool = True) -> None:
        if trained:
            text = (f"stopped by a signal after step {step}; checkpoint in {run_dir}/checkpoints; "
                    "rerun the same command to resume")
        elif step == 0:
            text = "stopped by a signal before the first step (nothing trained, no checkpoint); rerun the same command"
        else:
            text = (f"stopped by a signal before step {step + 1}; the checkpoint of step {step} in "
                    f"{run_dir}/checkpoints is intact; rerun the same command to resume")
        super().__init__(text)
        self.step = step


class ExitSignal:
    """SIGTERM / SIGUSR1 / SIGINT set a flag that the loop checks after each step (Megatron-LM's
    `--exit-signal-handler`, Slurm's `--signal=USR1@T`, Ctrl-C); a second signal restores the
    system's default action (terminate) and re-raises it, so a stuck run can still be stopped.

    A signal within `SAME_PRESS_S` seconds of the first counts as the same one: Ctrl-C in a
    terminal reaches every local trainer rank directly and again through the local launcher,
    which forwards signals to ranks started without a terminal.

    Args:
        enabled: install the handlers (only possible on the main thread; elsewhere a no-op).
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
    SAME_PRESS_S = 1.0

    def __init__(self, enabled: bool) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict = {}
        if not enabled or threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            if time.monotonic() - self._first_at < self.SAME_PRESS_S:
                return  # the same Ctrl-C, delivered twice
            self.restore()  # second signal: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        self._first_at = time.monotonic()
        again = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
        logger.warning("%s received: finishing the current step, then checkpoint and exit (%s again stops at once)",
                       self.signal_name, again)

    def requested(self) -> bool:
        """True on every rank when any rank got a signal (a MAX all-reduce when world size > 1)."""
        flag = self.signal_name is not None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # NCCL reduces only device tensors; gloo only host ones
            cuda = torch.distributed.get_backend() == "nccl"
            t = torch.tensor([int(flag)], device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
            if flag and self.signal_name is None:
                self.signal_name = "signal on another rank"
        return flag

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}
