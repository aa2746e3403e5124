"""Static checks of colocated mode (`rollout.colocate`, issue 17), run by `validate_config`.

Devices: in colocated mode the engines run on the trainer's devices. On GPU a device is one GPU of
the trainer's node (`trainer.nproc_per_node` of them); on CPU the trainer's `nproc_per_node`
processes stand in for the devices (each engine is one more process on the same host). Either way
the engines that fit on a node are `trainer.nproc_per_node // rollout.tp_size`.

Memory: an engine holds its TP shard of the weights, `params x dtype bytes / rollout.tp_size`, in
`rollout.mem_fraction_static x device memory`. The parameter count is estimated from the HF
config.json (the formula of `benchmarks/cost_model.py`'s `ModelShape.total_params`). Device memory
is the GPU's (read through torch only when `trainer.distributed_backend` is nccl) or, on CPU, the
host's RAM divided by `trainer.nproc_per_node`.

Imports only the standard library (torch lazily, GPU runs only).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron_rl.config.schema import Config
from megatron_rl.errors import ConfigError

GIB = float(2**30)
COLOCATED_BACKENDS = ("embedded", "sglang")
"""Backends with the release / resume / update-from-tensor endpoints (SGLang's API)."""


def estimate_params(hf: dict[str, Any]) -> Optional[int]:
    """Parameter count of a Qwen2 / Llama-style decoder from its HF config.json dict (the formula
    of `benchmarks/cost_model.py`: attention with GQA and q/k/v biases for qwen2, SwiGLU MLP, two
    RMSNorms a layer, embeddings (x2 unless tied), final norm). None when a key is missing."""
    try:
        h, ffn, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads", heads)
        vocab = hf["vocab_size"]
    except KeyError:
        return None
    head_dim = hf.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h
    if hf.get("model_type", "qwen2") == "qwen2" or hf.get("attention_bias", False):
        attn += q + 2 * kv
    per_layer = attn + 3 * h * ffn + 2 * h
    emb = vocab * h * (1 if hf.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + emb + h


def dtype_bytes(cfg: Config) -> int:
    """Bytes per weight element of the engines: 2 with `trainer.precision: bf16`, else 4."""
    return 2 if cfg.trainer.precision == "bf16" else 4


def device_memory_gib(cfg: Config) -> Optional[float]:
    """Memory of one device, GiB: with `trainer.distributed_backend: nccl` the first GPU's total
    memory, or None when no GPU is visible (a dry run on a login node: not checked); otherwise the
    host's physical RAM / `trainer.nproc_per_node`."""
    if cfg.trainer.distributed_backend == "nccl":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / GIB / max(cfg.trainer.nproc_per_node, 1)


def colocated_engines(cfg: Config) -> int:
    """Engines the run starts or is given: `len(rollout.server_urls)` or `rollout.num_servers`."""
    return len(cfg.rollout.server_urls) or cfg.rollout.num_servers


def check_colocate(cfg: Config, hf: Optional[dict[str, Any]] = None) -> None:
    """Static checks of `rollout.colocate` (module docstring). `hf` is the model's config.json
    dict when readable. Raises `ConfigError` naming the keys in conflict."""
    r, t = cfg.rollout, cfg.trainer
    if not r.colocate:
        return
    if t.max_staleness > 0:
        raise ConfigError(f"rollout.colocate: true needs trainer.max_staleness: 0 (got {t.max_staleness}): colocated "
                          "engines and the trainer take turns on the same devices, so generation cannot run ahead "
                          "of training; set trainer.max_staleness=0 or rollout.colocate=false")
    if r.backend not in COLOCATED_BACKENDS:
        raise ConfigError(f"rollout.colocate: true with rollout.backend={r.backend}: colocated mode needs the "
                          f"release / resume / update_weights_from_tensor endpoints ({', '.join(COLOCATED_BACKENDS)})")
    if r.server_urls:
        raise ConfigError(f"rollout.server_urls: {len(r.server_urls)} running server(s) with rollout.colocate: true; "
                          "colocated engines are started by megatron-rl train itself on the trainer's devices (they "
                          "release and resume memory in turn with it, and accept IPC handles only from the process "
                          "tree that launched them); unset rollout.server_urls (rollout.num_servers sets how many) "
                          "or set rollout.colocate=false")
    if t.pipeline_model_parallel_size > 1:
        raise ConfigError(f"rollout.colocate: true with trainer.pipeline_model_parallel_size "
                          f"{t.pipeline_model_parallel_size}: the engines accept IPC handles only from the process "
                          "tree of the trainer rank that launched them (each node's local rank 0, which hands over "
                          "the whole model), and each pipeline stage would send its own; use "
                          "pipeline_model_parallel_size 1")
    devices = t.nproc_per_node
    if devices % t.tensor_model_parallel_size:
        raise ConfigError(f"trainer.tensor_model_parallel_size {t.tensor_model_parallel_size} must divide "
                          f"trainer.nproc_per_node {devices} with rollout.colocate: true (each node's local rank 0 "
                          "gathers the model with its TP group, which must not span nodes)")
    if devices % r.tp_size:
        raise ConfigError(f"rollout.tp_size {r.tp_size} must divide trainer.nproc_per_node {devices} with "
                          "rollout.colocate: true (each engine takes rollout.tp_size of the trainer's devices)")
    fit = devices // r.tp_size
    engines = colocated_engines(cfg)
    if engines > fit:
        raise ConfigError(f"rollout.num_servers: {engines} engines with rollout.colocate: true, but trainer.nproc_per_node "
                          f"{devices} / rollout.tp_size {r.tp_size} = {fit} devices groups hold at most {fit} "
                          "(one engine per rollout.tp_size trainer devices)")
    if hf is None or r.mem_fraction_static is None:
        return
    params = estimate_params(hf)
    if params is None:
        return
    device = device_memory_gib(cfg)
    if device is None:
        return
    need = params * dtype_bytes(cfg) / r.tp_size / GIB
    have = r.mem_fraction_static * device
    if need >= have:
        raise ConfigError(f"rollout.mem_fraction_static {r.mem_fraction_static} x {have / r.mem_fraction_static:.2f} "
                          f"GiB per device = {have:.2f} GiB cannot hold the engine's weights: model.path has "
                          f"~{params / 1e9:.2f}B parameters x {dtype_bytes(cfg)} bytes (trainer.precision "
                          f"{t.precision}) / rollout.tp_size {r.tp_size} = {need:.2f} GiB per device; raise "
                          "rollout.mem_fraction_static or rollout.tp_size")
