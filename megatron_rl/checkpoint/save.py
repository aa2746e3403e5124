"""Run checkpoints: megatron-core distributed checkpoint (model, optimizer) + JSON run state.

Layout (DESIGN.md "Checkpoints"): `<run_dir>/checkpoints/iter_{step:07d}/` holds `model_optim/`
(dist_checkpointing, torch_dist format), `run_state.json` (step, data cursor, difficulty tracker,
scheduler, RNG) and `config.yaml`; `latest_checkpointed_iteration.txt`, written last, names the
newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
RUN_STATE_FILE = "run_state.json"
# The distributed optimizer's per-parameter format: reshardable across TP/PP/DP layouts.
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                     "singleton_local_shards": False}


def _in_process_results_queue() -> None:
    """Saves here are synchronous, so the writer's results never cross a process boundary; give
    megatron-core's torch_dist writer a plain queue instead of the `multiprocessing.Manager().Queue()`
    it creates on first use. That Manager is a server process of its own which outlives a trainer
    killed with SIGKILL (an orphan of ~550 MB per kill)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def _materialize_distributed_optimizer_state(optimizer) -> None:
    """A freshly built distributed optimizer has no Adam state yet (torch allocates it at the first
    step), and its `sharded_state_dict(is_loading=True)` needs the tensors to load into (megatron-core
    0.19 asserts on the empty state without Apex/TE); megatron-core's own loaders allocate them first
    with `_init_optimizer_states_with_dummy_values` (a zero-gradient step). Whatever that step does to
    the parameters (weight decay) is overwritten by the checkpoint's model and optimizer state."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer):
    """megatron-core 0.19's distributed optimizer, loading the `fully_reshardable` format with torch's
    Adam (no Apex / TE: CPU), restores Adam's `step` from the param groups and then copies every
    tensor of Adam's per-parameter state from the checkpoint's tensors, which do not carry `step`
    (a tensor in torch's Adam): `KeyError: 'step'` in `_set_main_param_and_optimizer_states`. For the
    duration of the load the `step` already restored is passed along as its own source (a no-op copy).
    The same load also gives every parameter ONE shared `step` tensor, which torch's foreach Adam then
    increments once per parameter at the next step (step 1 + n_params, not 2: the bias correction, so
    the update, differs from the uninterrupted run); afterwards each parameter gets its own copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            if "step" not in tensors:
                group, order = _opt.model_param_group_index_map[model_param]
                step = _opt.optimizer.state.get(_opt.optimizer.param_groups[group]["params"][order], {}).get("step")
                if isinstance(step, torch.Tensor):
                    tensors = {**tensors, "step": step}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _unwrap(m):
    from megatron.core.distributed import DistributedDataParallel

    return m.module if isinstance(m, DistributedDataParallel) else m


def _model_sharded_state_dict(model) -> dict:
    """Megatron-LM's layout: key `model` (or `model{i}` per virtual-pipeline chunk), tensor keys
    without the DDP wrapper's `module.` prefix (`decoder.layers.0.self_attention...`)."""
    return {f"model{i}" if len(model) > 1 else "model": _unwrap(m).sharded_state_dict(metadata=dict(SHARDING_METADATA))
            for i, m in enumerate(model)}


def capture_rng_state() -> dict:
    """Python, NumPy and torch CPU RNG states as JSON-serialisable values."""
    import random

    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`."""
    import random

    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


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

    _in_process_results_queue()
    ckpt = checkpoint_dir(run_dir, step)
    (ckpt / "model_optim").mkdir(parents=True, exist_ok=True)
    model_sd = _model_sharded_state_dict(model)
    sharded = dict(model_sd)
    sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=dict(SHARDING_METADATA))
    dist_checkpointing.save(sharded, str(ckpt / "model_optim"), content_metadata=dict(SHARDING_METADATA))
    if is_writer:
        state = dict(run_state)
        state["step"] = step
        state["scheduler"] = scheduler.state_dict()
        state["rng"] = capture_rng_state()
        (ckpt / RUN_STATE_FILE).write_text(json.dumps(state))
        (ckpt / "config.yaml").write_text(config_yaml)
        tmp = Path(run_dir) / "checkpoints" / (LATEST_FILE + ".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, Path(run_dir) / "checkpoints" / LATEST_FILE)
        _prune(Path(run_dir) / "checkpoints", keep_last_n)
    logger.info("saved checkpoint %s", ckpt)
    return ckpt


def is_complete(ckpt: Path) -> bool:
    """A checkpoint folder is complete when its run state (written after the tensors) and the
    dist-checkpoint metadata are both there."""
    return (ckpt / RUN_STATE_FILE).is_file() and (ckpt / "model_optim" / "metadata.json").is_file()


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[int]:
    """The step to resume from, or None when `<run_dir>/checkpoints` holds no complete checkpoint.

    `latest_checkpointed_iteration.txt` (written last) names it. Folders of later steps that it does
    not name are half-written (the run died while saving) and are ignored with a warning. When the
    marker is missing or names an incomplete folder (it was deleted or damaged by hand), the newest
    complete folder is used, with a warning.

    Raises:
        ValueError: the marker holds something other than an iteration number.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())
    marker = root / LATEST_FILE
    named = None
    if marker.is_file():
        text = marker.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"{marker}: expected an iteration number, got {text!r}")
        named = int(text)
        if is_complete(checkpoint_dir(run_dir, named)):
            for s in steps:
                if s > named:
                    logger.warning("ignoring %s: written after %s named %d (incomplete save)",
                                   checkpoint_dir(run_dir, s), LATEST_FILE, named)
            return named
        logger.warning("%s names step %d but %s is incomplete or missing", marker, named, checkpoint_dir(run_dir, named))
    complete = [s for s in steps if is_complete(checkpoint_dir(run_dir, s))]
    for s in steps:
        if s not in complete:
            logger.warning("ignoring incomplete checkpoint %s", checkpoint_dir(run_dir, s))
    if complete:
        logger.warning("resuming from the newest complete checkpoint, step %d", complete[-1])
        return complete[-1]
    return None


def load_checkpoint(run_dir: str | os.PathLike, step: int, *, model, optimizer, scheduler,
                    load_optimizer: bool = True) -> dict:
    """Load checkpoint `step` into `model`, `optimizer` and `scheduler`; every rank calls it.

    The tensors are resharded by megatron-core's dist_checkpointing, so the trainer's TP/PP/DP
    layout may differ from the one that saved it. RNG states are restored.

    Returns:
        The run state saved with it (`step`, `data`, `difficulty`, `weight_version`, ...).

    Raises:
        FileNotFoundError: the checkpoint folder or its run state is missing.
        ValueError: a tensor of the checkpoint does not match the model (names the tensor and both
            shapes), e.g. a checkpoint of another model size.
    """
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(run_dir, step)
    if not is_complete(ckpt):
        raise FileNotFoundError(f"{ckpt}: not a complete checkpoint (needs {RUN_STATE_FILE} and model_optim/metadata.json)")
    state = json.loads((ckpt / RUN_STATE_FILE).read_text())
    model_sd = _model_sharded_state_dict(model)
    _check_shapes(model_sd, ckpt / "model_optim")
    sharded = dict(model_sd)
    if load_optimizer:
        _materialize_distributed_optimizer_state(optimizer)
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=dict(SHARDING_METADATA))
    loaded = dist_checkpointing.load(sharded, str(ckpt / "model_optim"))
    for i, m in enumerate(model):
        _unwrap(m).load_state_dict(loaded[f"model{i}" if len(model) > 1 else "model"], strict=True)
    if load_optimizer:
        with _torch_adam_step_kept(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    scheduler.load_state_dict(state["scheduler"])
    if "rng" in state:
        restore_rng_state(state["rng"])
    logger.info("loaded checkpoint %s (step %d)", ckpt, step)
    return state


def _check_shapes(model_sd: dict, path: Path) -> None:
    """Compare the model's global tensor shapes with the checkpoint's, before loading."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = dist_checkpointing.load_tensors_metadata(str(path))
    for sh in nested_values(model_sd):
        if not isinstance(sh, ShardedTensor):
            continue
        other = saved.get(sh.key)
        if other is None:
            raise ValueError(f"checkpoint {path} has no tensor {sh.key!r} (model shape {tuple(sh.global_shape)}); "
                             "was it written for another architecture?")
        if tuple(other.global_shape) != tuple(sh.global_shape):
            hint = ""
            if ("word_embeddings" in sh.key or "output_layer" in sh.key) and \
                    tuple(other.global_shape)[1:] == tuple(sh.global_shape)[1:]:
                hint = ("; the padded vocabulary is a multiple of model.make_vocab_size_divisible_by x TP (as in "
                        "Megatron-LM), so it changes with the TP size: resume with the TP size that wrote the "
                        "checkpoint, or choose make_vocab_size_divisible_by so that both layouts pad alike")
            raise ValueError(f"checkpoint {path}: tensor {sh.key!r} has shape {tuple(other.global_shape)}, "
                             f"the model expects {tuple(sh.global_shape)}{hint}")


def _prune(root: Path, keep_last_n: int) -> None:
    steps = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and is_complete(p))
    for step in steps[:-keep_last_n]:
        shutil.rmtree(root / f"iter_{step:07d}", ignore_errors=True)
