"""megatron-core on CPU/gloo through the compatibility layer: TP=1 (1 rank), TP=2 and PP=2 (2 ranks).

Each rank (``rank_worker.py train``) asserts its group sizes, loads a random tiny Qwen2,
checks the HF export round trip (TP gather), logits / log-probs / entropy against HF, and runs
forward, backward and one optimizer step (loss finite, every parameter changes).
"""

from __future__ import annotations

import json

import pytest
import torch

from tiny_qwen2 import run_ranks


@pytest.mark.parametrize(
    "world_size, tie, arch, kv_heads",
    [(1, False, "qwen2", 2), (2, True, "qwen2", 2), (2, False, "qwen2", 2),
     (1, False, "qwen3", 4), (2, True, "qwen3", 2), (1, True, "llama", 1), (2, False, "llama", 2)],
    ids=["ws1-tp1-qwen2-untied-gqa2", "ws2-tp2-qwen2-tied-gqa2", "ws2-tp2-qwen2-untied-gqa2",
         "ws1-tp1-qwen3-untied-mha", "ws2-tp2-qwen3-tied-gqa2", "ws1-tp1-llama-tied-mqa", "ws2-tp2-llama-untied-gqa2"],
)
def test_tiny_gpt_train_step_on_gloo(world_size, tie, arch, kv_heads, tmp_path):
    """HF logits / log-probs / entropy == megatron's (< 1e-4, fp32), export bit-identical, one step,
    for each supported architecture, tied and untied embeddings and GQA ratios 1, 2 and 4. At TP=2
    the checkpoint streamed by `import_from_hf` (written at TP=1) loads into both TP ranks too."""
    env = {"TIE": "1" if tie else "0", "ARCH": arch, "KV_HEADS": str(kv_heads)}
    if world_size == 2:
        from megatron_rl.checkpoint.convert import import_from_hf
        from tiny_qwen2 import tiny_hf_config, tiny_hf_model

        tiny_hf_model(tiny_hf_config(tie_word_embeddings=tie, model_type=arch, num_key_value_heads=kv_heads),
                      seed=0).save_pretrained(tmp_path / "hf")
        env["CKPT"] = str(import_from_hf(tmp_path / "hf", tmp_path / "mcore"))
    results = run_ranks("train", world_size, timeout_s=120, extra_env=env)
    assert sorted(r["rank"] for r in results) == list(range(world_size))
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, losses  # TP ranks compute the same (replicated) loss
    for result in results:
        assert result["logit_err"] < 1e-4 and result["logp_err"] < 1e-4 and result["entropy_err"] < 1e-4


PP2_CASES = [("qwen2", True, 2), ("qwen2", False, 1), ("qwen3", False, 2), ("llama", True, 4)]


def test_pp2_logits_export_and_streamed_checkpoint(tmp_path):
    """PP=2 (2 ranks, one launch for all cases): logits of megatron-core's pipeline schedule == HF's
    (< 1e-4, fp32) for qwen2 tied / untied, qwen3 and llama at GQA ratios 2, 4 (MQA) and 1; each
    stage exports exactly its own HF tensors (bit-identical; together the whole checkpoint); the
    layout-independent checkpoint streamed by `import_from_hf` (TP=1, PP=1) loads into each stage."""
    from megatron_rl.checkpoint.convert import import_from_hf
    from tiny_qwen2 import tiny_hf_config, tiny_hf_model

    cases = []
    for arch, tie, kv_heads in PP2_CASES:
        hf_dir = tmp_path / f"{arch}-{tie}-{kv_heads}"
        tiny_hf_model(tiny_hf_config(tie_word_embeddings=tie, model_type=arch, num_key_value_heads=kv_heads),
                      seed=0).save_pretrained(hf_dir)
        import_from_hf(hf_dir, hf_dir / "mcore")
        cases.append([arch, tie, kv_heads, str(hf_dir / "mcore")])
    results = run_ranks("pp_logits", 2, timeout_s=240, extra_env={"CASES": json.dumps(cases)})
    by_rank = {r["rank"]: r["cases"] for r in results}
    assert sorted(by_rank) == [0, 1]
    for i, (arch, tie, kv_heads) in enumerate(PP2_CASES):
        first, last = by_rank[0][i], by_rank[1][i]
        assert first["logit_err"] is None and last["logit_err"] < 1e-4, (arch, tie, kv_heads)
        exported = first["exported"] + last["exported"]
        assert sorted(exported) == first["hf_names"] and len(set(exported)) == len(exported), (arch, tie)
        assert "model.embed_tokens.weight" in first["exported"] and "model.norm.weight" in last["exported"]


def test_compat_is_inactive_when_cuda_is_available(monkeypatch):
    from megatron_rl.parallel import cpu_compat

    monkeypatch.setattr(cpu_compat, "_state", {"enabled": False, "mode": None, "originals": [], "filter": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert cpu_compat.enable_cpu_compat() is False
    assert not cpu_compat.cpu_compat_enabled()
    assert torch.cuda.current_device is current_device  # nothing patched
    assert torch.empty(1, device="cpu").device.type == "cpu"


def test_compat_refuses_other_megatron_versions(monkeypatch):
    import megatron.core

    from megatron_rl.parallel import cpu_compat

    monkeypatch.setattr(cpu_compat, "_state", {"enabled": False, "mode": None, "originals": [], "filter": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match="0.19"):
        cpu_compat.enable_cpu_compat()
    assert not cpu_compat.cpu_compat_enabled()


def test_compat_rewrites_cuda_devices_and_is_idempotent():
    """In-process: enable, exercise the touch points, disable (other tests see plain torch)."""
    from megatron_rl.parallel import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the layer is never active with CUDA")
    assert cpu_compat.enable_cpu_compat() is True
    try:
        assert cpu_compat.enable_cpu_compat() is True  # idempotent
        assert torch.cuda.current_device() == 0
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to("cuda:0", torch.float64).dtype == torch.float64
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
        torch.cuda.synchronize()
        torch.cuda.manual_seed(7)
        state = torch.cuda.get_rng_state()
        first = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), first)  # CUDA RNG is the CPU RNG
        assert torch.ones(1).type() == "torch.FloatTensor"  # only megatron callers see cuda names
    finally:
        cpu_compat.disable_cpu_compat()
    assert not cpu_compat.cpu_compat_enabled()
    with pytest.raises(Exception):
        torch.zeros(1, device="cuda")
