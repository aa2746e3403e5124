"""HF config -> TransformerConfig / ModelSpec (hand-checked numbers) and the HF weight round trip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model  # noqa: E402

from shared_data import SHARED_DATA  # noqa: E402

from megatron_rl.models.hf_config import build_model_spec, build_transformer_config, padded_vocab_size  # noqa: E402

HF_CONFIGS = SHARED_DATA / "hf-configs"

# Hand-checked against the model cards' config.json: (layers, hidden, heads, kv heads, ffn,
# head dim = hidden / heads, eps, vocab, tied).
EXPECTED = {
    "Qwen2.5-0.5B": (24, 896, 14, 2, 4864, 64, 1e-6, 151936, True),
    "Qwen2.5-1.5B": (28, 1536, 12, 2, 8960, 128, 1e-6, 151936, True),
    "Qwen2.5-7B": (28, 3584, 28, 4, 18944, 128, 1e-6, 152064, False),
    "Qwen2.5-32B": (64, 5120, 40, 8, 27648, 128, 1e-5, 152064, False),
}


def _load(name: str) -> dict:
    path = HF_CONFIGS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_qwen25_configs_map_to_megatron_fields(name):
    layers, hidden, heads, kv_heads, ffn, head_dim, eps, vocab, tied = EXPECTED[name]
    hf = _load(name)
    cfg = build_transformer_config(hf)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (layers, hidden, heads)
    assert cfg.num_query_groups == kv_heads
    assert cfg.ffn_hidden_size == ffn
    assert cfg.kv_channels == head_dim
    assert cfg.layernorm_epsilon == eps
    assert cfg.normalization == "RMSNorm"
    assert cfg.gated_linear_unit is True and cfg.activation_func is F.silu
    assert cfg.add_qkv_bias is True and cfg.add_bias_linear is False
    assert cfg.qk_layernorm is False
    assert cfg.init_method_std == 0.02
    assert cfg.params_dtype == torch.float32 and not cfg.bf16

    spec = build_model_spec(hf)
    assert spec.vocab_size == vocab
    assert spec.tie_word_embeddings is tied
    assert spec.rotary_base == 1_000_000.0
    assert spec.max_position_embeddings == (32768 if name == "Qwen2.5-0.5B" else 131072)
    # 151936 = 1187 * 128 and 152064 = 1188 * 128: no padding at TP=1.
    assert spec.padded_vocab_size == vocab


def test_padded_vocab_is_multiple_of_128_times_tp():
    assert padded_vocab_size(151936, tensor_model_parallel_size=1) == 151936
    assert padded_vocab_size(151936, tensor_model_parallel_size=2) == 152064  # 594 * 256
    assert padded_vocab_size(152064, tensor_model_parallel_size=8) == 152576  # 149 * 1024 (148.5 rounded up)
    assert padded_vocab_size(200, tensor_model_parallel_size=1) == 256
    assert padded_vocab_size(200, tensor_model_parallel_size=4, make_vocab_size_divisible_by=64) == 256
    spec = build_model_spec(_load("Qwen2.5-32B"), tensor_model_parallel_size=8)
    assert spec.padded_vocab_size == 152576


def test_parallel_and_precision_arguments_pass_through():
    hf = _load("Qwen2.5-32B")
    cfg = build_transformer_config(
        hf,
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=4,
        sequence_parallel=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        recompute="full",
    )
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (8, 4)
    assert cfg.sequence_parallel and cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform"


def test_qwen3_and_llama_variants():
    qwen3 = dict(_load("Qwen2.5-0.5B"), model_type="qwen3", head_dim=128, attention_bias=False)
    cfg = build_transformer_config(qwen3)
    assert cfg.kv_channels == 128 and cfg.qk_layernorm and not cfg.add_qkv_bias
    assert build_model_spec(qwen3).qk_layernorm
    llama = dict(_load("Qwen2.5-0.5B"), model_type="llama")
    llama.pop("tie_word_embeddings")
    assert not build_transformer_config(llama).add_qkv_bias
    assert build_model_spec(llama).tie_word_embeddings is False


def test_transformers_v5_rope_parameters_layout():
    hf = dict(_load("Qwen2.5-7B"))
    hf.pop("rope_theta")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert build_model_spec(hf).rotary_base == 5e5


@pytest.mark.parametrize(
    "change, key",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ],
)
def test_unsupported_or_missing_keys_name_the_key(change, key):
    hf = dict(_load("Qwen2.5-7B"), **change)
    with pytest.raises(ValueError, match=key):
        build_transformer_config(hf)


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_transformer_config(_load("Qwen2.5-0.5B"), tensor_model_parallel_size=4)


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_weights_round_trip_is_bit_identical(megatron_world1, tie, tmp_path):
    from safetensors.torch import save_file

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights

    hf_config = tiny_hf_config(tie_word_embeddings=tie)
    state = hf_state_dict(tiny_hf_model(hf_config, seed=11), hf_config)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = build_model(hf_config, build_transformer_config(hf_config))
    load_hf_weights(model, tmp_path)  # from a safetensors directory

    emb = model.embedding.word_embeddings.weight
    assert emb.shape == (256, 64) and (emb[200:] == 0).all()  # padded rows zero
    layer = model.decoder.layers[0].self_attention.linear_qkv
    # Per-group interleave [q_g0 (2 heads), k_g0, v_g0, q_g1, ...], head dim 16.
    prefix = "model.layers.0.self_attn."
    assert torch.equal(layer.weight[0:32], state[prefix + "q_proj.weight"][0:32])
    assert torch.equal(layer.weight[32:48], state[prefix + "k_proj.weight"][0:16])
    assert torch.equal(layer.weight[48:64], state[prefix + "v_proj.weight"][0:16])
    assert torch.equal(layer.weight[64:96], state[prefix + "q_proj.weight"][32:64])
    assert torch.equal(layer.bias[112:128], state[prefix + "v_proj.bias"][16:32])

    exported = list(iter_hf_weights(model, hf_config))
    assert [name for name, _ in exported] == list(state)
    for name, tensor in exported:
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name

    # copy=False (the colocated hand-over): the same tensors, views of the parameters except the
    # regrouped q/k/v (2 query groups here), so writing a parameter shows in its view
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    views = list(iter_hf_weights(model, hf_config, copy=False))
    assert [name for name, _ in views] == list(state)
    for name, tensor in views:
        assert torch.equal(tensor, state[name]), name
        shares = tensor.untyped_storage().data_ptr() in params
        assert shares == (name.split(".")[-2] not in ("q_proj", "k_proj", "v_proj")), name
    assert all(not t.untyped_storage().data_ptr() in params for _, t in exported)  # copies by default
    norm = dict(views)["model.norm.weight"]
    model.decoder.final_layernorm.weight.data.add_(1.0)
    assert torch.equal(norm, state["model.norm.weight"] + 1.0)


def test_load_rejects_wrong_shapes(megatron_world1):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_weights import load_hf_weights

    hf_config = tiny_hf_config(tie_word_embeddings=False)
    state = hf_state_dict(tiny_hf_model(hf_config, seed=11), hf_config)
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"][:, :64]
    model = build_model(hf_config, build_transformer_config(hf_config))
    with pytest.raises(ValueError, match="linear_fc2"):
        load_hf_weights(model, state)
    state = hf_state_dict(tiny_hf_model(hf_config, seed=11), hf_config)
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf_weights(model, state)


def test_b29_rope_base_and_vocab_padding_from_the_hf_config():
    """B29: the RoPE base comes from the HF config (never a default); padded vocab =
    ceil(V / (d * TP)) * d * TP with the case's numbers."""
    hf = dict(_load("Qwen2.5-0.5B"), rope_theta=1e7)
    assert build_model_spec(hf).rotary_base == 1e7
    v = 151936
    assert padded_vocab_size(v, tensor_model_parallel_size=2, make_vocab_size_divisible_by=128) == 152064
    assert padded_vocab_size(v, tensor_model_parallel_size=2, make_vocab_size_divisible_by=1187) == 151936
    assert padded_vocab_size(v, tensor_model_parallel_size=1, make_vocab_size_divisible_by=128) == 151936
