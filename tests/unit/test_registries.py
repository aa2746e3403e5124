"""Pin the exact registered names so a new variant shows up in review."""

from megatron_rl.algorithms.advantages import ADV_ESTIMATORS
from megatron_rl.algorithms.aggregation import LOSS_AGG_MODES
from megatron_rl.algorithms.losses import POLICY_LOSSES
from megatron_rl.algorithms.options import (ADV_ESTIMATOR_SPECS, DAA_FACTOR_OPTIONS, POLICY_LOSS_OPTIONS,
                                            ROLLOUT_CORRECTION_OPTIONS)
from megatron_rl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS
from megatron_rl.rewards.registry import REWARD_FNS


def test_exact_registry_names():
    assert ADV_ESTIMATORS.names() == ["grpo", "reinforce_plus_plus_baseline", "rloo"]
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "vanilla"]
    assert LOSS_AGG_MODES.names() == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]
    assert REWARD_FNS.names() == ["dapo_math", "gsm8k", "math_auto", "math_boxed", "math_verify"]
    # the torch-free registrations the config takes its choices and options from
    assert ADV_ESTIMATOR_SPECS.names() == ["grpo", "reinforce_plus_plus_baseline", "rloo"]
    assert POLICY_LOSS_OPTIONS.names() == ["cispo", "gspo", "vanilla"]
    assert DAA_FACTOR_OPTIONS.names() == ["balanced", "constant", "power"]
    assert ROLLOUT_CORRECTIONS.names() == ["mask", "none", "seq_tis", "token_tis"]
    assert ROLLOUT_CORRECTION_OPTIONS.names() == ["mask", "none", "seq_tis", "token_tis"]


def test_algorithms_import_no_heavy_frameworks():
    import subprocess
    import sys

    code = (
        "import sys, megatron_rl.algorithms.advantages, megatron_rl.algorithms.daa, "
        "megatron_rl.algorithms.losses, megatron_rl.algorithms.aggregation, "
        "megatron_rl.algorithms.dynamic_sampling, megatron_rl.algorithms.reward_shaping, "
        "megatron_rl.algorithms.kl, megatron_rl.algorithms.rollout_correction\n"
        "bad = [m for m in ('megatron', 'transformers', 'sglang') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
