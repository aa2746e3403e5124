"""KL estimators and truncated importance sampling weights (ALGORITHMS section 5)."""

import math

import pytest
import torch

from megatron_rl.algorithms.kl import kl_penalty, tis_weights


def test_kl_estimators_hand_values():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    # d = ref - logp = [-0.5, 1.0, 0.0]
    assert kl_penalty(logp, ref, "k1").tolist() == [[0.5, -1.0, -0.0]]
    assert kl_penalty(logp, ref, "k2").tolist() == [[0.125, 0.5, 0.0]]
    # k3 = e^d - d - 1: e^-0.5 + 0.5 - 1 = 0.1065307; e - 2 = 0.7182818; 0
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)
    assert k3[0, 1].item() == pytest.approx(math.e - 2, abs=1e-6)
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), k3)


def test_kl_clamps_and_mask():
    logp = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[30.0, -30.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # d clamped to [-20, 20]: k1 = -20, 20; k3 = e^20 - 21 -> clamp 10; e^-20 + 19 -> clamp 10
    assert kl_penalty(logp, ref, "k1", loss_mask=mask).tolist() == [[-20.0, 20.0, 0.0]]
    k3 = kl_penalty(logp, ref, "k3", loss_mask=mask)
    assert k3.tolist() == [[10.0, 10.0, 0.0]]
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "k4")


def test_tis_weights_hand_values_and_detached():
    old = torch.tensor([[-0.9, -1.0, -1.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -3.0, -0.5, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    w, stats = tis_weights(old, rollout, mask, clip=2.0)
    # exp(0.1) = 1.1051709; exp(2) = 7.389 -> 2; exp(-0.5) = 0.6065307; masked -> 0
    torch.testing.assert_close(w, torch.tensor([[1.1051709, 2.0, 0.6065307, 0.0]]), atol=1e-6, rtol=0)
    assert not w.requires_grad
    # raw mean (1.1051709 + 7.3890561 + 0.6065307) / 3 = 3.0335859; used (1.1051709 + 2 + 0.6065307)/3 = 1.2372339
    assert stats["tis/raw_ratio_mean"].item() == pytest.approx(3.0335859, abs=1e-6)
    assert stats["tis/weight_mean"].item() == pytest.approx(1.2372339, abs=1e-6)
    with pytest.raises(ValueError):
        tis_weights(old, rollout, mask, clip=0.0)
