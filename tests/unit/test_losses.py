"""Policy losses (ALGORITHMS section 5): vanilla/dual-clip, GSPO, CISPO, metrics, masked safety."""

import math

import pytest
import torch

from megatron_rl.algorithms.losses import POLICY_LOSSES, policy_loss_metrics

VANILLA = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def _call(name, logp, old, adv, mask, **kw):
    return POLICY_LOSSES.get(name)(logp, old, adv, mask, **kw)


def _close(actual, expected, atol):
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


DEFAULT_KW = {"vanilla": VANILLA, "gspo": {}, "cispo": {}}


def test_vanilla_on_policy_ratio_one():
    # logp == old: ratio exactly 1, loss -A, gradient -A, nothing clipped
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[0.5, -2.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = _call("vanilla", logp, old, adv, mask, **VANILLA)
    assert torch.equal(out.ratio, torch.ones(1, 3))
    assert torch.equal(out.token_loss.detach(), -adv)
    out.token_loss.sum().backward()
    assert torch.equal(logp.grad, -adv)  # d(-A r)/dlogp = -A r = -A
    assert not out.is_clipped.any() and not out.is_dual_clipped.any()
    m = policy_loss_metrics(out, mask)
    assert float(m["pg_clipfrac"]) == 0.0 and float(m["ppo_kl"]) == 0.0


def test_vanilla_clipped_tokens_have_zero_gradient_and_dual_clip_only_for_negative_A():
    old = torch.zeros(1, 4)
    # ratios 1.5 (A=+1, clipped high), 10 (A=-1, dual clip 3), 10 (A=+1), 0.9 (A=-1, in range)
    logp = torch.log(torch.tensor([[1.5, 10.0, 10.0, 0.9]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = _call("vanilla", logp, old, adv, torch.ones(1, 4, dtype=torch.bool), **VANILLA)
    # -min(r A, clip(r) A): -1.28, then min(10, 3) = 3, -1.28, 0.9
    _close(out.token_loss.detach(), [[-1.28, 3.0, -1.28, 0.9]], 1e-6)
    out.token_loss.sum().backward()
    # clipped/dual-clipped branches are constants; the in-range token has grad -A r = 0.9
    _close(logp.grad, [[0.0, 0.0, 0.0, 0.9]], 1e-6)
    assert out.is_dual_clipped.tolist() == [[False, True, False, False]]


def test_masked_positions_are_inert_for_every_loss():
    # masked positions carry -inf, NaN and a huge gap; nothing may leak into values or grads
    logp = torch.tensor([[-1.0, float("-inf"), -1000.0], [-0.5, float("nan"), -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.3, 0.0], [-0.4, -1.0, float("-inf")]])
    adv = torch.tensor([[1.0, float("nan"), 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, False, False], [True, False, False]])
    for name in POLICY_LOSSES.names():
        if logp.grad is not None:
            logp.grad = None
        out = _call(name, logp, old, adv, mask, **DEFAULT_KW[name])
        assert torch.isfinite(out.token_loss).all(), name
        assert (out.token_loss[~mask] == 0).all() and not out.is_clipped[~mask].any()
        assert torch.isfinite(out.approx_kl).all() and torch.isfinite(out.ratio).all()
        out.token_loss.sum().backward()
        assert torch.isfinite(logp.grad).all(), name
        assert (logp.grad[~mask] == 0).all(), name


def test_huge_logprob_gap_is_clamped_not_inf():
    # logp - old = 100 -> clamp to 20; exp(20) = 4.85e8 finite
    logp = torch.tensor([[100.0]], requires_grad=True)
    out = _call("vanilla", logp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), **VANILLA)
    assert out.ratio.item() == pytest.approx(math.exp(20), rel=1e-6)
    assert out.token_loss.item() == 3.0  # dual clip bounds -A*r at c = 3


def test_advantages_per_sequence_or_per_token():
    logp = torch.tensor([[-1.0, -1.2], [-0.7, -0.1]])
    old = torch.tensor([[-1.1, -1.0], [-0.7, -0.3]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    a_seq = torch.tensor([0.5, -1.5])
    for name in POLICY_LOSSES.names():
        o1 = _call(name, logp, old, a_seq, mask, **DEFAULT_KW[name])
        o2 = _call(name, logp, old, a_seq[:, None].expand(2, 2), mask, **DEFAULT_KW[name])
        assert torch.equal(o1.token_loss, o2.token_loss)


def test_gspo_sequence_ratio_hand_values():
    old = torch.zeros(3, 3)
    # seq 0: log-ratios 0.1, 0.3 (+ padding) -> s = exp(0.2) = 1.221403 > 1 + 4e-4, A = +1 -> clipped
    # seq 1: log-ratios 0, 0, 0 -> s = 1, A = -1 -> loss 1 per token, grad -A s = +1
    # seq 2: log-ratios 1e-4, 1e-4 -> s = exp(1e-4) = 1.000100005 (inside [1-3e-4, 1+4e-4]), A = 2
    logp = torch.tensor([[0.1, 0.3, float("-inf")], [0.0, 0.0, 0.0], [1e-4, 1e-4, 5.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    out = _call("gspo", logp, old, adv, mask)
    s2 = math.exp(1e-4)
    expect = [[-1.0004, -1.0004, 0.0], [1.0, 1.0, 1.0], [-2 * s2, -2 * s2, 0.0]]
    _close(out.token_loss.detach(), expect, 1e-6)
    assert out.is_clipped.tolist() == [[True, True, False], [False] * 3, [False] * 3]
    assert out.ratio[0, 0].item() == pytest.approx(math.exp(0.2), rel=1e-6)
    out.token_loss.sum().backward()
    # gradient of -A * sg(s) * exp(logp - sg(logp)) per token is -A * s
    _close(logp.grad, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-2 * s2, -2 * s2, 0.0]], 1e-6)


def test_cispo_hand_values():
    old = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-1.0 + math.log(2.0), -1.0 + math.log(0.5)]], requires_grad=True)  # ratios 2, 0.5
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = _call("cispo", logp, old, adv, mask, cispo_clip_high=0.28)
    # w = [min(2, 1.28), 0.5] = [1.28, 0.5]; loss = -w A logp = [1.28*0.306853, 0.5*1.693147]
    _close(out.token_loss.detach(), [[1.28 * 0.3068528, 0.5 * 1.6931472]], 1e-6)
    assert out.is_clipped.tolist() == [[True, False]]
    out.token_loss.sum().backward()
    _close(logp.grad, [[-1.28, -0.5]], 1e-6)  # every token keeps a gradient
    out = _call("cispo", logp.detach(), old, adv, mask, cispo_clip_high=0.28, cispo_clip_low=0.2)
    # lower bound set: w = max(0.5, 0.8) = 0.8 -> 0.8 * 1.693147 = 1.354518
    assert out.token_loss[0, 1].item() == pytest.approx(1.3545178, abs=1e-6)
    assert out.is_clipped.tolist() == [[True, True]]


def test_explicit_kwargs_only():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(TypeError):
        POLICY_LOSSES.get("vanilla")(*args, clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=3.0)
    with pytest.raises(TypeError):
        POLICY_LOSSES.get("gspo")(*args, clip_ratio_c=3.0)
    with pytest.raises(TypeError):
        POLICY_LOSSES.get("cispo")(*args, clip_ratio_high=0.28)
    with pytest.raises(TypeError):
        POLICY_LOSSES.get("vanilla")(*args, 0.2, 0.2)  # options are keyword-only
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            POLICY_LOSSES.get("vanilla")(*args, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=c)
    with pytest.raises(ValueError):
        POLICY_LOSSES.get("vanilla")(*args, clip_ratio_low=1.5, clip_ratio_high=0.2)
    with pytest.raises(ValueError):
        POLICY_LOSSES.get("vanilla")(torch.zeros(1, 2), *args[1:], clip_ratio_low=0.2, clip_ratio_high=0.2)


def test_metrics_ppo_kl():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    logp = torch.tensor([[-1.5, -2.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    out = POLICY_LOSSES.get("vanilla")(logp, old, torch.ones(1), mask, **VANILLA)
    # mean of old - new over valid tokens: (0.5 + 0) / 2 = 0.25
    assert float(policy_loss_metrics(out, mask)["ppo_kl"]) == pytest.approx(0.25)
