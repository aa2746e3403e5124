"""Layout-independent (streaming) HF <-> megatron mapping: megatron-core's sharded-state-dict keys
(the global tensors of a torch_dist checkpoint) to and from HF tensors, for `checkpoint.convert`.
Split out of `models.hf_weights` (which re-exports every public name here).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron_rl.models.hf_weights import _fuse_qkv, _split_qkv, HFTensors, _HF_LAYER_ORDER, build_model_spec


# --------------------------------------------------------------------------- layout-independent (streaming) mapping
#
# megatron-core's sharded state dict (and so a torch_dist checkpoint) stores *global* tensors:
# the TP=1 layout of each parameter, with the layers of ``decoder.layers.*`` stacked along a
# leading axis of size num_layers (a layer is the chunk at offset ``(L, 0, ...)``). Norm keys use
# Transformer Engine's names under both specs (``linear_qkv.layer_norm_weight``), and
# ``linear_fc1`` is stored as two chunks of the global ``[L, 2F, h]`` tensor: gate rows ``[0, F)``
# and up rows ``[F, 2F)``. Mixture-of-Experts layers (SequentialMLP experts) store the router as
# ``decoder.layers.mlp.router.weight`` [L, E_n, h] and the experts under
# ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight`` with a second stacked axis, the
# global expert index E: fc1 [L, E_n, 2F, h] (per expert the gate / up chunks as the dense fc1),
# fc2 [L, E_n, h, F]; every EP rank writes its experts at their global offsets, so the checkpoint
# does not depend on EP either. The streaming converter (``checkpoint.convert``) maps these global
# tensors to and from HF tensors one at a time, without building the model.

_SHARDED_LAYER_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    "self_attention.linear_qkv.weight": (("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                                       "qkv"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), None),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), None),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), None),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), None),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), None),
    "mlp.router.weight": (("mlp.gate.weight",), None),  # MoE router [E_n, h]
}
# MoE experts: stacked over (layer, global expert); HF names under model.layers.L.mlp.experts.E.
_SHARDED_EXPERT_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    "mlp.experts.experts.linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "fc1"),
    "mlp.experts.experts.linear_fc2.weight": (("down_proj.weight",), None),
}
_SHARDED_OTHER_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), None),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
}
LAYERS_PREFIX = "decoder.layers."


def sharded_key_axes(key: str) -> int:
    """Number of stacked leading axes of a megatron-core sharded-state-dict tensor key: 0 (embedding,
    final norm, output layer), 1 (a layer tensor: the layer index) or 2 (an expert tensor: layer,
    then global expert index).

    Raises:
        ValueError: a key this mapping does not know (another architecture's tensor, e.g. a shared
            expert or a TE-grouped expert layout), naming the key.
    """
    if key.startswith(LAYERS_PREFIX):
        suffix = key[len(LAYERS_PREFIX):]
        if suffix in _SHARDED_LAYER_KEYS:
            return 1
        if suffix in _SHARDED_EXPERT_KEYS:
            return 2
    elif key in _SHARDED_OTHER_KEYS:
        return 0
    raise ValueError(f"megatron tensor {key!r} has no HF counterpart in the qwen2/qwen3/llama/qwen3_moe mapping")


def sharded_key_to_hf(key: str, layer: int | None = None, expert: int | None = None) -> tuple[tuple[str, ...], Any]:
    """HF names and fused kind of a megatron-core sharded-state-dict tensor key.

    Args:
        key: e.g. ``decoder.layers.mlp.linear_fc1.weight``, ``embedding.word_embeddings.weight`` or
            ``decoder.layers.mlp.experts.experts.linear_fc2.weight``.
        layer: the global layer index (the chunk's offset on the stacked axis) for layer and expert keys.
        expert: the global expert index (the offset on the second stacked axis) for expert keys;
            ignored for other keys.

    Returns:
        (HF names, kind): kind is "qkv" (per-group interleave of q, k, v), "fc1" ([gate; up]),
        "vocab" (rows padded to the padded vocabulary) or None (same tensor). Expert keys give
        ``model.layers.L.mlp.experts.E.{gate,up}_proj.weight`` ("fc1") / ``...down_proj.weight``.

    Raises:
        ValueError: a key this mapping does not know (see :func:`sharded_key_axes`), or a layer /
            expert key without its index.
    """
    axes = sharded_key_axes(key)
    if (axes and layer is None) or (axes == 2 and expert is None):
        raise ValueError(f"megatron tensor {key!r} is stacked over {'layers and experts' if axes == 2 else 'layers'}: "
                         "its layer" + (" and expert" if axes == 2 else "") + " index is needed")
    if axes == 0:
        return _SHARDED_OTHER_KEYS[key]
    suffix = key[len(LAYERS_PREFIX):]
    if axes == 1:
        names, kind = _SHARDED_LAYER_KEYS[suffix]
        return tuple(f"model.layers.{layer}.{n}" for n in names), kind
    names, kind = _SHARDED_EXPERT_KEYS[suffix]
    return tuple(f"model.layers.{layer}.mlp.experts.{expert}.{n}" for n in names), kind


def expected_hf_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an HF checkpoint of this config holds, in HF state_dict order
    (``lm_head.weight`` only when untied).

    Raises:
        ValueError: unsupported or incomplete config (see ``hf_config.build_transformer_config``).
    """
    from megatron_rl.models.hf_config import build_transformer_config

    spec = build_model_spec(hf_config)
    tf = build_transformer_config(hf_config)
    h, ffn, hn = tf.hidden_size, tf.ffn_hidden_size, tf.kv_channels
    moe = spec.moe
    nq, nkv = tf.num_attention_heads, tf.num_query_groups or tf.num_attention_heads
    per_layer = {
        "self_attn.q_proj.weight": (nq * hn, h), "self_attn.q_proj.bias": (nq * hn,),
        "self_attn.k_proj.weight": (nkv * hn, h), "self_attn.k_proj.bias": (nkv * hn,),
        "self_attn.v_proj.weight": (nkv * hn, h), "self_attn.v_proj.bias": (nkv * hn,),
        "self_attn.o_proj.weight": (h, nq * hn),
        "self_attn.q_norm.weight": (hn,), "self_attn.k_norm.weight": (hn,),
        "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    if not tf.add_qkv_bias:
        per_layer = {k: v for k, v in per_layer.items() if not k.endswith("proj.bias")}
    if not spec.qk_layernorm:
        per_layer = {k: v for k, v in per_layer.items() if not k.endswith("_norm.weight")}
    if moe is not None:
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("mlp.")}
        per_layer["mlp.gate.weight"] = (moe.num_experts, h)
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for layer in range(tf.num_layers):
        for suffix in _HF_LAYER_ORDER:
            if suffix in per_layer:
                shapes[f"model.layers.{layer}.{suffix}"] = per_layer[suffix]
            if suffix == "mlp.experts" and moe is not None:
                f = moe.ffn_hidden_size
                for e in range(moe.num_experts):
                    p = f"model.layers.{layer}.mlp.experts.{e}."
                    shapes[p + "gate_proj.weight"] = (f, h)
                    shapes[p + "up_proj.weight"] = (f, h)
                    shapes[p + "down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def check_hf_checkpoint(source: "HFTensors", hf_config: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    """Compare an HF checkpoint's tensor names and shapes with its config before converting it
    (reads only the safetensors headers).

    Returns:
        ``expected_hf_shapes(hf_config)``.

    Raises:
        ValueError: a tensor is missing, has another shape (names the tensor and both shapes), or
            has no place in the model (e.g. a bias that the config's architecture lacks).
    """
    expected = expected_hf_shapes(hf_config)
    for name, shape in expected.items():
        if name not in source:
            raise ValueError(f"{where}: no tensor {name!r} (config.json expects one of shape {list(shape)})")
        got = source.shape(name)
        if tuple(got) != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {list(got)}, config.json expects {list(shape)}")
    tied_head = "lm_head.weight" not in expected
    unused = sorted(n for n in source.names() - set(expected)
                    if not n.endswith("rotary_emb.inv_freq") and not (tied_head and n == "lm_head.weight"))
    if unused:
        raise ValueError(
            f"{where}: {len(unused)} tensors of the HF checkpoint have no place in the model, e.g. {unused[:4]}: "
            "the checkpoint does not match its config.json (model_type, attention_bias, tie_word_embeddings, ...)"
        )
    return expected


def global_chunk_from_hf(source: "HFTensors", key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                         *, num_query_groups: int) -> torch.Tensor:
    """One chunk of a megatron global tensor, built from the HF tensors it comes from.

    Args:
        source: the HF tensors.
        key: sharded-state-dict key (see :func:`sharded_key_to_hf`).
        offsets, sizes: the chunk in the global tensor; layer keys have the stacked layer axis
            first, expert keys the layer then the global expert axis (size 1 each in ``sizes``:
            one chunk is one layer's, or one layer's one expert's, tensor or a slice of it).
        num_query_groups: GQA groups (``num_key_value_heads``) for the QKV interleave.

    Returns:
        A tensor of shape ``sizes`` in the HF dtype (padded vocabulary rows are zero). It shares
        memory with the HF tensor when no fusing or padding is needed.

    Raises:
        ValueError: an unknown key (see :func:`sharded_key_axes`), a chunk spanning several layers
            or experts, or HF tensors that do not fill the chunk (names the tensor and both shapes).
    """
    axes = sharded_key_axes(key)
    if any(s != 1 for s in sizes[:axes]):
        raise ValueError(f"megatron tensor {key!r} chunk at {list(offsets)} of sizes {list(sizes)} spans several "
                         "layers or experts; the streaming converter builds one layer (and expert) at a time")
    names, kind = sharded_key_to_hf(key, *offsets[:axes])
    start, size = offsets[axes:], sizes[axes:]
    rows = slice(start[0], start[0] + size[0])
    if kind == "fc1":  # rows [0, F) are gate_proj, [F, 2F) up_proj
        ffn = source.shape(names[0])[0]
        parts = []
        for name, lo in ((names[0], 0), (names[1], ffn)):
            a, b = max(rows.start, lo), min(rows.stop, lo + ffn)
            if a < b:
                parts.append(source.get(name)[a - lo:b - lo])
        full = parts[0] if len(parts) == 1 else torch.cat(parts)
    elif kind == "qkv":
        full = _fuse_qkv(*(source.get(n) for n in names), num_query_groups)[rows]
    elif kind == "vocab":
        weight = source.get(names[0])
        if rows.stop <= weight.shape[0]:
            full = weight[rows]
        else:  # padded rows are zero
            full = weight.new_zeros(size[0], *weight.shape[1:])
            real = weight[rows.start:min(rows.stop, weight.shape[0])]
            full[: real.shape[0]] = real
    else:
        full = source.get(names[0])[rows]
    full = full[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(start[1:], size[1:]))]
    if tuple(full.shape) != tuple(size):
        raise ValueError(f"megatron tensor {key!r} chunk at {list(offsets)}: HF tensors {list(names)} give shape "
                         f"{list(full.shape)}, the checkpoint expects {list(size)}")
    return full.reshape(sizes)


def hf_from_global(key: str, tensor: torch.Tensor, *, layer: int | None, num_query_groups: int, head_dim: int,
                   vocab_size: int, first_expert: int = 0) -> list[tuple[str, torch.Tensor]]:
    """HF tensors of one whole megatron global tensor (one layer's slice for layer keys, without the
    stacked layer axis): QKV split per group, fc1 split into gate and up, padded vocabulary rows
    trimmed. The results are views of ``tensor`` where possible.

    Args:
        key: sharded-state-dict key (see :func:`sharded_key_to_hf`).
        tensor: the global tensor; layer keys: one layer's slice (e.g. [3*h', h] for QKV); expert
            keys: one layer's experts [n, 2F, h] (fc1) or [n, h, F] (fc2), the experts
            ``first_expert .. first_expert + n - 1`` (all of the layer's by default).
        layer: the global layer index (layer and expert keys), else None.
        num_query_groups, head_dim: the QKV layout.
        vocab_size: HF vocabulary rows (the padding is trimmed).
        first_expert: global index of the first expert in ``tensor`` (expert keys).

    Returns:
        [(HF name, tensor)], for expert keys expert by expert (gate, up per expert for fc1).

    Raises:
        ValueError: unknown key (see :func:`sharded_key_axes`).
    """
    if sharded_key_axes(key) == 2:
        return [named for e in range(tensor.shape[0])
                for named in _split_global(key, tensor[e], layer, first_expert + e, num_query_groups, head_dim,
                                           vocab_size)]
    return _split_global(key, tensor, layer, None, num_query_groups, head_dim, vocab_size)


def _split_global(key: str, tensor: torch.Tensor, layer: int | None, expert: int | None, num_query_groups: int,
                  head_dim: int, vocab_size: int) -> list[tuple[str, torch.Tensor]]:
    """:func:`hf_from_global` for one layer's (and one expert's) tensor."""
    names, kind = sharded_key_to_hf(key, layer, expert)
    if kind == "qkv":
        outputs = _split_qkv(tensor, num_query_groups, head_dim)
    elif kind == "fc1":
        outputs = torch.chunk(tensor, 2, dim=0)
    elif kind == "vocab":
        outputs = (tensor[:vocab_size],)
    else:
        outputs = (tensor,)
    return list(zip(names, outputs, strict=True))
