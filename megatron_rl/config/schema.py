"""The configuration schema: one dataclass per section, checked locally in `__post_init__`.

Leaf names follow verl's DAPO recipe (`actor.clip_ratio_high`, `algorithm.filter_groups.*`,
`reward.overlong_buffer.*`) and Megatron's parallelism names (`tensor_model_parallel_size`).
Cross-section checks live in `megatron_rl.config.validate`. Imports only the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


def _choice(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name}: {value!r} is not allowed; choose one of "
            f"{', '.join('null' if a is None else repr(a) for a in allowed)}"
        )


def _positive(section: str, name: str, value, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{section}.{name}: {value!r} must be a finite number")
    if (value < 0) if allow_zero else (value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{section}.{name}: {value!r} must be {bound}")


@dataclass(kw_only=True)
class ModelConfig:
    path: Optional[str] = None
    """Hugging Face model folder (config.json, *.safetensors, tokenizer files). Required to train."""
    hf_config_path: Optional[str] = None
    """A `config.json` to take the architecture from when `path` is not available (e.g. `--dry-run`
    of the 32B recipes on a laptop). Ignored when `path` is set."""
    tokenizer_path: Optional[str] = None
    """Tokenizer folder; defaults to `path`."""
    make_vocab_size_divisible_by: int = 128
    """megatron-core pads the vocabulary to a multiple of this times TP; padded rows are masked."""

    def __post_init__(self) -> None:
        _positive("model", "make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """verl-format rows (.jsonl or .parquet). Relative paths resolve against the recipe's folder."""
    train_adapter: str = "verl"
    """Row adapter for `train_files` (`verl`, `aime`, `amc`, `math500`, `gsm8k`)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out rows for evaluation (eval_before / eval_after / periodic eval)."""
    val_adapter: str = "verl"
    """Row adapter for `val_files`."""
    train_batch_size: int = 8
    """Prompts (groups) trained on per RL step, as in verl."""
    gen_batch_size: Optional[int] = None
    """Prompts drawn per generation batch (DAPO over-draws for dynamic sampling); default = train_batch_size."""
    max_prompt_length: int = 128
    """Tokens. Every prompt is checked at launch: a longer one is an error naming its file and line,
    or is dropped with a warning when `filter_overlong_prompts` is set."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than `max_prompt_length` at launch instead of failing (verl's name)."""
    max_response_length: int = 64
    """Generated tokens per response, EOS included (L_max of the overlong shaping)."""
    shuffle: bool = True
    """Reshuffle the prompt pool each epoch (seeded by `trainer.seed` and the epoch)."""

    def __post_init__(self) -> None:
        _positive("data", "train_batch_size", self.train_batch_size)
        _positive("data", "gen_batch_size", self.gen_batch_size)
        _positive("data", "max_prompt_length", self.max_prompt_length)
        _positive("data", "max_response_length", self.max_response_length)


