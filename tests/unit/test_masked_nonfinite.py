"""Property: every metric the trainer logs, the loss and the gradients stay finite when the masked
(not trained) positions of any input (old, rollout or reference log-probs, advantages' rows,
current log-probs) hold NaN or +-inf (issue 20).

Random masks, shapes and finite values at the trained positions; NaN / +inf / -inf / huge values
at masked positions, seeded. Exercises algorithms/losses.py (every registered policy loss and
`policy_loss_metrics`), aggregation.py (every mode), kl.py (`kl_penalty` with and without a mask,
`tis_weights`), and the trainer's own loss function (`PolicyTrainer._loss_func`, which runs
without megatron: the model output is given as logits) with TIS, the KL loss and the entropy bonus on.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from megatron_rl.algorithms.kl import KL_TYPES, kl_penalty, tis_weights
from megatron_rl.algorithms.losses import POLICY_LOSSES, policy_loss_metrics
from megatron_rl.algorithms.options import POLICY_LOSS_OPTIONS, ResolvedCorrection, options_of
from megatron_rl.config.schema import ActorConfig, TISConfig
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.policy import PolicyTrainer

SEEDS = range(12)
BAD = (float("nan"), float("inf"), float("-inf"), 1e30, -1e30)


def _poison(x: torch.Tensor, mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """`x` with a random one of NaN/inf/-inf/huge at every masked position."""
    idx = torch.randint(len(BAD), x.shape, generator=g)
    bad = torch.tensor(BAD, dtype=x.dtype)[idx]
    return torch.where(mask, x, bad)


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, s = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    mask = torch.rand(b, s, generator=g) < 0.6
    if seed % 4 == 0:
        mask[0] = False  # a row with nothing to train
    if seed == 1:
        mask[:] = False  # nothing valid at all
    lp = lambda: -torch.rand(b, s, generator=g) * 3.0  # noqa: E731 - finite log-probs <= 0
    logp = _poison(lp(), mask, g).requires_grad_(True)
    old = _poison(lp(), mask, g)
    rollout = _poison(lp(), mask, g)
    ref = _poison(lp(), mask, g)
    adv = torch.randn(b, generator=g)
    return g, mask, logp, old, rollout, ref, adv


def _finite(name: str, x) -> None:
    x = torch.as_tensor(x)
    assert torch.isfinite(x.float()).all(), f"{name} not finite: {x}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
def test_policy_losses_metrics_and_aggregation(seed, loss_name):
    _, mask, logp, old, _, _, adv = _case(seed)
    actor = ActorConfig()
    out = POLICY_LOSSES.get(loss_name)(logp, old, adv, mask, **options_of(POLICY_LOSS_OPTIONS.get(loss_name), actor))
    for field in ("token_loss", "approx_kl", "ratio"):
        _finite(f"{loss_name}.{field}", getattr(out, field).detach())
    for k, v in policy_loss_metrics(out, mask).items():
        _finite(f"{loss_name} metric {k}", v)
    for mode in LOSS_AGG_MODES.names():
        if logp.grad is not None:
            logp.grad = None
        num, count = aggregate_loss(out.token_loss, mask, mode, loss_scale_factor=8.0)
        _finite(f"{loss_name}/{mode} numerator", num.detach())
        num.backward(retain_graph=True)
        _finite(f"{loss_name}/{mode} gradient", logp.grad)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_penalty_masked(seed, kl_type):
    _, mask, logp, _, _, ref, _ = _case(seed)
    kl = kl_penalty(logp, ref, kl_type, loss_mask=mask)
    _finite(f"kl {kl_type}", kl.detach())
    assert (kl[~mask] == 0).all()
    kl.sum().backward()
    _finite(f"kl {kl_type} gradient", logp.grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_tis_weights_masked(seed):
    _, mask, _, old, rollout, _, _ = _case(seed)
    w, stats = tis_weights(old, rollout, mask, clip=2.0)
    _finite("tis weights", w)
    assert (w[~mask] == 0).all()
    for k, v in stats.items():
        _finite(k, v)


def _trainer(policy_loss: str, agg: str) -> PolicyTrainer:
    actor = ActorConfig(policy_loss=policy_loss, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.1,
                        entropy_coeff=0.01, tis=TISConfig(enable=True, clip=2.0), loss_scale_factor=8.0)
    return PolicyTrainer(None, None, None, vocab_size=11, micro_batch_size=4, actor=actor)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy_loss", POLICY_LOSSES.names())
def test_trainer_loss_function_metrics(seed, policy_loss):
    """Every sum the trainer logs (tokens, clipped, dual_clipped, approx_kl, entropy, tis_raw,
    tis_used, kl, loss_num, loss_count), the loss and the logits' gradient stay finite."""
    g, mask, _, old, rollout, ref, adv = _case(seed)
    b, s = mask.shape
    agg = ("token-mean", "seq-mean-token-mean") if policy_loss == "gspo" else tuple(LOSS_AGG_MODES.names())
    for mode in agg:
        logits = torch.randn(b, s, 11, generator=g).requires_grad_(True)
        labels = torch.randint(11, (b, s), generator=g)
        mb = TrainBatch(input_ids=labels, position_ids=torch.arange(s).expand(b, s), labels=labels, loss_mask=mask,
                        advantages=adv, rollout_logprobs=rollout, old_logprobs=old, ref_logprobs=ref)
        num, count, sums = _trainer(policy_loss, mode)._loss_func(mb, logits)
        _finite(f"{policy_loss}/{mode} loss", num.detach())
        for k, v in sums.items():
            _finite(f"{policy_loss}/{mode} logged {k}", v)
        assert sums["tokens"] == mask.sum()
        num.backward()
        _finite(f"{policy_loss}/{mode} logits gradient", logits.grad)


