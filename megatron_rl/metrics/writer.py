"""Per-step metrics: always a JSONL file (what tests read), TensorBoard and W&B when enabled."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Writes one JSON object per step to `<run_dir>/metrics.jsonl` and mirrors scalars to TensorBoard.

    Args:
        run_dir: the run's output folder.
        tensorboard: also write TensorBoard events under `<run_dir>/tensorboard`.
        wandb_project: log to Weights & Biases when set and `wandb` is installed (its key comes
            from the environment and is never written here).
        resume_from_step: a run resumed from the checkpoint of this step: metrics.jsonl keeps its
            rows up to this step (later ones were written after the checkpoint and are redone),
            TensorBoard purges later events. None: a new run, metrics.jsonl is truncated.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True,
                 wandb_project: Optional[str] = None, resume_from_step: Optional[int] = None) -> None:
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
        self._fh = open(self.path, "a" if resume_from_step is not None else "w")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = resume_from_step + 1 if resume_from_step is not None else None
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)
            except ImportError:  # tensorboard is a dependency; keep JSONL working without it
                logger.warning("tensorboard is not installed; metrics go to %s only", self.path)
        self._wandb = None
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, dir=str(run_dir))
            except ImportError:
                logger.warning("trainer.wandb is set but wandb is not installed; skipped")

    def write(self, step: int, metrics: dict) -> None:
        """Append `{"step": step, **metrics}`; non-finite floats are written as null."""
        clean = {}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            clean[k] = v
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
