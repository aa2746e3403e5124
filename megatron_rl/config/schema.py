"""The configuration schema: one dataclass per section, checked locally in `__post_init__`.

Leaf names follow verl's DAPO recipe (`actor.clip_ratio_high`, `algorithm.filter_groups.*`,
`reward.overlong_buffer.*`) and Megatron's parallelism names (`tensor_model_parallel_size`).
Every leaf has a docstring (meaning, unit, default, verl's name where one exists); `megatron-rl
config-keys` prints them. The options of each registered policy loss, advantage estimator and DAA
factor are not declared here: `ActorConfig`, `AlgorithmConfig` and `DAAConfig` inherit the options
dataclasses registered in `megatron_rl.algorithms.options`, and the allowed names come from those
registries. Cross-section checks live in `megatron_rl.config.validate`. Imports only the standard
library and the registries' names (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.algorithms.options import (ADV_ESTIMATOR_SPECS, CONDITIONAL_REMOVED, DAA_DIFFICULTY_MODES,
                                            DAA_FACTOR_OPTIONS, KL_TYPE_NAMES, LOSS_AGG_MODE_NAMES,
                                            OLD_LOGPROB_SOURCES, POLICY_LOSS_OPTIONS, ROLLOUT_CORRECTION_OPTIONS,
                                            check_choice, check_positive, option_bases)
from megatron_rl.config.moe import ExpertOptions
from megatron_rl.config.multi_turn import RolloutTurns
from megatron_rl.config.rollout_checks import RolloutChecks
from megatron_rl.config.rollout_requests import RolloutRequests
from megatron_rl.errors import ConfigError

ROLLOUT_BACKEND_PORTS: dict[str, int] = {"embedded": 1, "sglang": 2, "vllm": 1, "vllm-embedded": 1}
"""`rollout.backend` names -> TCP ports one engine of that backend needs (HTTP first; SGLang then its
`--nccl-port`). The registry `megatron_rl.rollout.engine.ENGINE_BACKENDS` holds the same names (a
unit test checks it); kept here so that the config stays free of torch and of the launchers."""


def _choice(section: str, name: str, value, allowed) -> None:
    check_choice(f"{section}.{name}", value, allowed)


def _positive(section: str, name: str, value, *, allow_zero: bool = False) -> None:
    check_positive(f"{section}.{name}", value, allow_zero=allow_zero)


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
class RolloutConfig(RolloutChecks, RolloutTurns, RolloutRequests):
    backend: str = "embedded"
    """Which servers `megatron-rl train` starts (or, with `server_urls`, which API the given ones
    speak): `embedded` (the project's HF-transformers server speaking SGLang's HTTP API), `sglang`
    (`<sglang_python> -m sglang.launch_server`), `vllm` (`vllm serve`, run as `<vllm_python> -m
    vllm.entrypoints.cli.main serve`, with native NCCL weight transfer, vLLM 0.33.x's API,
    docs/VLLM_API.md; without a GPU vLLM's CPU build 0.32 with `weight_sync.backend: gloo`) or `vllm-embedded` (the embedded server speaking vLLM's API, a CPU stand-in
    for a vLLM server: the vLLM client path end to end where vLLM cannot run)."""
    server_urls: list[str] = field(default_factory=list)
    """Base URLs of running rollout servers; empty = start `num_servers` servers of `backend`."""
    num_servers: int = 1
    """Servers to start when `server_urls` is empty."""
    server_ports: list[int] = field(default_factory=list)
    """Explicit ports of the started servers: one per server (embedded, vllm, vllm-embedded) or two
    per server, HTTP then `--nccl-port` (sglang); all distinct. Empty = free ports picked at launch (case B31)."""
    sglang_python: str = "python"
    """Interpreter of the environment SGLang is installed in (it pins its own torch)."""
    vllm_python: str = "python"
    """Interpreter of the environment vLLM 0.33.x is installed in (`rollout.backend: vllm`; vLLM pins
    its own torch, so it never shares the trainer's environment and the trainer never imports it)."""
    vllm_extra_args: list[str] = field(default_factory=list)
    """More `vllm serve` flags, passed as given (e.g. `["--enforce-eager"]`)."""
    tp_size: int = 1
    """GPUs per rollout engine (its ranks in the weight-sync group): SGLang `--tp-size`, vLLM
    `--tensor-parallel-size`."""
    mem_fraction_static: Optional[float] = None
    """Share of GPU memory an engine takes, in (0, 1): SGLang `--mem-fraction-static`, vLLM
    `--gpu-memory-utilization`; None = the engine's default."""
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
    """Sampling temperature of the rollout, >= 0 (0 = greedy). Default 1.0. verl: `rollout.temperature`."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 (default) = off. verl: `rollout.top_p`."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 (default) = whole vocabulary. verl: `rollout.top_k`."""
    deterministic: bool = True
    """Derive each response's `sampling_seed` from (seed, step, prompt, response), so the seeds do
    not depend on arrival order. Runs repeat only as far as the server's batching lets them (a
    near-tie token can flip): bit for bit needs `enable_deterministic_inference` too."""
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
    """HTTP calls in flight (a call carries a prompt's `n` responses on engines with a batch call, else one)."""
    api_key: Optional[str] = None
    """Bearer token for /generate (secret: never written to logs or saved configs)."""
    admin_api_key: Optional[str] = None
    """Bearer token for the control endpoints (secret)."""
    server_max_batch_size: int = 256
    """Embedded server: sequences decoded together."""
    colocate: bool = False
    """Colocated mode (DESIGN.md "Stages and engines"): the engines run on the trainer's own devices,
    one engine per `tp_size` trainer devices (on CPU the trainer's `trainer.nproc_per_node`
    processes count as the devices), started by `megatron-rl train`. Around every weight update the
    engines release their memory, the trainer trains, then the engines resume and receive the
    weights by IPC handles (`/update_weights_from_tensor`; shared-memory tensors on CPU). Needs
    `trainer.max_staleness: 0` and `rollout.backend` embedded or sglang. Default false.
    verl: `actor_rollout_ref.hybrid_engine`; slime: `--colocate`."""
    pause_mode: str = "abort"
    """How a weight update pauses engines that are generating (asynchronous training,
    ALGORITHMS.md section 8): `abort` (default; unfinished requests end and are resubmitted after
    the update, see `rollout.partial_rollout`) or `in_place` (they stay frozen with their KV cache
    and continue on the new weights; their tokens then span two versions). The synchronous step
    always pauses with `abort` and has nothing in flight."""
    partial_rollout: bool = False
    """With `rollout.pause_mode: abort`: resubmit a request aborted by a weight update with the
    tokens it already generated (prompt + prefix, the remaining `max_new_tokens`; its tokens then
    span two versions). False (default): resubmit it from scratch. Requests aborted as too stale
    always start again from scratch."""
    return_routed_experts: Optional[bool] = None
    """Engines return the experts they routed every token to (SGLang's request field; MoE only).
    None (default) = with actor.router_replay; true without replay: train/router_mismatch only."""

    def __post_init__(self) -> None:
        _choice("rollout", "backend", self.backend, tuple(ROLLOUT_BACKEND_PORTS))
        _positive("rollout", "n", self.n)
        _positive("rollout", "num_servers", self.num_servers)
        _positive("rollout", "temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p: {self.top_p!r} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k: {self.top_k!r} must be -1 (off) or >= 1")
        _positive("rollout", "timeout_s", self.timeout_s)
        _positive("rollout", "startup_timeout_s", self.startup_timeout_s)
        _positive("rollout", "max_concurrency", self.max_concurrency)
        _positive("rollout", "server_max_batch_size", self.server_max_batch_size)
        _positive("rollout", "tp_size", self.tp_size)
        _positive("rollout", "over_sampling_batch_size", self.over_sampling_batch_size, allow_zero=True)
        _positive("rollout", "max_server_restarts", self.max_server_restarts, allow_zero=True)
        self._check_rollout_checks()  # config/rollout_checks.py
        _choice("rollout", "pause_mode", self.pause_mode, ("abort", "in_place"))
        if self.partial_rollout and self.pause_mode != "abort":
            raise ConfigError("rollout.partial_rollout: true needs rollout.pause_mode: abort (with in_place nothing "
                              "is aborted by an update, so there is no prefix to resubmit); set one of them")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"rollout.mem_fraction_static: {self.mem_fraction_static!r} must be in (0, 1) or null")
        if self.server_ports:
            per = ROLLOUT_BACKEND_PORTS[self.backend]
            if len(self.server_ports) != per * self.num_servers:
                raise ConfigError(f"rollout.server_ports: {len(self.server_ports)} ports given, rollout.backend="
                                 f"{self.backend} with num_servers={self.num_servers} needs {per * self.num_servers}")
            dup = sorted({p for p in self.server_ports if self.server_ports.count(p) > 1})
            if dup:
                raise ConfigError(f"rollout.server_ports: {dup} appear more than once; every port must be distinct")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer updates of RL steps (DAPO: 20 RL steps)."""
    lr_decay_style: str = "constant"
    """Learning-rate schedule after warm-up: constant (default) | linear | cosine, decaying over all
    optimizer updates of the run (megatron-core's OptimizerParamScheduler)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay. Default 0.1. verl: `actor.optim.weight_decay`."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 = off. Default 1.0. verl: `actor.optim.clip_grad` / `actor.grad_clip`."""
    adam_beta1: float = 0.9
    """Adam beta1. Default 0.9."""
    adam_beta2: float = 0.999
    """Adam beta2. Default 0.999."""
    adam_eps: float = 1e-8
    """Adam epsilon. Default 1e-8."""

    def __post_init__(self) -> None:
        _positive("actor.optim", "lr", self.lr)
        _positive("actor.optim", "lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        _choice("actor.optim", "lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        _positive("actor.optim", "clip_grad", self.clip_grad, allow_zero=True)


@dataclass(kw_only=True)
class TISConfig:
    enable: bool = False
    """Truncated importance sampling: weight min(exp(old_logprobs - rollout_logprobs), clip) on each
    token's policy loss (ALGORITHMS.md 5). The eta = 0 case of `algorithm.rollout_correction.mode:
    token_tis`, run by the same code: true resolves the mode `auto` to token_tis with this cap."""
    clip: float = 2.0
    """Cap of the truncated importance weight; > 0. Default 2.0. Also the cap of
    `algorithm.rollout_correction` when its `tis_cap` is unset. verl: `actor.tis_imp_ratio_cap`."""

    def __post_init__(self) -> None:
        _positive("actor.tis", "clip", self.clip)


@dataclass(kw_only=True)
class ActorConfig(*option_bases(*(POLICY_LOSS_OPTIONS.get(n) for n in POLICY_LOSS_OPTIONS.names()))):
    """The policy update. Besides the fields below it carries the options of every registered
    policy loss (`clip_ratio_*` of vanilla, `gspo_clip_*`, `cispo_clip_*`; see
    `megatron_rl.algorithms.options`); only those of `policy_loss` are used."""

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
    """Passes over the step's mini-batches (each pass one optimizer update per mini-batch); >= 1.
    Default 1. verl: `actor.ppo_epochs`."""
    policy_loss: str = "vanilla"
    """Registered policy loss (`megatron_rl.algorithms.options.POLICY_LOSS_OPTIONS`): vanilla
    (PPO clip, default) | gspo | cispo. verl: `actor.policy_loss.loss_mode`."""
    loss_agg_mode: str = "token-mean"
    """token-mean (default) | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    (ALGORITHMS.md section 6). verl: `actor.loss_agg_mode`."""
    loss_scale_factor: Optional[float] = None
    """C of seq-mean-token-sum-norm, tokens; None (default) = data.max_response_length."""
    mask_truncated: bool = False
    """Overlong filtering: responses without EOS get loss mask 0. Default false."""
    use_kl_loss: bool = False
    """Add `kl_loss_coef` x KL(policy || reference) to the loss (builds a frozen reference model).
    Default false. verl: `actor.use_kl_loss`."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss, >= 0; must be > 0 with use_kl_loss. Default 0. verl: `actor.kl_loss_coef`."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: k1 | k2 | k3 | low_var_kl (= k3, default). verl: `actor.kl_loss_type`."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus subtracted from the loss; 0 (default) = off. verl: `actor.entropy_coeff`."""
    tis: TISConfig = field(default_factory=TISConfig)
    """Truncated importance sampling against the rollout's log-probs."""
    old_logprob_source: str = "recompute"
    """Where the proximal log-probs `old_logprobs` (prox_logp, the anchor of the clip) come from:
    recompute (default: the trainer's forward pass before the first update, ALGORITHMS.md 5) |
    rollout (the rollout engine's log-probs, no recompute; only valid with trainer.max_staleness 0
    and an engine whose numerics match the trainer's). verl: `algorithm.rollout_correction.bypass_mode`."""
    sequence_packing: bool = False
    """Run each micro-batch packed: several sequences to a row, kept apart by a block-diagonal causal
    mask, no padding between them (`trainer.batch.pack_sequences`); the log-probs are unpacked
    before the loss, so the loss and its normaliser are unchanged. Fewer tokens through the model
    when responses vary in length (the tiny recipe's update: 1.3x faster on CPU). Needs the local
    layer spec (trainer.transformer_impl local, or auto without Transformer Engine) and one pipeline
    stage: with Transformer Engine the packed (THD) path is not built.
    Default false. verl: `actor_rollout_ref.model.use_remove_padding`."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    router_replay: bool = False
    """Rollout routing replay (R3, arXiv 2510.11370; ALGORITHMS.md 9; MoE only): the routers take the
    engine's top-k experts per token and layer (megatron-core's RouterReplay) in the old-log-prob pass
    and every update; gates stay the router's own. Default false. slime: --use-rollout-routing-replay."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the registered policy losses' option checks
        _positive("actor", "ppo_mini_batch_size", self.ppo_mini_batch_size)
        _positive("actor", "ppo_micro_batch_size", self.ppo_micro_batch_size)
        _positive("actor", "ppo_epochs", self.ppo_epochs)
        _positive("actor", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        if self.use_dynamic_bsz and self.max_tokens_per_micro_batch is None:
            raise ConfigError("actor.use_dynamic_bsz: true needs actor.max_tokens_per_micro_batch (verl: "
                             "ppo_max_token_len_per_gpu), the token budget of a micro-batch")
        _choice("actor", "policy_loss", self.policy_loss, POLICY_LOSS_OPTIONS.names())
        _choice("actor", "loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODE_NAMES)
        _choice("actor", "kl_loss_type", self.kl_loss_type, KL_TYPE_NAMES)
        _choice("actor", "old_logprob_source", self.old_logprob_source, OLD_LOGPROB_SOURCES)
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
class DAAConfig(*option_bases(*(DAA_FACTOR_OPTIONS.get(n) for n in DAA_FACTOR_OPTIONS.names()))):
    """DA3PO's Direct Advantage Amplification. Carries the options of every registered DAA factor
    (`hard_threshold`, `amplification`, `max_factor`, `gamma`; see `megatron_rl.algorithms.options`).

    The defaults are the DA3PO paper's rule as reported by summaries of the paper (ALGORITHMS.md
    section 4.1: `factor: constant`, `difficulty: group`, lambda 2, tau 0.5), the same as the
    DA3PO recipes, so `algorithm.daa.enable=true` on any recipe means DA3PO as published."""

    enable: bool = False
    """DA3PO: amplify correct responses' advantages on hard prompts (ALGORITHMS.md section 4). Default false."""
    difficulty: str = "group"
    """How a group's success rate q_hat is estimated (ALGORITHMS.md 4.3): group (k/G, default, the
    paper's) | posterior (mean of Beta(prior_a + k, prior_b + G - k)) | history (Beta counts over
    every group of the prompt so far, aged by history_decay)."""
    factor: str = "constant"
    """Registered DAA factor: constant (amplification, default, the paper's rule) | balanced
    (beta(q_hat), our extension) | power ((hard_threshold / q_hat) ** gamma)."""
    prior_a: float = 0.5
    """a0 of the Beta(a0, b0) prior of the success rate; > 0. Default 0.5 (Jeffreys)."""
    prior_b: float = 0.5
    """b0 of the Beta(a0, b0) prior of the success rate; > 0. Default 0.5 (Jeffreys)."""
    history_decay: float = 1.0
    """Weight per RL step of age of an earlier group in `difficulty: history` (a group scored s
    steps ago counts decay^s); in (0, 1]. Default 1.0 (no decay)."""

    def __post_init__(self) -> None:
        if self.difficulty == "conditional":
            raise ConfigError(CONDITIONAL_REMOVED)
        _choice("algorithm.daa", "difficulty", self.difficulty, DAA_DIFFICULTY_MODES)
        _choice("algorithm.daa", "factor", self.factor, DAA_FACTOR_OPTIONS.names())
        super().__post_init__()  # the registered factors' option checks
        _positive("algorithm.daa", "prior_a", self.prior_a)
        _positive("algorithm.daa", "prior_b", self.prior_b)
        if not (isinstance(self.history_decay, (int, float)) and 0.0 < self.history_decay <= 1.0):
            raise ConfigError(f"algorithm.daa.history_decay: {self.history_decay!r} must be in (0, 1]")


@dataclass(kw_only=True)
class RolloutCorrectionConfig(*option_bases(*(ROLLOUT_CORRECTION_OPTIONS.get(n)
                                              for n in ROLLOUT_CORRECTION_OPTIONS.names()))):
    """Off-policy correction with the behaviour weight w_t = exp(prox_logp - behav_logp)
    (ALGORITHMS.md section 8). Carries the options of every registered mode (`tis_cap`, `mask_low`,
    `mask_high`, `level`; see `megatron_rl.algorithms.options`); only those of the mode are used."""

    mode: str = "auto"
    """auto (default) | token_tis (min(w_t, tis_cap) multiplies each token's policy loss) | seq_tis
    (min(exp(sum_t log w_t), tis_cap) for every token of a sample) | mask (tokens or samples whose
    w_t leaves [mask_low, mask_high] get loss mask 0) | none. auto = token_tis when actor.tis.enable
    (cap actor.tis.clip) or trainer.max_staleness > 0, none otherwise (today's behaviour). verl:
    `rollout_is: token|sequence` = token_tis|seq_tis, `rollout_rs: token` = mask."""

    def __post_init__(self) -> None:
        _choice("algorithm.rollout_correction", "mode", self.mode, ("auto", *ROLLOUT_CORRECTION_OPTIONS.names()))
        super().__post_init__()  # the registered modes' option checks


@dataclass(kw_only=True)
class AlgorithmConfig(*option_bases(*(ADV_ESTIMATOR_SPECS.get(n).options for n in ADV_ESTIMATOR_SPECS.names()))):
    """Advantages, dynamic sampling and DAA. Carries the options of every registered advantage
    estimator (`grpo_std`, `norm_adv_by_std_in_grpo`; see `megatron_rl.algorithms.options`)."""

    adv_estimator: str = "grpo"
    """Registered advantage estimator: grpo (default) | rloo | reinforce_plus_plus_baseline.
    verl: `algorithm.adv_estimator`."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    daa: DAAConfig = field(default_factory=DAAConfig)
    """DA3PO's advantage amplification."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction against the rollout engine's log-probs (ALGORITHMS.md section 8)."""

    def __post_init__(self) -> None:
        _choice("algorithm", "adv_estimator", self.adv_estimator, ADV_ESTIMATOR_SPECS.names())
        super().__post_init__()  # the registered estimators' option checks


@dataclass(kw_only=True)
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong reward shaping: a linear penalty for responses ending in the last `len` tokens
    before data.max_response_length. Default false. verl: `reward_model.overlong_buffer.enable`."""
    len: int = 16
    """Tokens of the soft-punishment buffer (L_buf); must be < data.max_response_length. Default 16.
    verl: `reward_model.overlong_buffer.len`."""
    penalty_factor: float = 1.0
    """Penalty at the full length (reward units), >= 0; it grows linearly over the buffer. Default 1.0.
    verl: `reward_model.overlong_buffer.penalty_factor`."""

    def __post_init__(self) -> None:
        _positive("reward.overlong_buffer", "len", self.len)
        _positive("reward.overlong_buffer", "penalty_factor", self.penalty_factor, allow_zero=True)


@dataclass(kw_only=True)
class RewardConfig:
    reward_fn: str = "dapo_math"
    """Registry name of the verifier."""
    correct_score: float = 1.0
    """Score of a response the verifier accepts (acc true), before shaping. Default 1.0."""
    incorrect_score: float = -1.0
    """Score of a response the verifier rejects (acc false), before shaping. Default -1.0."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping."""
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
    """Evaluate the trained policy after the last step (summary.json eval_after). Default true."""
    interval: int = 0
    """Evaluate every this many steps; 0 = only before/after."""
    token_interval: int = 0
    """Evaluate after the first step whose running total of generated tokens
    (`perf/total_generated_tokens`) reaches each multiple of this many tokens (one evaluation when a
    step crosses several), so that runs of different step sizes are compared at the same token
    counts; with `trainer.max_generated_tokens` a multiple of it, the final evaluation is the last
    such point. Combines with `interval`. Tokens, >= 0. Default 0 = off."""
    n: int = 8
    """Samples a problem for avg@n / pass@n."""
    temperature: float = 1.0
    """Sampling temperature of the eval, >= 0. Default 1.0."""
    top_p: float = 1.0
    """Nucleus sampling mass of the eval in (0, 1]. Default 1.0."""
    seed: int = 1234
    """Fixed sampling seed of the eval (each sample derives its own)."""
    max_problems: int = 0
    """Evaluate on the first this many val rows; 0 = all."""
    max_response_length: Optional[int] = None
    """Default: data.max_response_length."""

    def due(self, step: int, tokens_before: int, tokens_after: int) -> bool:
        """A periodic evaluation after `step`, whose generated tokens took the running total from
        `tokens_before` to `tokens_after`: every `interval` steps, or when a multiple of
        `token_interval` is crossed (tokens_before < m * token_interval <= tokens_after)."""
        if self.interval and step % self.interval == 0:
            return True
        t = self.token_interval
        return bool(t) and tokens_after // t > tokens_before // t

    def __post_init__(self) -> None:
        _positive("eval", "n", self.n)
        _positive("eval", "temperature", self.temperature, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"eval.top_p: {self.top_p!r} must be in (0, 1]")
        _positive("eval", "max_response_length", self.max_response_length)
        _positive("eval", "interval", self.interval, allow_zero=True)
        _positive("eval", "token_interval", self.token_interval, allow_zero=True)
        _positive("eval", "max_problems", self.max_problems, allow_zero=True)


@dataclass(kw_only=True)
class WeightSyncConfig:
    bucket_size_mib: float = 512.0
    """Bytes per broadcast bucket, MiB."""
    backend: str = "gloo"
    """gloo (CPU) | nccl (GPU). With `rollout.backend: vllm`, nccl is vLLM's own transfer engine (CUDA GPUs)
    and gloo megatron-rl's (plugins/vllm_gloo in vLLM's environment: vLLM's CPU build, scripts/setup_vllm_cpu.sh)."""
    master_address: str = "127.0.0.1"
    """Address the rollout servers reach the trainer's weight-sync TCPStore at. Default 127.0.0.1."""
    master_port: Optional[int] = None
    """TCPStore port of the weight-sync group; None = a free port."""
    timeout_s: float = 600.0
    """Timeout of the weight-sync group's rendezvous and collectives, and of the update calls, seconds. Default 600."""
    load_format: Optional[str] = None
    """SGLang's `load_format` of `/update_weights_from_distributed`: null (the default, SGLang's and
    slime's: one broadcast per tensor, no copy on the trainer side; the embedded server receives
    straight into its parameters) or `flattened_bucket` (the tensors of a bucket copied into one uint8
    tensor, one broadcast a bucket). The servers load the same weights either way
    (`benchmarks/sync_throughput.py` measures both). Colocated: the same for `/update_weights_from_tensor`."""
    check_checksums: bool = False
    """After every sync, compare a SHA-256 per tensor of each server's weights (`/get_weights_by_name`)
    with the trainer's; a mismatch fails the sync. Costs a full read-back of the weights over HTTP."""

    def __post_init__(self) -> None:
        _positive("weight_sync", "bucket_size_mib", self.bucket_size_mib)
        _choice("weight_sync", "backend", self.backend, ("gloo", "nccl"))
        _choice("weight_sync", "load_format", self.load_format, ("flattened_bucket", None))
        _positive("weight_sync", "timeout_s", self.timeout_s)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"weight_sync.master_port: {self.master_port!r} must be a TCP port (1-65535) or null")


@dataclass(kw_only=True)
class TrainerConfig(ExpertOptions):
    total_training_steps: int = 10
    """RL steps (verl's name)."""
    max_generated_tokens: int = 0
    """Token budget: the run stops after the first step whose running total of generated response
    tokens (`perf/total_generated_tokens`: every sampled response, kept or filtered out, resumes
    included) reaches this many tokens, exactly as after the last step (checkpoint with save_last,
    final evaluation, summary.json with `steps` = that step). total_training_steps still bounds
    the run and sets the LR schedule. Tokens, >= 0. Default 0 = no token budget."""
    max_staleness: int = 0
    """eta of ALGORITHMS.md section 8: the rollout producer generates ahead while the trainer trains,
    admitted so that no trained sample is more than eta weight versions old (step s's generation
    starts once the published version is >= s - 1 - eta). 0 (default) = the synchronous step,
    exactly. Versions, >= 0. AReaL: `max_head_offpolicyness`; verl's one-step off-policy is 1."""
    seed: int = 1234
    """Seed of the model init, the prompt order and the sampling seeds. Default 1234."""
    save_interval: int = 0
    """Checkpoint every this many steps; 0 = only at the end."""
    save_last: bool = True
    """Write a checkpoint after the last step."""
    keep_last_n_checkpoints: int = 2
    """Complete checkpoints kept in `<run_dir>/checkpoints`; older ones are deleted. Default 2."""
    resume_mode: str = "auto"
    """auto: continue from the latest complete checkpoint in `<run_dir>/checkpoints` if there is
    one (verl's name) | disable: start over (refused when the run dir already holds checkpoints)."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGUSR1 finish the current step, write a checkpoint and exit (code 75) so that
    a requeued job resumes from it; a second signal exits at once."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks (megatron-core's name); must divide the attention and KV heads and the
    FFN size. Default 1. verl: `actor_rollout_ref.actor.megatron.tensor_model_parallel_size`."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (megatron-core's name); must divide the layers. Default 1.
    verl: `actor_rollout_ref.actor.megatron.pipeline_model_parallel_size`."""
    context_parallel_size: int = 1
    """Context-parallel ranks (megatron-core's name); only 1 is implemented. Default 1.
    verl: `actor_rollout_ref.actor.megatron.context_parallel_size`."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1; Transformer Engine's norms, or torch norms marked
    sequence-parallel on the local spec). Default false.
    verl: `actor_rollout_ref.actor.megatron.sequence_parallel`."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (megatron-core's distributed optimizer).
    Default false. verl: `actor_rollout_ref.actor.megatron.use_distributed_optimizer`."""
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
    attention_backend: str = "auto"
    """auto | sdpa (Megatron's --attention-backend, plus torch SDPA): auto = megatron-core's own core
    attention; sdpa = torch's SDPA in the local spec (models/sdpa_attention.py): faster on CPU, fp32
    rounding differs (~1e-6). Needs the local spec (transformer_impl local, or auto without TE)."""
    recompute: Optional[str] = None
    """None | selective | full activation recompute."""
    distributed_backend: str = "gloo"
    """torch.distributed backend of the trainer's process groups: gloo (CPU, default) | nccl (GPU)."""
    distributed_timeout_s: float = 600.0
    """Timeout of every collective of the trainer."""
    tensorboard: bool = True
    """Write TensorBoard event files to `<run_dir>/tensorboard`. Default true."""
    wandb: bool = False
    """Log metrics to Weights & Biases (needs wandb installed and logged in). Default false."""
    progress_bar: bool = True
    """Show a progress bar of the steps on the controller. Default true."""
    num_threads: int = 0
    """torch intra-op threads per process; 0 = torch's default."""

    def __post_init__(self) -> None:
        _positive("trainer", "total_training_steps", self.total_training_steps)
        _positive("trainer", "max_generated_tokens", self.max_generated_tokens, allow_zero=True)
        _positive("trainer", "save_interval", self.save_interval, allow_zero=True)
        _positive("trainer", "max_staleness", self.max_staleness, allow_zero=True)
        _positive("trainer", "keep_last_n_checkpoints", self.keep_last_n_checkpoints)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "nproc_per_node"):
            _positive("trainer", name, getattr(self, name))
        self._check_expert_options()  # config/moe.py
        _choice("trainer", "precision", self.precision, ("fp32", "bf16"))
        _choice("trainer", "resume_mode", self.resume_mode, ("auto", "disable"))
        _positive("trainer", "num_threads", self.num_threads, allow_zero=True)
        if self.distributed_timeout_s < 1:
            raise ConfigError(f"trainer.distributed_timeout_s: {self.distributed_timeout_s!r} must be >= 1 (seconds)")
        _choice("trainer", "fp8", self.fp8, (None, "hybrid", "e4m3"))
        _choice("trainer", "fp8_recipe", self.fp8_recipe, ("delayed", "tensorwise", "blockwise", "mxfp8"))
        _choice("trainer", "fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("max", "most_recent"))
        _positive("trainer", "fp8_amax_history_len", self.fp8_amax_history_len)
        _positive("trainer", "fp8_margin", self.fp8_margin, allow_zero=True)
        _choice("trainer", "transformer_impl", self.transformer_impl, ("auto", "transformer_engine", "local"))
        _choice("trainer", "attention_backend", self.attention_backend, ("auto", "sdpa"))
        if self.attention_backend == "sdpa" and self.transformer_impl == "transformer_engine":
            raise ConfigError("trainer.attention_backend sdpa is for megatron-core's local layer spec; "
                              "trainer.transformer_impl transformer_engine brings its own attention (set local)")
        if self.fp8 is not None and self.transformer_impl == "local":
            raise ConfigError("trainer.fp8 needs trainer.transformer_impl: transformer_engine (or auto): "
                             "megatron-core's local layers have no FP8 GEMMs")
        if self.context_parallel_size > 1 and self.transformer_impl == "local":
            raise ConfigError("trainer.context_parallel_size > 1 needs trainer.transformer_impl: transformer_engine: "
                             "megatron-core runs context parallelism only in Transformer Engine's attention "
                             "(TEDotProductAttention); the local spec's attention refuses it")
        if self.fp8_param_gather and (self.fp8 is None or not self.use_distributed_optimizer):
            raise ConfigError("trainer.fp8_param_gather needs trainer.fp8 and trainer.use_distributed_optimizer")
        _choice("trainer", "recompute", self.recompute, (None, "selective", "full"))
        _choice("trainer", "distributed_backend", self.distributed_backend, ("gloo", "nccl"))
        if self.fp8 is not None and self.precision != "bf16":
            raise ConfigError("trainer.fp8 needs trainer.precision: bf16 (FP8 GEMMs with bf16 master compute)")


@dataclass(kw_only=True)
class Config:
    run_dir: str = "runs/default"
    """Output folder: resolved config, metrics.jsonl, TensorBoard, checkpoints, summary.json, logs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (Hugging Face folder)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, batch sizes and lengths."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout servers and sampling."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy update: batches, loss, optimizer."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, dynamic sampling, DAA."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Verifier and reward shaping."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on data.val_files."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer -> rollout server weight updates."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, checkpoints, parallel layout, precision, logging."""


SECRET_KEYS = ("rollout.api_key", "rollout.admin_api_key")
"""Dotted keys never written to disk or logs."""
