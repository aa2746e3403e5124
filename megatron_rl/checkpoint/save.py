"""Run checkpoints: megatron-core distributed checkpoint (model, optimizer) + JSON run state.

Layout (DESIGN.md "Checkpoints"): `<run_dir>/checkpoints/iter_{step:07d}/` holds `model_optim/`
(dist_checkpointing, torch_dist format), `run_state.json` (step, data cursor, difficulty tracker,
scheduler, RNG) and `config.yaml`; `latest_checkpointed_iteration.txt`, written last, names the
newest complete one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """`<run_dir>/checkpoints/iter_{step:07d}`."""
    return Path(run_dir) / "checkpoints" / f"iter_{step:07d}"


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model, optimizer, scheduler, run_state: dict,
                    config_yaml: str, keep_last_n: int, is_writer: bool = True) -> Path:
    """Write a complete checkpoint of `step`; every trainer rank must call it (collective).

    Args:
        model: list of DDP-wrapped model chunks.
        optimizer / scheduler: megatron-core optimizer and `OptimizerParamScheduler`.
        run_state: JSON-serialisable state (data cursor, difficulty tracker, weight version, ...).
        config_yaml: the resolved config text.
        keep_last_n: older complete checkpoints beyond this many are deleted.
        is_writer: this rank writes the JSON files and the latest marker (global rank 0).

    Returns:
        The checkpoint folder.
    """
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(run_dir, step)
    (ckpt / "model_optim").mkdir(parents=True, exist_ok=True)
    model_sd = {}
    for i, m in enumerate(model):
        model_sd[f"model{i}" if len(model) > 1 else "model"] = m.sharded_state_dict()
    sharded = dict(model_sd)
    sharded["optimizer"] = optimizer.sharded_state_dict(model_sd)
    dist_checkpointing.save(sharded, str(ckpt / "model_optim"))
    if is_writer:
        state = dict(run_state)
        state["step"] = step
        state["scheduler"] = scheduler.state_dict()
        state["torch_rng_state"] = torch.get_rng_state().tolist()
        (ckpt / "run_state.json").write_text(json.dumps(state))
        (ckpt / "config.yaml").write_text(config_yaml)
        tmp = Path(run_dir) / "checkpoints" / (LATEST_FILE + ".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, Path(run_dir) / "checkpoints" / LATEST_FILE)
        _prune(Path(run_dir) / "checkpoints", keep_last_n)
    logger.info("saved checkpoint %s", ckpt)
    return ckpt


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[int]:
    """Step named by `latest_checkpointed_iteration.txt`, or None when there is none."""
    marker = Path(run_dir) / "checkpoints" / LATEST_FILE
    if not marker.is_file():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{marker}: expected an iteration number, got {text!r}")
    return int(text)


def _prune(root: Path, keep_last_n: int) -> None:
    steps = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())
    for step in steps[:-keep_last_n]:
        shutil.rmtree(root / f"iter_{step:07d}", ignore_errors=True)
