"""Loss aggregation (ALGORITHMS section 6): hand values and micro-batch/DP split invariance."""

import pytest
import torch

from megatron_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
C = 10.0


def test_hand_values_all_modes():
    l = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # row 2 has no valid token: it counts in no normaliser
    expect = {
        "token-mean": (10.0, 4),  # (1+2+3+4) / 4 tokens = 2.5
        "seq-mean-token-mean": (6.0, 2),  # (6/3 + 4/1) / 2 = 3
        "seq-mean-token-sum": (10.0, 2),  # (6 + 4) / 2 = 5
        "seq-mean-token-sum-norm": (1.0, 2),  # (6/10 + 4/10) / 2 = 0.5
    }
    for mode, (num, cnt) in expect.items():
        n, c = aggregate_loss(l, m, mode, loss_scale_factor=C)
        assert n.item() == pytest.approx(num) and c.item() == cnt, mode
        assert n.dim() == 0 and c.dim() == 0 and c.dtype == torch.int


def test_empty_micro_batch_adds_nothing():
    for mode in MODES:
        n, c = aggregate_loss(torch.full((2, 3), float("nan")), torch.zeros(2, 3, dtype=torch.bool), mode, loss_scale_factor=C)
        assert n.item() == 0.0 and c.item() == 0


def test_masked_nan_inf_do_not_poison_grads():
    x = torch.tensor([[1.0, float("inf")], [2.0, float("nan")]], requires_grad=True)
    m = torch.tensor([[True, False], [True, False]])
    for mode in MODES:
        x.grad = None
        n, c = aggregate_loss(x * 2.0, m, mode, loss_scale_factor=C)
        (n / c).backward()
        assert torch.isfinite(x.grad).all() and (x.grad[~m] == 0).all(), mode


def test_norm_mode_needs_constant():
    l, m = torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregate_loss(l, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate_loss(l, m, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(KeyError):
        aggregate_loss(l, m, "sum")


def _pack(rows, width):
    """rows: list of 1-D tensors -> ([B, width] padded with garbage, [B, width] mask)."""
    x = torch.full((len(rows), width), 123.0)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        x[i, : len(r)] = r
        mask[i, : len(r)] = True
    return x, mask


@pytest.mark.parametrize("mode", MODES)
def test_split_invariance_loss_and_grad(mode):
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 0, 9, 3, 7, 2, 6]  # one empty sequence
    feats = [torch.randn(n, generator=g) for n in lengths]

    def run(splits, extra_pad):
        theta = torch.tensor([0.7, -0.3], requires_grad=True)
        nums, cnts = [], []
        start = 0
        for j, size in enumerate(splits):
            rows = feats[start : start + size]
            start += size
            width = max([len(r) for r in rows] + [1]) + extra_pad[j]
            x, mask = _pack(rows, width)
            token_loss = theta[0] * x + theta[1] * x * x  # any per-token function of the params
            n, c = aggregate_loss(token_loss, mask, mode, loss_scale_factor=C)
            nums.append(n)
            cnts.append(c)
        # megatron-core: sum numerators and counts over micro-batches and DP ranks, then divide
        loss = torch.stack(nums).sum() / torch.stack(cnts).sum()
        loss.backward()
        return loss.detach(), theta.grad.clone()

    ref_loss, ref_grad = run([8], [0])
    for splits, pads in (([4, 4], [3, 0]), ([2, 2, 2, 2], [0, 5, 1, 11]), ([1] * 8, list(range(8))), ([3, 5], [2, 2])):
        loss, grad = run(splits, pads)
        assert torch.allclose(loss, ref_loss, atol=1e-6), (mode, splits)
        assert torch.allclose(grad, ref_grad, atol=1e-6), (mode, splits)
    # and the value matches the formula computed directly
    valid = [f for f in feats if len(f)]
    per_tok = [0.7 * f - 0.3 * f * f for f in valid]
    direct = {
        "token-mean": torch.cat(per_tok).mean(),
        "seq-mean-token-mean": torch.stack([t.mean() for t in per_tok]).mean(),
        "seq-mean-token-sum": torch.stack([t.sum() for t in per_tok]).mean(),
        "seq-mean-token-sum-norm": torch.stack([t.sum() / C for t in per_tok]).mean(),
    }[mode]
    assert ref_loss.item() == pytest.approx(direct.item(), abs=1e-5)
