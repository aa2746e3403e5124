"""Policy updates through megatron-core's pipeline schedule (DESIGN.md step 6, ALGORITHMS.md 5-6).

Old log-probs are recomputed with the same model state, precision and micro-batch layout as the
update, so the first mini-batch of a step has ratio exactly 1. The loss function hands
megatron-core a numerator and an integer count per micro-batch (`calculate_per_token_loss=True`);
megatron-core sums both over micro-batches and data-parallel ranks and divides in
`finalize_model_grads`, which makes the normaliser of every aggregation mode global.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from megatron_rl.algorithms.aggregation import aggregate_loss
from megatron_rl.algorithms.kl import kl_penalty
from megatron_rl.algorithms.losses import POLICY_LOSSES
from megatron_rl.algorithms.options import (POLICY_LOSS_OPTIONS, ResolvedCorrection, options_of,
                                            resolve_rollout_correction)
from megatron_rl.algorithms.rollout_correction import rollout_correction
from megatron_rl.config.schema import ActorConfig, RolloutCorrectionConfig
from megatron_rl.trainer.batch import TrainBatch, pack_sequences
from megatron_rl.trainer.logprobs import forward_logits, token_logprobs_and_entropy

logger = logging.getLogger(__name__)


# every rank all-reduces the same keys (stages without the loss have none of their own)
_SUM_KEYS = ("tokens", "clipped", "dual_clipped", "approx_kl", "entropy", "kl", "loss_num", "loss_count",
             "rc_valid", "rc_nonfinite", "rc_behav_weight", "rc_is_weight", "rc_truncated", "rc_masked")
_RC_METRICS = {  # metric -> (sum of rollout_correction's `sums`, modes it is logged for)
    "train/rollout_corr/behav_weight_mean": ("behav_weight", ("token_tis", "seq_tis", "mask")),
    "train/rollout_corr/rollout_is_mean": ("is_weight", ("token_tis", "seq_tis")),
    "train/rollout_corr/rollout_is_ratio_fraction_high": ("truncated", ("token_tis", "seq_tis")),
    "train/rollout_corr/rollout_is_masked_fraction": ("masked", ("mask",)),
    "train/rollout_corr/nonfinite_fraction": ("nonfinite", ("token_tis", "seq_tis", "mask")),
    "train/tis_raw_ratio_mean": ("behav_weight", ()),  # section 5's names, with actor.tis.enable
    "train/tis_weight_mean": ("is_weight", ()),
}


class PolicyTrainer:
    """Runs log-prob passes and PPO mini-batch updates of a megatron-core GPTModel.

    Args:
        model: list of DDP-wrapped model chunks (megatron-core convention).
        optimizer: megatron-core optimizer (`get_megatron_optimizer`).
        scheduler: `OptimizerParamScheduler`.
        vocab_size: unpadded vocabulary size (padded logits are masked out).
        micro_batch_size: sequences per micro-batch (when `max_tokens_per_micro_batch` is None).
        max_tokens_per_micro_batch: token budget of a micro-batch (rows x padded width, see
            `trainer.batch.split_by_token_budget`); None = fixed `micro_batch_size` micro-batches.
        actor: the `actor` config section: `policy_loss` and its registered options (passed to the
            loss function as `options_of(POLICY_LOSS_OPTIONS.get(policy_loss), actor)`),
            `loss_agg_mode`, `loss_scale_factor`, `tis`, `old_logprob_source`,
            `use_kl_loss`/`kl_loss_coef`/`kl_loss_type`, `entropy_coeff`. Its batch sizes are not
            read here (see `micro_batch_size`).
        rollout_correction: the off-policy correction (`config.validate.rollout_correction_of(cfg)`);
            None = the one `actor.tis` alone resolves to (token_tis with `actor.tis.clip`, or none).
        sequence_packing: run every micro-batch packed (`trainer.batch.pack_sequences`,
            `actor.sequence_packing`); needs one pipeline stage and the local layer spec.
        max_response_length: `data.max_response_length`, the default `loss_scale_factor` of
            seq-mean-token-sum-norm.
        tp_group: tensor-parallel group for the vocab-parallel log-probs (None at TP=1).
        ref_model: frozen reference model chunks, only with a KL loss.
        dp_group: data-parallel group (with context-parallel ranks); None = no data parallelism.
        pp_group: pipeline-parallel group; None = one stage.
        routing: the model's `trainer.router_replay.RoutingReplay` (Mixture-of-Experts models):
            each micro-batch's engine routing is set on the routers before its forward (replayed
            with `actor.router_replay`), and the old-log-prob pass measures the router mismatch
            (`routing_metrics`). None = dense model, nothing to do.

    Layouts: every rank is handed the whole step's batch. Each mini-batch is split into equal
    contiguous shares, one per DP rank (its sequences must divide evenly); a rank runs its share
    through megatron-core's schedule (1F1B across `pp_group`), and megatron-core reduces the
    gradients and the loss normaliser over all micro-batches and DP ranks. Log-probs and metrics
    are gathered so that every rank returns the same full-batch values.

    Groups and ranks: advantages (every estimator, DAA included) are computed by the controller
    over the whole step before the batch reaches the trainer, and no loss term couples the
    sequences of a group, so no estimator needs a group on one DP rank; a DP share holds whole
    groups anyway when `actor.ppo_mini_batch_size` is a multiple of the DP size (shares are
    contiguous and groups are stored contiguously). With a token budget a rank's micro-batch
    count can differ from another rank's; the gradients are reduced once per mini-batch.
    """

    def __init__(self, model, optimizer, scheduler, *, vocab_size: int, micro_batch_size: int,
                 actor: ActorConfig, max_response_length: int | None = None, tp_group=None, ref_model=None,
                 dp_group=None, pp_group=None, max_tokens_per_micro_batch: int | None = None,
                 rollout_correction: ResolvedCorrection | None = None, sequence_packing: bool = False,
                 routing=None, equal_micro_batches: bool = False) -> None:
        if sequence_packing and pp_group is not None:
            raise ValueError("actor.sequence_packing needs trainer.pipeline_model_parallel_size 1")
        self.sequence_packing = sequence_packing
        self.routing = routing if routing is not None and routing.active else None
        self.routing_metrics: dict = {}
        """`train/router_mismatch*` of the last old-log-prob pass (ALGORITHMS.md 9); {} for dense models."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.actor = actor
        self.tp_group = tp_group
        self.ref_model = ref_model
        self.dp_group = dp_group
        self.pp_group = pp_group
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.equal_micro_batches = equal_micro_batches
        self._loss_fn = POLICY_LOSSES.get(actor.policy_loss)
        self._loss_kwargs = options_of(POLICY_LOSS_OPTIONS.get(actor.policy_loss), actor)
        self._loss_scale_factor = actor.loss_scale_factor
        if self._loss_scale_factor is None and actor.loss_agg_mode == "seq-mean-token-sum-norm":
            if max_response_length is None:
                raise ValueError("actor.loss_agg_mode seq-mean-token-sum-norm needs actor.loss_scale_factor or "
                                 "max_response_length (data.max_response_length)")
            self._loss_scale_factor = float(max_response_length)
        self._kl_coef = actor.kl_loss_coef if actor.use_kl_loss else 0.0
        self.correction = rollout_correction or resolve_rollout_correction(
            RolloutCorrectionConfig(), tis_enable=actor.tis.enable, tis_clip=actor.tis.clip)
        logger.info("off-policy correction: %s %s; old log-probs: %s", self.correction.mode, self.correction.options,
                    actor.old_logprob_source)

    # ---- layout helpers ------------------------------------------------------------------------
    @staticmethod
    def _size_rank(group) -> tuple[int, int]:
        import torch.distributed as dist

        if group is None:
            return 1, 0
        return dist.get_world_size(group), dist.get_rank(group)

    @property
    def is_last_stage(self) -> bool:
        size, rank = self._size_rank(self.pp_group)
        return rank == size - 1

    def _dp_share(self, mini: TrainBatch) -> TrainBatch:
        """This DP rank's contiguous share of a mini-batch.

        Raises:
            ValueError: the mini-batch does not split evenly over the data-parallel ranks.
        """
        size, rank = self._size_rank(self.dp_group)
        if size == 1:
            return mini
        if len(mini) % size:
            raise ValueError(f"a mini-batch of {len(mini)} sequences does not split over {size} data-parallel ranks "
                             "(actor.ppo_mini_batch_size x rollout.n must be a multiple of the data-parallel size)")
        per = len(mini) // size
        return mini.slice(rank * per, (rank + 1) * per)

    def _plans(self, shares: list[TrainBatch]) -> list[list[tuple[list[int], TrainBatch]]]:
        """`_plan` of each share. With `equal_micro_batches` and a token budget, every DP rank
        runs as many micro-batches per share as the rank with the most (the MoE dispatcher's
        collectives over an expert group spanning DP ranks run once per micro-batch: unequal
        counts would hang); one all-reduce of the counts per call."""
        plans = [self._plan(share) for share in shares]
        size, _ = self._size_rank(self.dp_group)
        if not self.equal_micro_batches or self.max_tokens_per_micro_batch is None or size == 1:
            return plans
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.dp_group) == "nccl" else "cpu"
        counts = torch.tensor([len(plan) for plan in plans], dtype=torch.long, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        return [plan if len(plan) == int(c) else self._plan(share, at_least=int(c))
                for plan, share, c in zip(plans, shares, counts.tolist())]

    def _plan(self, share: TrainBatch, at_least: int = 0) -> list[tuple[list[int], TrainBatch]]:
        """This rank's micro-batches of its share: (row indices within the share, micro-batch).

        Fixed-size micro-batches are consecutive rows at the full width S; token-budget ones are
        cut to their own padded width (`TrainBatch.token_budget_micro_batches`), at least
        `at_least` of them.
        """
        if self.max_tokens_per_micro_batch is not None:
            plan = share.token_budget_micro_batches(self.max_tokens_per_micro_batch, min_micro_batches=at_least)
        else:
            step, n = self.micro_batch_size, len(share)
            plan = [(list(range(a, min(a + step, n))), share.slice(a, min(a + step, n))) for a in range(0, n, step)]
        if self.sequence_packing:
            for _, mb in plan:
                mb.packing = pack_sequences(mb)
        return plan

    @staticmethod
    def _forward(m, mb: TrainBatch) -> torch.Tensor:
        """The model's logits for a micro-batch: [B, S, V/tp], or [R, L, V/tp] for packed rows."""
        if mb.packing is None:
            return forward_logits(m, mb.input_ids, position_ids=mb.position_ids)
        pk = mb.packing
        return forward_logits(m, pk.input_ids, position_ids=pk.position_ids, packed_mask=pk.attention_mask)

    def _token_logprobs(self, mb: TrainBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) of `mb`'s labels, each [B, S] float32, from `_forward`'s output."""
        labels = mb.labels if mb.packing is None else mb.packing.labels
        lp, ent = token_logprobs_and_entropy(output, labels, vocab_size=self.vocab_size, tp_group=self.tp_group)
        if mb.packing is not None:
            lp, ent = mb.packing.unpack(lp), mb.packing.unpack(ent)
        return lp, ent

    def _hand_out_routing(self, batch: TrainBatch, mini_batch_sequences: int | None) -> None:
        """This rank's rows (its DP shares of the mini-batches) and layers of the batch's routing."""
        size, rank = self._size_rank(self.dp_group)
        self.routing.hand_out(batch, mini_batch_sequences, dp_size=size, dp_rank=rank)

    def _minis(self, n: int, mini_batch_sequences: int | None) -> list[tuple[int, int]]:
        step = mini_batch_sequences or n
        return [(s, min(s + step, n)) for s in range(0, n, step)]

    def _gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather a DP share's rows [n/dp, ...] -> [n, ...] in DP-rank order."""
        import torch.distributed as dist

        size, _ = self._size_rank(self.dp_group)
        if size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=self.dp_group)
        return torch.cat(parts, dim=0)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast a tensor of the last pipeline stage to every stage (same shape everywhere)."""
        import torch.distributed as dist

        size, _ = self._size_rank(self.pp_group)
        if size == 1:
            return tensor
        dist.broadcast(tensor, src=dist.get_global_rank(self.pp_group, size - 1), group=self.pp_group)
        return tensor

    def _sum_metrics(self, sums: dict) -> dict:
        """Sum metric sums over the pipeline group (only the last stage has them) and DP ranks."""
        import torch.distributed as dist

        keys = sorted(sums)
        t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
        for group in (self.pp_group, self.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(t, group=group)
        return dict(zip(keys, t.tolist()))

    # ---- forward-only passes -------------------------------------------------------------
    def _schedule(self):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()

    def compute_logprobs(self, batch: TrainBatch, *, model=None, mini_batch_sequences: int | None = None) -> torch.Tensor:
        """Per-token log-probs of `batch.labels` at every position: [N, S] float32 (no grad), the
        same full tensor on every rank.

        Pass the `mini_batch_sequences` of the coming `update`: the recompute then uses the same
        DP shares and micro-batch layout, so it is bit-identical to the first update's forward pass.
        """
        model = model or self.model
        for m in model:
            m.eval()
        if model is self.model and self.routing is not None:  # this rank's rows and layers of the routing
            self._hand_out_routing(batch, mini_batch_sequences)
        shares = [self._dp_share(batch.slice(a, b)) for a, b in self._minis(len(batch), mini_batch_sequences)]
        plans = self._plans(shares)
        mbs = [mb for plan in plans for _, mb in plan]
        measure = model is self.model and self.routing is not None

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            if measure:
                self.routing.before_forward(m, mb, measure=True)
            logits = self._forward(m, mb)

            def loss_func(output):
                lp, _ = self._token_logprobs(mb, output)
                return torch.zeros((), dtype=torch.float32), torch.tensor(0, dtype=torch.int), {"logprobs": lp}

            return logits, loss_func

        try:
            with torch.no_grad():
                out = self._schedule()(
                    forward_step_func=forward_step, data_iterator=iter(mbs), model=model,
                    num_microbatches=len(mbs), seq_length=batch.input_ids.shape[1],
                    micro_batch_size=max(len(mb) for mb in mbs), forward_only=True,
                )
        finally:
            if measure:
                self.routing.finish()
        if measure:
            self.routing_metrics = self.routing.mismatch_metrics()
        for m in model:
            m.train()
        width = batch.input_ids.shape[1]
        local = torch.zeros((sum(len(s) for s in shares), width), dtype=torch.float32)
        if self.is_last_stage:  # micro-batch outputs back into the shares' row order, at width S
            outputs, offset = iter(out), 0
            for share, plan in zip(shares, plans):
                for rows, _ in plan:
                    lp = next(outputs)["logprobs"].float()
                    local[torch.as_tensor(rows) + offset, : lp.shape[1]] = lp
                offset += len(share)
        local = self._from_last_stage(local)
        # rows are [mini 0 share, mini 1 share, ...] on each DP rank: gather per mini-batch
        pieces, offset = [], 0
        for share in shares:
            pieces.append(self._gather_rows(local[offset : offset + len(share)]))
            offset += len(share)
        return torch.cat(pieces, dim=0)

    def old_logprobs(self, batch: TrainBatch, *, mini_batch_sequences: int | None = None) -> torch.Tensor:
        """The proximal log-probs `prox_logp` of `batch` ([N, S] float32, nats), per
        `actor.old_logprob_source` (ALGORITHMS.md 5 and 8).

        `recompute`: `compute_logprobs` with the coming update's layout (first mini-batch ratio
        exactly 1). `rollout`: `batch.rollout_logprobs` itself, the same tensor (no forward pass), so
        the first mini-batch ratio is `exp(logp - behav_logp)` and every behaviour weight is 1
        (decoupled PPO's proximal policy = the behaviour policy; verl's `bypass_mode`).
        """
        if self.actor.old_logprob_source == "rollout":
            return batch.rollout_logprobs
        return self.compute_logprobs(batch, mini_batch_sequences=mini_batch_sequences)

    # ---- the update --------------------------------------------------------------------------
    def _loss_func(self, mb: TrainBatch, output: torch.Tensor):
        logprobs, entropy = self._token_logprobs(mb, output)
        mask, weights, sums = mb.loss_mask, None, {}
        if self.correction.mode != "none":  # section 8: weights and rejection from prox vs behav log-probs
            corr = rollout_correction(mb.old_logprobs, mb.rollout_logprobs, mask, self.correction.mode,
                                      **self.correction.options)
            mask, weights = corr.loss_mask, corr.weights  # rejected tokens leave the loss and its normaliser
            sums.update({f"rc_{k}": v for k, v in corr.sums.items()})
        adv = mb.advantages.unsqueeze(1).expand_as(logprobs)  # (B, S)
        out = self._loss_fn(logprobs, mb.old_logprobs, adv, mask, **self._loss_kwargs)
        token_loss = out.token_loss if weights is None else out.token_loss * weights  # weights: detached
        if self._kl_coef > 0:
            # the mask goes in, so masked reference log-probs are never used (a NaN there would
            # otherwise give NaN gradients through torch.where's zero branch)
            kl = kl_penalty(logprobs, mb.ref_logprobs, self.actor.kl_loss_type, loss_mask=mask)
            token_loss = token_loss + self._kl_coef * kl
            sums["kl"] = kl.detach().sum()
        if self.actor.entropy_coeff:
            token_loss = token_loss - self.actor.entropy_coeff * torch.where(mask, entropy, torch.zeros_like(entropy))
        num, count = aggregate_loss(token_loss, mask, self.actor.loss_agg_mode,
                                    loss_scale_factor=self._loss_scale_factor)
        m = mask.float()
        with torch.no_grad():
            sums.update(
                tokens=m.sum(),
                clipped=(out.is_clipped.float() * m).sum(),
                dual_clipped=(out.is_dual_clipped.float() * m).sum(),
                approx_kl=(torch.where(mask, out.approx_kl, torch.zeros_like(out.approx_kl))).sum(),
                entropy=(torch.where(mask, entropy, torch.zeros_like(entropy))).sum(),
                loss_num=num.detach(),
                loss_count=count.detach().float(),
            )
        return num, count.to(torch.int), {k: v.detach().float() for k, v in sums.items()}

    def accumulate_gradients(self, mini: TrainBatch) -> list[dict]:
        """Zero the gradients, then forward and backward every micro-batch of one mini-batch.

        After it, each parameter's `main_grad` holds the gradient of the mini-batch loss, already
        divided by the global normaliser (all micro-batches, all DP ranks) by megatron-core's
        `finalize_model_grads`. `mini` is the whole mini-batch (this rank runs its DP share).
        Returns the per-micro-batch metric sums of this rank (empty on non-last pipeline stages).
        """
        mbs = [mb for _, mb in self._plans([self._dp_share(mini)])[0]]
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.before_forward(m, mb, measure=False)
            return self._forward(m, mb), partial(self._loss_func, mb)

        try:
            return self._schedule()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
                num_microbatches=len(mbs), seq_length=mini.input_ids.shape[1],
                micro_batch_size=max(len(mb) for mb in mbs), forward_only=False,
            )
        finally:
            if self.routing is not None:
                self.routing.finish()

    def update(self, batch: TrainBatch, *, mini_batch_sequences: int, ppo_epochs: int = 1) -> list[dict]:
        """PPO updates over `batch` (old_logprobs set): one optimizer step per mini-batch.

        Args:
            batch: the step's sequences, grouped so each mini-batch holds whole groups.
            mini_batch_sequences: sequences per optimizer step (ppo_mini_batch_size x rollout.n).
            ppo_epochs: passes over the mini-batches.

        Returns:
            One metrics dict per optimizer step (loss, grad_norm, pg_clipfrac, ...).
        """
        assert batch.old_logprobs is not None, "compute old_logprobs before the update"
        if self.routing is not None:  # (done by compute_logprobs unless the old log-probs came from the engine)
            self._hand_out_routing(batch, mini_batch_sequences)
        history = []
        for _ in range(ppo_epochs):
            for start in range(0, len(batch), mini_batch_sequences):
                mini = batch.slice(start, min(start + mini_batch_sequences, len(batch)))
                if not bool(self._trained_mask(mini).any()):  # (a zero normaliser would give NaN gradients)
                    logger.warning("mini-batch at sequence %d has no trained token; skipped", start)
                    continue
                out = self.accumulate_gradients(mini)
                ok, grad_norm, _ = self.optimizer.step()
                if ok:
                    self.scheduler.step(increment=1)
                sums = {k: 0.0 for k in _SUM_KEYS}
                for o in out:
                    for k, v in o.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                sums = self._sum_metrics(sums)
                tokens = max(sums["tokens"], 1.0)
                rec = {
                    "train/loss": sums["loss_num"] / max(sums["loss_count"], 1.0),
                    "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                    "train/pg_clipfrac": sums["clipped"] / tokens,
                    "train/pg_clipfrac_lower": sums["dual_clipped"] / tokens,
                    "train/ppo_kl": sums["approx_kl"] / tokens,
                    "train/entropy": sums["entropy"] / tokens,
                    "train/lr": self.optimizer.param_groups[0]["lr"],
                    "train/update_skipped": float(not ok),
                }
                rec.update(self._correction_metrics(sums))
                if self._kl_coef > 0:
                    rec["train/kl_loss"] = sums["kl"] / tokens
                history.append(rec)
        return history

    def _trained_mask(self, mini: TrainBatch) -> torch.Tensor:
        """`[N, S] bool`: the tokens of `mini` the loss trains, after the correction's rejection."""
        if self.correction.mode == "none":
            return mini.loss_mask
        return rollout_correction(mini.old_logprobs, mini.rollout_logprobs, mini.loss_mask, self.correction.mode,
                                  **self.correction.options).loss_mask

    def _correction_metrics(self, sums: dict) -> dict:
        """The correction's metrics of one mini-batch from its summed `rc_*` sums: shares and means
        over the valid tokens before the correction (ALGORITHMS.md 8; verl's `rollout_corr/` names)."""
        mode = self.correction.mode
        if mode == "none":
            return {}
        valid = max(sums.get("rc_valid", 0.0), 1.0)
        legacy = self.actor.tis.enable
        return {name: sums.get(f"rc_{key}", 0.0) / valid for name, (key, modes) in _RC_METRICS.items()
                if mode in modes or (legacy and name.startswith("train/tis_"))}
