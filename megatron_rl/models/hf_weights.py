"""HF <-> megatron-core parameter mapping for Qwen2/Qwen2.5 (also Qwen3, Llama): load and export.

Name map (``L`` = global layer index; megatron names of the local spec, TE fused-norm names in
brackets):

=====================================================  ===============================================
HF                                                     megatron-core GPTModel
=====================================================  ===============================================
model.embed_tokens.weight [V, h]                       embedding.word_embeddings.weight [Vp/tp, h]
model.layers.L.input_layernorm.weight                  decoder.layers.L.input_layernorm.weight
                                                       [self_attention.linear_qkv.layer_norm_weight]
model.layers.L.self_attn.{q,k,v}_proj.{weight,bias}    decoder.layers.L.self_attention.linear_qkv.*
model.layers.L.self_attn.o_proj.weight                 decoder.layers.L.self_attention.linear_proj.weight
model.layers.L.self_attn.{q,k}_norm.weight (qwen3)     decoder.layers.L.self_attention.{q,k}_layernorm.weight
model.layers.L.post_attention_layernorm.weight         decoder.layers.L.pre_mlp_layernorm.weight
                                                       [mlp.linear_fc1.layer_norm_weight]
model.layers.L.mlp.{gate,up}_proj.weight               decoder.layers.L.mlp.linear_fc1.weight
model.layers.L.mlp.down_proj.weight                    decoder.layers.L.mlp.linear_fc2.weight
model.norm.weight                                      decoder.final_layernorm.weight
lm_head.weight (untied only)                           output_layer.weight [Vp/tp, h]
Mixture-of-Experts layers (qwen3_moe), instead of the mlp rows above (E = global expert index):
model.layers.L.mlp.gate.weight [E_n, h]                decoder.layers.L.mlp.router.weight (replicated)
model.layers.L.mlp.experts.E.{gate,up}_proj.weight     decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight
model.layers.L.mlp.experts.E.down_proj.weight          decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight
=====================================================  ===============================================

Experts: an expert-parallel rank r of EP holds the experts ``[r*E_n/EP, (r+1)*E_n/EP)`` as its local
experts ``e = E - r*E_n/EP``; inside an expert the fc1/fc2 shards follow the dense rules over the
expert-tensor-parallel group (ETP, = TP unless set). The HF names are the on-disk per-expert
names (what safetensors checkpoints, SGLang and vLLM use); transformers >= 5 fuses them in memory
into ``mlp.experts.gate_up_proj`` [E_n, 2F, h] and ``mlp.experts.down_proj`` [E_n, h, F]
(:func:`unfuse_hf_experts` / :func:`fuse_hf_experts` convert an in-memory state dict).

Fused layouts. ``linear_qkv`` rows are grouped per query group g (ng = num_key_value_heads
groups, np/ng query heads each, head dim hn): ``[q heads of g (np/ng*hn rows), k_g (hn), v_g (hn)]``
for g = 0..ng-1; a TP rank holds the contiguous groups ``[r*ng/tp, (r+1)*ng/tp)``.
``linear_fc1`` on TP rank r is ``[gate rows of shard r; up rows of shard r]``. Row-parallel
weights (``linear_proj``, ``linear_fc2``) are split along the input dim; the vocabulary is padded
with zero rows to Vp and split along rows. Norms are replicated.

PP: layer indices come from each layer's global ``layer_number``, so a pipeline stage loads and
exports its own layers. Export at PP > 1 yields only this stage's tensors; the stage broadcast
belongs to weight sync.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import build_model_spec

logger = logging.getLogger(__name__)

_ROW, _REPLICATED = 1, None  # kinds: split dim of row-parallel weights, not split


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


# --------------------------------------------------------------------------- fused layouts


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """HF q [np*hn, ...], k/v [ng*hn, ...] -> megatron's per-group [q_g..., k_g, v_g] rows."""
    rest = q.shape[1:]
    q = q.reshape(num_groups, -1, *rest)
    k = k.reshape(num_groups, -1, *rest)
    v = v.reshape(num_groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, num_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`_fuse_qkv` on the full (all-group) tensor."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, -1, *rest)
    q_rows = grouped.shape[1] - 2 * head_dim
    q, k, v = torch.split(grouped, [q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by TP size {tp_size}")
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


def _shard_fc1(gate: torch.Tensor, up: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.cat([_shard(gate, 0, tp_rank, tp_size), _shard(up, 0, tp_rank, tp_size)], dim=0)


def _pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if weight.shape[0] > padded_rows:
        raise ValueError(f"vocabulary rows {weight.shape[0]} exceed the padded size {padded_rows}")
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros(padded_rows - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


# --------------------------------------------------------------------------- HF expert layouts

_FUSED_GATE_UP, _FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def unfuse_hf_experts(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict with transformers' in-memory fused experts (``model.layers.L.mlp.experts.
    gate_up_proj`` [E_n, 2F, h], ``...down_proj`` [E_n, h, F]) -> the on-disk per-expert names
    (``mlp.experts.E.{gate,up,down}_proj.weight``), in that order per layer; other tensors pass
    unchanged (views, no copy). A dict without fused experts comes back as a copy of itself.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith(_FUSED_GATE_UP):
            prefix = name[: -len(_FUSED_GATE_UP)]
            for e in range(tensor.shape[0]):
                gate, up = torch.chunk(tensor[e], 2, dim=0)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
                down = state_dict[prefix + _FUSED_DOWN]
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down[e]
        elif not name.endswith(_FUSED_DOWN):
            out[name] = tensor
    return out


def fuse_hf_experts(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unfuse_hf_experts`: per-expert HF names -> transformers' fused in-memory
    ``mlp.experts.gate_up_proj`` / ``down_proj`` (a layer's experts must all be present).

    Raises:
        ValueError: a layer whose expert indices are not 0..E_n-1 or lack a projection.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in named.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[-1] == "weight" and parts[-3].isdigit():
            prefix = name[: name.index("mlp.experts.")]
            experts.setdefault(prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = tensor
        else:
            out[name] = tensor
    for prefix, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))) or any(
                set(p) != {"gate_proj", "up_proj", "down_proj"} for p in by_index.values()):
            raise ValueError(f"{prefix}mlp.experts: experts {sorted(by_index)} are not 0..n-1 each with gate_proj, "
                             "up_proj and down_proj")
        order = range(len(by_index))
        out[prefix + _FUSED_GATE_UP] = torch.stack(
            [torch.cat([by_index[e]["gate_proj"], by_index[e]["up_proj"]], dim=0) for e in order])
        out[prefix + _FUSED_DOWN] = torch.stack([by_index[e]["down_proj"] for e in order])
    return out


# --------------------------------------------------------------------------- tensor sources


class HFTensors:
    """Name -> tensor lookup over a state dict or a directory of safetensors files (one tensor read
    at a time: a file is opened, the tensor copied out and the file closed again).

    Raises:
        ValueError: the directory is missing, holds no safetensors, or a file is unreadable.
    """

    def __init__(self, source: str | os.PathLike | Mapping[str, torch.Tensor]):
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Path] = {}
        if isinstance(source, Mapping):
            self._dict = source
            return
        root = Path(source)
        if not root.is_dir():
            raise ValueError(f"HF checkpoint directory {str(root)!r} does not exist")
        from safetensors import safe_open

        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: root / file for name, file in weight_map.items()}
        else:
            for file in sorted(root.glob("*.safetensors")):
                try:
                    with safe_open(str(file), framework="pt") as handle:
                        self._files.update({name: file for name in handle.keys()})
                except Exception as e:  # safetensors raises its own SafetensorError
                    raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        if not self._files:
            raise ValueError(f"no *.safetensors weights found in {str(root)!r}")

    def __contains__(self, name: str) -> bool:
        return name in (self._dict if self._dict is not None else self._files)

    def names(self) -> set[str]:
        return set(self._dict if self._dict is not None else self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the safetensors header (no data is read)."""
        if name not in self:
            raise KeyError(f"HF weight {name!r} not found in the checkpoint")
        if self._dict is not None:
            return tuple(self._dict[name].shape)
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(f"HF weight {name!r} not found in the checkpoint")
        if self._dict is not None:
            return self._dict[name]
        from safetensors import safe_open

        try:
            with safe_open(str(self._files[name]), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as e:  # SafetensorError on a truncated or corrupt file
            raise ValueError(f"{self._files[name]}: cannot read tensor {name!r} ({e})") from None


# --------------------------------------------------------------------------- mapping


def _layer_entries(layer, hf_index: int, fused_norms: bool) -> list[tuple[str, Any, list[str], Any]]:
    """(megatron name suffix, param, HF names, kind) for one transformer layer."""
    p = f"model.layers.{hf_index}."
    attn, mlp = layer.self_attention, layer.mlp
    entries: list[tuple[str, Any, list[str], Any]] = []

    def add(suffix: str, param, hf_suffixes: list[str], kind) -> None:
        entries.append((suffix, param, [p + s for s in hf_suffixes], kind))

    qkv = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    add("self_attention.linear_qkv.weight", attn.linear_qkv.weight, qkv, "qkv")
    if getattr(attn.linear_qkv, "bias", None) is not None:
        add("self_attention.linear_qkv.bias", attn.linear_qkv.bias, [n.replace(".weight", ".bias") for n in qkv], "qkv")
    add("self_attention.linear_proj.weight", attn.linear_proj.weight, ["self_attn.o_proj.weight"], _ROW)
    for mc, hf in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
        norm = getattr(attn, mc, None)
        if getattr(norm, "weight", None) is not None:
            add(f"self_attention.{mc}.weight", norm.weight, [f"self_attn.{hf}.weight"], _REPLICATED)
    if hasattr(mlp, "router"):  # Mixture-of-Experts layer (SequentialMLP experts)
        add("mlp.router.weight", mlp.router.weight, ["mlp.gate.weight"], _REPLICATED)
        experts = mlp.experts.local_experts
        first = _expert_offset(mlp, len(experts))
        for e, expert in enumerate(experts):
            g = first + e
            add(f"mlp.experts.local_experts.{e}.linear_fc1.weight", expert.linear_fc1.weight,
                [f"mlp.experts.{g}.gate_proj.weight", f"mlp.experts.{g}.up_proj.weight"], "expert_fc1")
            add(f"mlp.experts.local_experts.{e}.linear_fc2.weight", expert.linear_fc2.weight,
                [f"mlp.experts.{g}.down_proj.weight"], "expert_row")
    else:
        add("mlp.linear_fc1.weight", mlp.linear_fc1.weight, ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "fc1")
        add("mlp.linear_fc2.weight", mlp.linear_fc2.weight, ["mlp.down_proj.weight"], _ROW)
    if fused_norms:  # Transformer Engine spec: each norm lives in the linear that follows it
        add("self_attention.linear_qkv.layer_norm_weight", attn.linear_qkv.layer_norm_weight,
            ["input_layernorm.weight"], _REPLICATED)
        add("mlp.linear_fc1.layer_norm_weight", mlp.linear_fc1.layer_norm_weight,
            ["post_attention_layernorm.weight"], _REPLICATED)
    else:
        add("input_layernorm.weight", layer.input_layernorm.weight, ["input_layernorm.weight"], _REPLICATED)
        add("pre_mlp_layernorm.weight", layer.pre_mlp_layernorm.weight,
            ["post_attention_layernorm.weight"], _REPLICATED)
    return entries


def _expert_offset(moe_layer, num_local: int) -> int:
    """Global index of this rank's first local expert: ep_rank x num_local (megatron's layout)."""
    experts = moe_layer.experts
    ep_group = getattr(experts, "ep_group", None)
    if ep_group is None:
        ep_group = getattr(getattr(moe_layer, "pg_collection", None), "ep", None)
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    return ep_rank * num_local


def _model_entries(model) -> list[tuple[str, Any, list[str], Any]]:
    """(megatron name, param, HF names, kind) for every parameter of one pipeline stage.

    Kinds: "qkv", "fc1", "vocab", "vocab_tied_copy" (the last stage's copy of a tied
    embedding at PP > 1: loaded, never exported), _ROW (split along dim 1), _REPLICATED, and for
    experts "expert_fc1" / "expert_row" (as "fc1" / _ROW over the expert-tensor-parallel group,
    one expert of the expert-parallel group).
    """
    model = _unwrap(model)
    entries: list[tuple[str, Any, list[str], Any]] = []
    if model.pre_process:
        entries.append(("embedding.word_embeddings.weight", model.embedding.word_embeddings.weight,
                        ["model.embed_tokens.weight"], "vocab"))
    for local_index, layer in enumerate(model.decoder.layers):
        hf_index = layer.layer_number - 1  # layer_number is global and 1-based
        fused_norms = hasattr(layer.self_attention.linear_qkv, "layer_norm_weight")
        for suffix, param, hf_names, kind in _layer_entries(layer, hf_index, fused_norms):
            entries.append((f"decoder.layers.{local_index}.{suffix}", param, hf_names, kind))
    if model.post_process:
        entries.append(("decoder.final_layernorm.weight", model.decoder.final_layernorm.weight,
                        ["model.norm.weight"], _REPLICATED))
        if not model.share_embeddings_and_output_weights:
            entries.append(("output_layer.weight", model.output_layer.weight, ["lm_head.weight"], "vocab"))
        elif not model.pre_process:
            # PP > 1 with tied embeddings: the last stage keeps its own copy of the embedding.
            entries.append(("output_layer.weight", model.output_layer.weight,
                            ["model.embed_tokens.weight"], "vocab_tied_copy"))
    return entries


# --------------------------------------------------------------------------- load


@torch.no_grad()
def load_hf_weights(
    model,
    hf_dir_or_state_dict: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Copy HF weights into a megatron-core GPTModel (this TP rank's shard, this PP stage's layers,
    this expert-parallel rank's experts).

    Args:
        model: ``GPTModel`` (optionally DDP-wrapped) built by ``models.builder.build_model``.
        hf_dir_or_state_dict: an HF checkpoint directory (``*.safetensors``, with or without
            ``model.safetensors.index.json``) or an HF-named state dict (e.g.
            ``Qwen2ForCausalLM.state_dict()``); tensors of any float dtype, cast to the params'.
        tp_rank, tp_size: this rank's tensor-parallel coordinates.
        etp_rank, etp_size: this rank's expert-tensor-parallel coordinates (MoE; None: = TP's).
            The expert-parallel rank is the model's own (its experts know their group).

    Padded vocabulary rows (index >= HF vocab size) are set to zero. With tied embeddings
    ``lm_head.weight`` is not read. Tensors are copied one by one (no second copy of the
    stage in memory): after an error the model is partially loaded and must be discarded.

    Raises:
        KeyError: a needed HF tensor is missing.
        ValueError: a shape does not match (wrong config, TP size) or the directory is invalid.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    config = _unwrap(model).config
    if config.tensor_model_parallel_size != tp_size:
        raise ValueError(
            f"tp_size={tp_size} but the model was built with tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size}"
        )
    etp_rank = tp_rank if etp_rank is None else etp_rank
    etp_size = tp_size if etp_size is None else etp_size
    if config.num_moe_experts and (config.expert_tensor_parallel_size or tp_size) != etp_size:
        raise ValueError(f"etp_size={etp_size} but the model was built with expert_tensor_parallel_size="
                         f"{config.expert_tensor_parallel_size}")
    if isinstance(hf_dir_or_state_dict, Mapping):
        hf_dir_or_state_dict = unfuse_hf_experts(hf_dir_or_state_dict)
    source = HFTensors(hf_dir_or_state_dict)
    num_groups = config.num_query_groups or config.num_attention_heads
    used: set[str] = set()
    entries = _model_entries(model)
    if config.num_moe_experts:  # every expert of the checkpoint is used by some EP rank
        used.update(n for n in source.names() if ".mlp.experts." in n)
    for name, param, hf_names, kind in entries:
        used.update(hf_names)
        tensors = [source.get(n) for n in hf_names]
        if kind == "qkv":
            local = _shard(_fuse_qkv(*tensors, num_groups), 0, tp_rank, tp_size)
        elif kind == "fc1":
            local = _shard_fc1(*tensors, tp_rank, tp_size)
        elif kind == "expert_fc1":
            local = _shard_fc1(*tensors, etp_rank, etp_size)
        elif kind == "expert_row":
            local = _shard(tensors[0], 1, etp_rank, etp_size)
        elif kind in ("vocab", "vocab_tied_copy"):
            local = _shard(_pad_vocab(tensors[0], param.shape[0] * tp_size), 0, tp_rank, tp_size)
        else:
            local = _shard(tensors[0], kind, tp_rank, tp_size)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for {name} (from {hf_names}): HF gives {tuple(local.shape)}, "
                f"model has {tuple(param.shape)}"
            )
        param.copy_(local.to(dtype=param.dtype))
    if config.pipeline_model_parallel_size == 1:  # this rank holds every layer: nothing may be left over
        ignorable = ("rotary_emb.inv_freq",)  # buffers some older checkpoints store
        unused = sorted(n for n in source.names() - used
                        if not n.endswith(ignorable) and not (n == "lm_head.weight" and "model.embed_tokens.weight" in used
                                                             and not any("lm_head" in u for u in used)))
        if unused:
            raise ValueError(
                f"{len(unused)} tensors of the HF checkpoint have no place in the model, e.g. {unused[:4]}: "
                "the checkpoint does not match its config.json (model_type, attention_bias, tie_word_embeddings, ...)"
            )
    logger.info("loaded HF weights into TP rank %d/%d", tp_rank, tp_size)


# --------------------------------------------------------------------------- export


def _all_gather(local: torch.Tensor, dim: int, tp_group) -> list[torch.Tensor]:
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    return shards


@torch.no_grad()
def iter_hf_weights(
    model,
    hf_config: Mapping[str, Any],
    *,
    tp_group=None,
    copy: bool = True,
    ep_group=None,
    etp_group=None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full HF-named tensors of this pipeline stage, in HF ``state_dict`` order.

    Order: ``model.embed_tokens.weight``, then per layer q/k/v proj (weight, bias), o_proj,
    (q_norm, k_norm), gate/up/down proj, input_layernorm, post_attention_layernorm, then
    ``model.norm.weight`` and ``lm_head.weight`` (only when untied; with tied embeddings HF
    checkpoints and SGLang's loader skip it). Padded vocabulary rows are trimmed.

    Every TP rank of ``tp_group`` must iterate (the shards are all-gathered); all of them get the
    full tensors. Tensors are in the parameters' dtype on the parameters' device: fresh copies, or
    with ``copy=False`` views of the parameters wherever no conversion is needed (TP 1: every
    tensor but q/k/v with more than one query group, whose rows are regrouped); a view reads what
    the parameter holds when it is read, so the caller must be done with it before the next
    optimizer step (the colocated hand-over, which the engines copy out of at once).

    Args:
        model: ``GPTModel`` (optionally DDP-wrapped).
        hf_config: the HF config the model was built from (vocabulary size).
        tp_group: tensor-parallel group; None or a group of size 1 means no gather.
        copy: False: views where possible (above) instead of copies.
        ep_group: expert-parallel group (MoE): every rank of it must iterate; each local expert is
            all-gathered over it, so every rank yields every expert of the layer (in global expert
            order). None or size 1: this rank's own experts only, under their global indices.
        etp_group: expert-tensor-parallel group (MoE); None: ``tp_group`` when the model's
            expert TP equals its TP, else required.

    MoE layers yield ``mlp.gate.weight`` then each expert's gate/up/down projections, expert by
    expert, in place of the dense MLP's three tensors.

    Raises:
        ValueError: unsupported HF config, or a parameter whose TP partitioning cannot be
            established (see :func:`check_partitioning`), raised before anything is yielded.
    """
    spec = build_model_spec(hf_config)
    config = _unwrap(model).config
    num_groups = config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    etp_size = tp_size
    if config.num_moe_experts:
        want_etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
        if etp_group is None and want_etp != config.tensor_model_parallel_size and want_etp > 1:
            raise ValueError(f"the model's expert_tensor_parallel_size={want_etp} differs from its TP size: pass "
                             "etp_group to gather the expert shards")
        etp_group = tp_group if etp_group is None else etp_group
        etp_size = 1 if etp_group is None else dist.get_world_size(etp_group)
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    check_partitioning(model, hf_config, tp_size, etp_size=etp_size)  # before the first tensor leaves (case B24)

    def gather(local: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [local] if tp_size == 1 else _all_gather(local, dim, tp_group)

    def egather(local: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [local] if etp_size == 1 else _all_gather(local, dim, etp_group)

    def over_ep(hf_names: list[str], outputs: tuple) -> list[tuple[str, torch.Tensor]]:
        """This rank's expert tensors -> those of the same local expert on every EP rank."""
        if ep_size == 1:
            return list(zip(hf_names, outputs, strict=True))
        per_rank = [_all_gather(t, 0, ep_group) for t in outputs]  # [tensor][ep rank]
        local_first = int(hf_names[0].split(".")[5])
        num_local = config.num_moe_experts // ep_size
        local_index = local_first % num_local
        named = []
        for r in range(ep_size):
            g = r * num_local + local_index
            for name, parts in zip(hf_names, per_rank, strict=True):
                pieces = name.split(".")
                pieces[5] = str(g)
                named.append((".".join(pieces), parts[r]))
        return named

    def joined(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return parts[0] if len(parts) == 1 and not copy else torch.cat(parts, dim=dim)

    pending: list[tuple[str, torch.Tensor]] = []  # one unit (embedding, a layer, the head)
    for name, param, hf_names, kind in _model_entries(model):
        if kind == "vocab_tied_copy":
            continue
        unit = _unit_of(hf_names[0])
        if pending and _unit_of(pending[0][0]) != unit:
            yield from _in_hf_order(pending)
            pending = []
        local = param.detach()
        if kind == "qkv":
            outputs = _split_qkv(joined(gather(local, 0)), num_groups, head_dim)
        elif kind == "fc1":
            halves = [torch.chunk(shard, 2, dim=0) for shard in gather(local, 0)]
            outputs = (joined([h[0] for h in halves]), joined([h[1] for h in halves]))
        elif kind in ("expert_fc1", "expert_row"):
            if kind == "expert_fc1":
                halves = [torch.chunk(shard, 2, dim=0) for shard in egather(local, 0)]
                outputs = (joined([h[0] for h in halves]), joined([h[1] for h in halves]))
            else:
                outputs = (joined(egather(local, 1), 1),)
            pending.extend((n, t.clone() if copy and ep_size == 1 else t) for n, t in over_ep(hf_names, outputs))
            continue
        elif kind == "vocab":
            outputs = (joined(gather(local, 0))[: spec.vocab_size],)
        elif kind is _REPLICATED:
            outputs = (local,)
        else:
            outputs = (joined(gather(local, kind), kind),)
        pending.extend((hf_name, tensor.clone() if copy else tensor)
                       for hf_name, tensor in zip(hf_names, outputs, strict=True))
    yield from _in_hf_order(pending)


# Registration order of HF's Qwen2/Qwen3/Llama decoder layer (= its state_dict order).
_HF_LAYER_ORDER = (
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.experts",  # MoE: mlp.experts.E.{gate,up,down}_proj.weight, then the router
    "mlp.gate.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
_EXPERT_PROJ_ORDER = ("gate_proj", "up_proj", "down_proj")


_NAME_PARTITION_DIM = {"qkv": 0, "fc1": 0, "vocab": 0, "vocab_tied_copy": 0, _ROW: 1, _REPLICATED: None,
                       "expert_fc1": 0, "expert_row": 1}


def check_partitioning(model, hf_config: Mapping[str, Any], tp_size: int, *, etp_size: int | None = None) -> None:
    """Fail fast, before any tensor is gathered or sent, unless every parameter of this stage has
    a known TP partitioning consistent with the HF shapes (case B24, slime#2280).

    The partition dim of each parameter comes from its stable megatron name (column-parallel
    ``linear_qkv``/``linear_fc1``/vocabulary: dim 0; row-parallel ``linear_proj``/``linear_fc2``:
    dim 1; norms replicated), not from megatron's ``tensor_model_parallel``/``partition_dim``
    attributes, so a parameter that lost those attributes is still gathered correctly. Checked:
    every parameter is mapped to HF names; where megatron's attributes are present they agree
    with the name; the local shape times ``tp_size`` along that dim equals the full HF shape (the
    vocabulary may be padded). Expert weights are checked against ``etp_size`` (None: = tp_size).

    Raises:
        ValueError: an unmapped parameter, contradicting metadata, or a local shape that is not a
            1/tp_size shard of the HF tensor (names the parameter and both shapes).
    """
    expected = expected_hf_shapes(hf_config)
    entries = _model_entries(model)
    mapped = {id(param) for _, param, _, _ in entries}
    for name, param in _unwrap(model).named_parameters():
        if id(param) not in mapped:
            raise ValueError(f"parameter {name} {tuple(param.shape)} has no HF mapping: refusing to export or sync "
                             "a partial model")
    dense_tp = tp_size
    for name, param, hf_names, kind in entries:
        dim = _NAME_PARTITION_DIM[kind]
        is_expert = isinstance(kind, str) and kind.startswith("expert_")
        tp_size = (dense_tp if etp_size is None else etp_size) if is_expert else dense_tp
        if tp_size > 1 and getattr(param, "tensor_model_parallel", None) is not None:
            meta = getattr(param, "partition_dim", None) if param.tensor_model_parallel else None
            if meta is not None and meta < 0:
                meta = None
            if meta != dim:
                raise ValueError(f"parameter {name}: megatron marks its partition dim as {meta}, its name says {dim}")
        shapes = [expected.get(h) for h in hf_names]
        if kind == "vocab_tied_copy" or any(sh is None for sh in shapes):
            continue  # tied copy (never exported) / names checked by expected_hf_shapes' config
        if kind in ("qkv", "fc1", "expert_fc1"):
            full = (sum(sh[0] for sh in shapes), *shapes[0][1:])
        else:
            full = shapes[0]
        local = tuple(param.shape)
        want = list(full)
        if dim is not None and tp_size > 1:
            want[dim] = full[dim] / tp_size
        if kind == "vocab":
            ok = len(local) == 2 and local[1] == full[1] and local[0] * tp_size >= full[0]
        else:
            ok = len(local) == len(want) and all(a == b for a, b in zip(local, want))
        if not ok:
            raise ValueError(
                f"parameter {name}: local shape {local} is not a 1/{tp_size} shard (dim {dim}) of the HF tensor "
                f"{'+'.join(hf_names)} {tuple(full)}: refusing to send it as a full tensor"
            )


def _unit_of(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        return ".".join(hf_name.split(".")[:3])
    return "head" if hf_name in ("model.norm.weight", "lm_head.weight") else hf_name


def _in_hf_order(named: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    def key(item: tuple[str, torch.Tensor]) -> tuple[int, int, int]:
        name = item[0]
        if name.startswith("model.layers."):
            suffix = name.split(".", 3)[3]
            if suffix.startswith("mlp.experts."):  # mlp.experts.E.<proj>.weight (HF registers them first)
                _, _, e, proj, _ = suffix.split(".")
                return (_HF_LAYER_ORDER.index("mlp.experts"), int(e), _EXPERT_PROJ_ORDER.index(proj))
            return (_HF_LAYER_ORDER.index(suffix), 0, 0)
        return (0, 0, 0)

    return iter(sorted(named, key=key))  # stable: non-layer units keep their order


# the streaming mapping lives in models/hf_sharded.py; its public names stay importable from here
from megatron_rl.models.hf_sharded import (LAYERS_PREFIX, check_hf_checkpoint, expected_hf_shapes,  # noqa: E402,F401
                                           global_chunk_from_hf, hf_from_global, sharded_key_axes,
                                           sharded_key_to_hf)
