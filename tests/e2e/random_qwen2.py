"""A random 2-layer Qwen2 saved in HF format, shared by the rollout-server e2e tests."""

import torch

EOS = 2


def save_random_qwen2(path, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                      max_position_embeddings: int = 512):
    """Save a seeded random Qwen2ForCausalLM (2 layers, GQA 4/2, untied, EOS 2) to `path`; returns `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.3,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path
