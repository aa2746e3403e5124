"""The RL training loop: DESIGN.md "One step", read top to bottom in `run_training`.

0 initial weight sync -> per step: 1 draw prompts, 2 rollout, 3 reward, 4 dynamic sampling,
5 advantages (+DAA), 6 old log-probs and PPO updates, 7 weight sync, 8 metrics / eval / checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import yaml

from megatron_rl.config import Config, config_to_dict, save_config
from megatron_rl.trainer.preflight import run_preflight
from megatron_rl.errors import RolloutServerError, WeightSyncError

logger = logging.getLogger(__name__)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Console + `<run_dir>/train.log` handlers with the rank in every line (entry point only)."""
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    if rank != 0:  # the controller narrates; other ranks' INFO lines go to their own log file
        console.setLevel(logging.WARNING)
    root.addHandler(console)
    run_dir.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(run_dir / ("train.log" if rank == 0 else f"train_rank{rank}.log"))
    fh.setFormatter(fmt)
    root.addHandler(fh)
    for noisy in ("httpx", "urllib3", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


_CONTROLLER: dict = {}  # the running controller, for error reports

_TRAINER_ONLY_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "TORCHELASTIC_RUN_ID", "CUDA_DEVICE_MAX_CONNECTIONS", "MEGATRON_RL_USER_OMP_NUM_THREADS")


def rollout_server_env() -> dict[str, str]:
    """The environment of an embedded rollout server: this process's, without the trainer's
    rank variables, and with the user's OMP_NUM_THREADS rather than the one-thread-per-rank value
    the local launcher sets (the server's thread count changes its numerics, so it must not depend
    on the trainer's layout)."""
    env = dict(os.environ)
    user_threads = env.get("MEGATRON_RL_USER_OMP_NUM_THREADS")
    for key in _TRAINER_ONLY_ENV:
        env.pop(key, None)
    if user_threads is not None:
        if user_threads:
            env["OMP_NUM_THREADS"] = user_threads
        else:
            env.pop("OMP_NUM_THREADS", None)
    return env


class _Controller:
    """Rank-0 side: servers, clients, rollout manager, weight sync sender, reward pool.

    Embedded servers are launched first, in a background thread, so that their start-up overlaps
    the trainer's model build; `connect` waits for them.
    """

    def __init__(self, cfg: Config, stack: contextlib.ExitStack) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.cfg = cfg
        self.stack = stack
        self._servers: list = []
        r = cfg.rollout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="server-launch")
        self._launch = self._pool.submit(self._start_servers) if not r.server_urls else None
        stack.callback(self._stop_servers)

    def _start_servers(self) -> list[str]:
        from megatron_rl.rollout.launcher import launch_servers

        cfg, r = self.cfg, self.cfg.rollout
        self._servers = launch_servers(
            r.backend, cfg.model.path, r.num_servers, ports=r.server_ports, log_dir=cfg.run_dir,
            startup_timeout_s=r.startup_timeout_s, env=rollout_server_env(), api_key=r.api_key,
            admin_api_key=r.admin_api_key, random_seed=cfg.trainer.seed,
            enable_deterministic_inference=r.enable_deterministic_inference,
            embedded_args=["--max-batch-size", str(r.server_max_batch_size),
                           # the server's rendezvous / broadcast timeout = the trainer's (a failed
                           # group set-up frees the server's control thread as soon as the trainer gives up)
                           "--weight-sync-timeout-s", str(cfg.weight_sync.timeout_s)],
            sglang_python=r.sglang_python,
            tp_size=r.tp_size, mem_fraction_static=r.mem_fraction_static, skip_tokenizer_init=r.skip_tokenizer_init,
            sglang_args=r.sglang_extra_args,
        )
        return [server.base_url for server in self._servers]

    def _stop_servers(self) -> None:
        if self._launch is not None:
            self._launch.cancel()
            try:
                self._launch.result(timeout=self.cfg.rollout.startup_timeout_s + 30)
            except Exception:  # noqa: BLE001 - the launch error was already raised by connect()
                pass
        for server in self._servers:
            server.stop()
        self._pool.shutdown(wait=False)

    def dead_servers(self) -> str:
        """A report of embedded servers that are no longer running (exit code, log tail), or ""."""
        import signal

        lines = []
        for i, server in enumerate(self._servers):
            code = server.process.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                lines.append(f"rollout server {i} (pid {server.process.pid}) is dead ({how}); last lines of "
                             f"{server.log_path}:\n{server.log_tail(20)}")
        return "\n".join(lines)

    def connect(self, tokenizer) -> None:
        """Wait for the servers, then build clients, the rollout manager and the weight-sync group.

        Raises:
            RolloutServerError: a server did not come up (the message holds its log tail).
        """
        from megatron_rl.rewards.pool import RewardPool
        from megatron_rl.rollout.client import RolloutClient
        from megatron_rl.rollout.fleet import ServerFleet
        from megatron_rl.rollout.manager import RolloutManager
        from megatron_rl.weight_sync.sender import WeightSyncSender

        cfg, r, stack = self.cfg, self.cfg.rollout, self.stack
        urls = self._launch.result() if self._launch is not None else list(r.server_urls)
        self.clients = [RolloutClient(u, api_key=r.api_key, admin_api_key=r.admin_api_key, timeout_s=60.0,
                                      generate_timeout_s=r.timeout_s) for u in urls]
        for c in self.clients:
            stack.callback(c.close)
        self.fleet = ServerFleet(self.clients, self._servers if self._launch is not None else None,
                                 max_restarts=r.max_server_restarts)
        self.reward_pool = stack.enter_context(RewardPool(cfg.reward.num_workers, cfg.reward.timeout_s))
        ob = cfg.reward.overlong_buffer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.manager = RolloutManager(
            self.fleet, tokenizer, self.reward_pool, reward_fn=cfg.reward.reward_fn,
            max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
            correct_score=cfg.reward.correct_score, incorrect_score=cfg.reward.incorrect_score,
            overlong=(ob.enable, ob.len, ob.penalty_factor), seed=cfg.trainer.seed,
            max_concurrency=r.max_concurrency, eos_token_ids=sorted(eos),
        )
        stack.callback(self.manager.close)
        ws = cfg.weight_sync
        self.sender = WeightSyncSender(
            self.clients, master_address=ws.master_address, master_port=ws.master_port, backend=ws.backend,
            bucket_size_mib=ws.bucket_size_mib, timeout_s=ws.timeout_s, load_format=ws.load_format,
        )
        self.sender.init_group()
        stack.callback(self.sender.destroy)

    def prepare_sync(self) -> None:
        """Before a weight sync: bring back servers that were down (restart; re-create the group
        over the servers that are up). Raises `RolloutServerError` when none can be brought back."""
        self.fleet.check_all()
        if self.fleet.recover():
            logger.warning("rollout servers changed (%d up); re-creating the weight-update group",
                           len(self.fleet.up_clients()))
            self.sender.reinit(self.fleet.up_clients())

    def sync(self, named_tensors, version: int) -> dict:
        """Push the weights (DESIGN.md step 7) to every server that is up; group re-created first
        when a previous attempt broke it. Raises `WeightSyncError`."""
        if not self.sender.initialized:
            self.sender.reinit(self.fleet.up_clients())
        expected: dict = {}
        if self.cfg.weight_sync.check_checksums:
            named_tensors = self.sender.checksums(named_tensors, expected)
        metrics = self.sender.sync(named_tensors, weight_version=str(version))
        if expected:
            metrics.update(self.sender.check_checksums(expected))
        metrics["rollout/server_restarts"] = self.fleet.restarts
        metrics["rollout/servers_up"] = len(self.fleet.up_clients())
        return metrics


