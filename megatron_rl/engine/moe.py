"""Mixture-of-Experts support of the embedded server: per-expert weight names and routing capture.

Weight names. transformers >= 5 keeps a layer's experts fused in memory (``model.layers.L.mlp.
experts.gate_up_proj`` [E, 2F, h] float, ``...down_proj`` [E, h, F]); checkpoints on disk, SGLang,
vLLM and the trainer's weight sync name them per expert (``model.layers.L.mlp.experts.E.
{gate,up,down}_proj.weight``: gate and up [F, h], down [h, F]; ``megatron_rl.models.hf_weights.
unfuse_hf_experts``). ``ExpertViews`` maps every per-expert name to the slice of the fused
parameter it is (``gate_up_proj[E, :F]``, ``gate_up_proj[E, F:]``, ``down_proj[E]``: each a
contiguous view, so a broadcast can land in it in place), made on demand from the parameter's
current storage (colocated mode replaces that storage on release and resume).

Routing capture (``return_routed_experts``, SGLang 0.5.23's request field; ALGORITHMS.md section
9). ``RouterCapture`` puts a forward hook on every MoE router of the HF model (a module named
``...layers.<l>.mlp.gate`` with a ``top_k``: transformers' ``Qwen3MoeTopKRouter``, whose forward
returns ``(router_logits, router_scores, router_indices)``). The hooks do nothing unless the
engine arms them for one forward (``arm`` ... ``collect``), which it does only when a request in
that forward asked for routing: requests without the flag pay one Python call per layer and
forward, nothing else. What they record is the router's own top-k, ``router_indices`` [B*S, K]
int64 in the router's order (descending probability), the very ids the experts then ran.

Encoding on the wire (SGLang 0.5.23, ``srt/managers/tokenizer_manager.py`` and
``srt/state_capturer/routed_experts.py``): ``meta_info["routed_experts"]`` is
``base64(int32 array [T, L, K] as raw little-endian bytes)``, T = prompt + completion - 1
(``routed_experts_start_len`` rows fewer): positions ``[start, seqlen - 1)``, since the last
generated token is never fed back. ``encode_routed_experts`` writes it.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Hashable, Mapping

import numpy as np
import torch

__all__ = ["ExpertViews", "RouterCapture", "encode_routed_experts", "encode_routed_experts_npy"]

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_GATE_UP = "gate_up_proj"
_FUSED_DOWN = "down_proj"
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.mlp\.gate$")


class ExpertViews:
    """Per-expert HF names over transformers' fused in-memory experts (module docstring).

    Args:
        params: the model's state dict with ``keep_vars=True`` (name -> Parameter); the fused
            experts are the 3-D entries named ``<prefix>gate_up_proj`` / ``<prefix>down_proj``
            with ``<prefix>`` ending in ``.mlp.experts.``.

    Raises:
        ValueError: a fused ``gate_up_proj`` without its ``down_proj`` (or with another expert
            count), or with an odd second dimension.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """``<prefix>`` (ends in ``mlp.experts.``) -> (gate_up_proj [E, 2F, h], down_proj [E, h, F])."""
        for name, p in params.items():
            if not (name.endswith(".mlp.experts." + _FUSED_GATE_UP) and p.dim() == 3):
                continue
            prefix = name[: -len(_FUSED_GATE_UP)]
            down = params.get(prefix + _FUSED_DOWN)
            if down is None or down.dim() != 3 or down.shape[0] != p.shape[0] or p.shape[1] % 2:
                raise ValueError(f"{name} {list(p.shape)}: no matching {prefix}{_FUSED_DOWN} "
                                 f"({None if down is None else list(down.shape)}) or an odd gate/up width")
            self._fused[prefix] = (p, down)

    def __bool__(self) -> bool:
        return bool(self._fused)

    def fused_names(self) -> set[str]:
        """The fused in-memory names (``<prefix>gate_up_proj``, ``<prefix>down_proj``)."""
        return {prefix + n for prefix in self._fused for n in (_FUSED_GATE_UP, _FUSED_DOWN)}

    def names(self) -> list[str]:
        """Every per-expert name, per layer and expert in gate, up, down order."""
        return [f"{prefix}{e}.{part}.weight" for prefix, (gu, _) in self._fused.items() for e in range(gu.shape[0])
                for part in ("gate_proj", "up_proj", "down_proj")]

    def _parse(self, name: str) -> tuple[str, int, str] | None:
        m = _EXPERT_NAME.match(name)
        if m is None or m["prefix"] not in self._fused:
            return None
        e = int(m["e"])
        return (m["prefix"], e, m["part"]) if e < self._fused[m["prefix"]][0].shape[0] else None

    def view(self, name: str) -> torch.Tensor | None:
        """The per-expert tensor ``name`` as a view of its fused parameter (detached, sharing its
        current storage; contiguous): gate [F, h], up [F, h], down [h, F]. None for another name."""
        parsed = self._parse(name)
        if parsed is None:
            return None
        prefix, e, part = parsed
        gate_up, down = self._fused[prefix]
        if part == "down_proj":
            return down.detach()[e]
        width = gate_up.shape[1] // 2
        return gate_up.detach()[e, :width] if part == "gate_proj" else gate_up.detach()[e, width:]

    def units(self, name: str) -> list[Hashable] | None:
        """What writing ``name`` rewrites, as keys ``(id(fused parameter), expert, part)``: one for a
        per-expert name, every expert's parts for a fused name; None for any other name."""
        parsed = self._parse(name)
        if parsed is not None:
            prefix, e, part = parsed
            fused = self._fused[prefix][1 if part == "down_proj" else 0]
            return [(id(fused), e, part)]
        for prefix, (gate_up, down) in self._fused.items():
            if name == prefix + _FUSED_GATE_UP:
                return [(id(gate_up), e, part) for e in range(gate_up.shape[0]) for part in ("gate_proj", "up_proj")]
            if name == prefix + _FUSED_DOWN:
                return [(id(down), e, "down_proj") for e in range(down.shape[0])]
        return None


