"""The engine's routing of a batch, row by row and unpadded, and its hand-out to the trainer ranks.

Rollout routing replay (ALGORITHMS.md 9) needs, for every trained token and MoE layer, the top-k
experts the engine chose: 384 ids a token at Qwen3-30B-A3B's 48 layers x top-8. Padded to the
step's longest sequence and broadcast whole, a 30B-scale batch would be ~120 GiB on every rank
(examples/qwen3-30b-a3b/README.md). So the batch keeps it as :class:`RoutedRows` (one int16
``[T_i, L, K]`` tensor a row, only the positions the engine routed), the controller broadcasts the
batch without it (`RoutedRows.stripped`), and :func:`hand_out` then gives every rank only the rows
of its data-parallel shares and the layers of its pipeline stage (`RoutedRows.keep`). The replay
pads one micro-batch at a time (`RoutedRows.padded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["RoutedRows", "dp_rows", "fill_pad_rows", "hand_out", "pad_routes"]


@dataclass
class RoutedRows:
    """Per batch row, the experts the engine routed each of its first T_i positions to.

    Attributes:
        rows: one entry a batch row: int16 ``[T_i, len(layers), K]`` (position t of prompt +
            response, the held layers in ``layers`` order), or None where this rank does not hold
            the row (another data-parallel rank's, or the batch as broadcast before `hand_out`).
        layers: the global MoE layer indices the rows hold, ascending.
        topk: K, experts a token.
        local: True once `hand_out` ran: the rows this rank needs are here.
        minis: the mini-batch size (sequences) `hand_out` chose the rows for.
    """

    rows: list
    layers: tuple[int, ...]
    topk: int
    local: bool = False
    minis: int | None = None
    _column: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_samples(cls, rows: Sequence[Any], lengths: Sequence[int]) -> "RoutedRows":
        """From N arrays (numpy or torch, any int dtype) of shape [T_i, L, K], T_i <= lengths[i].

        Raises:
            ValueError: a count, shape or length that does not fit (names the row), or expert ids
                outside [0, 32767] (int16).
        """
        if len(rows) != len(lengths):
            raise ValueError(f"build_train_batch: {len(rows)} routed_experts rows for {len(lengths)} sequences")
        # int64 before any range check: torch has no CPU max/min for uint16/uint32 (CASES.md M08)
        tensors = [torch.as_tensor(r).to(torch.int64) for r in rows]
        shapes = {tuple(t.shape[1:]) for t in tensors}
        if len(shapes) != 1 or any(t.dim() != 3 for t in tensors):
            raise ValueError(f"build_train_batch: routed_experts rows must be [tokens, layers, top-k] with one [layers, "
                             f"top-k] for all rows, got {sorted(shapes)}")
        layers, k = shapes.pop()
        out = []
        for i, (t, length) in enumerate(zip(tensors, lengths)):
            if t.shape[0] > length:
                raise ValueError(f"sequence {i}: routing for {t.shape[0]} positions but the sequence has {length} tokens")
            if t.numel() and (int(t.max()) > 32767 or int(t.min()) < 0):
                raise ValueError(f"sequence {i}: routed_experts holds expert ids outside [0, 32767]")
            out.append(t.to(torch.int16).contiguous())
        return cls(rows=out, layers=tuple(range(layers)), topk=k)

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, layer: int) -> int:
        """Where global MoE layer `layer` sits in each row's layer axis.

        Raises:
            ValueError: the rows do not hold that layer.
        """
        if not self._column:
            self._column.update({g: j for j, g in enumerate(self.layers)})
        if layer not in self._column:
            raise ValueError(f"routed_experts holds layers {list(self.layers)}, not layer {layer} (routing for another "
                             "model config, or not handed out for this pipeline stage)")
        return self._column[layer]

    def _like(self, rows: list) -> "RoutedRows":
        return RoutedRows(rows=rows, layers=self.layers, topk=self.topk, local=self.local, minis=self.minis)

    def slice(self, start: int, end: int) -> "RoutedRows":
        """Rows [start, end)."""
        return self._like(self.rows[start:end])

    def select(self, idx: Sequence[int]) -> "RoutedRows":
        """Rows `idx`, in that order."""
        return self._like([self.rows[int(i)] for i in idx])

    def stripped(self) -> "RoutedRows":
        """The same layout with no rows held: what the controller broadcasts with the batch."""
        return RoutedRows(rows=[None] * len(self.rows), layers=self.layers, topk=self.topk, local=False)

    def keep(self, row_ids: Sequence[int], layers: Sequence[int]) -> "RoutedRows":
        """Only rows `row_ids` (the others None) and only `layers` (global indices, each held).

        Raises:
            ValueError: a layer these rows do not hold.
        """
        cols = [self.column(g) for g in layers]
        every = cols == list(range(len(self.layers)))
        wanted = set(int(i) for i in row_ids)
        rows = [None if (i not in wanted or r is None) else (r if every else r[:, cols].contiguous())
                for i, r in enumerate(self.rows)]
        return RoutedRows(rows=rows, layers=tuple(layers), topk=self.topk, local=self.local, minis=self.minis)

    def nbytes(self) -> int:
        """Bytes of the rows held."""
        return sum(r.numel() * r.element_size() for r in self.rows if r is not None)

    def padded(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(routed [B, width, L, K] int64, valid [B, width] bool)``: positions without routing
        (the last token, padding) hold the placeholder ids ``0..K-1`` and are False in ``valid``
        (the replay refills them in megatron's token order: `fill_pad_rows`).

        Raises:
            ValueError: a row this rank does not hold, or one longer than `width`.
        """
        routed = torch.arange(self.topk, dtype=torch.long).expand(len(self.rows), width, len(self.layers),
                                                                 self.topk).clone()
        valid = torch.zeros((len(self.rows), width), dtype=torch.bool)
        for i, r in enumerate(self.rows):
            if r is None:
                raise ValueError(f"routed_experts: row {i} of this micro-batch is not held on this rank (the "
                                 "routing was not handed out for this data-parallel share)")
            if r.shape[0] > width:
                raise ValueError(f"routed_experts: row {i} has routing for {r.shape[0]} positions, wider than {width}")
            routed[i, : r.shape[0]] = r
            valid[i, : r.shape[0]] = True
        return routed, valid


def pad_routes(n: int, topk: int, num_experts: int, ep_size: int = 1) -> torch.Tensor:
    """Expert ids for `n` positions that route nothing real (padding, the never-fed-back last token,
    packing's alignment): ``[n, topk]`` int64, each row `topk` distinct ids in ``[0, num_experts)``.

    Pad rows still go through expert dispatch (CASES.md M03). A repeated id in a row collapses in
    megatron-core's routing map (tokens x k assignments no longer hold); the same pair in every
    row puts all pad work on one expert-parallel rank. So the ids are taken in "rank-first" order
    (slime PR 2308): expert ``r * (E / EP) + j`` of EP rank r is the ``j * EP + r``-th, and pad row p
    takes entries ``p * k .. p * k + k - 1`` of that order (mod E): consecutive assignments visit the
    EP ranks in turn, so the ranks' pad assignments differ by at most 1. E=8, EP=4, k=2, n=4:
    ``[[0, 2], [4, 6], [1, 3], [5, 7]]``.

    Raises:
        ValueError: ``topk > num_experts``, or `ep_size` not dividing `num_experts`.
    """
    if not 1 <= topk <= num_experts or ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"pad_routes: need 1 <= topk ({topk}) <= num_experts ({num_experts}) and ep_size "
                         f"({ep_size}) dividing num_experts")
    per_rank = num_experts // ep_size
    order = torch.arange(num_experts).view(ep_size, per_rank).t().reshape(-1)  # rank-first
    slots = torch.arange(n * topk).view(n, topk) % num_experts
    return order[slots]