class TrainingInterrupted(Exception):
    """The run stopped on SIGTERM/SIGUSR1 after writing the checkpoint of `step` (resume by rerunning)."""

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


class _ExitSignal:
    """SIGTERM / SIGUSR1 set a flag that the loop checks after each step (Megatron-LM's
    `--exit-signal-handler`, Slurm's `--signal=USR1@T`); a second signal restores the default
    action and re-raises it, so a stuck run can still be stopped."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, enabled: bool) -> None:
        import signal
        import threading

        self.signal_name: str | None = None
        self._previous: dict = {}
        if not enabled or threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        if self.signal_name is not None:  # second signal: stop now
            self.restore()
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: finishing the current step, then checkpoint and exit", self.signal_name)

    def requested(self) -> bool:
        """True on every rank when any rank got a signal (a MAX all-reduce when world size > 1)."""
        flag = self.signal_name is not None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            t = torch.tensor([int(flag)])
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flag = bool(t.item())
            if flag and self.signal_name is None:
                self.signal_name = "signal on another rank"
        return flag

    def restore(self) -> None:
        import signal

        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


def _layout_hints(t, dp_size: int, use_te: bool) -> list[str]:
    """Memory savers left off where they apply (verl and the 32B recipes turn both on): one line each.

    Args:
        t: the trainer config section; dp_size: data-parallel ranks; use_te: Transformer Engine layers in use.
    """
    hints = []
    if t.tensor_model_parallel_size > 1 and use_te and not t.sequence_parallel:
        hints.append(f"trainer.sequence_parallel is off with tensor_model_parallel_size={t.tensor_model_parallel_size}: "
                     "norm and dropout activations are kept whole on every TP rank; set trainer.sequence_parallel=true "
                     "to split them (verl's default)")
    if dp_size > 1 and not t.use_distributed_optimizer:
        hints.append(f"trainer.use_distributed_optimizer is off with {dp_size} data-parallel ranks: every rank keeps "
                     "the full fp32 master weights and Adam states; set trainer.use_distributed_optimizer=true to "
                     "shard them over DP (verl's default)")
    return hints


def _warn_config_changes(cfg: Config, saved_path: Path) -> None:
    """Log the keys whose values differ from the config the checkpoint was written with."""
    if not saved_path.is_file():
        return
    from megatron_rl.config.loader import _flatten

    saved = yaml.safe_load(saved_path.read_text()) or {}
    old, new = _flatten(saved), _flatten(config_to_dict(cfg))
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key) and "api_key" not in key:
            logger.warning("resuming with a changed setting %s: %r (checkpoint) -> %r (now)", key, old.get(key), new.get(key))


def _sampling_params(cfg: Config) -> dict:
    p = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    if cfg.rollout.top_k != -1:
        p["top_k"] = cfg.rollout.top_k
    return p


def run_training(cfg: Config) -> dict:
    """Train `cfg` end to end; returns the summary written to `<run_dir>/summary.json`.

    Raises:
        ValueError: bad data (file and row named), dynamic sampling that keeps nothing, config errors.
        RolloutServerError / WeightSyncError: a rollout server that does not come up or a failed sync.
    """
    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(run_dir, rank)
    run_preflight(cfg)
    done = _finished_summary(cfg, run_dir)
    if done is not None:
        logger.info("%s already finished all %d steps; nothing to do (summary: %s). Raise "
                    "trainer.total_training_steps to train further, or use another run_dir",
                    run_dir, cfg.trainer.total_training_steps, run_dir / "summary.json")
        return done
    with contextlib.ExitStack() as stack:
        try:
            return _run(cfg, run_dir, rank, stack, t_start)
        except (RolloutServerError, WeightSyncError) as e:
            ctl = _CONTROLLER.get("current")
            report = ctl.dead_servers() if ctl is not None else ""
            if report:
                raise type(e)(f"{e}\n{report}") from e
            raise


def _finished_summary(cfg: Config, run_dir: Path) -> dict | None:
    """The summary of a run dir whose run already completed `total_training_steps` (resume_mode auto)."""
    from megatron_rl.checkpoint.save import latest_checkpoint

    path = run_dir / "summary.json"
    if cfg.trainer.resume_mode != "auto" or not path.is_file():
        return None
    latest = latest_checkpoint(run_dir)
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if latest is not None and latest >= cfg.trainer.total_training_steps and summary.get("steps") == latest:
        return summary
    return None


def _run(cfg: Config, run_dir: Path, rank: int, stack: contextlib.ExitStack, t_start: float) -> dict:
    from transformers import AutoTokenizer

    from megatron_rl.algorithms.advantages import compute_advantages
    from megatron_rl.algorithms.options import ADV_ESTIMATOR_SPECS
    from megatron_rl.algorithms.daa import DifficultyTracker, apply_daa
    from megatron_rl.algorithms.dynamic_sampling import collect_groups
    from megatron_rl.checkpoint.save import latest_checkpoint, load_checkpoint, save_checkpoint
    from megatron_rl.data.dataset import PromptDataset, load_rows
    from megatron_rl.data.prompts import check_prompt_lengths
    from megatron_rl.eval.evaluate import eval_metric_row, evaluate
    from megatron_rl.metrics.writer import MetricsWriter
    from megatron_rl.models.builder import build_model, transformer_config_for, use_te_for, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_model_spec
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.cpu_compat import enable_cpu_compat
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel, world_of_one
    from megatron_rl.trainer.batch import build_train_batch
    from megatron_rl.trainer.policy import PolicyTrainer

    # installed first: a SIGTERM/SIGUSR1 during start-up (model build, server launch, the step-0
    # eval) is acted on before the first step instead of killing the process
    stop = _ExitSignal(enabled=cfg.trainer.exit_signal_handler)
    stack.callback(stop.restore)
    is_controller = rank == 0
    ctl = _Controller(cfg, stack) if is_controller else None
    _CONTROLLER["current"] = ctl
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    enable_cpu_compat()
    t = cfg.trainer
    layout = dict(
        tensor_model_parallel_size=t.tensor_model_parallel_size,
        pipeline_model_parallel_size=t.pipeline_model_parallel_size,
        context_parallel_size=t.context_parallel_size, backend=t.distributed_backend,
        timeout_s=int(t.distributed_timeout_s), seed=t.seed,
    )
    if "WORLD_SIZE" not in os.environ:  # a plain process, not under torchrun/srun: a world of one
        pgs = stack.enter_context(world_of_one(**layout))
    else:
        pgs = initialize_parallel(**layout)
        stack.callback(destroy_parallel)
    if is_controller:
        save_config(cfg, run_dir / "config.yaml")
        for hint in _layout_hints(t, pgs.dp_size, use_te_for(t.transformer_impl)):
            logger.warning(hint)
    torch.manual_seed(t.seed)

    # data first: a bad row or an over-long prompt fails in seconds, before the model is built.
    # Only the controller reads the data; the other ranks receive each step's batch from it.
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows = []
    for f in cfg.data.train_files if is_controller else []:
        train_rows += load_rows(f, adapter=cfg.data.train_adapter)
    if not train_rows and is_controller:
        raise ValueError("data.train_files holds no rows")
    val_rows = []
    for f in cfg.data.val_files if is_controller else []:
        val_rows += load_rows(f, adapter=cfg.data.val_adapter)
    if cfg.eval.max_problems:
        val_rows = val_rows[: cfg.eval.max_problems]
    train_rows = check_prompt_lengths(train_rows, tokenizer, cfg.data.max_prompt_length,
                                      drop=cfg.data.filter_overlong_prompts, what="data.train_files")
    if not train_rows and is_controller:
        raise ValueError("data.train_files: every prompt is longer than data.max_prompt_length")
    val_rows = check_prompt_lengths(val_rows, tokenizer, cfg.data.max_prompt_length,
                                    drop=cfg.data.filter_overlong_prompts, what="data.val_files")

    hf_config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    spec = build_model_spec(hf_config, tensor_model_parallel_size=t.tensor_model_parallel_size,
                              make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    tf_config = transformer_config_for(hf_config, t)
    model = build_model(hf_config, tf_config, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                        pre_process=pgs.is_pipeline_first_stage, post_process=pgs.is_pipeline_last_stage,
                        use_te=use_te_for(t.transformer_impl))
    load_hf_weights(model, cfg.model.path, tp_rank=pgs.tp_rank, tp_size=pgs.tp_size)
    o = cfg.actor.optim
    steps_per_rl_step = (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
    tm = wrap_ddp_and_optimizer(
        model, tf_config, lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
        adam_betas=(o.adam_beta1, o.adam_beta2), adam_eps=o.adam_eps,
        use_distributed_optimizer=t.use_distributed_optimizer,
        lr_warmup_steps=o.lr_warmup_steps * steps_per_rl_step,
        lr_decay_steps=max(t.total_training_steps * steps_per_rl_step, 1), lr_decay_style=o.lr_decay_style,
    )
    ddp_model, optimizer, scheduler = tm.model, tm.optimizer, tm.scheduler
    ref_model = None
    if cfg.actor.use_kl_loss:
        ref_model = build_model(hf_config, tf_config, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                                pre_process=pgs.is_pipeline_first_stage, post_process=pgs.is_pipeline_last_stage,
                                use_te=use_te_for(t.transformer_impl))
        load_hf_weights(ref_model, cfg.model.path, tp_rank=pgs.tp_rank, tp_size=pgs.tp_size)
        ref_model.requires_grad_(False)
        ref_model = [ref_model]
    a = cfg.actor
    trainer = PolicyTrainer(
        ddp_model, optimizer, scheduler, vocab_size=spec.vocab_size, micro_batch_size=a.ppo_micro_batch_size,
        tp_group=pgs.tp if t.tensor_model_parallel_size > 1 else None, ref_model=ref_model,
        dp_group=pgs.dp_cp if pgs.dp_size * pgs.cp_size > 1 else None,
        pp_group=pgs.pp if pgs.pp_size > 1 else None, max_tokens_per_micro_batch=a.token_budget,
        actor=a, max_response_length=cfg.data.max_response_length,
    )

    dataset = PromptDataset(train_rows, seed=t.seed, shuffle=cfg.data.shuffle) if is_controller else None
    daa = cfg.algorithm.daa
    tracker = DifficultyTracker(a0=daa.prior_a, b0=daa.prior_b)
    fg = cfg.algorithm.filter_groups
    gen_batch_size = cfg.data.gen_batch_size or cfg.data.train_batch_size
    eval_len = cfg.eval.max_response_length or cfg.data.max_response_length

    summary: dict = {"run_dir": str(run_dir.resolve()), "config": config_to_dict(cfg)}
    weight_version, total_tokens, start_step, wall_before = 0, 0, 1, 0.0
    resumed_from = latest_checkpoint(run_dir) if t.resume_mode == "auto" else None
    if resumed_from is not None:
        # Exact resume: weights, optimizer, scheduler, RNG, data cursor, difficulty history.
        state = load_checkpoint(run_dir, resumed_from, model=ddp_model, optimizer=optimizer, scheduler=scheduler)
        _warn_config_changes(cfg, run_dir / "checkpoints" / f"iter_{resumed_from:07d}" / "config.yaml")
        if is_controller:
            dataset.load_state_dict(state["data"])
        tracker.load_state_dict(state["difficulty"])
        weight_version = int(state["weight_version"])
        total_tokens = int(state.get("total_generated_tokens", 0))
        wall_before = float(state.get("wall_s", 0.0))
        if "eval_before" in state:
            summary["eval_before"] = state["eval_before"]
        start_step = resumed_from + 1
        summary["resumed_from_step"] = resumed_from
        logger.info("resuming from step %d (%s); next step %d", resumed_from, run_dir / "checkpoints", start_step)
    writer = None
    if is_controller:
        ctl.connect(tokenizer)
        writer = MetricsWriter(run_dir, tensorboard=t.tensorboard, wandb_project="megatron-rl" if t.wandb else None,
                               resume_from_step=resumed_from)
        stack.callback(writer.close)

    tp_group = pgs.tp if pgs.tp_size > 1 else None

    def push_weights(version: int) -> dict:
        """Every rank calls it: the controller sends all stages' HF tensors to the servers; the first
        DP replica's ranks take part in the TP gathers, and each later stage's first TP rank
        forwards its tensors to the controller (DESIGN.md step 7). A failed sync is retried once
        (every rank sends again); a second failure stops the run with `WeightSyncError` before any
        checkpoint of this step is written, so the last checkpoint stays the newest complete one."""
        with torch.no_grad():
            if not is_controller:
                while True:
                    if pgs.dp_rank == 0 and pgs.cp_rank == 0:
                        _send_stage_weights(model, hf_config, pgs)
                    status = _broadcast_batch(None, pgs)
                    if status != _SYNC_RETRY:
                        return {}
            error = None
            for attempt in (1, 2):
                weights = _all_stage_weights(model, hf_config, pgs)
                try:
                    ctl.prepare_sync()
                    metrics = ctl.sync(weights, version)
                    _broadcast_batch(_SYNC_DONE, pgs)
                    if attempt == 2:
                        logger.warning("weight sync to version %d succeeded on the retry", version)
                    return metrics
                except (WeightSyncError, RolloutServerError) as e:
                    for _ in weights:  # drain: the other stages' sends and the TP gathers stay in step
                        pass
                    error = e
                    if attempt == 1:
                        logger.warning("weight sync to version %d failed (%s); retrying once with a new group",
                                       version, e)
                        ctl.sender.destroy()
                        _broadcast_batch(_SYNC_RETRY, pgs)
            _broadcast_batch(RuntimeError(f"weight sync failed twice: {error}"), pgs)
            raise WeightSyncError(
                f"weight sync to version {version} failed twice, the run stops: {error}. The newest checkpoint "
                f"in {run_dir / 'checkpoints'} is intact; rerun the same command to resume from it") from error

    def resync_now(clients) -> None:
        """A restarted server while no other was up (`ServerFleet`): re-create the group, push the
        current weights; the other ranks are waiting for the step's batch and join the sync."""
        logger.warning("re-syncing %d rollout server(s) to weight version %d", len(clients), weight_version)
        _broadcast_batch(_RESYNC, pgs)
        m = push_weights(weight_version)  # prepare_sync re-creates the group over the servers now up
        logger.warning("re-sync to weight version %d done in %.2f s", weight_version, m.get("weight_sync/time_s", 0.0))

    if is_controller:
        ctl.fleet.set_resync(resync_now)

    def run_eval(tag: str) -> dict:
        if not is_controller:
            return {}
        logger.info("eval %s: %d problems x %d samples + greedy ...", tag, len(val_rows), cfg.eval.n)
        res = evaluate(ctl.manager, val_rows, n=cfg.eval.n, temperature=cfg.eval.temperature,
                       top_p=cfg.eval.top_p, seed=cfg.eval.seed, max_new_tokens=eval_len, tag=tag)
        logger.info("eval %s: %s", tag, {k: round(v, 4) for k, v in res.items() if isinstance(v, float)})
        return res

    # 0. initial sync: the servers sample only at the trainer's weight version.
    sync_metrics = push_weights(weight_version)
    if cfg.eval.before_train and val_rows and resumed_from is None:
        summary["eval_before"] = run_eval("eval_before")
        writer.write(0, eval_metric_row(summary["eval_before"]))

    progress = None
    if t.progress_bar and is_controller:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (logs then get one line a step instead)
        progress = tqdm(total=t.total_training_steps, initial=start_step - 1, desc="RL steps", unit="step",
                        dynamic_ncols=True, disable=None)
        stack.callback(progress.close)
    sampling = _sampling_params(cfg)
    over_sampling = bool(cfg.rollout.over_sampling_batch_size) and fg.enable and not cfg.rollout.deterministic
    if cfg.rollout.over_sampling_batch_size and not over_sampling and is_controller:
        logger.warning("rollout.over_sampling_batch_size is ignored: it needs algorithm.filter_groups.enable and "
                       "rollout.deterministic=false (which groups finish first depends on timing)")

    def checkpoint(step: int) -> None:
        save_checkpoint(
            run_dir, step, model=ddp_model, optimizer=optimizer, scheduler=scheduler,
            run_state={"data": dataset.state_dict() if dataset is not None else {}, "difficulty": tracker.state_dict(),
                       "weight_version": weight_version, "total_generated_tokens": total_tokens,
                       "wall_s": wall_before + time.perf_counter() - t_start,
                       **({"eval_before": summary["eval_before"]} if "eval_before" in summary else {})},
            config_yaml=yaml.safe_dump(config_to_dict(cfg), sort_keys=False),
            keep_last_n=t.keep_last_n_checkpoints, is_writer=is_controller,
        )

    if start_step <= t.total_training_steps and stop.requested():  # a signal during start-up or the step-0 eval
        logger.warning("%s received before step %d: exiting without training it", stop.signal_name, start_step)
        raise TrainingInterrupted(start_step - 1, run_dir, trained=False)
    for step in range(start_step, t.total_training_steps + 1):
        t_step = time.perf_counter()
        timings: dict = {"timing/generate_s": 0.0, "timing/reward_s": 0.0, "rollout/aborted": 0}
        q_hats: dict[str, float] = {}
        generated = {"tokens": 0, "responses": 0, "checksum": 0}

        def prepare():
            """Steps 1-5 on the controller: the step's groups, their advantages and the batch."""
            # 1-3. draw prompts, rollout, reward (one generation batch per call).
            def generate_batch(batch_idx: int):
                t_gen = time.perf_counter()
                try:
                    return _generate_batch(batch_idx)
                finally:
                    in_batches[0] += time.perf_counter() - t_gen

            def _generate_batch(batch_idx: int):
                if over_sampling:  # launch more prompts than needed, abort the rest once the batch is full
                    rows = dataset.next_batch(cfg.rollout.over_sampling_batch_size)
                    groups, tm = ctl.manager.generate_groups(
                        rows, n=cfg.rollout.n, sampling_params=sampling, step=step, gen_batch=batch_idx,
                        stop_after=cfg.data.train_batch_size - kept_so_far[0], keep_fn=keep)
                    kept_so_far[0] += sum(1 for g in groups if keep(g))
                else:
                    rows = dataset.next_batch(gen_batch_size)
                    groups, tm = ctl.manager.generate_groups(rows, n=cfg.rollout.n, sampling_params=sampling,
                                                             step=step, gen_batch=batch_idx)
                for k, v in tm.items():
                    timings[k] = timings.get(k, 0) + v
                for g in groups:
                    k_correct, g_valid = g.num_correct, g.num_valid
                    generated["tokens"] += sum(len(s.response_ids) for s in g.samples)
                    generated["responses"] += len(g.samples)
                    generated["checksum"] = (generated["checksum"] + sum(map(token_checksum, (
                        s.response_ids for s in g.samples)))) % _CHECKSUM_PRIME
                    if 1 <= k_correct <= g_valid - 1:
                        q_hats[g.group_uid] = tracker.estimate(g.prompt_key, k_correct, g_valid, daa.difficulty)
                    if g_valid:  # a group whose every reward failed says nothing about the prompt
                        tracker.record(g.prompt_key, k_correct, g_valid)
                return groups

            def keep(group) -> bool:
                values = group.metric_values(fg.metric)
                return len(values) >= 2 and max(values) > min(values)

            kept_so_far = [0]
            in_batches = [0.0]  # seconds inside generate_batch (rollout + reward + per-group bookkeeping)

            # 4. dynamic sampling (or keep every group of one batch).
            t_collect = time.perf_counter()
            kept, ds_stats = collect_groups(
                generate_batch, train_batch_size=cfg.data.train_batch_size,
                max_num_gen_batches=fg.max_num_gen_batches, on_exhausted=fg.on_exhausted,
                ppo_mini_batch_size=a.ppo_mini_batch_size, dp_size=pgs.dp_size, enable=fg.enable, keep_fn=keep,
                solve_rate_fn=lambda g: g.num_correct / max(g.num_valid, 1),
            )
            # the group filter and the bookkeeping between generation batches, outside the batches
            timings["timing/filter_s"] = time.perf_counter() - t_collect - in_batches[0]
            samples = [s for g in kept for s in g.samples]

            # 5. advantages, then DAA on hard prompts' correct responses.
            t_adv = time.perf_counter()
            rewards = torch.tensor([s.score for s in samples], dtype=torch.float64)
            valid = torch.tensor([not s.failed for s in samples], dtype=torch.bool)
            uids = [s.group_uid for s in samples]
            resp_mask = None
            if ADV_ESTIMATOR_SPECS.get(cfg.algorithm.adv_estimator).needs_response_mask:
                width = max(len(s.response_ids) for s in samples)
                resp_mask = torch.zeros((len(samples), width), dtype=torch.bool)
                for i, s in enumerate(samples):
                    resp_mask[i, : len(s.response_ids)] = not s.failed
            adv = compute_advantages(
                cfg.algorithm.adv_estimator, rewards, uids, valid, response_mask=resp_mask,
                grpo_std=cfg.algorithm.grpo_std, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            )
            daa_stats = {}
            if daa.enable:
                group_index = torch.tensor([i for i, g in enumerate(kept) for _ in g.samples], dtype=torch.long)
                q = torch.tensor([q_hats.get(g.group_uid, 1.0) for g in kept], dtype=torch.float64)
                eligible = torch.tensor([g.group_uid in q_hats for g in kept], dtype=torch.bool)
                correct = torch.tensor([s.acc and not s.failed for s in samples], dtype=torch.bool)
                adv, daa_stats = apply_daa(adv, correct, group_index, q, eligible, factor=daa.factor,
                                           hard_threshold=daa.hard_threshold, max_factor=daa.max_factor,
                                           gamma=daa.gamma)
            trained = [not s.failed and not (a.mask_truncated and s.truncated) for s in samples]

            # 6. old log-probs (same layout as the update), then PPO mini-batch updates.
            batch = build_train_batch(
                [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                advantages=adv.tolist(), rollout_logprobs=[s.rollout_logprobs for s in samples],
                trained=trained, pad_id=pad_id,
                pad_to_multiple_of=t.tensor_model_parallel_size if t.sequence_parallel else 1,
            )
            return batch, samples, kept, ds_stats, daa_stats, t_adv

        # 1-5 happen on the controller; the other ranks receive the batch (or the controller's error)
        samples = kept = None
        ds_stats, daa_stats, t_adv = {}, {}, t_step
        if is_controller:
            try:
                batch, samples, kept, ds_stats, daa_stats, t_adv = prepare()
            except Exception as e:
                _broadcast_batch(RuntimeError(f"{type(e).__name__}: {e}"), pgs)
                raise
            _broadcast_batch(batch, pgs)
        else:
            batch = _broadcast_batch(None, pgs)
            while isinstance(batch, str) and batch == _RESYNC:
                push_weights(weight_version)
                batch = _broadcast_batch(None, pgs)
        t_lp = time.perf_counter()
        mini_seqs = a.ppo_mini_batch_size * cfg.rollout.n
        batch.old_logprobs = trainer.compute_logprobs(batch, mini_batch_sequences=mini_seqs)
        if ref_model is not None:
            batch.ref_logprobs = trainer.compute_logprobs(batch, model=ref_model, mini_batch_sequences=mini_seqs)
        t_upd = time.perf_counter()
        history = trainer.update(batch, mini_batch_sequences=mini_seqs, ppo_epochs=a.ppo_epochs)
        t_sync = time.perf_counter()

        # 7. weight sync: the servers move to the new version before the next rollout.
        weight_version += 1
        sync_metrics = push_weights(weight_version)
        t_end = time.perf_counter()

        # 8. metrics, eval, checkpoint.
        total_tokens += generated["tokens"]  # (0 on non-controller ranks)
        if is_controller:
            m = _step_metrics(samples, kept, ds_stats, daa_stats, history, cfg)
            with torch.no_grad():
                diff = (batch.old_logprobs - batch.rollout_logprobs).abs()[batch.loss_mask]
            m["train/rollout_logprob_abs_diff"] = float(diff.mean()) if diff.numel() else 0.0
            m.update(timings)
            m.update({
                "timing/advantage_s": t_lp - t_adv, "timing/old_logprob_s": t_upd - t_lp,
                "timing/update_s": t_sync - t_upd, "timing/weight_sync_s": t_end - t_sync,
                "timing/step_s": t_end - t_step,
                "perf/generated_tokens": generated["tokens"], "perf/total_generated_tokens": total_tokens,
                "rollout/token_checksum": generated["checksum"],
                "perf/generate_tokens_per_s": generated["tokens"] / max(timings["timing/generate_s"], 1e-9),
                "perf/train_tokens_per_s": int(batch.loss_mask.sum()) / max(t_sync - t_lp, 1e-9),
                "weight_sync/version": weight_version,
            })
            m.update({k: v for k, v in sync_metrics.items() if isinstance(v, (int, float))})
            if cfg.eval.interval and step % cfg.eval.interval == 0 and step != t.total_training_steps and val_rows:
                ev = run_eval(f"eval_step{step}")
                m.update(eval_metric_row(ev))
            writer.write(step, m)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(acc=f"{m['train/acc']:.2f}", kept=m["train/kept_groups"],
                                     len=f"{m['response_length/mean']:.0f}")
            logger.info("step %d: acc %.3f score %.3f kept %d gen_batches %d loss %.4f grad_norm %.3f (%.1fs)",
                        step, m["train/acc"], m["train/score"], m["train/kept_groups"], m["train/num_gen_batches"],
                        m["train/loss"], m["train/grad_norm"], m["timing/step_s"])
        stopping = stop.requested() and step != t.total_training_steps
        if (t.save_interval and step % t.save_interval == 0) or (t.save_last and step == t.total_training_steps) \
                or stopping:
            checkpoint(step)
        if stopping:
            logger.warning("%s received: stopped after step %d with a checkpoint; run the same command to resume",
                           stop.signal_name, step)
            raise TrainingInterrupted(step, run_dir)

    if cfg.eval.after_train and val_rows and is_controller:
        summary["eval_after"] = run_eval("eval_after")
        writer.write(t.total_training_steps, eval_metric_row(summary["eval_after"]))
    summary["steps"] = t.total_training_steps
    summary["wall_s"] = wall_before + time.perf_counter() - t_start
    summary["total_generated_tokens"] = total_tokens
    if "eval_before" in summary and "eval_after" in summary:
        n = cfg.eval.n
        summary["delta_avg@%d" % n] = summary["eval_after"][f"avg@{n}"] - summary["eval_before"][f"avg@{n}"]
    if is_controller:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info("done in %.1fs; summary in %s", summary["wall_s"], run_dir / "summary.json")
    return summary


_RESYNC = "__megatron_rl_resync__"
"""Controller -> other ranks while they wait for a batch: take part in a weight sync now."""
_SYNC_DONE = "__megatron_rl_sync_done__"
_SYNC_RETRY = "__megatron_rl_sync_retry__"
"""Controller -> other ranks after their sends of a sync: done, or send everything again."""


def _broadcast_batch(batch, pgs):
    """Controller (global rank 0) -> every rank: the step's `TrainBatch`, or the exception that
    stopped the controller (re-raised on every rank so that no rank waits for a batch forever)."""
    import torch.distributed as dist

    if pgs.world_size == 1:
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        if pgs.rank == 0:
            return None
        raise RuntimeError(f"the controller (rank 0) stopped: {type(box[0]).__name__}: {box[0]}")
    return box[0]


def _all_stage_weights(model, hf_config, pgs):
    """On the controller: this stage's HF tensors (TP-gathered), then every later pipeline
    stage's, received from that stage's first TP rank of the first DP replica, in stage order."""
    import torch.distributed as dist

    from megatron_rl.models.hf_weights import iter_hf_weights

    yield from iter_hf_weights(model, hf_config, tp_group=pgs.tp if pgs.tp_size > 1 else None)
    for stage in range(1, pgs.pp_size):
        src = dist.get_global_rank(pgs.pp, stage)
        while True:
            box = [None]
            dist.recv_object_list(box, src=src)
            if box[0] is None:
                break
            name, shape, dtype = box[0]
            tensor = torch.empty(shape, dtype=dtype)
            dist.recv(tensor, src=src)
            yield name, tensor


def _send_stage_weights(model, hf_config, pgs) -> None:
    """The other ranks of the first DP replica: take part in this stage's TP gathers; a later
    stage's first TP rank sends the tensors to the controller (see `_all_stage_weights`)."""
    import torch.distributed as dist

    from megatron_rl.models.hf_weights import iter_hf_weights

    sender = pgs.pp_rank > 0 and pgs.tp_rank == 0
    for name, tensor in iter_hf_weights(model, hf_config, tp_group=pgs.tp if pgs.tp_size > 1 else None):
        if sender:
            dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0)
            dist.send(tensor.contiguous(), dst=0)
    if sender:
        dist.send_object_list([None], dst=0)