class RouterCapture:
    """Forward hooks on the HF model's MoE routers that record each forward's top-k expert ids
    when armed (module docstring).

    Attributes:
        num_layers: the model's decoder layers (HF ``num_hidden_layers``): the L of the routing,
            as SGLang counts it (a layer without a router would report zeros).
        topk: experts per token (the routers' ``top_k``), the K of the routing; 0 without routers.
        num_experts: experts per layer (the routers' ``num_experts``); 0 without routers.
        supported: whether the model has MoE routers at all.

    Raises:
        ValueError: routers with different ``top_k``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        routers: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            m = _ROUTER_NAME.search(name)
            if m is not None and isinstance(getattr(module, "top_k", None), int):
                routers[int(m["layer"])] = module
        ks = {int(r.top_k) for r in routers.values()}
        if len(ks) > 1:
            raise ValueError(f"MoE routers with different top_k {sorted(ks)}: one [tokens, layers, top-k] routing "
                             "cannot hold them")
        self.topk = ks.pop() if ks else 0
        experts = {int(getattr(r, "num_experts", 0) or 0) for r in routers.values()}
        self.num_experts = max(experts, default=0)
        self.supported = bool(routers)
        self.num_layers = max(self.num_layers, max(routers, default=-1) + 1)
        self._armed: list[torch.Tensor | None] | None = None
        self._handles = [module.register_forward_hook(self._hook(layer)) for layer, module in sorted(routers.items())]

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            if self._armed is None:
                return
            ids = None
            if isinstance(output, tuple):
                ids = next((o for o in reversed(output) if isinstance(o, torch.Tensor) and not o.is_floating_point()),
                           None)
            if ids is None or ids.dim() != 2 or ids.shape[1] != self.topk:
                raise RuntimeError(f"the router of layer {layer} ({type(module).__name__}) returned no [tokens, "
                                   f"{self.topk}] integer expert ids; routed experts cannot be recorded")
            self._armed[layer] = ids

        return record

    def arm(self) -> None:
        """Record the routers' ids during the next forward (scheduler thread only)."""
        self._armed = [None] * self.num_layers

    def collect(self, batch: int, seq: int) -> torch.Tensor:
        """Disarm and return what the forward since ``arm`` routed: [batch, seq, L, K] int32 (a
        layer whose router did not run reports zeros, as SGLang's capture buffer would).

        Raises:
            RuntimeError: not armed, or a router saw another number of tokens than batch x seq.
        """
        armed, self._armed = self._armed, None
        if armed is None:
            raise RuntimeError("RouterCapture.collect without arm")
        out = torch.zeros(batch, seq, self.num_layers, self.topk, dtype=torch.int32)
        for layer, ids in enumerate(armed):
            if ids is None:
                continue
            if ids.shape[0] != batch * seq:
                raise RuntimeError(f"layer {layer}'s router saw {ids.shape[0]} tokens, expected {batch} x {seq}")
            out[:, :, layer] = ids.reshape(batch, seq, self.topk).to(torch.int32)
        return out

    def disarm(self) -> None:
        """Forget an armed capture (a forward failed)."""
        self._armed = None


def encode_routed_experts(routing: torch.Tensor | np.ndarray) -> str:
    """SGLang 0.5.23's wire form of a routing [T, L, K]: base64 of its int32 little-endian bytes."""
    arr = routing.numpy() if isinstance(routing, torch.Tensor) else np.asarray(routing)
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")


def encode_routed_experts_npy(routing: torch.Tensor | np.ndarray, num_experts: int) -> str:
    """vLLM 0.33's wire form of a routing [T, L, K] (``CompletionResponseChoice.routed_experts``):
    base64 of the ``.npy`` file (``vllm/utils/serial_utils.py numpy2base64``) of the array in the
    narrowest dtype vLLM's capturer uses, uint8 for up to 256 experts, else uint16
    (``model_executor/layers/fused_moe/routed_experts_capturer.py``). The dtype follows the
    model's expert count, never the ids of one request (CASES.md M08).

    Raises:
        ValueError: an id outside ``[0, num_experts)`` (checked in int64: a narrower cast would
            wrap it silently, 300 -> 44 in uint8).
    """
    import io

    arr = routing.numpy() if isinstance(routing, torch.Tensor) else np.asarray(routing)
    wide = arr.astype(np.int64)
    if wide.size and (int(wide.min()) < 0 or int(wide.max()) >= num_experts):
        raise ValueError(f"routed experts in [{int(wide.min())}, {int(wide.max())}] outside the model's "
                         f"[0, {num_experts})")
    arr = wide.astype(np.uint8 if num_experts <= 256 else np.uint16)
    with io.BytesIO() as buf:
        np.save(buf, arr, allow_pickle=False)
        return base64.b64encode(buf.getbuffer()).decode("ascii")
