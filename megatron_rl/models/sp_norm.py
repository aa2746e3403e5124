"""A torch norm for megatron-core's local layer spec that also runs under sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` outright (``assert not config.sequence_parallel``), so without Transformer
Engine a model could not use sequence parallelism, and Mixture-of-Experts layers with TP > 1 (which
megatron-core requires to run with it) could not train at all. Under sequence parallelism a norm
is pointwise over the hidden dimension: each TP rank normalises its own chunk of the sequence with
the same weight, and the weight's gradient is the sum of the ranks' partial gradients. That is all
Transformer Engine's norm adds (``TENorm`` marks its parameters ``sequence_parallel``), and
megatron-core's ``finalize_model_grads`` then all-reduces those gradients over the TP group
(``_allreduce_non_tensor_model_parallel_grads``). This class does the same with torch's norms.
"""

from __future__ import annotations

import torch

__all__ = ["SequenceParallelTorchNorm"]


class SequenceParallelTorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature: ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm``
    over ``hidden_size``, its parameters marked ``sequence_parallel`` when the config says so.

    Raises:
        ValueError: ``config.normalization`` other than RMSNorm / LayerNorm, or a zero-centred gamma /
            persistent / memory-efficient norm (as WrappedTorchNorm refuses them).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag} is not supported by torch's norms (megatron-core's local layer spec)")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: expected RMSNorm or LayerNorm")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm
