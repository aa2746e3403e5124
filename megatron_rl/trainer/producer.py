"""The rollout producer (controller only): DESIGN.md steps 1-5 of one RL step.

Draw prompts, sample `rollout.n` responses each, score them, filter groups (dynamic sampling),
compute advantages (+ DAA), and build the step's `TrainBatch`. Its per-step state (groups kept so
far, difficulty estimates, token counts) lives in fields of `_StepState`, one per step.

With `actor.router_replay` (Mixture-of-Experts policies) the producer asks the rollout manager for
the engines' routing of every response (`RoutedExpertsSpec` of the model's config) and passes each
sample's routing into the batch (`TrainBatch.routed_experts`, a `RoutedRows`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.daa import apply_daa
from megatron_rl.algorithms.dynamic_sampling import collect_groups, keep_group
from megatron_rl.algorithms.options import ADV_ESTIMATOR_SPECS
from megatron_rl.trainer.batch import build_train_batch
from megatron_rl.trainer.step_metrics import CHECKSUM_PRIME, token_checksum

logger = logging.getLogger(__name__)

__all__ = ["ProducedStep", "RolloutProducer", "routed_experts_spec", "sample_routing", "sampling_params"]


def routed_experts_spec(cfg):
    """The `RoutedExpertsSpec` (layers, top-k, experts) of the policy when the engines return routing
    (`actor.router_replay`, or `rollout.return_routed_experts` for the mismatch metric alone), read
    from `model.path`'s config.json; None otherwise.

    Raises:
        ValueError: router replay on a model whose config is not a Mixture-of-Experts one.
    """
    from megatron_rl.config.moe import routing_requested

    if not routing_requested(cfg):
        return None
    from megatron_rl.rollout.result import RoutedExpertsSpec

    path = Path(cfg.model.path) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"actor.router_replay: cannot read the model's config {path}: {e}") from None
    try:
        return RoutedExpertsSpec.from_hf_config(hf_config)
    except ValueError as e:
        raise ValueError(f"actor.router_replay: {e}") from None


def sample_routing(samples) -> list:
    """Each sample's routing, [len(prompt) + len(response) - 1, L, K] int16, for `build_train_batch`.

    Raises:
        ValueError: a sample without routing, or with another number of positions (names its group
            and prompt key).
    """
    out = []
    for s in samples:
        r = s.routed_experts
        want = len(s.prompt_ids) + len(s.response_ids) - 1
        if r is None or r.shape[0] != want:
            raise ValueError(f"actor.router_replay: sample of group {s.group_uid} ({s.prompt_key}) has routed_experts "
                             f"{None if r is None else list(r.shape)}, expected {want} positions (prompt "
                             f"{len(s.prompt_ids)} + response {len(s.response_ids)} - 1)")
        out.append(r)
    return out


def sampling_params(cfg) -> dict:
    """SGLang sampling params of training rollouts (`rollout.temperature`, `top_p`, `top_k`)."""
    p = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p}
    if cfg.rollout.top_k != -1:
        p["top_k"] = cfg.rollout.top_k
    return p


@dataclass
class ProducedStep:
    """Everything steps 1-5 made for one step.

    Attributes:
        batch: the `TrainBatch` (B = kept groups x `rollout.n` sequences).
        samples / kept: the trained samples (B) and their groups.
        ds_stats / daa_stats: dynamic-sampling and DAA statistics.
        timings: `timing/generate_s`, `timing/reward_s`, `timing/filter_s`, `rollout/aborted` (+ more
            with over-sampling), seconds / counts.
        generated_tokens / responses / checksum: over every sampled response, kept or not.
        advantage_started: `time.perf_counter()` when step 5 began.
        start_version / state: asynchronous mode only (`trainer/async_producer.py`).
    """

    batch: object
    samples: list
    kept: list
    ds_stats: dict
    daa_stats: dict
    timings: dict
    generated_tokens: int
    responses: int
    checksum: int
    advantage_started: float
    start_version: int | None = None
    """Asynchronous mode: the weight version published when this step's generation started."""
    state: dict | None = None
    """Asynchronous mode: the run state (data cursor, difficulty history) right after this step was
    produced, saved with a checkpoint of this step (the producer has moved on since)."""


