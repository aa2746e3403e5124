"""The RL training loop: DESIGN.md "One step", read top to bottom in `_train`.

Set-up (`trainer/setup.py`) returns a `Run`; the weights are published (step 0); then per step:
produce (steps 1-5 on the controller: prompts, rollout, reward, dynamic sampling, advantages)
-> train (step 6 on every rank: old log-probs and PPO updates) -> publish the weights (step 7)
-> record (step 8: metrics, evaluation, checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.errors import RolloutServerError, WeightSyncError
from megatron_rl.parallel.control import (ControllerFailed, PhaseDone, broadcast_object, receive_from_controller,
                                          send_to_ranks)
from megatron_rl.trainer.async_producer import start_async_producer
from megatron_rl.trainer.run_io import progress_bar, save_run_checkpoint
from megatron_rl.trainer.signals import ExitSignal, TrainingInterrupted
from megatron_rl.trainer.step_metrics import step_metrics, step_progress
from megatron_rl.weight_sync.publisher import SyncPlan

logger = logging.getLogger(__name__)

__all__ = ["TrainingInterrupted", "run_training"]


def run_training(cfg: Config) -> dict:
    """Train `cfg` end to end; returns the summary written to `<run_dir>/summary.json`.

    Raises:
        ValueError: bad data (file and row named), dynamic sampling that keeps nothing, config errors.
        RolloutServerError / WeightSyncError: a rollout server that does not come up or a failed sync.
        TrainingInterrupted: SIGTERM / SIGUSR1 stopped the run (after a checkpoint, if a step ran).
    """
    from megatron_rl.models.hub import resolve_config_models
    from megatron_rl.trainer.preflight import run_preflight
    from megatron_rl.trainer.setup import setup_logging

    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(run_dir, rank)
    resolve_config_models(cfg)  # hub ids (ORG/NAME[@REV]) -> the cached snapshot folder
    run_preflight(cfg)
    done = _finished_summary(cfg, run_dir)
    if done is not None:
        logger.info("%s already finished all %d steps; nothing to do (summary: %s). Raise "
                    "trainer.total_training_steps (or trainer.max_generated_tokens) to train further, or use "
                    "another run_dir", run_dir, done.get("steps"), run_dir / "summary.json")
        return done
    with contextlib.ExitStack() as stack:
        # installed first: a SIGTERM/SIGUSR1 during start-up (model build, server launch, the step-0
        # eval) is acted on before the first step instead of killing the process
        stop = ExitSignal(enabled=cfg.trainer.exit_signal_handler)
        stack.callback(stop.restore)
        run = None
        try:
            from megatron_rl.trainer.setup import build_run

            run = build_run(cfg, stack, rank, t_start)
            return _train(run, stop, stack)
        except (RolloutServerError, WeightSyncError) as e:
            report = run.engines.dead_servers() if run is not None and run.engines is not None else ""
            if report:
                raise type(e)(f"{e}\n{report}") from e
            raise


def _finished_summary(cfg: Config, run_dir: Path) -> dict | None:
    """The summary of a run dir whose run already completed `total_training_steps` or reached
    `max_generated_tokens` (resume_mode auto)."""
    from megatron_rl.checkpoint.save import latest_checkpoint

    path = run_dir / "summary.json"
    if cfg.trainer.resume_mode != "auto" or not path.is_file():
        return None
    latest = latest_checkpoint(run_dir)
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if latest is None or summary.get("steps") != latest:
        return None
    budget = cfg.trainer.max_generated_tokens
    if latest >= cfg.trainer.total_training_steps or (budget and summary.get("total_generated_tokens", 0) >= budget):
        return summary
    return None


def _train(run, stop: ExitSignal, stack: contextlib.ExitStack) -> dict:
    """Step 0 (publish, evaluate), the steps, the final evaluation and the summary."""
    from megatron_rl.eval.evaluate import eval_metric_row

    cfg, t = run.cfg, run.cfg.trainer
    if run.is_controller:  # an engine restarted while none other was up: publish the current weights
        run.engines.fleet.set_resync(lambda clients: _resync(run))
    # 0. the engines sample only at the trainer's weight version.
    run.publisher.publish(run.weight_version)
    if cfg.eval.before_train and cfg.data.val_files and run.resumed_from is None:
        ev = _evaluate(run, "eval_before")
        if ev:
            run.summary["eval_before"] = ev
            run.writer.write(0, eval_metric_row(ev))
    progress = progress_bar(run, stack)
    # resumed at its token budget (stopped there before summary.json was written): only finish
    end = run.start_step - 1 if 0 < t.max_generated_tokens <= run.total_tokens else t.total_training_steps
    if run.start_step <= end and stop.requested():  # a signal during start-up or step-0 eval
        logger.warning("%s received before step %d: exiting without training it", stop.signal_name, run.start_step)
        raise TrainingInterrupted(run.start_step - 1, run.run_dir, trained=False)
    run.ahead = start_async_producer(run, end, stack)  # trainer.max_staleness > 0 only
    step = run.start_step - 1  # the last step run: none yet (the checkpoint resumed from)
    run.t_steps = time.perf_counter()
    for step in range(run.start_step, end + 1):
        t_step = time.perf_counter()
        produced, batch = _produce(run, step)
        times = _train_step(run, batch, produced, t_step)
        tokens_before = run.total_tokens  # every rank's: broadcast after each step when counted
        run.total_tokens += produced.generated_tokens if produced is not None else 0
        last = step == end or _budget_reached(run)
        ev = {}  # a periodic evaluation, not at the last step (the final one follows)
        if cfg.eval.due(step, tokens_before, run.total_tokens) and not last and cfg.data.val_files:
            ev = _evaluate(run, f"eval_step{step}")
        if run.is_controller:
            _record(run, step, produced, batch, times, progress, ev)
        stopping = stop.requested() and not last
        if (t.save_interval and step % t.save_interval == 0) or (t.save_last and last) or stopping:
            save_run_checkpoint(run, step)
        if stopping:
            logger.warning("%s received: stopped after step %d with a checkpoint; run the same command to resume",
                           stop.signal_name, step)
            raise TrainingInterrupted(step, run.run_dir)
        if last:
            break
    return _finish(run, step)


def _budget_reached(run) -> bool:
    """`trainer.max_generated_tokens` reached after this step. Only the controller counts tokens:
    it broadcasts its running total (also for `eval.token_interval`), so every rank takes the same
    decisions (and logs the same total)."""
    budget = run.cfg.trainer.max_generated_tokens
    if not (budget or run.cfg.eval.token_interval):
        return False
    run.total_tokens = broadcast_object(run.total_tokens, src=0, world_size=run.pgs.world_size)
    if budget and run.total_tokens >= budget:
        logger.info("%d generated tokens >= trainer.max_generated_tokens %d: this step is the last",
                    run.total_tokens, budget)
        return True
    return False


def _produce(run, step: int):
    """Steps 1-5 on the controller; the other ranks receive the batch (taking part in any weight
    sync the controller starts meanwhile), or the controller's error."""
    if not run.is_controller:
        msg = receive_from_controller(run.pgs)
        while isinstance(msg, SyncPlan):  # an engine restarted mid-rollout: take part in its re-sync
            run.publisher.follow(msg)
            msg = receive_from_controller(run.pgs)
        return None, msg
    try:
        if run.ahead is not None:  # produced ahead on the producer's thread (trainer/async_producer.py)
            produced, waited = run.ahead.take(step, resync=lambda: _resync(run))
            produced.timings["timing/wait_rollout_s"] = waited
            run.produced_state = produced.state
        else:
            produced = run.producer.produce(step)
    except Exception as e:
        send_to_ranks(ControllerFailed(f"{type(e).__name__}: {e}"), run.pgs)
        raise
    send_to_ranks(produced.batch.for_broadcast(), run.pgs)  # routing rows: handed out by the policy
    return produced, produced.batch


