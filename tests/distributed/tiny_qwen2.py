"""Tiny random Qwen2 models and a rank launcher shared by the model / parallel tests.

Imported by the distributed workers (``rank_worker.py``) and by single-process unit tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_VOCAB = 200  # padded to 256 (TP=1, TP=2): exercises the padded-vocabulary masking


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
TINY_EXPERTS = 4  # qwen3_moe: 4 experts, top-2, expert MLP 32 wide


def tiny_hf_config(*, tie_word_embeddings: bool, model_type: str = "qwen2", num_key_value_heads: int = 2) -> dict:
    """HF config.json dict of a 2-layer model (hidden 64, 4 attention heads, `num_key_value_heads`
    KV heads): qwen2 (q/k/v bias), qwen3 (no bias, q/k RMSNorm, explicit head_dim 16), llama, or
    qwen3_moe (qwen3's attention, 4 experts of width 32, top-2, renormalised)."""
    extra = {}
    if model_type == "qwen3":
        extra = {"head_dim": 16, "attention_bias": False}
    elif model_type == "qwen3_moe":
        extra = {"head_dim": 16, "attention_bias": False, "num_experts": TINY_EXPERTS, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.0}
    elif model_type == "llama":
        extra = {"attention_bias": False, "mlp_bias": False}
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **extra,
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }


def tiny_hf_model(hf_config: dict, *, seed: int = 0):
    """Random fp32 HF causal LM of `hf_config`'s model_type (eager attention) with every weight,
    bias and norm random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)  # RMSNorm gains near 1
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)  # HF initialises q/k/v biases to zero; make them count
            else:
                param.copy_(0.08 * noise)
    return model


def hf_state_dict(model, hf_config: dict) -> dict[str, torch.Tensor]:
    """HF state dict as saved on disk (no ``lm_head.weight`` when tied; experts under their per-expert
    names, as on disk, not transformers' fused in-memory tensors)."""
    from megatron_rl.models.hf_weights import unfuse_hf_experts

    state = {k: v.detach().clone() for k, v in unfuse_hf_experts(model.state_dict()).items()}
    if hf_config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    return state


def ragged_batch(*, seed: int = 0, lengths=(5, 9, 3, 12), pad_id: int = 0):
    """Right-padded [4, max(lengths)] input_ids and [4, S] bool mask (True = real token)."""
    generator = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    input_ids = torch.full((len(lengths), seq), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), seq), dtype=torch.bool)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(0, TINY_VOCAB, (length,), generator=generator)
        mask[row, :length] = True
    return input_ids, mask


def free_port() -> int:
    from megatron_rl.ports import find_free_port

    return find_free_port()


def run_ranks(scenario: str, world_size: int, *, timeout_s: float = 90, extra_env: dict | None = None) -> list[dict]:
    """Run ``rank_worker.py <scenario>`` as ``world_size`` gloo ranks; return each rank's JSON result.

    Raises AssertionError (with the ranks' output) when a rank fails or the timeout passes.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            **(extra_env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("rank_worker.py")), scenario],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs, failed = [], False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
            failed = True
        outputs.append(out)
        failed = failed or proc.returncode != 0
    if failed:
        raise AssertionError("rank failure:\n" + "\n=====\n".join(o[-6000:] for o in outputs))
    results = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines, f"no RESULT line in rank output:\n{out[-4000:]}"
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results
