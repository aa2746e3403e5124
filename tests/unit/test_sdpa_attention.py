"""`trainer.attention_backend: sdpa` (megatron_rl/models/sdpa_attention.py): the same model with
torch's SDPA core attention gives megatron-core's own `DotProductAttention` results to float32
rounding: logits and gradients of a causal batch and of packed rows with a block-diagonal mask
(padding rows fully masked stay finite), GQA and MHA, and the fallbacks and refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema import TrainerConfig
from megatron_rl.errors import ConfigError
from megatron_rl.models.builder import build_layer_spec, build_model
from megatron_rl.models.hf_config import build_transformer_config
from megatron_rl.models.hf_weights import load_hf_weights

from tests.distributed.tiny_qwen2 import TINY_VOCAB, hf_state_dict, tiny_hf_config, tiny_hf_model


def _pair(kv_heads: int):
    hf_config = tiny_hf_config(tie_word_embeddings=False, num_key_value_heads=kv_heads)
    state = hf_state_dict(tiny_hf_model(hf_config, seed=3), hf_config)
    models = []
    for backend in ("auto", "sdpa"):
        torch.manual_seed(0)
        m = build_model(hf_config, build_transformer_config(hf_config), use_te=False, attention_backend=backend)
        load_hf_weights(m, state)
        models.append(m)
    return models


def _block_mask(lengths: list[int], width: int) -> torch.Tensor:
    """[1, 1, width, width] bool, True = masked: causal within each segment; the tail after the last
    segment is padding whose rows see nothing (every key masked)."""
    mask = torch.ones(width, width, dtype=torch.bool)
    start = 0
    for n in lengths:
        mask[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).triu(1)
        start += n
    return mask[None, None]


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_sdpa_equals_megatron_core_attention(megatron_world1, kv_heads):
    from megatron_rl.models.sdpa_attention import SDPADotProductAttention

    ref, sdpa = _pair(kv_heads)
    core = sdpa.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, SDPADotProductAttention)
    assert type(ref.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_VOCAB, (3, 24), generator=g)
    pos = torch.arange(24).expand(3, 24)
    packed = _block_mask([9, 7, 5], 24).expand(3, 1, 24, 24)  # 3 tokens of padding at the end of each row
    for mask in (None, packed):
        # padding positions (all keys masked): megatron's fill makes them attend uniformly, the additive
        # mask by their scores; finite either way and loss-masked in training, so neither compared nor in the loss
        real = slice(0, 21) if mask is not None else slice(None)
        outs = []
        for m in (ref, sdpa):
            m.zero_grad(set_to_none=True)
            logits = m(ids, pos, mask)
            (logits[:, real].float().square().mean()).backward()
            outs.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        (la, ga), (lb, gb) = outs
        assert torch.isfinite(lb).all()
        assert torch.allclose(la[:, real], lb[:, real], atol=2e-5, rtol=1e-4), (la - lb).abs().max()
        assert (la - lb).abs().max() > 0 or mask is None  # a different kernel, not the same code path
        for n in ga:
            assert torch.allclose(ga[n], gb[n], atol=2e-5, rtol=1e-3), (n, (ga[n] - gb[n]).abs().max())


def test_attention_backend_refusals():
    with pytest.raises(ValueError, match="auto or sdpa"):
        build_layer_spec(tiny_hf_config(tie_word_embeddings=False), use_te=False, attention_backend="flash")
    with pytest.raises(ConfigError, match="trainer.attention_backend"):
        TrainerConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="transformer_engine brings its own attention"):
        TrainerConfig(attention_backend="sdpa", transformer_impl="transformer_engine")
    assert TrainerConfig(attention_backend="sdpa", transformer_impl="local").attention_backend == "sdpa"