@dataclass
class _StepState:
    step: int
    kept_so_far: int = 0
    in_batches_s: float = 0.0
    """Seconds inside `_generate_batch` (rollout + reward + per-group bookkeeping)."""
    q_hats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=lambda: {"timing/generate_s": 0.0, "timing/reward_s": 0.0,
                                                   "rollout/aborted": 0})
    tokens: int = 0
    responses: int = 0
    checksum: int = 0


class RolloutProducer:
    """Steps 1-5 on the controller.

    Args:
        cfg: the run's `Config`.
        manager: a `RolloutManager` (generation through the engines, rewards).
        dataset: the `PromptDataset` (its cursor is part of the run state).
        tracker: the DAA `DifficultyTracker` (records every scored group).
        pad_id: padding token id of the batch.
        dp_size: data-parallel size (a partial dynamic-sampling batch is a multiple of mini-batch x DP).
    """

    def __init__(self, cfg, manager, dataset, tracker, *, pad_id: int, dp_size: int) -> None:
        self.cfg = cfg
        self.manager = manager
        self.dataset = dataset
        self.tracker = tracker
        self.pad_id = pad_id
        self.dp_size = dp_size
        self.sampling = sampling_params(cfg)
        fg = cfg.algorithm.filter_groups
        self.over_sampling = bool(cfg.rollout.over_sampling_batch_size) and fg.enable and not cfg.rollout.deterministic
        if cfg.rollout.over_sampling_batch_size and not self.over_sampling:
            logger.warning("rollout.over_sampling_batch_size is ignored: it needs algorithm.filter_groups.enable and "
                           "rollout.deterministic=false (which groups finish first depends on timing)")
        self.routed_experts = routed_experts_spec(cfg)
        """`RoutedExpertsSpec` of the routing every sample carries (`actor.router_replay`), or None."""
        if self.routed_experts is not None and getattr(manager, "routed_experts", None) is None:
            manager.request_routed_experts(self.routed_experts)

    def keep(self, group) -> bool:
        """Dynamic sampling's keep rule (ALGORITHMS.md section 2) on the group's metric values."""
        return keep_group(group.metric_values(self.cfg.algorithm.filter_groups.metric))

    def produce(self, step: int) -> ProducedStep:
        """Steps 1-5 of `step`: the groups, their advantages and the train batch.

        Raises:
            DynamicSamplingExhausted: too few groups kept (see `collect_groups`).
            RolloutServerError: the engines failed beyond recovery.
        """
        cfg, fg = self.cfg, self.cfg.algorithm.filter_groups
        st = _StepState(step)
        t_collect = time.perf_counter()
        kept, ds_stats = collect_groups(
            lambda batch_idx: self._generate_batch(st, batch_idx), train_batch_size=cfg.data.train_batch_size,
            max_num_gen_batches=fg.max_num_gen_batches, on_exhausted=fg.on_exhausted,
            ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size, dp_size=self.dp_size, enable=fg.enable,
            keep_fn=self.keep, solve_rate_fn=lambda g: g.num_correct / max(g.num_valid, 1),
        )
        # the group filter and the bookkeeping between generation batches, outside the batches
        st.timings["timing/filter_s"] = time.perf_counter() - t_collect - st.in_batches_s
        samples = [s for g in kept for s in g.samples]
        t_adv = time.perf_counter()
        adv, daa_stats = self._advantages(kept, samples, st.q_hats)
        a = cfg.actor
        trained = [not s.failed and not (a.mask_truncated and s.truncated) for s in samples]
        t = cfg.trainer
        batch = build_train_batch(
            [s.prompt_ids for s in samples], [s.response_ids for s in samples],
            advantages=adv.tolist(), rollout_logprobs=[s.rollout_logprobs for s in samples],
            trained=trained, pad_id=self.pad_id,
            pad_to_multiple_of=t.tensor_model_parallel_size if t.sequence_parallel else 1,
            routed_experts=sample_routing(samples) if self.routed_experts is not None else None,
            response_masks=[s.response_mask for s in samples],
        )
        return ProducedStep(batch, samples, kept, ds_stats, daa_stats, st.timings, st.tokens, st.responses,
                            st.checksum, t_adv)

    def _generate_batch(self, st: _StepState, batch_idx: int) -> list:
        """Steps 1-3 for one generation batch: draw, sample, score; records every group."""
        t0 = time.perf_counter()
        try:
            groups = self._sample(st, batch_idx)
            for g in groups:
                self._record(st, g)
            return groups
        finally:
            st.in_batches_s += time.perf_counter() - t0

    def _sample(self, st: _StepState, batch_idx: int) -> list:
        cfg = self.cfg
        if self.over_sampling:  # launch more prompts than needed, abort the rest once the batch is full
            rows = self.dataset.next_batch(cfg.rollout.over_sampling_batch_size)
            groups, tm = self.manager.generate_groups(
                rows, n=cfg.rollout.n, sampling_params=self.sampling, step=st.step, gen_batch=batch_idx,
                stop_after=cfg.data.train_batch_size - st.kept_so_far, keep_fn=self.keep)
            st.kept_so_far += sum(1 for g in groups if self.keep(g))
        else:
            rows = self.dataset.next_batch(cfg.data.gen_batch_size or cfg.data.train_batch_size)
            groups, tm = self.manager.generate_groups(rows, n=cfg.rollout.n, sampling_params=self.sampling,
                                                      step=st.step, gen_batch=batch_idx)
        for k, v in tm.items():  # sums over generation batches; a `_max` is the largest
            st.timings[k] = max(st.timings.get(k, 0), v) if k.endswith("_max") else st.timings.get(k, 0) + v
        return groups

    def _record(self, st: _StepState, g) -> None:
        """Token counts and checksum; the group's difficulty estimate and the tracker's history."""
        daa = self.cfg.algorithm.daa
        k_correct, g_valid = g.num_correct, g.num_valid
        st.tokens += sum(len(s.response_ids) for s in g.samples)
        st.responses += len(g.samples)
        st.checksum = (st.checksum + sum(token_checksum(s.response_ids) for s in g.samples)) % CHECKSUM_PRIME
        if 1 <= k_correct <= g_valid - 1:
            st.q_hats[g.group_uid] = self.tracker.estimate(g.prompt_key, k_correct, g_valid, daa.difficulty,
                                                           step=st.step)
        if g_valid:  # a group whose every reward failed says nothing about the prompt
            self.tracker.record(g.prompt_key, k_correct, g_valid, step=st.step)

    def _advantages(self, kept: list, samples: list, q_hats: dict) -> tuple[torch.Tensor, dict]:
        """Step 5: advantages [B] float64 of the estimator, then DAA on hard prompts' correct responses."""
        cfg, daa = self.cfg, self.cfg.algorithm.daa
        rewards = torch.tensor([s.score for s in samples], dtype=torch.float64)
        valid = torch.tensor([not s.failed for s in samples], dtype=torch.bool)
        uids = [s.group_uid for s in samples]
        resp_mask = None
        if ADV_ESTIMATOR_SPECS.get(cfg.algorithm.adv_estimator).needs_response_mask:
            width = max(len(s.response_ids) for s in samples)
            resp_mask = torch.zeros((len(samples), width), dtype=torch.bool)
            for i, s in enumerate(samples):
                resp_mask[i, : len(s.response_ids)] = not s.failed
                if s.response_mask is not None:  # a multi-turn episode: the model's tokens only
                    resp_mask[i, : len(s.response_ids)] &= torch.tensor(s.response_mask, dtype=torch.bool)
        adv = compute_advantages(
            cfg.algorithm.adv_estimator, rewards, uids, valid, response_mask=resp_mask,
            grpo_std=cfg.algorithm.grpo_std, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        )
        if not daa.enable:
            return adv, {}
        group_index = torch.tensor([i for i, g in enumerate(kept) for _ in g.samples], dtype=torch.long)
        q = torch.tensor([q_hats.get(g.group_uid, 1.0) for g in kept], dtype=torch.float64)
        eligible = torch.tensor([g.group_uid in q_hats for g in kept], dtype=torch.bool)
        correct = torch.tensor([s.acc and not s.failed for s in samples], dtype=torch.bool)
        return apply_daa(adv, correct, group_index, q, eligible, factor=daa.factor, hard_threshold=daa.hard_threshold,
                         amplification=daa.amplification, max_factor=daa.max_factor, gamma=daa.gamma)
