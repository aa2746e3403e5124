"""CPU compatibility layer that lets megatron-core 0.19 run on a CPU-only torch with gloo.

megatron-core assumes a GPU in a handful of places. When (and only when) no CUDA device is
available, :func:`enable_cpu_compat` maps them to the CPU:

- a process-wide ``TorchFunctionMode`` (:class:`_CudaToCpuMode`) that rewrites cuda devices
  (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")`` and the bare integer returned by
  ``torch.cuda.current_device()``) to ``"cpu"`` in tensor factories and ``Tensor.to``, also
  inside the backward pass (torch pops a mode while its handler runs, so ``Tensor.backward``
  would run the autograd engine without it; ``torch.autograd``'s ``_engine_run_backward`` is
  wrapped to push the mode again: activation recompute reruns megatron's forward there), makes
  ``Tensor.cuda()`` a no-op, and answers ``Tensor.type()`` with the ``torch.cuda.*`` name when
  the caller is megatron-core (grad clipping asserts ``'torch.cuda.FloatTensor'``; the
  float16 optimizer wrapper checks the same names);
- ``torch.cuda.current_device`` -> 0, ``set_device`` / ``synchronize`` / ``empty_cache`` ->
  no-ops, ``Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` ->
  inert stand-ins (DDP grad buffers);
- the MoE token dispatcher's all-to-all (``tensor_parallel.mappings._AllToAll.forward``): gloo
  refuses split sizes given as tensors (CUDA converts them, CPU does not), and the output is
  allocated on ``torch.cuda.current_device()``, which in the backward pass (where the function
  mode is not active: autograd runs the backward outside it) names a CUDA device. The CPU
  version takes the split sizes as lists and allocates on the input's device;
- gathers and reduce-scatters along the first dimension with uneven split sizes (the MoE
  dispatcher with expert TP > 1: each TP rank routes a different number of tokens): gloo needs
  equal sizes, so the gather pads to the largest and cuts back, and the reduce-scatter
  all-reduces the whole tensor and keeps this rank's rows (same values; more traffic);
- CUDA RNG (``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` and megatron's
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``, which go through ``_lazy_call`` and would
  never run) -> the CPU default generator, so the RNG tracker's ``fork`` really switches the
  generator used by CPU dropout and weight init. The tracker's "CPU RNG state changed within
  GPU RNG context" warning is then expected and filtered.

The layer is pinned to the tested megatron-core version (0.19.x): another version raises.
Importing this module has no side effects. The function mode lives in torch's thread-local
mode stack: it covers the thread that called :func:`enable_cpu_compat` (the trainer's main
thread), not threads started by other libraries.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.versions import check_torch_version

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_CORE_PREFIX = "0.19"

_state: dict[str, Any] = {"enabled": False, "mode": None, "originals": [], "filter": None}


def _is_cuda_device(device: Any) -> bool:
    """True for anything that names a CUDA device (str, torch.device or a bare index)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device in torch means a CUDA ordinal; bool is an int subclass but never a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _caller_is_megatron() -> bool:
    """True when the first frame outside torch and this module belongs to megatron.core."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != __name__ and not name.startswith("torch"):
            return name.startswith("megatron.core")
        frame = frame.f_back
    return False


_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function call in this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TYPE:
            return self._tensor_type(args, kwargs)

        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)

    @staticmethod
    def _tensor_type(args, kwargs):
        tensor = args[0]
        dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
        if dtype is None:
            name = _TENSOR_TYPE(tensor)
            # Only megatron-core asks for the cuda name (clip_grads, Float16OptimizerWithFloat16Params).
            if name.startswith("torch.") and ".cuda." not in name and _caller_is_megatron():
                return "torch.cuda." + name[len("torch.") :]
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda.") :]
        rest = {k: v for k, v in kwargs.items() if k != "dtype"}
        return _TENSOR_TYPE(tensor, dtype, **rest)


class _NullStream:
    """Inert stand-in for ``torch.cuda.Stream`` / ``Event``: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NullStream":
        return _NullStream()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, *args: Any, **kwargs: Any) -> float:
        return 0.0


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class _DropForkWarning(logging.Filter):
    """Drops the tracker's warning that becomes expected once CUDA RNG is the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _check_megatron_version() -> None:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if not str(version).startswith(SUPPORTED_MEGATRON_CORE_PREFIX):
        raise RuntimeError(
            f"megatron_rl.parallel.cpu_compat is pinned to megatron-core "
            f"{SUPPORTED_MEGATRON_CORE_PREFIX}.x, found {version}; re-check the CPU touch points "
            "(DESIGN.md, 'megatron-core on CPU') before widening the pin"
        )


def _set(owner: Any, name: str, value: Any) -> None:
    _state["originals"].append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "current_device", lambda: 0)
    _set(cuda, "set_device", lambda *a, **k: None)
    _set(cuda, "synchronize", lambda *a, **k: None)
    _set(cuda, "empty_cache", lambda *a, **k: None)
    _set(cuda, "Stream", _NullStream)
    _set(cuda, "Event", _NullStream)
    _set(cuda, "current_stream", lambda *a, **k: _NullStream())
    _set(cuda, "default_stream", lambda *a, **k: _NullStream())
    _set(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    for owner in (cuda, cuda.random):
        _set(owner, "get_rng_state", _cpu_get_rng_state)
        _set(owner, "set_rng_state", _cpu_set_rng_state)
        _set(owner, "manual_seed", _cpu_manual_seed)


def _split_list(sizes: Any) -> Any:
    """Split sizes as a list of ints (gloo's ``all_to_all_single`` takes no tensor); None stays."""
    if sizes is None:
        return None
    if isinstance(sizes, torch.Tensor):
        return [int(v) for v in sizes.tolist()]
    return [int(v) for v in sizes]


def _cpu_all_to_all_forward(ctx, group, input, output_split_sizes, input_split_sizes, use_nccl_stream=False):
    """megatron-core's ``_AllToAll.forward`` on CPU (see the module docstring)."""
    import torch.distributed as dist

    output_split_sizes, input_split_sizes = _split_list(output_split_sizes), _split_list(input_split_sizes)
    ctx.group = group
    ctx.output_split_sizes = output_split_sizes
    ctx.input_split_sizes = input_split_sizes
    ctx.use_nccl_stream = use_nccl_stream
    if group.size() == 1:
        return input
    input = input.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty([sum(output_split_sizes)] + list(input.size()[1:]))
    dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return output


def _uneven_gather(original):
    """megatron-core's ``_gather_along_first_dim`` with gloo for uneven ``output_split_sizes``
    (gloo's all_gather needs equal sizes): pad to the largest, all-gather, cut each back."""
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

        sizes = _split_list(output_split_sizes)
        top = max(sizes)
        padded = input_.new_zeros([top] + list(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    return gather


def _uneven_reduce_scatter(original):
    """megatron-core's ``_reduce_scatter_along_first_dim`` with gloo for uneven
    ``input_split_sizes``: all-reduce the whole input, keep this rank's rows."""
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        import torch.distributed as dist

        sizes = _split_list(input_split_sizes)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].contiguous()

    return reduce_scatter


def _patch_autograd_engine() -> None:
    import torch.autograd
    import torch.autograd.graph

    original = torch.autograd.graph._engine_run_backward

    def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        with _CudaToCpuMode():
            return original(*args, **kwargs)

    _set(torch.autograd, "_engine_run_backward", _engine_run_backward)
    _set(torch.autograd.graph, "_engine_run_backward", _engine_run_backward)


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings as mc_mappings
    from megatron.core.tensor_parallel import random as mc_random

    _set(mc_mappings._AllToAll, "forward", staticmethod(_cpu_all_to_all_forward))
    _set(mc_mappings, "_gather_along_first_dim", _uneven_gather(mc_mappings._gather_along_first_dim))
    _set(mc_mappings, "_reduce_scatter_along_first_dim",
         _uneven_reduce_scatter(mc_mappings._reduce_scatter_along_first_dim))
    _set(mc_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _set(mc_random, "_set_cuda_rng_state", _cpu_set_rng_state)
    _state["filter"] = _DropForkWarning()
    logging.getLogger(mc_random.__name__).addFilter(_state["filter"])


def enable_cpu_compat() -> bool:
    """Enable the CPU compatibility layer for megatron-core when no CUDA device is available.

    Idempotent. Must be called before megatron-core builds process groups or models, in every
    process (each torchrun rank), from the thread that runs the model.

    Returns:
        True when the layer is active (this call or an earlier one enabled it); False when CUDA
        is available, in which case nothing is changed.

    Raises:
        RuntimeError: megatron-core is not the pinned 0.19.x version, or torch is outside the
            supported range (`megatron_rl.versions`: >=2.6.0,<3).
    """
    if _state["enabled"]:
        return True
    if torch.cuda.is_available():
        return False
    check_torch_version(__name__)
    _check_megatron_version()
    _patch_torch_cuda()
    _patch_autograd_engine()
    _patch_megatron()
    mode = _CudaToCpuMode()
    mode.__enter__()  # kept for the life of the process, like torch.set_default_device
    _state["mode"] = mode
    _state["enabled"] = True
    logger.info("megatron-core CPU compatibility layer enabled (no CUDA device)")
    return True


def disable_cpu_compat() -> None:
    """Undo :func:`enable_cpu_compat` (for tests sharing a process); a no-op when not enabled.

    Must run on the thread that enabled the layer, with no other torch function mode pushed
    on top of it since.
    """
    if not _state["enabled"]:
        return
    _state["mode"].__exit__(None, None, None)
    for owner, name, original in reversed(_state["originals"]):
        setattr(owner, name, original)
    logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_state["filter"])
    _state.update(enabled=False, mode=None, originals=[], filter=None)
    logger.info("megatron-core CPU compatibility layer disabled")


def cpu_compat_enabled() -> bool:
    """Whether :func:`enable_cpu_compat` has activated the layer in this process."""
    return bool(_state["enabled"])
