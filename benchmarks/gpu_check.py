"""GPU check: bf16 training throughput and MFU of a ~0.5B Qwen2 on megatron-core, and rollout generation speed.

Runs only with a CUDA device; without one it prints why and exits 0 (``--cpu-smoke`` runs the same
code on a tiny shape on CPU instead, so the code is exercised in CI). On one H200 it should take
2-3 minutes (an estimate: not yet run on a GPU). Steps:

1. **matmul ceiling**: the best bf16 GEMM rate of ``torch.matmul`` over a few square sizes
   (TFLOP/s), the ceiling MFU is measured against (the datasheet peak is printed too).
2. **training**: a randomly initialised Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 / 2
   heads, FFN 4864, vocabulary 151,936, tied) built by ``megatron_rl.models.builder`` (the
   trainer's own builder, bf16, TP 1), wrapped with megatron DDP + the distributed optimizer, and
   trained with the project's ``PolicyTrainer``: old-log-prob pass + one PPO update on a synthetic
   batch (``--seqs`` sequences of ``--seq-len`` tokens, micro-batches of ``--micro-batch``).
   Tokens/s of the update, and MFU = (6 N + 6 x attention FLOPs) x tokens/s / matmul ceiling,
   where N counts the non-embedding weights plus the output projection (standard MFU accounting).
3. **FP8** (only if Transformer Engine imports): the same update with TE's bf16 layers and then
   with ``fp8=hybrid`` (delayed scaling): step time ratio.
4. **colocated hand-over** (issue 17): the shape's bf16 weights handed to a second process by
   ``ColocatedSender`` buckets: CUDA IPC handles on a GPU (``torch.cuda.ipc_collect()`` after each
   bucket), shared memory in ``--cpu-smoke``; seconds and ``gpu/mem_used_gib`` per bucket. The
   CUDA path is written against torch's API and has not run yet (no GPU here).
5. **rollout**: the embedded server (``megatron-rl rollout-server``) on the same shape, saved as
   a Hugging Face folder, generating ``--gen-requests`` x ``--gen-tokens`` tokens (``ignore_eos``);
   and, for reference, Hugging Face ``generate`` of the same model on the GPU in one batch.
6. **asynchronous update** (issue 16): the trainer's ``WeightSyncSender`` broadcasts the shape's
   weights over NCCL to an SGLang engine on the GPU while it keeps generating (a live update:
   pause ``in_place`` -> update -> continue, as ``WeightPublisher.publish(live=True)``); generation
   wall time with and without the update, the update's seconds, and every response complete with
   its tokens spanning both weight versions. Needs SGLang in this environment (skipped otherwise);
   on one GPU the two NCCL ranks get distinct ``NCCL_HOSTID`` (NCCL refuses two ranks of one
   communicator on one device otherwise), so the bytes go over NCCL's socket transport: the
   mechanics are real, the GB/s is not NVLink's. ``--cpu-smoke``: the embedded server over gloo.

Writes ``benchmarks/results/gpu_check.json`` (``--cpu-smoke``: ``gpu_check_cpu_smoke.json`` in the
system temp folder unless ``--out`` is given) and prints a table.

    .venv/bin/python benchmarks/gpu_check.py             # on a GPU machine
    .venv/bin/python benchmarks/gpu_check.py --cpu-smoke # tiny shape on CPU (exercises the code)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
    "torch_dtype": "bfloat16",
}
"""Qwen2.5-0.5B's architecture (random weights here)."""

TINY = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "float32"}
"""The --cpu-smoke shape."""

DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H20": 148.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0}


