"""Qwen3-MoE as a policy (issue 29): HF config -> TransformerConfig, the refusals, the HF expert
layouts, and the one-process model against transformers' own Qwen3MoeForCausalLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from tiny_qwen2 import hf_state_dict, ragged_batch, tiny_hf_config, tiny_hf_model  # noqa: E402

from shared_data import SHARED_DATA  # noqa: E402

from megatron_rl.models.hf_config import build_model_spec, build_transformer_config, moe_spec  # noqa: E402
from megatron_rl.models.hf_weights import (expected_hf_shapes, fuse_hf_experts, iter_hf_weights,  # noqa: E402
                                           load_hf_weights, unfuse_hf_experts)


def _moe(**overrides) -> dict:
    return {**tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe"), **overrides}


def test_qwen3_moe_maps_to_megatron_moe_fields():
    """The HF -> megatron MoE fields (CASES.md M07's flag mapping; its exact weights and the
    norm_topk_prob=False model check: tests/unit/test_cases_moe.py)."""
    tf = build_transformer_config(_moe(), expert_model_parallel_size=2, moe_aux_loss_coeff=0.01,
                                  moe_router_load_balancing_type="aux_loss")
    assert (tf.num_moe_experts, tf.moe_router_topk, tf.moe_ffn_hidden_size) == (4, 2, 32)
    # every layer is an MoE layer: the dense FFN size is set to the expert's (SequentialMLP deep-copies
    # the config, process groups included, when the two differ)
    assert tf.ffn_hidden_size == 32
    assert tf.moe_router_pre_softmax is False  # norm_topk_prob: softmax over the k chosen logits
    assert tf.moe_router_dtype == "fp32" and tf.moe_router_score_function == "softmax"
    assert tf.moe_grouped_gemm is False and tf.moe_token_dispatcher_type == "alltoall"
    assert (tf.expert_model_parallel_size, tf.expert_tensor_parallel_size) == (2, 1)
    assert (tf.moe_router_load_balancing_type, tf.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    assert tf.qk_layernorm is True and tf.moe_enable_routing_replay is False
    assert build_transformer_config(_moe(norm_topk_prob=False)).moe_router_pre_softmax is True
    assert build_transformer_config(_moe(), moe_enable_routing_replay=True).moe_enable_routing_replay is True
    spec = build_model_spec(_moe())
    assert spec.moe is not None and (spec.moe.num_experts, spec.moe.topk) == (4, 2) and spec.qk_layernorm


def test_qwen3_30b_a3b_config_maps():
    path = SHARED_DATA / "hf-configs" / "Qwen3-30B-A3B.json"
    hf = json.loads(path.read_text()) if path.exists() else {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    tf = build_transformer_config(hf, expert_model_parallel_size=8)
    assert (tf.num_layers, tf.num_moe_experts, tf.moe_router_topk, tf.moe_ffn_hidden_size) == (48, 128, 8, 768)
    shapes = expected_hf_shapes(hf)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes


def test_transformers5_num_local_experts_is_read():
    cfg = _moe()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert moe_spec(cfg).num_experts == 4
    assert build_transformer_config(cfg).num_moe_experts == 4


@pytest.mark.parametrize("override, key", [
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
])
def test_unsupported_moe_keys_are_refused_by_name(override, key):
    """Refusals naming the HF key (dense-first layers: CASES.md M05, with first_k_dense_replace in
    tests/unit/test_cases_moe.py)."""
    with pytest.raises(ValueError, match=key):
        moe_spec(_moe(**override))
    with pytest.raises(ValueError, match=key):
        build_transformer_config(_moe(**override))


def test_expert_parallel_layout_errors_name_the_key():
    with pytest.raises(ValueError, match="num_experts"):
        build_transformer_config(_moe(), expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="dense"):
        build_transformer_config(tiny_hf_config(tie_word_embeddings=False), expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        build_transformer_config(_moe(), expert_tensor_parallel_size=3)


def test_fused_and_per_expert_layouts_round_trip():
    hf = tiny_hf_model(_moe(), seed=0)
    fused = {k: v.detach() for k, v in hf.state_dict().items()}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    per_expert = unfuse_hf_experts(fused)
    g = per_expert["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert torch.equal(g, fused["model.layers.1.mlp.experts.gate_up_proj"][2, :32])
    assert torch.equal(per_expert["model.layers.1.mlp.experts.2.up_proj.weight"],
                       fused["model.layers.1.mlp.experts.gate_up_proj"][2, 32:])
    assert torch.equal(per_expert["model.layers.1.mlp.experts.3.down_proj.weight"],
                       fused["model.layers.1.mlp.experts.down_proj"][3])
    back = fuse_hf_experts(per_expert)
    assert back.keys() == fused.keys()
    assert all(torch.equal(back[k], fused[k]) for k in fused)
    del per_expert["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts"):
        fuse_hf_experts(per_expert)


def test_moe_model_equals_hf_and_exports_bit_exact(megatron_world1):
    """One process: transformers' Qwen3MoeForCausalLM and megatron-core's GPTModel with SequentialMLP
    experts give the same logits (fp32, ~1e-6), and the HF export is the loaded tensors bit for bit,
    in HF's order."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.trainer.logprobs import forward_logits

    cfg = _moe()
    hf = tiny_hf_model(cfg, seed=0)
    sd = hf_state_dict(hf, cfg)
    model = build_model(cfg, build_transformer_config(cfg))
    load_hf_weights(model, sd)
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 4
    exported = list(iter_hf_weights(model, cfg))
    assert [n for n, _ in exported] == list(sd)
    for name, tensor in exported:
        assert torch.equal(tensor, sd[name]), name
    ids, mask = ragged_batch(seed=1)
    model.eval()
    with torch.no_grad():
        got = forward_logits(model, ids)[..., : cfg["vocab_size"]]
        want = hf(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5
    # not vacuous: a different expert weight changes the logits
    with torch.no_grad():
        model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc2.weight.mul_(3.0)
        assert (forward_logits(model, ids)[..., : cfg["vocab_size"]] - want).abs().max() > 1e-3
    # the fused in-memory state dict loads the same
    model2 = build_model(cfg, build_transformer_config(cfg))
    load_hf_weights(model2, {k: v.detach() for k, v in hf.state_dict().items()})
    for (n1, p1), (n2, p2) in zip(model2.named_parameters(), build_and_load(cfg, sd).named_parameters()):
        assert torch.equal(p1, p2), n1


def build_and_load(cfg, sd):
    from megatron_rl.models.builder import build_model

    m = build_model(cfg, build_transformer_config(cfg))
    load_hf_weights(m, sd)
    return m
