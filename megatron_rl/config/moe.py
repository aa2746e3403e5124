"""The trainer section's Mixture-of-Experts keys (issue 29), a base of `schema.TrainerConfig`.

Megatron's names, so that the keys read as `trainer.expert_model_parallel_size` etc.; kept here so
the schema module stays small. Checked by `_check_expert_options` from the section's `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_rl.algorithms.options import check_choice, check_positive

LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass(kw_only=True)
class ExpertOptions:
    """Expert parallelism and the router's load balancing of a Mixture-of-Experts policy."""

    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (megatron-core's name; Mixture-of-Experts models): each rank holds
    num_experts / EP experts of every MoE layer, tokens travel to them by all-to-all. Must divide
    the experts; megatron's expert layout: expert TP x EP x expert-DP x PP = world. Default 1.
    verl: `actor_rollout_ref.actor.megatron.expert_model_parallel_size`."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallelism inside each expert (megatron-core's name); None (default) = the TP size.
    verl: `actor_rollout_ref.actor.megatron.expert_tensor_parallel_size`."""
    moe_router_load_balancing_type: str = "none"
    """none (default) | aux_loss | seq_aux_loss | global_aux_loss: the MoE load-balancing loss
    (Megatron's --moe-router-load-balancing-type). Computed from the router's own scores, also
    under routing replay (ALGORITHMS.md section 9)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss, >= 0 (Megatron's --moe-aux-loss-coeff). Default 0.
    megatron-core scales the loss's gradient for a per-token loss count (`calculate_per_token_loss`):
    with actor.loss_agg_mode token-mean (the only mode allowed with a coefficient > 0) the count is
    the response tokens, so the effective weight is coeff x (positions the router sees / response
    tokens), prompt positions included."""

    def _check_expert_options(self) -> None:
        """Raises `ConfigError` naming the `trainer.` key of a bad value."""
        check_positive("trainer.expert_model_parallel_size", self.expert_model_parallel_size)
        check_positive("trainer.expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        for name in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                from megatron_rl.errors import ConfigError

                raise ConfigError(f"trainer.{name}: {value!r} must be an int")
        check_choice("trainer.moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                     LOAD_BALANCING_TYPES)
        check_positive("trainer.moe_aux_loss_coeff", self.moe_aux_loss_coeff, allow_zero=True)


def routing_requested(cfg) -> bool:
    """Whether the rollout engines return routed experts: `rollout.return_routed_experts`, or when
    None `actor.router_replay` (a `Config`)."""
    asked = cfg.rollout.return_routed_experts
    return bool(cfg.actor.router_replay if asked is None else asked)
