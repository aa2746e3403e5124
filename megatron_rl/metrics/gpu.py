"""GPU utilisation and memory through NVML (nvidia-ml-py), when a CUDA GPU is present.

`gpu_stats()` is cheap to call every step. On a machine without CUDA, or without the
`nvidia-ml-py` package (the `gpu` extra), it returns `{}` and never imports pynvml.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_warned = False


def gpu_stats(device: int | None = None) -> dict[str, float]:
    """Stats of this process's current CUDA device.

    Returns:
        `{"gpu/util_pct": % of the last sample period a kernel ran (NVML), "gpu/mem_used_gib":
        device memory in use by all processes (NVML, GiB), "gpu/mem_total_gib",
        "gpu/torch_max_allocated_gib": this process's peak tensor memory (torch, GiB)}`;
        `{}` without CUDA or without nvidia-ml-py (a one-time warning says so when CUDA is there).
    """
    global _warned
    import torch

    if not torch.cuda.is_available():
        return {}
    dev = torch.cuda.current_device() if device is None else device
    try:
        import pynvml  # noqa: F401 - nvidia-ml-py; torch's NVML helpers below need it
    except ImportError:
        if not _warned:
            logger.warning("nvidia-ml-py is not installed: no gpu/* metrics (pip install 'megatron-rl[gpu]')")
            _warned = True
        return {}
    gib = float(1 << 30)
    out = {"gpu/util_pct": float(torch.cuda.utilization(dev)),
           "gpu/mem_used_gib": torch.cuda.device_memory_used(dev) / gib,
           "gpu/mem_total_gib": torch.cuda.get_device_properties(dev).total_memory / gib,
           "gpu/torch_max_allocated_gib": torch.cuda.max_memory_allocated(dev) / gib}
    return out
