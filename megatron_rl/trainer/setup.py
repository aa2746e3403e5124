"""Set-up of one training run: logging, process groups, data, the policy, engines, resume state.

`build_run` returns a `Run` that the loop (`trainer/loop.py`) drives step by step; every
resource it opens is registered on the caller's `ExitStack`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from megatron_rl.config import Config, config_to_dict, save_config

logger = logging.getLogger(__name__)

__all__ = ["Run", "build_run", "layout_hints", "setup_logging"]


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


def layout_hints(t, dp_size: int, use_te: bool) -> list[str]:
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


@dataclass
class Run:
    """Everything a running training job holds; built by `build_run`.

    Attributes (the controller is global rank 0; `None` / empty on other ranks where noted):
        model: this rank's model chunk (unwrapped `GPTModel`); ddp_model: `[DDP(model)]`.
        policy: the `PolicyTrainer` (log-probs and PPO updates).
        ref_model: `[reference model]` when `actor.use_kl_loss`, else None.
        dataset: the `PromptDataset` (controller); val_rows: held-out rows (controller).
        tracker: the DAA `DifficultyTracker` (all ranks; only the controller's records).
        engines / producer / writer: controller only.
        publisher: the `WeightPublisher` (all ranks).
        weight_version / total_tokens / start_step / wall_before / resumed_from: resume state.
        summary: the dict written to `summary.json`.
    """

    cfg: Config
    run_dir: Path
    rank: int
    pgs: object
    t_start: float
    hf_config: dict = field(default_factory=dict)
    tokenizer: object = None
    pad_id: int = 0
    train_rows: list = field(default_factory=list)
    val_rows: list = field(default_factory=list)
    model: object = None
    ddp_model: object = None
    optimizer: object = None
    scheduler: object = None
    policy: object = None
    ref_model: object = None
    dataset: object = None
    tracker: object = None
    engines: object = None
    node_engines: object = None
    """A node leader's own colocated engines on nodes other than the controller's (else None)."""
    producer: object = None
    publisher: object = None
    colocation: object = None
    writer: object = None
    weight_version: int = 0
    total_tokens: int = 0
    start_step: int = 1
    wall_before: float = 0.0
    t_steps: float = 0.0
    """perf_counter() when this process began its first step (the ETA of the step lines)."""
    resumed_from: int | None = None
    summary: dict = field(default_factory=dict)
    ahead: object = None
    """The controller's `AsyncProducer` (`trainer.max_staleness` > 0), else None."""
    produced_state: dict | None = None
    """Asynchronous mode: data cursor + difficulty history as of the last trained step's production."""

    @property
    def is_controller(self) -> bool:
        return self.rank == 0

    def state(self) -> dict:
        """The run state saved with each checkpoint (besides model, optimizer and scheduler)."""
        produced = self.produced_state or {}  # the producer may have moved on (asynchronous mode)
        return {"data": produced.get("data") or (self.dataset.state_dict() if self.dataset is not None else {}),
                "difficulty": produced.get("difficulty") or self.tracker.state_dict(),
                "weight_version": self.weight_version,
                "total_generated_tokens": self.total_tokens,
                "wall_s": self.wall_before + time.perf_counter() - self.t_start,
                **({"eval_before": self.summary["eval_before"]} if "eval_before" in self.summary else {})}


def _init_parallel(cfg: Config, stack: contextlib.ExitStack):
    from megatron_rl.parallel.cpu_compat import enable_cpu_compat
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel, world_of_one

    from megatron_rl.parallel.threads import apply_torch_threads, run_thread_share, user_omp_threads

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.trainer.nproc_per_node))
    servers = 0 if cfg.rollout.server_urls else cfg.rollout.num_servers
    apply_torch_threads(cfg.trainer.num_threads or user_omp_threads() or run_thread_share(ranks, servers, cfg.trainer.max_staleness == 0).rank)
    logger.info("torch threads %d (OMP_WAIT_POLICY=%s)", torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
    enable_cpu_compat()
    t = cfg.trainer
    layout = dict(
        tensor_model_parallel_size=t.tensor_model_parallel_size,
        pipeline_model_parallel_size=t.pipeline_model_parallel_size,
        context_parallel_size=t.context_parallel_size, expert_model_parallel_size=t.expert_model_parallel_size,
        expert_tensor_parallel_size=t.expert_tensor_parallel_size, backend=t.distributed_backend,
        timeout_s=int(t.distributed_timeout_s), seed=t.seed,
    )
    if "WORLD_SIZE" not in os.environ:  # a plain process, not under torchrun/srun: a world of one
        return stack.enter_context(world_of_one(**layout))
    pgs = initialize_parallel(**layout)
    stack.callback(destroy_parallel)
    return pgs


def _load_data(run: Run) -> None:
    """Tokenizer and rows: a bad row or an over-long prompt fails in seconds, before the model is
    built. Only the controller reads the data; the other ranks receive each step's batch from it."""
    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import load_rows
    from megatron_rl.data.prompts import check_prompt_lengths

    cfg, is_controller = run.cfg, run.is_controller
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    run.tokenizer = tokenizer
    run.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, val_rows = [], []
    for f in cfg.data.train_files if is_controller else []:
        train_rows += load_rows(f, adapter=cfg.data.train_adapter)
    if not train_rows and is_controller:
        raise ValueError("data.train_files holds no rows")
    for f in cfg.data.val_files if is_controller else []:
        val_rows += load_rows(f, adapter=cfg.data.val_adapter)
    if cfg.eval.max_problems:
        val_rows = val_rows[: cfg.eval.max_problems]
    run.train_rows = check_prompt_lengths(train_rows, tokenizer, cfg.data.max_prompt_length,
                                          drop=cfg.data.filter_overlong_prompts, what="data.train_files")
    if not run.train_rows and is_controller:
        raise ValueError("data.train_files: every prompt is longer than data.max_prompt_length")
    run.val_rows = check_prompt_lengths(val_rows, tokenizer, cfg.data.max_prompt_length,
                                        drop=cfg.data.filter_overlong_prompts, what="data.val_files")


def _build_model(run: Run, tf_config, *, trainable: bool = True):
    from megatron_rl.models.builder import build_model, use_te_for
    from megatron_rl.models.hf_weights import load_hf_weights

    cfg, pgs = run.cfg, run.pgs
    model = build_model(run.hf_config, tf_config, make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                        pre_process=pgs.is_pipeline_first_stage, post_process=pgs.is_pipeline_last_stage,
                        use_te=use_te_for(cfg.trainer.transformer_impl),
                        attention_backend=cfg.trainer.attention_backend)
    load_hf_weights(model, cfg.model.path, tp_rank=pgs.tp_rank, tp_size=pgs.tp_size, etp_rank=pgs.etp_rank,
                    etp_size=pgs.etp_size)
    if not trainable:
        model.requires_grad_(False)
    return model


def _build_policy(run: Run) -> None:
    """The policy (and reference) model, DDP + optimizer + LR schedule, and the `PolicyTrainer`."""
    from megatron_rl.config.validate import check_model_layout, rollout_correction_of
    from megatron_rl.models.builder import transformer_config_for, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_model_spec
    from megatron_rl.trainer.policy import PolicyTrainer

    cfg, pgs, t, a = run.cfg, run.pgs, run.cfg.trainer, run.cfg.actor
    check_model_layout(cfg, warn=False)  # again: a hub id not cached when the config loaded skipped it
    run.hf_config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    spec = build_model_spec(run.hf_config, tensor_model_parallel_size=t.tensor_model_parallel_size,
                            make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    # MoE policies always get megatron-core's RouterReplay instances: they replay the engine's routing
    # with actor.router_replay, and measure the router mismatch either way (trainer.router_replay)
    is_moe = spec.moe is not None
    tf_config = transformer_config_for(run.hf_config, t, router_replay=is_moe)
    run.model = _build_model(run, tf_config)
    o = a.optim
    steps_per_rl_step = (cfg.data.train_batch_size // a.ppo_mini_batch_size) * a.ppo_epochs
    tm = wrap_ddp_and_optimizer(
        run.model, tf_config, lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad,
        adam_betas=(o.adam_beta1, o.adam_beta2), adam_eps=o.adam_eps,
        use_distributed_optimizer=t.use_distributed_optimizer,
        lr_warmup_steps=o.lr_warmup_steps * steps_per_rl_step,
        lr_decay_steps=max(t.total_training_steps * steps_per_rl_step, 1), lr_decay_style=o.lr_decay_style,
    )
    run.ddp_model, run.optimizer, run.scheduler = tm.model, tm.optimizer, tm.scheduler
    if a.use_kl_loss:
        # the reference model routes by itself (ALGORITHMS.md 9): its routers must not join megatron-core's
        # process-global RouterReplay list, so it gets a config without replay
        ref_config = transformer_config_for(run.hf_config, t) if is_moe else tf_config
        run.ref_model = [_build_model(run, ref_config, trainable=False)]
    if a.sequence_packing and cfg.trainer.transformer_impl == "auto":
        from megatron_rl.models.builder import transformer_engine_usable

        if transformer_engine_usable():
            from megatron_rl.errors import ConfigError

            raise ConfigError("actor.sequence_packing: true runs on the local layer spec, but trainer.transformer_impl "
                              "auto picks Transformer Engine here: set trainer.transformer_impl: local (or packing off)")
    run.policy = PolicyTrainer(
        run.ddp_model, run.optimizer, run.scheduler, vocab_size=spec.vocab_size, micro_batch_size=a.ppo_micro_batch_size,
        tp_group=pgs.tp if t.tensor_model_parallel_size > 1 else None, ref_model=run.ref_model,
        dp_group=pgs.dp_cp if pgs.dp_size * pgs.cp_size > 1 else None,
        pp_group=pgs.pp if pgs.pp_size > 1 else None, max_tokens_per_micro_batch=a.token_budget,
        actor=a, max_response_length=cfg.data.max_response_length, rollout_correction=rollout_correction_of(cfg),
        sequence_packing=a.sequence_packing, routing=_routing_replay(run, tf_config) if is_moe else None,
        equal_micro_batches=is_moe and t.expert_model_parallel_size > 1,
    )


def _routing_replay(run: Run, tf_config):
    """The policy model's `RoutingReplay` (replays the engine's routing with actor.router_replay)."""
    from megatron_rl.trainer.router_replay import RoutingReplay

    return RoutingReplay(run.ddp_model, replay=run.cfg.actor.router_replay, tp_rank=run.pgs.tp_rank,
                         tp_size=run.pgs.tp_size, sequence_parallel=tf_config.sequence_parallel,
                         num_layers=tf_config.num_layers, topk=tf_config.moe_router_topk,
                         tp_group=run.pgs.tp, num_experts=tf_config.num_moe_experts,
                         ep_size=tf_config.expert_model_parallel_size)


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


def _restore(run: Run) -> None:
    """Exact resume from the newest complete checkpoint: weights, optimizer, scheduler, RNG, data
    cursor, difficulty history, weight version, token count, wall time, the step-0 evaluation."""
    from megatron_rl.checkpoint.save import latest_checkpoint, load_checkpoint

    cfg = run.cfg
    run.resumed_from = latest_checkpoint(run.run_dir) if cfg.trainer.resume_mode == "auto" else None
    if run.resumed_from is None:
        return
    step = run.resumed_from
    state = load_checkpoint(run.run_dir, step, model=run.ddp_model, optimizer=run.optimizer, scheduler=run.scheduler)
    _warn_config_changes(cfg, run.run_dir / "checkpoints" / f"iter_{step:07d}" / "config.yaml")
    if run.is_controller:
        run.dataset.load_state_dict(state["data"])
    run.tracker.load_state_dict(state["difficulty"])
    run.weight_version = int(state["weight_version"])
    run.total_tokens = int(state.get("total_generated_tokens", 0))
    run.wall_before = float(state.get("wall_s", 0.0))
    if "eval_before" in state:
        run.summary["eval_before"] = state["eval_before"]
    run.start_step = step + 1
    run.summary["resumed_from_step"] = step
    logger.info("resuming from step %d (%s); next step %d", step, run.run_dir / "checkpoints", run.start_step)


def _sender_factory(cfg: Config, engines, colocation=None):
    """`(urls, group_name) -> WeightSyncSender` over new clients of those engines (a
    `ColocatedWeightSender` with `rollout.colocate`: it hands tensors to this node's engines among
    `urls`, reached through the loopback address, and opens / closes the session on all of
    `urls`; `engines` is this node's `EngineSet`, None on ranks that start none)."""
    from megatron_rl.rollout.engine import engine_backend
    from megatron_rl.weight_sync.sender import WeightSyncSender

    r, ws = cfg.rollout, cfg.weight_sync

    def client(u: str):
        return engine_backend(r.backend).client(u, api_key=r.api_key, admin_api_key=r.admin_api_key,
                                                timeout_s=60.0, generate_timeout_s=r.timeout_s)

    def make(urls: list[str], group_name: str):
        clients = [client(u) for u in urls]
        if colocation is not None:
            from megatron_rl.weight_sync.colocated import ColocatedWeightSender

            mine = dict(zip(engines.advertised_urls(), engines.local_urls())) if engines is not None else {}
            return ColocatedWeightSender([client(mine[u]) for u in urls if u in mine], control_clients=clients,
                                         memory=colocation.engines, bucket_size_mib=ws.bucket_size_mib,
                                         timeout_s=ws.timeout_s, load_format=ws.load_format)
        return WeightSyncSender(clients, master_address=ws.master_address,
                                master_port=ws.master_port if group_name == "weight_update_group" else None,
                                backend=ws.backend, group_name=group_name, bucket_size_mib=ws.bucket_size_mib,
                                timeout_s=ws.timeout_s, load_format=ws.load_format,
                                # a real vLLM server with nccl: its own NCCL group; with gloo (plugins/vllm_gloo)
                                # and the vllm-embedded stand-in: a torch gloo group
                                transport="vllm-nccl" if r.backend == "vllm" and ws.backend == "nccl" else "torch")

    return make


def _node_engine_urls(run: Run, engines) -> list[str]:
    """Colocated runs on several nodes (collective): the URLs of the engines of nodes other than
    the controller's, as the controller reaches them; [] otherwise.

    Raises:
        RolloutServerError: a node's engines did not come up (every rank raises, naming the node).
    """
    from megatron_rl.errors import RolloutServerError

    if not (run.cfg.rollout.colocate and run.pgs.world_size > 1):
        return []
    from megatron_rl.parallel.control import gather_objects

    mine, error = [], None
    if engines is not None and not run.is_controller:
        try:
            mine = engines.advertised_urls()
        except Exception as e:  # noqa: BLE001 - shared: every rank raises it
            error = f"node {engines.node.node_rank}: {type(e).__name__}: {e}"
    everyone = gather_objects((mine, error), world_size=run.pgs.world_size)
    errors = [e for _, e in everyone if e]
    if errors:
        raise RolloutServerError("colocated engines did not come up: " + "; ".join(errors))
    return [u for urls, _ in everyone for u in urls]


def _check_engines(run: Run, clients) -> tuple[int, str] | None:
    """Before step 1 (issue 32): every engine reports the policy's own log-probs (unless
    `rollout.check_logprob_semantics` is false; `rollout/engine_checks.py`); returns the shortest
    engine context as `(tokens, URL)` for the rollout manager, None when no engine reports one.

    Raises:
        RolloutServerError: an engine reports other log-probs (named, with the setting that fixes it).
    """
    from megatron_rl.rollout.engine_checks import check_engines, engine_context_limit

    r = run.cfg.rollout
    if r.check_logprob_semantics:
        vocab = min(len(run.tokenizer), int(run.hf_config.get("vocab_size") or len(run.tokenizer)))
        check_engines(clients, vocab_size=vocab, backend=r.backend, timeout_s=r.timeout_s)
    else:
        logger.warning("rollout.check_logprob_semantics is false: the engines' log-probs are taken as the policy's "
                       "unchecked (actor.old_logprob_source: rollout and the rollout correction rely on them)")
    return engine_context_limit(clients)


def _admit_engine(run: Run, client, context_limit: tuple[int, str] | None) -> None:
    """The start-up checks again, for an engine the fleet brings back before a sync: its log-probs
    (as `_check_engines`) and a context no shorter than the run's limit.

    Raises:
        RolloutServerError: it fails either (names it; the fleet keeps it out).
    """
    from megatron_rl.errors import RolloutServerError
    from megatron_rl.rollout.engine_checks import check_engines

    r = run.cfg.rollout
    if r.check_logprob_semantics:
        vocab = min(len(run.tokenizer), int(run.hf_config.get("vocab_size") or len(run.tokenizer)))
        check_engines([client], vocab_size=vocab, backend=r.backend, timeout_s=r.timeout_s)
    n = client.context_length() if context_limit is not None else None
    if n is not None and n < context_limit[0]:
        raise RolloutServerError(f"rollout engine {client.base_url} came back with a context of {n} tokens, shorter than "
                                 f"the {context_limit[0]} the run started with (prompts were checked against that)",
                                 url=client.base_url, status_code=200)


def _connect_controller(run: Run, stack: contextlib.ExitStack, remote_urls=()) -> None:
    """Controller: engines (`remote_urls`: other nodes' colocated ones), rollout manager + reward
    pool, producer, metrics writer."""
    from megatron_rl.metrics.writer import MetricsWriter
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.multiturn import build_environment
    from megatron_rl.trainer.producer import RolloutProducer

    cfg, r = run.cfg, run.cfg.rollout
    fleet = run.engines.connect(remote_urls)
    context_limit = _check_engines(run, fleet.clients)
    if not r.colocate:  # colocated engines are the run's own (node leaders restart them), asleep between syncs
        fleet.set_admit(lambda client: _admit_engine(run, client, context_limit))
    pool = stack.enter_context(RewardPool(cfg.reward.num_workers, cfg.reward.timeout_s))
    ob = cfg.reward.overlong_buffer
    eos = {run.tokenizer.eos_token_id} if run.tokenizer.eos_token_id is not None else set()
    manager = RolloutManager(
        fleet, run.tokenizer, pool, reward_fn=cfg.reward.reward_fn,
        max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
        correct_score=cfg.reward.correct_score, incorrect_score=cfg.reward.incorrect_score,
        overlong=(ob.enable, ob.len, ob.penalty_factor), seed=cfg.trainer.seed,
        max_concurrency=r.max_concurrency, eos_token_ids=sorted(eos), partial_rollout=r.partial_rollout,
        pause_timeout_s=cfg.weight_sync.timeout_s + r.timeout_s, context_limit=context_limit,
        environment=build_environment(r.multi_turn, run.tokenizer),
        consecutive_seeds=r.consecutive_seeds(r.backend),
    )
    stack.callback(manager.close)
    logger.info("rollout: %s", "a prompt's responses as one request with n (rollout.parallel_sampling: seeds s..s+n-1)"
                if manager.consecutive_seeds else "a seed per response (rollout.parallel_sampling off)")
    run.producer = RolloutProducer(cfg, manager, run.dataset, run.tracker, pad_id=run.pad_id, dp_size=run.pgs.dp_size)
    run.writer = MetricsWriter(run.run_dir, tensorboard=cfg.trainer.tensorboard,
                               wandb_project="megatron-rl" if cfg.trainer.wandb else None,
                               resume_from_step=run.resumed_from)
    stack.callback(run.writer.close)


def build_run(cfg: Config, stack: contextlib.ExitStack, rank: int, t_start: float) -> Run:
    """Set up everything of a run (DESIGN.md "One step", before step 0): process groups, data,
    policy, resume state, engines, producer, weight publisher. Collective over every rank.

    Raises:
        ValueError: bad data (file and row named), config errors found at launch.
        RolloutServerError: an engine did not come up.
    """
    from megatron_rl.algorithms.daa import DifficultyTracker
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.models.builder import use_te_for
    from megatron_rl.parallel.nodes import node_info
    from megatron_rl.rollout.engine_set import EngineSet
    from megatron_rl.weight_sync.publisher import WeightPublisher

    run_dir = Path(cfg.run_dir)
    node = node_info()
    tp = cfg.trainer.tensor_model_parallel_size
    if cfg.rollout.colocate and node.local_world_size % tp:
        from megatron_rl.errors import ConfigError

        raise ConfigError(f"trainer.tensor_model_parallel_size {tp} must divide the {node.local_world_size} trainer "
                          "rank(s) torchrun started on this node (LOCAL_WORLD_SIZE) with rollout.colocate: true (each "
                          "node's local rank 0 gathers the model with its TP group, which must not span nodes); set "
                          "trainer.nproc_per_node to torchrun's --nproc-per-node")
    engines = None  # the controller's; with colocation on several nodes also every node leader's
    if rank == 0 or (cfg.rollout.colocate and node.nnodes > 1 and node.is_leader):
        engines = EngineSet(cfg, node)  # start now, in the background, and come up while the model is built
        stack.callback(engines.stop)
    run = Run(cfg=cfg, run_dir=run_dir, rank=rank, pgs=_init_parallel(cfg, stack), t_start=t_start,
              summary={"run_dir": str(run_dir.resolve()), "config": config_to_dict(cfg)})
    if run.is_controller:
        run.engines = engines
        save_config(cfg, run_dir / "config.yaml")
        for hint in layout_hints(cfg.trainer, run.pgs.dp_size, use_te_for(cfg.trainer.transformer_impl)):
            logger.warning(hint)
    else:
        run.node_engines = engines
    torch.manual_seed(cfg.trainer.seed)
    _load_data(run)
    _build_policy(run)
    t = cfg.trainer
    run.dataset = PromptDataset(run.train_rows, seed=t.seed, shuffle=cfg.data.shuffle) if run.is_controller else None
    run.tracker = DifficultyTracker(a0=cfg.algorithm.daa.prior_a, b0=cfg.algorithm.daa.prior_b,
                                    history_decay=cfg.algorithm.daa.history_decay)
    _restore(run)
    remote_urls = _node_engine_urls(run, engines)
    if run.is_controller:
        _connect_controller(run, stack, remote_urls)
    if cfg.rollout.colocate:  # issue 17: engines on the trainer's devices (trainer/offload.py)
        from megatron_rl.trainer.offload import setup_colocation

        run.colocation = setup_colocation(run)
    run.publisher = WeightPublisher(
        run.model, run.hf_config, run.pgs, sender_factory=_sender_factory(cfg, engines, run.colocation),
        fleet=run.engines.fleet if run.is_controller else None,
        check_checksums=cfg.weight_sync.check_checksums, run_dir=run_dir, pause_mode=cfg.rollout.pause_mode,
        node_sources=cfg.rollout.colocate, node_leader=node.is_leader)
    stack.callback(run.publisher.close)
    return run