CORRECTIONS = (ResolvedCorrection("token_tis", {"tis_cap": 2.0}), ResolvedCorrection("seq_tis", {"tis_cap": 2.0}),
               ResolvedCorrection("mask", {"mask_low": 0.5, "mask_high": 2.0, "level": "token"}),
               ResolvedCorrection("mask", {"mask_low": 0.5, "mask_high": 2.0, "level": "sequence"}))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda c: f"{c.mode}-{c.options.get('level', '')}")
def test_trainer_loss_function_every_correction(seed, correction):
    """The same with each off-policy correction of ALGORITHMS.md 8 (the rc_* sums included)."""
    g, mask, _, old, rollout, ref, adv = _case(seed)
    b, s = mask.shape
    logits = torch.randn(b, s, 11, generator=g).requires_grad_(True)
    labels = torch.randint(11, (b, s), generator=g)
    mb = TrainBatch(input_ids=labels, position_ids=torch.arange(s).expand(b, s), labels=labels, loss_mask=mask,
                    advantages=adv, rollout_logprobs=rollout, old_logprobs=old, ref_logprobs=ref)
    actor = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    trainer = PolicyTrainer(None, None, None, vocab_size=11, micro_batch_size=4, actor=actor,
                            rollout_correction=correction)
    num, _, sums = trainer._loss_func(mb, logits)
    _finite(f"{correction.mode} loss", num.detach())
    for k, v in sums.items():
        _finite(f"{correction.mode} logged {k}", v)
    assert sums["rc_valid"] == mask.sum() and sums["tokens"] <= mask.sum()
    num.backward()
    _finite(f"{correction.mode} logits gradient", logits.grad)


def test_poison_really_poisons():
    """The generator does put NaN and inf at masked positions (the property is not vacuous)."""
    seen = set()
    for seed in SEEDS:
        _, mask, logp, old, rollout, ref, _ = _case(seed)
        for x in (logp.detach(), old, rollout, ref):
            seen.update("nan" if math.isnan(v) else "inf" if math.isinf(v) else "finite" for v in x[~mask].tolist())
            assert torch.isfinite(x[mask]).all()
    assert {"nan", "inf"} <= seen