_CHECKSUM_PRIME = 2_147_483_647  # 2^31 - 1: sums stay exact in a float64 metric


def token_checksum(tokens) -> int:
    """A position-sensitive hash of one response's token ids, in [0, 2^31 - 1): the step's
    `rollout/token_checksum` is the sum over every sampled response (kept or filtered out) modulo
    the same prime, so two runs that sampled the same tokens log the same integer."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % _CHECKSUM_PRIME
    return h


def _step_metrics(samples, kept, ds_stats: dict, daa_stats: dict, history: list[dict], cfg: Config) -> dict:
    lengths = [len(s.response_ids) for s in samples]
    n = max(len(samples), 1)
    m = {
        "train/score": sum(s.score for s in samples) / n,
        "train/acc": sum(s.acc for s in samples) / n,
        "train/format_valid": sum(s.format_valid for s in samples) / n,
        "reward/failed": sum(s.failed for s in samples),
        "reward/overlong_penalty_mean": sum(s.overlong_penalty for s in samples) / n,
        "response_length/mean": sum(lengths) / n,
        "response_length/max": max(lengths) if lengths else 0,
        "response_length/clip_ratio": sum(s.truncated for s in samples) / n,
        "train/num_gen_batches": ds_stats.get("num_gen_batches", 1),
        "train/kept_groups": ds_stats.get("kept_groups", len(kept)),
        "train/generated_groups": ds_stats.get("generated_groups", len(kept)),  # solve_* counts are over these
        "train/solve_none": ds_stats.get("solve_none", 0),
        "train/solve_all": ds_stats.get("solve_all", 0),
        "train/daa_amplified_frac": float(daa_stats.get("amplified_frac", 0.0)),
        "train/daa_factor_mean": float(daa_stats.get("factor_mean", 1.0)),
        "train/num_updates": len(history),
    }
    if history:
        for key in history[0]:
            vals = [h[key] for h in history if h.get(key) is not None and not (isinstance(h[key], float) and math.isnan(h[key]))]
            m[key] = sum(vals) / len(vals) if vals else float("nan")
    else:
        m.update({"train/loss": float("nan"), "train/grad_norm": float("nan")})
    return m