def fill_pad_rows(routes: torch.Tensor, valid: torch.Tensor | None = None, *, num_experts: int,
                  ep_size: int = 1) -> torch.Tensor:
    """`routes` ``[T, ..., K]`` (megatron's token order, e.g. ``[T, L, K]``) with its pad rows
    refilled by `pad_routes` in order of appearance; the other rows are returned unchanged (a copy).

    Args:
        routes: expert ids, int.
        valid: ``[T]`` bool, False = a pad row (whatever it holds); None = the pad rows are those
            whose ids are all negative (a ``-1`` sentinel).
        num_experts, ep_size: the model's experts per layer and its expert-parallel size.

    Raises:
        ValueError: a row that is partly valid (some ids negative, some not; with `valid`, a valid
            row holding a negative id) or holds an id >= num_experts: it cannot be repaired by
            filling. The message names the row.
    """
    routes = routes.to(torch.int64)
    flat = routes.reshape(routes.shape[0], -1)
    negative = flat < 0
    if valid is None:
        valid = ~negative.all(dim=1)
    valid = valid.to(torch.bool).reshape(-1)
    bad = (negative.any(dim=1) | (flat >= num_experts).any(dim=1)) & valid
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"routed_experts: row {row} is partly valid or out of range ({flat[row].tolist()}, "
                         f"{num_experts} experts): such a row cannot be filled")
    out = routes.clone()
    pads = (~valid).nonzero().reshape(-1)
    if pads.numel():
        fill = pad_routes(pads.numel(), routes.shape[-1], num_experts, ep_size)  # [n, K]
        out[pads] = fill.view(pads.numel(), *([1] * (routes.dim() - 2)), routes.shape[-1]).expand(
            pads.numel(), *routes.shape[1:])
    return out