def model_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), standard MFU accounting:
    6 x (non-embedding weights + output projection) + 6 x attention (QK^T and AV at mean causal
    context seq_len / 2: 2 x 2 x h x seq_len / 2 per layer forward)."""
    h, f, L, a, g = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                     cfg["num_attention_heads"], cfg["num_key_value_heads"])
    d = h // a
    layer = h * a * d + 2 * h * g * d + a * d * h + 3 * h * f
    dense = L * layer + cfg["vocab_size"] * h  # + output projection (the embedding lookup is free)
    attn_fwd = 2 * h * seq_len * L  # 4 h L x (seq_len / 2)
    return 6 * dense + 3 * attn_fwd


def matmul_ceiling(device: str, dtype, sizes: list[int], iters: int) -> dict:
    """Best measured GEMM rate (TFLOP/s) of torch.matmul over square `sizes`."""
    import torch

    best, per = 0.0, {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        tflops = 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12
        per[n] = tflops
        best = max(best, tflops)
        del a, b
    return {"best_tflops": best, "by_size": per}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _loss_settings():
    from megatron_rl.config.schema import ActorConfig

    return ActorConfig(
        loss_agg_mode="token-mean", loss_scale_factor=None,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, kl_loss_type="k3",
    )


def _synthetic_batch(cfg: dict, seqs: int, seq_len: int, prompt_len: int, seed: int = 0):
    import torch

    from megatron_rl.trainer.batch import build_train_batch

    g = torch.Generator().manual_seed(seed)
    v = cfg["vocab_size"]
    prompts = [torch.randint(3, v, (prompt_len,), generator=g).tolist() for _ in range(seqs)]
    responses = [torch.randint(3, v, (seq_len - prompt_len,), generator=g).tolist() for _ in range(seqs)]
    adv = (torch.randn(seqs, generator=g)).tolist()
    return build_train_batch(prompts, responses, advantages=adv,
                             rollout_logprobs=[[-1.0] * len(r) for r in responses], trained=[True] * seqs, pad_id=0)


def train_throughput(cfg: dict, *, bf16: bool, seqs: int, seq_len: int, micro_batch: int, steps: int,
                     warmup: int, use_te: bool | None = None, fp8: str | None = None) -> dict:
    """Old-log-prob pass + one PPO update per step on a synthetic batch; mean seconds of the measured steps."""
    import torch

    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_model_spec, build_transformer_config
    from megatron_rl.trainer.policy import PolicyTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if bf16 else torch.float32
    tf_config = build_transformer_config(cfg, params_dtype=dtype, bf16=bf16, fp8=fp8,
                                         fp8_recipe="delayed" if fp8 else None)
    torch.manual_seed(0)
    model = build_model(cfg, tf_config, use_te=use_te)
    n_params = sum(p.numel() for p in model.parameters())
    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-5, clip_grad=1.0, use_distributed_optimizer=True)
    spec = build_model_spec(cfg)
    trainer = PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=spec.vocab_size,
                            micro_batch_size=micro_batch, actor=_loss_settings())
    batch = _synthetic_batch(cfg, seqs, seq_len, prompt_len=seq_len // 4)
    tokens = int(batch.seq_lengths.sum())  # every token goes through forward and backward
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lp_s, upd_s, grad_norms = [], [], []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        batch.old_logprobs = trainer.compute_logprobs(batch, mini_batch_sequences=seqs)
        _sync(device)
        t1 = time.perf_counter()
        hist = trainer.update(batch, mini_batch_sequences=seqs)
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            lp_s.append(t1 - t0)
            upd_s.append(t2 - t1)
        grad_norms.append(float(hist[-1]["train/grad_norm"]))
    upd = sum(upd_s) / len(upd_s)
    out = {"params": n_params, "tokens_per_step": tokens, "logprob_s": sum(lp_s) / len(lp_s), "update_s": upd,
           "update_tokens_per_s": tokens / upd, "logprob_tokens_per_s": tokens / (sum(lp_s) / len(lp_s)),
           "grad_norms": grad_norms, "finite": all(x == x and abs(x) != float("inf") for x in grad_norms),
           "fp8": fp8, "transformer_engine": bool(use_te) if use_te is not None else None}
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, tm, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def rollout_throughput(cfg: dict, workdir: Path, *, requests: int, new_tokens: int, prompt_len: int,
                       hf_reference: bool) -> dict:
    """The embedded server on the shape (random weights saved as HF) + optionally HF generate on the GPU."""
    import torch

    from megatron_rl.rollout.client import GenerateRequest
    from megatron_rl.rollout.launcher import launch_rollout_server

    model, path = _save_hf(cfg, workdir / "hf_model")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(requests)]
    out: dict = {"requests": requests, "new_tokens": new_tokens, "prompt_len": prompt_len}
    with launch_rollout_server(path, log_path=workdir / "rollout_server.log", startup_timeout_s=600,
                               extra_args=["--max-batch-size", str(max(requests, 1))]) as server:
        client = server.client()
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        client.generate_many([GenerateRequest(prompts[0], dict(params, max_new_tokens=2), "warm")], max_concurrency=1)
        reqs = [GenerateRequest(p, dict(params, sampling_seed=i), f"r{i}") for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        res = client.generate_many(reqs, max_concurrency=requests)
        wall = time.perf_counter() - t0
    toks = sum(len(r.output_ids) for r in res)
    out["embedded_server"] = {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall,
                              "device": "cpu (the embedded server does not place the model on a GPU)"}
    if hf_reference and torch.cuda.is_available():
        m = model.to("cuda").eval()
        x = torch.tensor(prompts, device="cuda")
        with torch.no_grad():
            m.generate(x[:1], max_new_tokens=2, do_sample=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        gen = int((y.shape[1] - x.shape[1]) * y.shape[0])
        out["hf_generate_gpu"] = {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall}
    return out


def async_live_update(cfg: dict, workdir: Path, device: str, *, requests: int, new_tokens: int,
                      prompt_len: int) -> dict:
    """Issue 16's asynchronous weight update on a generating engine: `requests` x `new_tokens`
    (ignore_eos) generated once alone (after a warm-up request), then again with a live update
    (pause in_place, broadcast, continue) a quarter of the way in. On CUDA: SGLang + NCCL (distinct
    NCCL_HOSTID with one GPU); on CPU: the embedded server + gloo. Returns timings and the response
    checks, or {"skipped": why}."""
    import importlib.util
    import threading

    import torch

    from megatron_rl.rollout.client import GenerateRequest
    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.weight_sync.sender import WeightSyncSender

    env = dict(os.environ)
    if device == "cuda":
        if importlib.util.find_spec("sglang") is None:
            return {"skipped": "SGLang is not importable here (the embedded server cannot take NCCL)"}
        if torch.cuda.device_count() < 2:
            os.environ["NCCL_HOSTID"], env["NCCL_HOSTID"] = "gpu-check-trainer", "gpu-check-engine"
        kw = dict(sglang_python=sys.executable, tp_size=1, mem_fraction_static=0.3,
                  per_server_args=[["--base-gpu-id", str(min(1, torch.cuda.device_count() - 1))]])
    else:
        kw = dict(embedded_args=["--max-batch-size", str(requests)])
    model, path = _save_hf(cfg, workdir / "hf_async")
    named = [(n, t.detach().to(device)) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    g = torch.Generator().manual_seed(2)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    reqs = [GenerateRequest(torch.randint(3, cfg["vocab_size"], (prompt_len,), generator=g).tolist(),
                            dict(params, sampling_seed=i), f"a{i}") for i in range(requests)]
    (server,) = launch_servers("sglang" if device == "cuda" else "embedded", path, 1, log_dir=workdir,
                               startup_timeout_s=600, env=env, **kw)
    out: dict = {"engine": "sglang" if device == "cuda" else "embedded", "requests": requests, "new_tokens": new_tokens}
    try:
        client = server.client()
        sender = WeightSyncSender([client], backend="nccl" if device == "cuda" else "gloo", timeout_s=300)
        sender.init_group()
        client.generate_many([GenerateRequest(reqs[0].input_ids, dict(params, max_new_tokens=2), "warm")])
        t0 = time.perf_counter()
        client.generate_many(reqs, max_concurrency=requests)
        out["generate_alone_s"] = alone = time.perf_counter() - t0
        done: dict = {}
        gen = threading.Thread(target=lambda: done.update(res=client.generate_many(reqs, max_concurrency=requests)))
        t0 = time.perf_counter()
        gen.start()
        time.sleep(alone / 4)  # a quarter of the way in
        t1 = time.perf_counter()
        sender.begin_update("in_place")
        stats = sender.send(iter(named), weight_version="async-1")
        sender.finish_update("async-1", flush_refusal_ok=True)
        out["update_s"], out["update_bytes"] = time.perf_counter() - t1, stats["bytes"]
        gen.join()
        out["generate_with_update_s"] = time.perf_counter() - t0
        res = done["res"]
        out["complete"] = sum(len(r.output_ids) == new_tokens for r in res)
        out["spanning_two_versions"] = sum(len(r.weight_versions or []) > 1 for r in res)
        out["final_versions"] = sorted({r.weight_version for r in res})
        sender.destroy()
    finally:
        server.stop()
        os.environ.pop("NCCL_HOSTID", None)
    return out


def _save_hf(cfg: dict, path: Path):
    """A randomly initialised Hugging Face Qwen2 of the shape, saved to `path`; returns (model, path)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
            "bos_token_id", "eos_token_id")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{k: cfg[k] for k in keys}))
    model = model.to(torch.bfloat16 if cfg["torch_dtype"] == "bfloat16" else torch.float32)
    model.save_pretrained(path)
    return model, path