def _train_step(run, batch, produced, t_step: float) -> dict:
    """Step 6 (old log-probs, reference log-probs, PPO mini-batch updates) and step 7 (publish)."""
    a = run.cfg.actor
    if run.colocation is not None:  # engines release, trainer onloads (issue 17)
        run.colocation.before_train()
    t_lp = time.perf_counter()
    mini_seqs = a.ppo_mini_batch_size * run.cfg.rollout.n
    batch.old_logprobs = run.policy.old_logprobs(batch, mini_batch_sequences=mini_seqs)  # actor.old_logprob_source
    if run.ref_model is not None:
        batch.ref_logprobs = run.policy.compute_logprobs(batch, model=run.ref_model, mini_batch_sequences=mini_seqs)
    t_upd = time.perf_counter()
    history = run.policy.update(batch, mini_batch_sequences=mini_seqs, ppo_epochs=a.ppo_epochs)
    if run.colocation is not None:  # trainer offloads before the engines resume
        run.colocation.after_train()
    t_sync = time.perf_counter()
    run.weight_version += 1
    # asynchronous: the next step is generating meanwhile (pause -> update -> continue, rollout.pause_mode)
    sync_metrics = run.publisher.publish(run.weight_version, live=run.ahead is not None)
    if run.colocation is not None:
        sync_metrics = {**sync_metrics, **run.colocation.metrics()}
    if run.ahead is not None:  # admits the next step's generation; frees a waiting re-sync
        run.ahead.published(run.weight_version)
    t_end = time.perf_counter()
    t_adv, sync = produced.advantage_started if produced is not None else t_step, sync_metrics
    return {"advantage": t_lp - t_adv, "old_logprob": t_upd - t_lp, "update": t_sync - t_upd, "history": history,
            "weight_sync": t_end - t_sync, "step": t_end - t_step, "sync": {**sync, **run.policy.routing_metrics}}