def dp_rows(n: int, mini_batch_sequences: int | None, dp_size: int, dp_rank: int) -> list[int]:
    """The batch rows one data-parallel rank trains on: of every mini-batch of
    `mini_batch_sequences` rows (None = one mini-batch), its contiguous 1/dp_size share (as
    `PolicyTrainer._dp_share` splits them)."""
    step = mini_batch_sequences or n
    out: list[int] = []
    for a in range(0, n, step):
        b = min(a + step, n)
        per = (b - a) // dp_size if dp_size > 1 else b - a
        out.extend(range(a + dp_rank * per, a + (dp_rank + 1) * per))
    return out


def hand_out(routed: RoutedRows, *, mini_batch_sequences: int | None, dp_size: int, dp_rank: int,
             layers: Sequence[int], tp_group=None) -> RoutedRows:
    """Every rank's share of the controller's routing (all ranks of the default group call it).

    The controller (global rank 0) holds every row; each rank says which data-parallel rank it is
    and which MoE layers it runs (one small ``all_gather_object``). The controller then sends each
    tensor-parallel group's share once, to the group's first rank, one rank at a time
    (``send_object_list``: at most one share is serialised at once, never a copy per rank padded to
    the largest as ``scatter_object_list`` would); that rank broadcasts it within its TP group
    (the TP ranks of one DP rank and stage run the same rows and layers). Returns this rank's
    `RoutedRows` with ``local`` True.

    Args:
        routed: the controller's rows (rank 0); on other ranks the broadcast copy (no rows).
        mini_batch_sequences: the update's mini-batch size in sequences (None = one mini-batch).
        dp_size, dp_rank: this rank's data-parallel group size and rank.
        layers: the global MoE layer numbers of this rank's model chunks.
        tp_group: this rank's tensor-parallel group (None = TP 1); its first rank receives.

    Raises:
        ValueError: the controller's rows lack a layer a rank asks for.
    """
    import torch.distributed as dist

    layers = sorted(int(g) for g in layers)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        mine = routed.keep(dp_rows(len(routed), mini_batch_sequences, dp_size, dp_rank), layers)
        mine.local, mine.minis = True, mini_batch_sequences
        return mine
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    leader = tp_size == 1 or dist.get_rank(tp_group) == 0
    needs: list = [None] * dist.get_world_size()
    dist.all_gather_object(needs, (dp_rank, tuple(layers), leader))
    box: list = [None]
    if dist.get_rank() == 0:
        n, part, key = len(routed), None, None
        # ranks ordered by what they need: each distinct share is cut once and dropped after its last send
        for r in sorted((r for r, (_, _, lead) in enumerate(needs) if lead), key=lambda r: (needs[r][:2], r)):
            if needs[r][:2] != key:
                key = needs[r][:2]
                part = routed.keep(dp_rows(n, mini_batch_sequences, dp_size, key[0]), list(key[1]))
            if r == 0:
                box[0] = part
            else:
                dist.send_object_list([part], dst=r)
    elif leader:
        dist.recv_object_list(box, src=0)
    if tp_size > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    mine = box[0]
    mine.local, mine.minis = True, mini_batch_sequences
    return mine
