"""Rollout routing replay (R3, arXiv 2510.11370) on megatron-core's own ``RouterReplay`` (ALGORITHMS.md 9).

A Mixture-of-Experts model built with ``moe_enable_routing_replay`` has one
``megatron.core.transformer.moe.router_replay.RouterReplay`` per router. :class:`RoutingReplay`
drives the instances of ONE model (found through its modules, not megatron-core's process-global
list, which every model built in the process joins):

- before a micro-batch's forward (:meth:`RoutingReplay.before_forward`) it turns the batch's
  engine routing ``TrainBatch.routed_experts`` (``RoutedRows``, padded here to the micro-batch's
  [B, S, L, K]) into each local layer's target indices
  in megatron's token order (the router sees ``[S, B, h]`` flattened: token ``s * B + b``; under
  sequence parallelism this TP rank's contiguous chunk of S; packed rows through their index) and
  sets them with REPLAY_FORWARD. megatron-core then gathers the router's own scores at those ids
  (softmax over the k chosen logits when the model renormalises its top-k), so the router still
  gets gradients.
- under activation recompute the recomputed forward runs inside autograd's backward; there the
  instances answer as REPLAY_BACKWARD (the FIFO of targets megatron-core keeps per instance,
  popped in the order the forwards ran: the 1F1B order of every pipeline schedule), detected with
  ``torch._C._current_graph_task_id() != -1``. Megatron-core switches no action by itself.
- in the old-log-prob pass it also counts, per layer, the valid positions where the top-k SET of
  the trainer's own router scores differs from the engine's ids (``train/router_mismatch``):
  with replay the scores are those computed from the replayed hidden states (no extra forward);
  without replay the instances RECORD the trainer's own choice and it is compared the same way.

Deliberate deviation from Megatron-LM's usage: the targets are set per model and per micro-batch
on the instances directly (``set_target_indices``) instead of ``RouterReplay.set_replay_data`` on
the global list, so a reference model or a second model in the process cannot shift the layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def model_routers(model) -> list[tuple[int, object]]:
    """(global MoE layer index, RouterReplay instance) of every router of one model chunk, in layer
    order; [] for a dense model or one built without ``moe_enable_routing_replay``."""
    out = []
    for layer in getattr(_unwrap(model).decoder, "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        replay = getattr(router, "router_replay", None)
        if replay is not None:
            out.append((layer.layer_number - 1, replay))
    return out


class RoutingReplay:
    """Sets, per micro-batch, the engine's routing on one model's routers and measures the mismatch.

    Args:
        model: the model chunks (DDP-wrapped or not) of this rank.
        replay: replay the engine's routing (``actor.router_replay``); False = the routers choose
            by themselves and only the mismatch is measured (when a batch carries routing).
        tp_rank, tp_size: this rank's tensor-parallel coordinates.
        sequence_parallel: the model runs with sequence parallelism (the router sees S / TP tokens).
        num_layers: the model's layer count (the metric's per-layer axis).
        topk: the routers' top-k (``moe_router_topk``); a batch whose routing has another K is refused.
        tp_group: this rank's tensor-parallel group (used when ``tp_size`` > 1): the routing is sent
            once per TP group and broadcast within it (`routed_rows.hand_out`).
        num_experts, ep_size: experts per MoE layer and the expert-parallel size, for the ids of
            the positions without routing (`routed_rows.fill_pad_rows`: distinct, spread over the EP
            ranks; CASES.md M03); None = read from the model's config (``num_moe_experts``,
            ``expert_model_parallel_size``).

    The metric's counts are summed over the default process group by :meth:`mismatch_metrics`;
    TP ranks without sequence parallelism see the same tokens, so only TP rank 0 counts then.
    """

    def __init__(self, model, *, replay: bool, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False,
                 num_layers: int, topk: int | None = None, tp_group=None, num_experts: int | None = None,
                 ep_size: int | None = None) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        config = getattr(_unwrap(chunks[0]), "config", None) if chunks else None
        self.num_experts = num_experts or getattr(config, "num_moe_experts", None)
        self.ep_size = ep_size or getattr(config, "expert_model_parallel_size", None) or 1
        self._routers = {id(_unwrap(m)): model_routers(m) for m in chunks}
        self.replay = replay
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel
        self.num_layers, self.topk = num_layers, topk
        self.tp_group = tp_group if tp_size > 1 else None
        self._counts = torch.zeros((num_layers, 2), dtype=torch.float64)  # [mismatched, valid] per layer
        self._measure = False
        for routers in self._routers.values():
            for _, inst in routers:
                self._wrap(inst)

    @property
    def active(self) -> bool:
        """Whether this model has routers to drive."""
        return any(self._routers.values())

    def hand_out(self, batch, mini_batch_sequences: int | None, *, dp_size: int, dp_rank: int) -> None:
        """Give this rank its share of the controller's routing, in place on `batch` (every rank
        calls it, once a step; a no-op when the batch has no routing or already got it): the rows
        of its data-parallel shares (DP rank `dp_rank` of `dp_size`) of each mini-batch of
        `mini_batch_sequences` rows and the MoE layers of its model chunks (`routed_rows.hand_out`).

        Raises:
            ValueError: the batch's routing was handed out for another mini-batch size.
        """
        rr = getattr(batch, "routed_experts", None)
        if rr is not None and rr.local and rr.minis != mini_batch_sequences:
            raise ValueError(f"the routing was handed out for mini-batches of {rr.minis} sequences, not "
                             f"{mini_batch_sequences}: every pass over a batch must use the update's mini-batches")
        if rr is None or rr.local:
            return
        from megatron_rl.trainer.routed_rows import hand_out

        layers = [layer for routers in self._routers.values() for layer, _ in routers]
        batch.routed_experts = hand_out(rr, mini_batch_sequences=mini_batch_sequences, dp_size=dp_size,
                                        dp_rank=dp_rank, layers=layers, tp_group=self.tp_group)

    # ---- per micro-batch -----------------------------------------------------------------------
    def _token_order(self, per_row: torch.Tensor, mb) -> torch.Tensor:
        """[B, S, ...] per-position values -> megatron's [S*B (/tp), ...] router order (CASES.md M01):
        row ``s * B + b`` is position s of batch row b; under sequence parallelism this TP rank's
        contiguous chunk of that order; packed rows: each sequence's positions back to back at its
        packed slots, the alignment pads after them."""
        packing = getattr(mb, "packing", None)
        if packing is not None:  # packed rows [R, Lp]: each real position goes to its packed slot
            r, lp = packing.input_ids.shape
            flat = per_row.new_zeros((r * lp, *per_row.shape[2:]))
            if per_row.dtype == torch.long:  # filler: valid distinct ids 0..K-1
                flat[:] = torch.arange(per_row.shape[-1], dtype=torch.long)
            width = per_row.shape[1]
            real = (torch.arange(width).unsqueeze(0) < mb.seq_lengths.unsqueeze(1)).reshape(-1)
            idx = packing.index.reshape(-1)
            flat[idx[real]] = per_row.reshape(-1, *per_row.shape[2:])[real]
            per_row = flat.view(r, lp, *per_row.shape[2:])
        flat = per_row.transpose(0, 1).reshape(-1, *per_row.shape[2:])  # [S*B, ...]: token s * B + b
        if self.sp and self.tp_size > 1:  # this rank's contiguous 1/TP of that order: megatron's split of
            # S whenever S % TP == 0 (which megatron needs; CASES.md M01 also gives S=3, TP=2: 3 rows each)
            flat = torch.chunk(flat, self.tp_size, dim=0)[self.tp_rank]
        return flat.contiguous()

    def before_forward(self, model, mb, *, measure: bool) -> None:
        """Set `mb`'s routing on `model`'s routers for the coming forward.

        Args:
            model: the model chunk the schedule is about to run.
            mb: the micro-batch (`TrainBatch`), with `routed_experts` (`RoutedRows`) or None.
            measure: count the router mismatch on this forward (the old-log-prob pass).

        Raises:
            ValueError: replay is on and the micro-batch carries no routing, its top-k or layers do
                not match the model, or a row is not held on this rank.
        """
        routers = self._routers.get(id(_unwrap(model)), [])
        if not routers:
            return
        rr = getattr(mb, "routed_experts", None)
        if rr is None:
            if self.replay:
                raise ValueError("actor.router_replay is on but the batch carries no routed_experts: the rollout "
                                 "engine did not return the experts it routed to (SGLang: --enable-return-routed-"
                                 "experts and return_routed_experts in the request)")
            for _, inst in routers:
                inst.router_replay_action = None
                inst._mr_valid = None
            return
        if self.topk is not None and rr.topk != self.topk:
            raise ValueError(f"routed_experts has top-{rr.topk} per position, the model routes each token to "
                             f"{self.topk} experts (moe_router_topk / the HF config's num_experts_per_tok): the engine "
                             "serves another model config")
        if max(rr.layers, default=-1) >= self.num_layers:
            raise ValueError(f"routed_experts has layers {list(rr.layers)}: expected layers of a {self.num_layers}-layer "
                             "model")
        columns = [rr.column(layer) for layer, _ in routers]
        routed, valid = rr.padded(mb.input_ids.shape[1])  # [B, S, L_held, K] int64: one micro-batch widened
        ordered_valid = self._token_order(valid, mb)  # [T]
        ordered = self._token_order(routed, mb)  # [T, L_held, K]
        if self.num_experts:  # the positions without routing: distinct ids spread over the EP ranks
            from megatron_rl.trainer.routed_rows import fill_pad_rows

            ordered = fill_pad_rows(ordered, ordered_valid, num_experts=self.num_experts, ep_size=self.ep_size)
        if not measure:
            ordered_valid = None
        self._measure = measure
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for (layer, inst), col in zip(routers, columns):
            target = ordered[:, col, :]
            if self.replay:
                inst.set_target_indices(target)
                inst.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            else:
                inst.router_replay_action = RouterReplayAction.RECORD if measure else None
            inst._mr_target, inst._mr_layer = target, layer
            inst._mr_valid = ordered_valid

    def finish(self) -> None:
        """After a schedule call (forward and backward done): drop every target and action."""
        for routers in self._routers.values():
            for _, inst in routers:
                inst.clear_indices()
                inst.router_replay_action = None
                inst._mr_valid = inst._mr_target = None
        self._measure = False

    # ---- the wrapped top-k ---------------------------------------------------------------------
    def _wrap(self, inst) -> None:
        original = inst.get_replay_topk
        owner = self

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            action = inst.router_replay_action
            if action == RouterReplayAction.REPLAY_FORWARD and torch._C._current_graph_task_id() != -1:
                inst.router_replay_action = RouterReplayAction.REPLAY_BACKWARD  # recompute inside backward
                try:
                    return original(scores, topk, num_groups, group_topk, default_compute_topk)
                finally:
                    inst.router_replay_action = action
            probs, indices = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if owner._measure and getattr(inst, "_mr_valid", None) is not None:
                with torch.no_grad():
                    own = torch.topk(scores.detach(), topk, dim=1).indices
                    owner._count(inst._mr_layer, own, inst._mr_target.to(own.device), inst._mr_valid)
            return probs, indices

        inst.get_replay_topk = get_replay_topk

    def _count(self, layer: int, own: torch.Tensor, engine: torch.Tensor, valid: torch.Tensor) -> None:
        if not self.sp and self.tp_rank != 0:
            return  # every TP rank routes the same tokens: count them once
        same = torch.sort(own, dim=1).values.eq(torch.sort(engine, dim=1).values).all(dim=1)
        v = valid.to(torch.bool)
        self._counts[layer, 0] += float((~same & v).sum())
        self._counts[layer, 1] += float(v.sum())

    def mismatch_metrics(self, group=None) -> dict:
        """`train/router_mismatch` (share of valid (position, layer) pairs whose top-k sets differ)
        and `train/router_mismatch/layer_{l}` since the last call, summed over `group` (default:
        the whole world; None without torch.distributed); {} when nothing was measured. Resets."""
        import torch.distributed as dist

        counts = self._counts.clone()
        self._counts.zero_()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        valid = float(counts[:, 1].sum())
        if valid == 0:
            return {}
        out = {"train/router_mismatch": float(counts[:, 0].sum()) / valid}
        for layer in range(self.num_layers):
            if counts[layer, 1] > 0:
                out[f"train/router_mismatch/layer_{layer}"] = float(counts[layer, 0] / counts[layer, 1])
        return out


def routers_of(chunks: Iterable) -> int:
    """Number of RouterReplay instances in the chunks (0: no replay-capable router)."""
    return sum(len(model_routers(m)) for m in chunks)
