"""Per-step metrics: always a JSONL file (what tests and `megatron-rl report` read), mirrored to
logging backends behind one interface (`MetricsBackend`): TensorBoard and Weights & Biases."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Optional, Protocol

logger = logging.getLogger(__name__)


class MetricsBackend(Protocol):
    """A scalar logger: `log(step, {name: number})` and `close()`."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """TensorBoard event files under `log_dir` (torch's SummaryWriter).

    Args:
        purge_step: on resume, events at or after this step are dropped (they are redone).
    """

    def __init__(self, log_dir: str | os.PathLike, *, purge_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


class WandbBackend:
    """Weights & Biases, offline by default (runs are synced later with `wandb sync <dir>`).

    Args:
        project: W&B project name.
        run_dir: the run folder (W&B writes its `wandb/` folder there).
        mode: "offline" (default), "online" or "disabled"; `$WANDB_MODE` overrides the default.
        name: run name (default: the run folder's name). The API key comes from the environment
            and is never written here.

    Raises:
        ImportError: wandb is not installed (says how to install it or turn W&B off).
    """

    def __init__(self, project: str, run_dir: str | os.PathLike, *, mode: Optional[str] = None,
                 name: Optional[str] = None, config: Optional[dict] = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError("W&B logging is selected (trainer.wandb) but the wandb package is not installed: "
                              "pip install 'megatron-rl[wandb]', or set trainer.wandb=false") from None
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self._run = wandb.init(project=project, dir=str(run_dir), mode=mode, name=name or Path(run_dir).name,
                               config=config, resume="allow")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """Writes one JSON object per step to `<run_dir>/metrics.jsonl` and mirrors scalars to backends.

    Args:
        run_dir: the run's output folder.
        tensorboard: add a `TensorBoardBackend` under `<run_dir>/tensorboard`.
        wandb_project: add a `WandbBackend` (offline unless `$WANDB_MODE` says otherwise) when set.
        resume_from_step: a run resumed from the checkpoint of this step: metrics.jsonl keeps its
            rows up to this step (later ones were written after the checkpoint and are redone),
            TensorBoard purges later events. None: a new run, metrics.jsonl is truncated.
        backends: more `MetricsBackend`s.
        gpu_stats: add `gpu/*` (utilisation, memory; `metrics.gpu.gpu_stats`) to every row when a
            CUDA GPU and nvidia-ml-py are present (nothing on CPU).

    Raises:
        ImportError: wandb_project is set but wandb is not installed.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True,
                 wandb_project: Optional[str] = None, resume_from_step: Optional[int] = None,
                 backends: tuple[MetricsBackend, ...] = (), gpu_stats: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.is_file():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by the crash
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resume_from_step:
                    kept.append(line + "\n")
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self.backends: list[MetricsBackend] = list(backends)
        if wandb_project:  # first, so a missing wandb fails before any file is opened
            self.backends.append(WandbBackend(wandb_project, run_dir))
        self._fh = open(self.path, "a" if resume_from_step is not None else "w")
        if tensorboard:
            try:
                purge = resume_from_step + 1 if resume_from_step is not None else None
                self.backends.append(TensorBoardBackend(Path(run_dir) / "tensorboard", purge_step=purge))
            except ImportError:  # tensorboard is a dependency; keep JSONL working without it
                logger.warning("tensorboard is not installed; metrics go to %s only", self.path)
        self._gpu = gpu_stats

    def write(self, step: int, metrics: dict) -> None:
        """Append `{"step": step, **metrics}` (plus `gpu/*` on a GPU); non-finite floats are written as null."""
        if self._gpu:
            from megatron_rl.metrics.gpu import gpu_stats

            metrics = {**metrics, **gpu_stats()}
        clean = {}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            clean[k] = v
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        self._fh.flush()
        scalars = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for b in self.backends:
            b.log(step, scalars)

    def close(self) -> None:
        self._fh.close()
        for b in self.backends:
            b.close()
