"""Expert parallelism of the rollout engines (issue 29): how many routed experts a model's
config.json names, the engine's EP size, and vLLM's all-or-nothing expert parallelism. Re-exported
by `megatron_rl.rollout.launcher`."""

from __future__ import annotations

import json
import os
from pathlib import Path


def moe_num_experts(hf_config: dict | None) -> int:
    """Routed experts per MoE layer named by a Hugging Face config.json dict, 0 for a dense model.

    Reads the key each family uses: ``num_experts`` (Qwen2/Qwen3-MoE), ``n_routed_experts``
    (DeepSeek), ``num_local_experts`` (Mixtral); None or a missing key is 0.

    Raises:
        ValueError: the key holds something other than a non-negative integer (named).
    """
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = (hf_config or {}).get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.json {key!r}={value!r}: expected a non-negative integer (routed experts)")
        if value:
            return value
    return 0


def engine_ep_size(model_path: str | os.PathLike | None, tp_size: int) -> int:
    """Expert-parallel size of one rollout engine of ``tp_size`` GPUs: ``tp_size`` for a
    Mixture-of-Experts model (every GPU of the engine holds num_experts / tp_size whole experts;
    vLLM's ``--enable-expert-parallel`` always spans the engine's TP ranks, and it is SGLang's
    usual MoE layout), 1 for a dense model or an engine of one GPU.

    Args:
        model_path: the model folder (its ``config.json`` is read); None, or a folder without a
            readable config.json, counts as dense (the engine then fails on its own if it is not).
        tp_size: GPUs of the engine (``rollout.tp_size`` / ``ROLLOUT_TP_SIZE``), >= 1.

    Raises:
        ValueError: ``tp_size < 1``; a config.json that is not JSON; experts that do not divide
            over ``tp_size`` GPUs (the message names both numbers).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if model_path is None or tp_size == 1:
        return 1
    path = Path(model_path) / "config.json"
    try:
        text = path.read_text()
    except OSError:
        return 1
    try:
        experts = moe_num_experts(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not experts:
        return 1
    if experts % tp_size:
        raise ValueError(f"{path}: {experts} experts do not divide over the rollout engine's {tp_size} GPUs "
                         "(expert parallelism over rollout.tp_size / ROLLOUT_TP_SIZE); choose a TP size dividing them")
    return tp_size


def vllm_expert_parallel(ep_size: int, tp_size: int) -> bool:
    """Whether a vLLM engine of ``tp_size`` GPUs runs ``ep_size``-way expert parallelism: vLLM has no
    EP size, ``--enable-expert-parallel`` spans every TP rank, so only 1 (off) and ``tp_size`` (on) exist.

    Raises:
        ValueError: any other ``ep_size`` (names both sizes).
    """
    if ep_size == 1:
        return False
    if ep_size == tp_size:
        return True
    raise ValueError(f"ep_size {ep_size} with a vLLM engine of tp_size {tp_size}: vLLM's --enable-expert-parallel "
                     "spans all the engine's TP ranks, so the EP size is 1 or the TP size")