def _ipc_receiver(conn, shapes: dict, device: str) -> None:
    """The engine side of `ipc_handover`: parameters of `shapes` on `device`; each payload is decoded
    with the restricted unpickler (the sender, our parent, is the trusted tree), copied in, dropped."""
    import os

    import torch

    from megatron_rl.weight_sync.ipc import deserialize_named_tensors, process_tree

    params = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    trusted = process_tree(os.getppid())
    while True:
        msg = conn.recv()
        if msg is None:
            break
        payload, load_format = msg
        t0 = time.perf_counter()
        for name, view in deserialize_named_tensors(payload, trusted_pids=trusted, load_format=load_format):
            params[name].copy_(view)
        del view
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - t0)


def ipc_handover(cfg: dict, device: str, bucket_mib: float = 256.0, load_format: str | None = "flattened_bucket") -> dict:
    """The colocated hand-over (issue 17) of the shape's weights (bf16) to another process:
    CUDA IPC handles on GPU, shared memory on CPU; `flattened_bucket`: `ColocatedSender` packs each
    bucket into one device buffer (`torch.cuda.ipc_collect()` after each); None: the named tensors
    themselves by handle, chunked by `bucket_mib` (what colocated runs send: no copy on the sender).
    Seconds and memory (`gpu/mem_used_gib` on GPU) per phase."""
    import multiprocessing as mproc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rl.weight_sync.buckets import bucket_named_tensors
    from megatron_rl.weight_sync.ipc import ColocatedSender, serialize_named_tensors, shared_segments

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
    model = Qwen2ForCausalLM(Qwen2Config(**{k: cfg[k] for k in keys})).to(torch.bfloat16).to(device)
    named = [(n, t.detach()) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    mem = (lambda: torch.cuda.device_memory_used() / 2**30) if device == "cuda" else (lambda: 0.0)
    ctx = mproc.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(child, {n: list(t.shape) for n, t in named}, device))
    proc.start()
    out: dict = {"device": device, "load_format": load_format, "phases": [],
                 "bytes": sum(t.numel() * t.element_size() for _, t in named)}
    before = set(shared_segments())
    try:
        sender = ColocatedSender(int(bucket_mib * 2**20), device)
        t_all = time.perf_counter()
        for i, bucket in enumerate(bucket_named_tensors(iter(named), bucket_mib)):
            m0, t0 = mem(), time.perf_counter()
            payload = sender.payload(bucket) if load_format == "flattened_bucket" else serialize_named_tensors(bucket)
            t1 = time.perf_counter()
            parent.send((payload, load_format))
            load_s = parent.recv()
            t2 = time.perf_counter()
            sender.after_bucket()
            out["phases"].append({"bucket": i, "pack_serialize_s": t1 - t0, "receiver_load_s": load_s,
                                  "roundtrip_s": t2 - t1, "ipc_collect_s": time.perf_counter() - t2,
                                  "mem_before_gib": m0, "mem_after_gib": mem()})
        sender.close()
        out["total_s"] = time.perf_counter() - t_all
        out["gb_per_s"] = out["bytes"] / 1e9 / out["total_s"]
        out["mem_after_close_gib"] = mem()
        del named, model, bucket  # named: the parameters' own segments (CPU) end with them
        out["shared_segments_left"] = len(set(shared_segments()) - before)
    finally:
        parent.send(None)
        proc.join(timeout=60)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (fp32): exercises the code, no GPU")
    ap.add_argument("--seqs", type=int, default=None, help="sequences per step (default 32; smoke 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; smoke 32)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 4; smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 5; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2; smoke 1)")
    ap.add_argument("--gen-requests", type=int, default=None, help="rollout requests (default 32; smoke 4)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="new tokens per request (default 64; smoke 8)")
    ap.add_argument("--skip-rollout", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("gpu_check: no GPU (torch.cuda.is_available() is False): nothing measured. "
              "Run it on a machine with a CUDA device, or with --cpu-smoke for a tiny CPU run of the same code.")
        return 0
    d = (lambda v, gpu, cpu: v if v is not None else (cpu if smoke else gpu))
    seqs, seq_len = d(args.seqs, 32, 4), d(args.seq_len, 2048, 32)
    micro, steps, warmup = d(args.micro_batch, 4, 2), d(args.steps, 5, 1), d(args.warmup, 2, 1)
    gen_requests, gen_tokens = d(args.gen_requests, 32, 4), d(args.gen_tokens, 64, 8)
    cfg = TINY if smoke else QWEN25_05B
    out_path = args.out or (Path(tempfile.gettempdir()) / "gpu_check_cpu_smoke.json" if smoke
                            else REPO / "benchmarks" / "results" / "gpu_check.json")
    device = "cpu" if smoke else "cuda"
    from megatron_rl.quiet import quiet_known_warnings

    quiet_known_warnings()
    from megatron_rl.parallel.groups import world_of_one

    result: dict = {"benchmark": "gpu_check", "cpu_smoke": smoke, "shape": {k: cfg[k] for k in
                    ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size")},
                    "batch": {"seqs": seqs, "seq_len": seq_len, "micro_batch": micro, "steps": steps}}
    t_all = time.perf_counter()
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        result["device"] = name
        result["datasheet_bf16_tflops"] = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
        result["matmul"] = matmul_ceiling("cuda", torch.bfloat16, [4096, 8192, 16384], iters=20)
    else:
        result["device"] = "cpu"
        result["matmul"] = matmul_ceiling("cpu", torch.float32, [128, 256], iters=3)
    ceiling = result["matmul"]["best_tflops"]

    te = False
    try:
        import transformer_engine  # noqa: F401

        te = device == "cuda"
    except Exception:  # noqa: BLE001 - TE missing or broken: the FP8 part is skipped
        te = False
    with world_of_one(tensor_model_parallel_size=1, backend="nccl" if device == "cuda" else "gloo", timeout_s=600):
        bf16 = device == "cuda"
        tr = train_throughput(cfg, bf16=bf16, seqs=seqs, seq_len=seq_len, micro_batch=micro, steps=steps,
                              warmup=warmup)
        fpt = model_flops_per_token(cfg, seq_len)
        tr["model_tflops_per_s"] = fpt * tr["update_tokens_per_s"] / 1e12
        tr["mfu_vs_matmul_ceiling"] = tr["model_tflops_per_s"] / ceiling
        if result.get("datasheet_bf16_tflops"):
            tr["mfu_vs_datasheet"] = tr["model_tflops_per_s"] / result["datasheet_bf16_tflops"]
        result["train_bf16" if bf16 else "train_fp32"] = tr
        if te:
            te_bf16 = train_throughput(cfg, bf16=True, seqs=seqs, seq_len=seq_len, micro_batch=micro, steps=steps,
                                       warmup=warmup, use_te=True)
            te_fp8 = train_throughput(cfg, bf16=True, seqs=seqs, seq_len=seq_len, micro_batch=micro, steps=steps,
                                      warmup=warmup, use_te=True, fp8="hybrid")
            result["te"] = {"bf16": te_bf16, "fp8": te_fp8, "fp8_speedup": te_bf16["update_s"] / te_fp8["update_s"]}
        else:
            result["te"] = {"skipped": "Transformer Engine not importable" if device == "cuda" else "CPU run"}
    result["ipc_handover"] = ipc_handover(cfg, device)
    result["ipc_handover_named"] = ipc_handover(cfg, device, load_format=None)
    if not args.skip_rollout:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            result["rollout"] = rollout_throughput(cfg, Path(tmp), requests=gen_requests, new_tokens=gen_tokens,
                                                   prompt_len=min(64, seq_len // 2), hf_reference=device == "cuda")
            result["async_update"] = async_live_update(cfg, Path(tmp), device, requests=gen_requests,
                                                       new_tokens=4 * gen_tokens, prompt_len=min(64, seq_len // 2))
    result["wall_s"] = time.perf_counter() - t_all
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")

    tr = result.get("train_bf16") or result["train_fp32"]
    print(f"device: {result['device']}   shape: {cfg['num_hidden_layers']} layers x {cfg['hidden_size']} "
          f"({tr['params'] / 1e6:.1f} M params)   batch: {seqs} x {seq_len} tokens, micro-batch {micro}")
    print(f"{'matmul ceiling':34s} {ceiling:10.4g} TFLOP/s" +
          (f"  (datasheet {result['datasheet_bf16_tflops']:.0f})" if result.get("datasheet_bf16_tflops") else ""))
    print(f"{'update tokens/s':34s} {tr['update_tokens_per_s']:10.0f}   ({tr['update_s']:.3f} s a step)")
    print(f"{'old-log-prob tokens/s':34s} {tr['logprob_tokens_per_s']:10.0f}")
    print(f"{'model TFLOP/s, MFU vs ceiling':34s} {tr['model_tflops_per_s']:10.4g}   {100 * tr['mfu_vs_matmul_ceiling']:.1f}%"
          + ("  (CPU smoke: meaningless)" if smoke else ""))
    if "peak_memory_gib" in tr:
        print(f"{'peak memory':34s} {tr['peak_memory_gib']:10.1f} GiB")
    if "fp8_speedup" in result["te"]:
        t = result["te"]
        print(f"{'TE bf16 / fp8 update s':34s} {t['bf16']['update_s']:.3f} / {t['fp8']['update_s']:.3f}  "
              f"(fp8 x{t['fp8_speedup']:.2f})")
    else:
        print(f"{'FP8':34s} skipped: {result['te']['skipped']}")
    if "rollout" in result:
        r = result["rollout"]
        print(f"{'embedded server generate tokens/s':34s} {r['embedded_server']['tokens_per_s']:10.1f}   "
              f"({r['requests']} requests x {r['new_tokens']} tokens, {r['embedded_server']['device']})")
        if "hf_generate_gpu" in r:
            print(f"{'HF generate on the GPU tokens/s':34s} {r['hf_generate_gpu']['tokens_per_s']:10.1f}")
    a = result.get("async_update")
    if a and "skipped" in a:
        print(f"{'async update':34s} skipped: {a['skipped']}")
    elif a:
        print(f"{'async update s (generation s)':34s} {a['update_s']:10.3f}   (generation {a['generate_alone_s']:.2f} s "
              f"alone, {a['generate_with_update_s']:.2f} s with it; {a['complete']}/{a['requests']} complete, "
              f"{a['spanning_two_versions']} spanning two versions, {a['engine']})")
    for key, label in (("ipc_handover_named", "named tensors"), ("ipc_handover", "flattened_bucket")):
        h = result[key]
        print(f"{'colocated hand-over GB/s':34s} {h['gb_per_s']:10.3f}   ({label}: {h['bytes'] / 2**20:.0f} MiB, "
              f"{len(h['phases'])} buckets, {h['device']}; {h['shared_segments_left']} shared segments left)")
    print(f"grad norms finite: {tr['finite']}; {result['wall_s']:.0f} s in all; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