def _record(run, step: int, produced, batch, times: dict, progress, ev: dict) -> None:
    """Step 8 on the controller: the metrics row (with the step's evaluation `ev`, if any), the
    progress line."""
    from megatron_rl.eval.evaluate import eval_metric_row

    cfg = run.cfg
    m = step_metrics(produced, batch, times["history"], times, times["sync"], run.weight_version, run.total_tokens)
    if ev:
        m.update(eval_metric_row(ev))
    run.writer.write(step, m)
    if progress is not None:
        progress.update(1)
        progress.set_postfix(acc=f"{m['train/acc']:.2f}", kept=m["train/kept_groups"],
                             len=f"{m['response_length/mean']:.0f}")
    now = time.perf_counter()
    where = step_progress(step, cfg.trainer.total_training_steps, run.start_step, now - run.t_steps,
                          run.wall_before + now - run.t_start)
    logger.info("step %d: acc %.3f score %.3f kept %d gen_batches %d loss %.4f grad_norm %.3f (%.1fs) [%s]",
                step, m["train/acc"], m["train/score"], m["train/kept_groups"], m["train/num_gen_batches"],
                m["train/loss"], m["train/grad_norm"], m["timing/step_s"], where)


def _resync(run) -> None:
    """A restarted engine while no other was up (`ServerFleet`): the other ranks, waiting for the step's
    batch or an evaluation's end, get the publisher's plan instead and take part. Asynchronous mode, off
    the main thread: `AsyncProducer.resync_from_thread` (to the main thread, or here while it evaluates)."""
    if run.ahead is not None and threading.current_thread() is not threading.main_thread():
        return run.ahead.resync_from_thread(lambda: _publish_again(run))
    _publish_again(run)


def _publish_again(run) -> None:
    logger.warning("re-syncing the rollout servers to weight version %d", run.weight_version)
    m = run.publisher.publish(run.weight_version)
    logger.warning("re-sync to weight version %d done in %.2f s", run.weight_version, m.get("weight_sync/time_s", 0.0))


def _evaluate(run, tag: str) -> dict:
    """Held-out evaluation through the engines; every rank calls it at the same point. The
    controller evaluates (an engine restarted meanwhile is re-synced with every rank taking part:
    the others wait on the channel for the publisher's plans until `PhaseDone`); {} elsewhere and
    when there are no held-out rows."""
    from megatron_rl.eval.evaluate import evaluate

    if not run.is_controller:
        msg = receive_from_controller(run.pgs)
        while isinstance(msg, SyncPlan):
            run.publisher.follow(msg)
            msg = receive_from_controller(run.pgs)
        return {}
    cfg, res = run.cfg, {}
    try:
        if run.val_rows:
            logger.info("eval %s: %d problems x %d samples + greedy on weight version %d ...", tag,
                        len(run.val_rows), cfg.eval.n, run.weight_version)
            with run.ahead.evaluating(lambda: _publish_again(run)) if run.ahead else contextlib.nullcontext():
                res = evaluate(run.producer.manager, run.val_rows, n=cfg.eval.n, temperature=cfg.eval.temperature,
                               top_p=cfg.eval.top_p, seed=cfg.eval.seed,
                               max_new_tokens=cfg.eval.max_response_length or cfg.data.max_response_length, tag=tag)
            res["weight_version"] = run.weight_version  # the published weights it ran on (summary.json)
            logger.info("eval %s: %s", tag, {k: round(v, 4) for k, v in res.items() if isinstance(v, float)})
    except Exception as e:
        send_to_ranks(ControllerFailed(f"{type(e).__name__}: {e}"), run.pgs)
        raise
    send_to_ranks(PhaseDone(tag), run.pgs)
    return res


def _finish(run, step: int) -> dict:
    """The final evaluation and `summary.json` after `step`, the last step run."""
    from megatron_rl.eval.evaluate import eval_metric_row

    cfg, summary = run.cfg, run.summary
    if run.ahead is not None:  # a token budget can end the run before the steps produced ahead
        run.ahead.close()
    if cfg.eval.after_train and cfg.data.val_files:
        ev = _evaluate(run, "eval_after")
        if ev:
            summary["eval_after"] = ev
            run.writer.write(step, eval_metric_row(ev))
    summary["steps"] = step
    summary["wall_s"] = run.wall_before + time.perf_counter() - run.t_start
    summary["total_generated_tokens"] = run.total_tokens
    if "eval_before" in summary and "eval_after" in summary:
        n = cfg.eval.n
        summary["delta_avg@%d" % n] = summary["eval_after"][f"avg@{n}"] - summary["eval_before"][f"avg@{n}"]
    if run.is_controller:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info("done in %.1fs; summary in %s", summary["wall_s"], run.run_dir / "summary.json")
    return summary
