"""HF weight loading refuses checkpoints that do not match the model (one gloo rank)."""

import pytest
import torch

from tests.distributed.tiny_qwen2 import tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(120)


def _model(hf_config):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config

    return build_model(hf_config, build_transformer_config(hf_config))


def test_leftover_tensors_are_an_error(megatron_world1):
    """A Qwen2 checkpoint (QKV bias) loaded into a model whose config says no bias (e.g. its
    config.json was edited to llama): the biases would be dropped silently."""
    from megatron_rl.models.hf_weights import load_hf_weights

    cfg = tiny_hf_config(tie_word_embeddings=True)
    sd = dict(tiny_hf_model(cfg, seed=0).state_dict())
    model = _model(cfg)
    load_hf_weights(model, sd)  # the matching checkpoint loads
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"1 tensors of the HF checkpoint have no place in the model, e\.g\. "
                                         r"\['model.layers.0.self_attn.extra.weight'\]"):
        load_hf_weights(model, sd)


def test_corrupt_safetensors_names_the_file(megatron_world1, tmp_path):
    from megatron_rl.models.hf_weights import load_hf_weights

    cfg = tiny_hf_config(tie_word_embeddings=True)
    tiny_hf_model(cfg, seed=0).save_pretrained(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        load_hf_weights(_model(cfg), tmp_path)
