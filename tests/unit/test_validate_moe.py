"""The Mixture-of-Experts checks of `validate_config` on the tiny MoE recipe (issue 29): each
refusal names the key and the reason; the recipe itself loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "examples/tiny/moe-dapo.yaml"
DENSE = ROOT / "examples/tiny/dapo.yaml"


def test_the_tiny_moe_recipe_loads_with_replay():
    cfg = load_config(MOE, [])
    assert cfg.actor.router_replay is True and cfg.trainer.expert_model_parallel_size == 1


@pytest.mark.parametrize("overrides, message", [
    (["trainer.expert_model_parallel_size=3"], "trainer.expert_model_parallel_size 3 must divide num_experts 8"),
    (["trainer.tensor_model_parallel_size=2"], "needs trainer.sequence_parallel: true"),
    # expert TP other than TP, with or without expert parallelism (the publisher uses the TP layout)
    (["trainer.expert_tensor_parallel_size=2"], "expert_tensor_parallel_size 2 != trainer.tensor_model_parallel_size 1"),
    (["trainer.expert_model_parallel_size=2", "trainer.expert_tensor_parallel_size=2"],
     "expert_tensor_parallel_size 2 != trainer.tensor_model_parallel_size 1"),
    (["trainer.moe_router_load_balancing_type=aux_loss", "trainer.moe_aux_loss_coeff=0.001",
      "actor.loss_agg_mode=seq-mean-token-mean"], "moe_aux_loss_coeff 0.001 with actor.loss_agg_mode"),
    (["rollout.return_routed_experts=false"], "rollout.return_routed_experts must not be false"),
    (["trainer.moe_aux_loss_coeff=0.01"], "moe_aux_loss_coeff 0.01 has no effect with "
                                          "trainer.moe_router_load_balancing_type none"),
    (["trainer.expert_model_parallel_size=2", "trainer.nproc_per_node=2", "rollout.colocate=true"],
     "rollout.colocate with trainer.expert_model_parallel_size > 1"),
])
def test_moe_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(MOE, overrides)


def test_aux_loss_with_token_mean_is_accepted():
    cfg = load_config(MOE, ["trainer.moe_router_load_balancing_type=aux_loss", "trainer.moe_aux_loss_coeff=0.001"])
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.trainer.moe_aux_loss_coeff == 0.001


@pytest.mark.parametrize("overrides", [["actor.router_replay=true"], ["trainer.expert_model_parallel_size=2"],
                                       ["rollout.return_routed_experts=true"],
                                       ["trainer.expert_tensor_parallel_size=1"],
                                       ["trainer.moe_router_load_balancing_type=aux_loss"],
                                       ["trainer.moe_aux_loss_coeff=0.001"]])
def test_expert_settings_on_a_dense_model_are_refused(overrides):
    key = overrides[0].split("=")[0].replace(".", r"\.")
    with pytest.raises(ConfigError, match=f"^{key}=.*: need a Mixture-of-Experts model; .* has model_type 'qwen2'"):
        load_config(DENSE, overrides)


def test_rollout_old_logprobs_warn_that_the_mismatch_is_not_measured(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(MOE, ["actor.old_logprob_source=rollout"])
    assert "where train/router_mismatch is measured: the metric is not reported" in caplog.text


def test_the_trainer_rechecks_a_model_that_was_not_readable_at_load():
    """A hub id not in the cache when the config loads skips the model checks; the trainer runs
    them again on the local folder (`trainer.setup._build_policy`) before building anything."""
    from megatron_rl.config.validate import check_model_layout

    local = load_config(MOE, []).model.path
    cfg = load_config(MOE, ["model.path=some-org/not-cached-moe", "trainer.expert_model_parallel_size=3"])
    cfg.model.path = local  # what the train command holds once the model is downloaded
    with pytest.raises(ConfigError, match="trainer.expert_model_parallel_size 3 must divide num_experts 8"):
        check_model_layout(cfg, warn=False)
