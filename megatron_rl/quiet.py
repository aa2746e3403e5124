"""Silence the start-up warnings that are expected on a machine without CUDA, Transformer Engine
or NVIDIA Apex (megatron-core falls back to torch implementations and says so at every import),
and megatron-core deprecation notices about APIs this project calls on purpose. Real warnings
still show. Call `quiet_known_warnings()` before importing megatron-core (the CLI does).
"""

from __future__ import annotations

import logging
import warnings

# (regex on the message, why it is expected)
_EXPECTED = (
    (r"Transformer Engine and Apex are not installed", "CPU / no TE: megatron-core uses torch fallbacks"),
    (r"Apex is not installed\. Falling back to Torch Norm", "CPU / no Apex: torch RMSNorm"),
    (r"full scope is deprecated", "megatron-core default of cuda_graph_scope, irrelevant without CUDA graphs"),
    (r"MimoModelConfig is experimental", "imported by megatron-core itself"),
    # megatron-core's distributed-checkpoint load (strategies/torch.py) calls torch DCP's load with
    # the reader positional and no_dist=True on purpose (each rank reads its own shards), on the
    # torch ShardedTensor format its checkpoints are written in
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single process",
     "megatron-core's checkpoint load passes no_dist=True"),
    (r"The argument order of load has been changed", "megatron-core calls torch DCP load with a positional reader"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", "megatron-core's checkpoint format"),
)
_LOG_EXPECTED = (
    "GPTModel IS DEPRECATED",  # GPTModel is what megatron-core 0.19's Qwen2 path and checkpoints use
    "async save is deprecated",  # printed for synchronous saves too
)


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in _LOG_EXPECTED)


def quiet_known_warnings() -> None:
    """Install the warning filters and log filters (idempotent)."""
    for pattern, _why in _EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
    # torch logs "No CUDA runtime is found" when megatron-core imports its C++ extension helpers.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for name in ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected())
