"""Overlong reward shaping (ALGORITHMS section 1)."""

import pytest
import torch

from megatron_rl.algorithms.reward_shaping import generated_lengths, overlong_penalty, validate_overlong_buffer


def test_dapo_defaults_hand_values():
    # L_max 20480, L_buf 4096, factor 1: threshold 16384
    lengths = torch.tensor([100, 16384, 16385, 18432, 20480, 25000])
    p = overlong_penalty(lengths, max_response_length=20480, overlong_buffer_len=4096, penalty_factor=1.0)
    # -(16385-16384)/4096 = -0.000244140625; -(18432-16384)/4096 = -0.5; 20480 -> -1; capped at -1
    assert p.tolist() == [0.0, 0.0, -0.000244140625, -0.5, -1.0, -1.0]
    assert p.dtype == torch.float32


def test_penalty_factor_scales_and_caps():
    p = overlong_penalty(torch.tensor([3584, 4096, 9999]), max_response_length=4096, overlong_buffer_len=1024,
                         penalty_factor=0.5)
    # (3584 - 3072) / 1024 * 0.5 = 0.25; full buffer -> 0.5; beyond L_max capped at 0.5
    assert p.tolist() == [-0.25, -0.5, -0.5]


def test_generated_lengths_counts_only_action_tokens():
    mask = torch.tensor([[False, True, True, False, True], [False, False, False, False, False]])
    assert generated_lengths(mask).tolist() == [3, 0]


def test_validation():
    for buf in (4096, 5000, 0, -1):
        with pytest.raises(ValueError, match="overlong_buffer.len"):
            overlong_penalty(torch.tensor([1]), max_response_length=4096, overlong_buffer_len=buf, penalty_factor=1.0)
    with pytest.raises(ValueError):
        validate_overlong_buffer(max_response_length=10, overlong_buffer_len=5, penalty_factor=-1.0)
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([-1]), max_response_length=10, overlong_buffer_len=5, penalty_factor=1.0)
