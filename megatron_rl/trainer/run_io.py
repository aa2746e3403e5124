"""The loop's plumbing around a step: the progress bar and the run's distributed checkpoint."""

from __future__ import annotations

import contextlib

__all__ = ["progress_bar", "save_run_checkpoint"]


def progress_bar(run, stack: contextlib.ExitStack):
    """A tqdm bar of the steps on the controller (None elsewhere, or with `trainer.progress_bar` off)."""
    t = run.cfg.trainer
    if not (t.progress_bar and run.is_controller):
        return None
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs then get one line a step instead)
    progress = tqdm(total=t.total_training_steps, initial=run.start_step - 1, desc="RL steps", unit="step",
                    dynamic_ncols=True, disable=None)
    stack.callback(progress.close)
    return progress


def save_run_checkpoint(run, step: int) -> None:
    """Every rank: the distributed checkpoint of `step` with the run state (`Run.state`)."""
    import yaml

    from megatron_rl.checkpoint.save import save_checkpoint
    from megatron_rl.config import config_to_dict

    save_checkpoint(
        run.run_dir, step, model=run.ddp_model, optimizer=run.optimizer, scheduler=run.scheduler,
        run_state=run.state(), config_yaml=yaml.safe_dump(config_to_dict(run.cfg), sort_keys=False),
        keep_last_n=run.cfg.trainer.keep_last_n_checkpoints, is_writer=run.is_controller,
    )