@dataclass(kw_only=True)
class RolloutConfig:
    backend: str = "embedded"
    """Which servers `megatron-rl train` starts when `server_urls` is empty: `embedded` (the
    project's HF-transformers server speaking SGLang's HTTP API) or `sglang`
    (`<sglang_python> -m sglang.launch_server`). With `server_urls` set nothing is started."""
    server_urls: list[str] = field(default_factory=list)
    """Base URLs of running rollout servers; empty = start `num_servers` servers of `backend`."""
    num_servers: int = 1
    """Servers to start when `server_urls` is empty."""
    server_ports: list[int] = field(default_factory=list)
    """Explicit ports of the started servers: one per server (embedded) or two per server, HTTP
    then `--nccl-port` (sglang); all distinct. Empty = free ports picked at launch (case B31)."""
    sglang_python: str = "python"
    """Interpreter of the environment SGLang is installed in (it pins its own torch)."""
    tp_size: int = 1
    """SGLang `--tp-size`: GPUs per rollout engine (its ranks in the weight-sync group)."""
    mem_fraction_static: Optional[float] = None
    """SGLang `--mem-fraction-static` in (0, 1); None = SGLang's default."""
    skip_tokenizer_init: bool = True
    """SGLang `--skip-tokenizer-init` (token ids in and out; the rollout sends ids)."""
    sglang_extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` flags, passed as given (e.g. `["--enable-memory-saver"]`)."""
    over_sampling_batch_size: int = 0
    """Dynamic sampling with abort (slime's name): prompts launched at once; once
    `data.train_batch_size` groups are kept, the requests still running are aborted
    (`/abort_request`) and their partial responses discarded. 0 = off (whole generation batches of
    `data.gen_batch_size`). Needs `algorithm.filter_groups.enable`; ignored with
    `rollout.deterministic` (which groups finish first depends on timing)."""
    max_server_restarts: int = 3
    """Restarts of a started server that died, per run, before the run stops (0 = never restart)."""
    n: int = 8
    """Responses per prompt (group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = whole vocabulary."""
    deterministic: bool = True
    """Derive each response's `sampling_seed` from (seed, step, prompt, response) so a run repeats."""
    enable_deterministic_inference: bool = False
    """Start the servers with `--enable-deterministic-inference` (SGLang's flag): results do not
    depend on how concurrent requests are batched, so runs repeat bit for bit even when timing
    differs (e.g. another parallel layout), at a throughput cost (the embedded server then decodes
    one request at a time). Without it, batching can move log-probs by ~1e-7 and rarely flip a
    sampled token."""
    timeout_s: float = 600.0
    """HTTP timeout of one /generate call."""
    startup_timeout_s: float = 180.0
    """How long to wait for an embedded server's /health."""
    max_concurrency: int = 256
    """Requests in flight per server."""
    api_key: Optional[str] = None
    """Bearer token for /generate (secret: never written to logs or saved configs)."""
    admin_api_key: Optional[str] = None
    """Bearer token for the control endpoints (secret)."""
    server_max_batch_size: int = 256
    """Embedded server: sequences decoded together."""

    def __post_init__(self) -> None:
        _choice("rollout", "backend", self.backend, ("embedded", "sglang"))
        _positive("rollout", "n", self.n)
        _positive("rollout", "num_servers", self.num_servers)
        _positive("rollout", "temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p: {self.top_p!r} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k: {self.top_k!r} must be -1 (off) or >= 1")
        _positive("rollout", "timeout_s", self.timeout_s)
        _positive("rollout", "startup_timeout_s", self.startup_timeout_s)
        _positive("rollout", "max_concurrency", self.max_concurrency)
        _positive("rollout", "server_max_batch_size", self.server_max_batch_size)
        _positive("rollout", "tp_size", self.tp_size)
        _positive("rollout", "over_sampling_batch_size", self.over_sampling_batch_size, allow_zero=True)
        _positive("rollout", "max_server_restarts", self.max_server_restarts, allow_zero=True)
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"rollout.mem_fraction_static: {self.mem_fraction_static!r} must be in (0, 1) or null")
        if self.server_ports:
            per = 1 if self.backend == "embedded" else 2
            if len(self.server_ports) != per * self.num_servers:
                raise ValueError(f"rollout.server_ports: {len(self.server_ports)} ports given, rollout.backend="
                                 f"{self.backend} with num_servers={self.num_servers} needs {per * self.num_servers}")
            dup = sorted({p for p in self.server_ports if self.server_ports.count(p) > 1})
            if dup:
                raise ValueError(f"rollout.server_ports: {dup} appear more than once; every port must be distinct")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer updates of RL steps (DAPO: 20 RL steps)."""
    lr_decay_style: str = "constant"
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 = off."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8

    def __post_init__(self) -> None:
        _positive("actor.optim", "lr", self.lr)
        _positive("actor.optim", "lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        _choice("actor.optim", "lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        _positive("actor.optim", "clip_grad", self.clip_grad, allow_zero=True)


@dataclass(kw_only=True)
class TISConfig:
    enable: bool = False
    """Truncated importance sampling: weight min(exp(old_logprobs - rollout_logprobs), clip)."""
    clip: float = 2.0

    def __post_init__(self) -> None:
        _positive("actor.tis", "clip", self.clip)


@dataclass(kw_only=True)
class ActorConfig:
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer update (x rollout.n sequences), as in verl."""
    ppo_micro_batch_size: int = 16
    """Sequences per forward/backward micro-batch on one data-parallel rank (unused while a token
    budget is in effect)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of a micro-batch on one data-parallel rank (verl: `ppo_max_token_len_per_gpu`
    with `use_dynamic_bsz`): rows x padded width, the width being the micro-batch's longest
    prompt + response (rounded up to TP under sequence parallelism). None = fixed
    `ppo_micro_batch_size` micro-batches. Must be >= data.max_prompt_length + data.max_response_length.
    Does not change the gradient (the loss normaliser is global, ALGORITHMS.md section 6)."""
    use_dynamic_bsz: Optional[bool] = None
    """verl's switch for the token budget: None = on exactly when `max_tokens_per_micro_batch` is
    set; false = the budget is ignored (fixed micro-batches); true requires the budget."""
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"
    """Registry name: vanilla | gspo | cispo."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    loss_scale_factor: Optional[float] = None
    """C of seq-mean-token-sum-norm; default data.max_response_length."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """DAPO clip-higher uses 0.28."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; must be > 1."""
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_clip_low: Optional[float] = None
    cispo_clip_high: float = 0.28
    mask_truncated: bool = False
    """Overlong filtering: responses without EOS get loss mask 0."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    tis: TISConfig = field(default_factory=TISConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        _positive("actor", "ppo_mini_batch_size", self.ppo_mini_batch_size)
        _positive("actor", "ppo_micro_batch_size", self.ppo_micro_batch_size)
        _positive("actor", "ppo_epochs", self.ppo_epochs)
        _positive("actor", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if self.use_dynamic_bsz and self.max_tokens_per_micro_batch is None:
            raise ValueError("actor.use_dynamic_bsz: true needs actor.max_tokens_per_micro_batch (verl: "
                             "ppo_max_token_len_per_gpu), the token budget of a micro-batch")
        _choice("actor", "policy_loss", self.policy_loss, ("vanilla", "gspo", "cispo"))
        _choice(
            "actor",
            "loss_agg_mode",
            self.loss_agg_mode,
            ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
        )
        _choice("actor", "kl_loss_type", self.kl_loss_type, ("k1", "k2", "k3", "low_var_kl"))
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c: {self.clip_ratio_c!r} must be > 1 (dual-clip)")
        for name in ("clip_ratio_low", "clip_ratio_high", "gspo_clip_low", "gspo_clip_high", "cispo_clip_high"):
            _positive("actor", name, getattr(self, name))
        _positive("actor", "loss_scale_factor", self.loss_scale_factor)
        _positive("actor", "kl_loss_coef", self.kl_loss_coef, allow_zero=True)

    @property
    def token_budget(self) -> Optional[int]:
        """The micro-batch token budget in effect (None = fixed `ppo_micro_batch_size`)."""
        return None if self.use_dynamic_bsz is False else self.max_tokens_per_micro_batch


@dataclass(kw_only=True)
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: keep only groups whose `metric` is not constant."""
    metric: str = "acc"
    """acc (raw correctness) | score (shaped reward)."""
    max_num_gen_batches: int = 10
    """Generation batches per step at most; <= 0 = no limit."""
    on_exhausted: str = "train_partial"
    """train_partial | error, when max_num_gen_batches is reached."""

    def __post_init__(self) -> None:
        _choice("algorithm.filter_groups", "metric", self.metric, ("acc", "score"))
        _choice("algorithm.filter_groups", "on_exhausted", self.on_exhausted, ("train_partial", "error"))


@dataclass(kw_only=True)
class DAAConfig:
    enable: bool = False
    """DA3PO: amplify correct responses' advantages on hard prompts (ALGORITHMS.md section 4)."""
    difficulty: str = "history"
    """group | conditional | history."""
    factor: str = "balanced"
    """balanced (beta(q)) | power ((hard_threshold / q) ** gamma)."""
    hard_threshold: float = 0.5
    max_factor: float = 8.0
    gamma: float = 1.0
    prior_a: float = 0.5
    prior_b: float = 0.5

    def __post_init__(self) -> None:
        _choice("algorithm.daa", "difficulty", self.difficulty, ("group", "conditional", "history"))
        _choice("algorithm.daa", "factor", self.factor, ("balanced", "power"))
        if not 0.0 < self.hard_threshold <= 1.0:
            raise ValueError(f"algorithm.daa.hard_threshold: {self.hard_threshold!r} must be in (0, 1]")
        if self.max_factor < 1.0:
            raise ValueError(f"algorithm.daa.max_factor: {self.max_factor!r} must be >= 1")
        _positive("algorithm.daa", "gamma", self.gamma)
        _positive("algorithm.daa", "prior_a", self.prior_a)
        _positive("algorithm.daa", "prior_b", self.prior_b)


@dataclass(kw_only=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """grpo | rloo | reinforce_plus_plus_baseline."""
    grpo_std: str = "unbiased"
    """unbiased (Bessel, as verl) | population."""
    norm_adv_by_std_in_grpo: bool = True
    """False + loss_agg_mode seq-mean-token-sum-norm = Dr. GRPO."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    daa: DAAConfig = field(default_factory=DAAConfig)

    def __post_init__(self) -> None:
        _choice(
            "algorithm", "adv_estimator", self.adv_estimator, ("grpo", "rloo", "reinforce_plus_plus_baseline")
        )
        _choice("algorithm", "grpo_std", self.grpo_std, ("unbiased", "population"))


@dataclass(kw_only=True)
class OverlongBufferConfig:
    enable: bool = False
    len: int = 16
    """Tokens of the soft-punishment buffer (L_buf); must be < data.max_response_length."""
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        _positive("reward.overlong_buffer", "len", self.len)
        _positive("reward.overlong_buffer", "penalty_factor", self.penalty_factor, allow_zero=True)


@dataclass(kw_only=True)
class RewardConfig:
    reward_fn: str = "dapo_math"
    """Registry name of the verifier."""
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    num_workers: int = 2
    """Verifier processes."""
    timeout_s: float = 10.0
    """Per-response verifier timeout; a timeout marks the response invalid."""

    def __post_init__(self) -> None:
        _positive("reward", "num_workers", self.num_workers)
        _positive("reward", "timeout_s", self.timeout_s)


@dataclass(kw_only=True)
class EvalConfig:
    before_train: bool = True
    """Evaluate the base policy before the first step (summary.json eval_before)."""
    after_train: bool = True
    interval: int = 0
    """Evaluate every this many steps; 0 = only before/after."""
    n: int = 8
    """Samples a problem for avg@n / pass@n."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 1234
    """Fixed sampling seed of the eval (each sample derives its own)."""
    max_problems: int = 0
    """Evaluate on the first this many val rows; 0 = all."""
    max_response_length: Optional[int] = None
    """Default: data.max_response_length."""

    def __post_init__(self) -> None:
        _positive("eval", "n", self.n)
        _positive("eval", "temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"eval.top_p: {self.top_p!r} must be in (0, 1]")
        _positive("eval", "max_response_length", self.max_response_length)
        _positive("eval", "interval", self.interval, allow_zero=True)
        _positive("eval", "max_problems", self.max_problems, allow_zero=True)


@dataclass(kw_only=True)
class WeightSyncConfig:
    bucket_size_mib: float = 512.0
    """Bytes per broadcast bucket, MiB."""
    backend: str = "gloo"
    """gloo (CPU) | nccl (GPU)."""
    master_address: str = "127.0.0.1"
    master_port: Optional[int] = None
    """TCPStore port of the weight-sync group; None = a free port."""
    timeout_s: float = 600.0
    load_format: Optional[str] = None
    """SGLang's `load_format` of `/update_weights_from_distributed`: null (the default, SGLang's and
    slime's: one broadcast per tensor, no copy on the trainer side; the embedded server receives
    straight into its parameters) or `flattened_bucket` (the tensors of a bucket copied into one uint8
    tensor, one broadcast a bucket). The servers load the same weights either way
    (`benchmarks/sync_throughput.py` measures both)."""
    check_checksums: bool = False
    """After every sync, compare a SHA-256 per tensor of each server's weights (`/get_weights_by_name`)
    with the trainer's; a mismatch fails the sync. Costs a full read-back of the weights over HTTP."""

    def __post_init__(self) -> None:
        _positive("weight_sync", "bucket_size_mib", self.bucket_size_mib)
        _choice("weight_sync", "backend", self.backend, ("gloo", "nccl"))
        _choice("weight_sync", "load_format", self.load_format, ("flattened_bucket", None))
        _positive("weight_sync", "timeout_s", self.timeout_s)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"weight_sync.master_port: {self.master_port!r} must be a TCP port (1-65535) or null")


@dataclass(kw_only=True)
class TrainerConfig:
    total_training_steps: int = 10
    """RL steps (verl's name)."""
    seed: int = 1234
    save_interval: int = 0
    """Checkpoint every this many steps; 0 = only at the end."""
    save_last: bool = True
    """Write a checkpoint after the last step."""
    keep_last_n_checkpoints: int = 2
    resume_mode: str = "auto"
    """auto: continue from the latest complete checkpoint in `<run_dir>/checkpoints` if there is
    one (verl's name) | disable: start over (refused when the run dir already holds checkpoints)."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGUSR1 finish the current step, write a checkpoint and exit (code 75) so that
    a requeued job resumes from it; a second signal exits at once."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    nproc_per_node: int = 1
    """Trainer processes launched on this machine (world size when not under torchrun/srun)."""
    precision: str = "fp32"
    """fp32 | bf16."""
    fp8: Optional[str] = None
    """None | hybrid | e4m3 (needs Transformer Engine on Hopper or newer)."""
    fp8_recipe: str = "delayed"
    """delayed | tensorwise | blockwise | mxfp8."""
    fp8_amax_history_len: int = 1024
    """Amax window (steps) of the delayed-scaling recipe (Megatron's --fp8-amax-history-len)."""
    fp8_amax_compute_algo: str = "max"
    """max | most_recent: how the delayed recipe reduces the amax history."""
    fp8_margin: int = 0
    """Exponent margin of the FP8 scaling factor (Megatron's --fp8-margin)."""
    fp8_param_gather: bool = False
    """FP8 weight copies for the distributed optimizer's all-gather (Megatron's --fp8-param-gather)."""
    transformer_impl: str = "auto"
    """auto | transformer_engine | local (Megatron's --transformer-impl): the layer spec. auto = TE's
    fused layernorm-linear and TE attention when Transformer Engine imports and CUDA is present,
    megatron-core's local spec otherwise (CPU). FP8 and sequence parallelism need TE."""
    recompute: Optional[str] = None
    """None | selective | full activation recompute."""
    distributed_backend: str = "gloo"
    distributed_timeout_s: float = 600.0
    """Timeout of every collective of the trainer."""
    tensorboard: bool = True
    wandb: bool = False
    progress_bar: bool = True
    num_threads: int = 0
    """torch intra-op threads per process; 0 = torch's default."""

    def __post_init__(self) -> None:
        _positive("trainer", "total_training_steps", self.total_training_steps)
        _positive("trainer", "save_interval", self.save_interval, allow_zero=True)
        _positive("trainer", "keep_last_n_checkpoints", self.keep_last_n_checkpoints)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "nproc_per_node"):
            _positive("trainer", name, getattr(self, name))
        _choice("trainer", "precision", self.precision, ("fp32", "bf16"))
        _choice("trainer", "resume_mode", self.resume_mode, ("auto", "disable"))
        _positive("trainer", "num_threads", self.num_threads, allow_zero=True)
        if self.distributed_timeout_s < 1:
            raise ValueError(f"trainer.distributed_timeout_s: {self.distributed_timeout_s!r} must be >= 1 (seconds)")
        _choice("trainer", "fp8", self.fp8, (None, "hybrid", "e4m3"))
        _choice("trainer", "fp8_recipe", self.fp8_recipe, ("delayed", "tensorwise", "blockwise", "mxfp8"))
        _choice("trainer", "fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("max", "most_recent"))
        _positive("trainer", "fp8_amax_history_len", self.fp8_amax_history_len)
        _positive("trainer", "fp8_margin", self.fp8_margin, allow_zero=True)
        _choice("trainer", "transformer_impl", self.transformer_impl, ("auto", "transformer_engine", "local"))
        if self.fp8 is not None and self.transformer_impl == "local":
            raise ValueError("trainer.fp8 needs trainer.transformer_impl: transformer_engine (or auto): "
                             "megatron-core's local layers have no FP8 GEMMs")
        if self.sequence_parallel and self.transformer_impl == "local":
            raise ValueError("trainer.sequence_parallel needs trainer.transformer_impl: transformer_engine (or "
                             "auto): megatron-core's local spec has no sequence-parallel norms")
        if self.context_parallel_size > 1 and self.transformer_impl == "local":
            raise ValueError("trainer.context_parallel_size > 1 needs trainer.transformer_impl: transformer_engine: "
                             "megatron-core runs context parallelism only in Transformer Engine's attention "
                             "(TEDotProductAttention); the local spec's attention refuses it")
        if self.fp8_param_gather and (self.fp8 is None or not self.use_distributed_optimizer):
            raise ValueError("trainer.fp8_param_gather needs trainer.fp8 and trainer.use_distributed_optimizer")
        _choice("trainer", "recompute", self.recompute, (None, "selective", "full"))
        _choice("trainer", "distributed_backend", self.distributed_backend, ("gloo", "nccl"))
        if self.fp8 is not None and self.precision != "bf16":
            raise ValueError("trainer.fp8 needs trainer.precision: bf16 (FP8 GEMMs with bf16 master compute)")


@dataclass(kw_only=True)
class Config:
    run_dir: str = "runs/default"
    """Output folder: resolved config, metrics.jsonl, TensorBoard, checkpoints, summary.json, logs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


SECRET_KEYS = ("rollout.api_key", "rollout.admin_api_key")
"""Dotted keys never written to disk or logs."""
