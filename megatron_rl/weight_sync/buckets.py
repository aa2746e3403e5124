"""Bucketing of HF-named tensors for the weight broadcast, in SGLang's ``flattened_bucket`` layout.

A bucket is a list of ``(name, tensor)``; on the wire it is ONE ``uint8`` tensor holding the
tensors' bytes back to back in list order, each tensor starting at a byte offset that is a
multiple of its dtype's element size (zero padding in between), plus the metadata lists
``names``, ``dtypes`` (torch dtype names, e.g. ``"bfloat16"``) and ``shapes`` that the
trainer posts to ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``
(SGLANG_API.md 2.3). The receiver computes the same offsets from the metadata alone.

Standard library and torch only (STYLE.md), so the server, the sender and the tests share it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BucketMeta",
    "bucket_named_tensors",
    "cast_named_tensors",
    "dtype_from_name",
    "dtype_name",
    "flatten_bucket",
    "flattened_layout",
    "server_weight_dtype",
    "unflatten_bucket",
    "wire_buckets",
]

MIB = 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """Return SGLang's wire name of a torch dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype named ``name`` (``"float32"`` or ``"torch.float32"``).

    Raises:
        ValueError: ``name`` is not a torch dtype name.
    """
    attr = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; expected a torch dtype such as 'float32' or 'bfloat16'")
    return attr


@dataclass(frozen=True)
class BucketMeta:
    """Metadata of one bucket, exactly the lists posted to ``/update_weights_from_distributed``.

    Attributes:
        names: HF parameter names, in wire order.
        dtypes: torch dtype names (``dtype_name``), one per name.
        shapes: full shapes, one list of ints per name.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes must have the same length, got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> BucketMeta:
        """The metadata of ``(name, tensor)`` pairs, in their order."""
        return cls(names=[n for n, _ in named_tensors], dtypes=[dtype_name(t.dtype) for _, t in named_tensors],
                   shapes=[list(t.shape) for _, t in named_tensors])

    @property
    def nbytes(self) -> int:
        """Size in bytes of the flattened bucket (padding included)."""
        return flattened_layout(self.dtypes, self.shapes)[1]


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def flattened_layout(dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a flattened bucket and the bucket's total size.

    Each tensor starts at the first multiple of its element size at or after the end of the
    previous one. Returns ``(offsets, total_nbytes)``.

    Raises:
        ValueError: a dtype name is unknown or a dimension is negative.
    """
    offsets: list[int] = []
    end = 0
    for dt, shape in zip(dtypes, shapes, strict=True):
        dtype = dt if isinstance(dt, torch.dtype) else dtype_from_name(dt)
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {list(shape)}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        start = _align(end, itemsize)
        numel = 1
        for d in shape:
            numel *= int(d)
        offsets.append(start)
        end = start + numel * itemsize
    return offsets, end


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_size_mib: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_size_mib`` MiB.

    The size of a bucket is its flattened size (alignment padding included). A tensor larger
    than the limit forms a bucket of its own. Order is preserved; the input is consumed lazily,
    so at most one bucket of references is held at a time.

    Raises:
        ValueError: ``bucket_size_mib`` is not positive, or a name repeats.
        TypeError: an item is not a ``(str, torch.Tensor)`` pair.
    """
    if not bucket_size_mib > 0:
        raise ValueError(f"bucket_size_mib must be > 0, got {bucket_size_mib}")
    limit = int(bucket_size_mib * MIB)
    bucket: list[tuple[str, torch.Tensor]] = []
    end = 0
    seen: set[str] = set()
    for item in named_tensors:
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        new_end = _align(end, tensor.element_size()) + tensor.numel() * tensor.element_size()
        if bucket and new_end > limit:
            yield bucket
            bucket, end = [], 0
            new_end = tensor.numel() * tensor.element_size()
        bucket.append((name, tensor))
        end = new_end
    if bucket:
        yield bucket


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, BucketMeta]:
    """Flatten one bucket into a single uint8 tensor and its metadata.

    Args:
        bucket: ``(name, tensor)`` pairs, all on one device; any dtype and layout.

    Returns:
        ``(flat, meta)``: ``flat`` is ``[meta.nbytes] uint8`` on the tensors' device holding the
        bytes of each tensor (contiguous, row-major) at the offsets of ``flattened_layout`` (for a
        bucket of one contiguous tensor, a uint8 view of that tensor: do not write to it);
        ``meta`` lists the names, dtype names and shapes in the same order.

    Raises:
        ValueError: the bucket is empty or spans several devices.
    """
    if not bucket:
        raise ValueError("cannot flatten an empty bucket")
    devices = {t.device for _, t in bucket}
    if len(devices) != 1:
        raise ValueError(f"all tensors of a bucket must be on one device, got {sorted(map(str, devices))}")
    meta = BucketMeta.of(bucket)
    offsets, total = flattened_layout([t.dtype for _, t in bucket], meta.shapes)
    if len(bucket) == 1 and bucket[0][1].is_contiguous():
        # a bucket of one tensor (large tensors go alone) is its own bytes: a view, no copy
        return bucket[0][1].detach().reshape(-1).view(torch.uint8), meta
    flat = torch.empty(total, dtype=torch.uint8, device=devices.pop())  # (nbytes,)
    end = 0
    for (_, t), off in zip(bucket, offsets):
        if off > end:
            flat[end:off].zero_()  # alignment padding: deterministic bytes on the wire
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[off : off + raw.numel()].copy_(raw)
        end = off + raw.numel()
    return flat, meta


def unflatten_bucket(flat: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``flatten_bucket``: cut ``flat`` into tensors described by ``meta``.

    Args:
        flat: ``[meta.nbytes] uint8``.
        meta: names, dtype names and shapes, in wire order.

    Returns:
        ``(name, tensor)`` pairs; each tensor is a view into ``flat`` (clone to keep it apart).

    Raises:
        ValueError: ``flat`` is not 1-D uint8 of exactly the size the metadata implies.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D uint8 tensor, got {flat.dtype} with shape {list(flat.shape)}")
    offsets, total = flattened_layout(meta.dtypes, meta.shapes)
    if flat.numel() != total:
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes, metadata implies {total}")
    out = []
    for name, dt, shape, off in zip(meta.names, meta.dtypes, meta.shapes, offsets):
        dtype = dtype_from_name(dt)
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[off : off + nbytes].view(dtype).view(list(shape))))
    return out


def _describe(item) -> str:
    if isinstance(item, (tuple, list)):
        return "(" + ", ".join(type(x).__name__ for x in item) + ")"
    return repr(item)[:80]


def cast_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cast floating-point tensors to the rollout server's weight dtype (``/model_info`` ``dtype``).

    Integer and bool tensors (buffers) pass through unchanged; ``dtype=None`` passes everything
    through. This is the one place where trainer weights change dtype for the servers.
    """
    target = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got {type(item).__name__} "
                            f"{_describe(item)}")
        name, tensor = item
        if target is not None and tensor.is_floating_point() and tensor.dtype != target:
            tensor = tensor.to(target)
        yield name, tensor


def server_weight_dtype(model_info: dict, *, url: str = "the rollout server") -> torch.dtype | None:
    """The weight dtype a server reports in ``/model_info`` (``"dtype"``), or None when it reports none.

    SGLang 0.5.23 and the embedded server both put the dtype name there (e.g. ``"bfloat16"``).

    Raises:
        ValueError: the reported value is not a torch dtype name (names ``url`` and the value).
    """
    value = model_info.get("dtype")
    if value is None:
        return None
    try:
        return dtype_from_name(str(value))
    except ValueError:
        raise ValueError(f"{url} /model_info reports dtype {value!r}, which is not a torch dtype name") from None


def wire_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | str | None,
    bucket_size_mib: float,
    flatten: bool = True,
) -> Iterator[tuple[torch.Tensor | list[torch.Tensor], BucketMeta, bool]]:
    """The one path from trainer tensors to sync payloads: cast, bucket, flatten (case B26).

    Every sync path (the broadcast sender, the checksum check, benchmarks) goes through here,
    so the declared dtype of a payload tensor is always its real dtype and always the server's
    (``cast_named_tensors``), whatever the bucket size.

    Args:
        named_tensors: ``(HF name, full tensor)`` pairs, consumed lazily.
        dtype: the servers' weight dtype (``server_weight_dtype``); None sends tensors as they are.
        bucket_size_mib: most bytes per bucket (``bucket_named_tensors``), sizes measured after the cast.
        flatten: True for SGLang's ``load_format="flattened_bucket"`` (one uint8 tensor a bucket);
            False for ``load_format=null`` (one broadcast per tensor): ``flat`` is then the list of
            the bucket's tensors, each contiguous (no copy when it already is).

    Yields:
        ``(flat, meta, is_last)``: ``flat`` ``[meta.nbytes] uint8`` (or the tensors, see ``flatten``),
        its ``BucketMeta``, and whether it is the last bucket, in input order. The next bucket's tensors are taken from
        ``named_tensors`` (one bucket ahead) before a bucket is yielded, but only flattened when
        the consumer asks for it, so a sender can flatten bucket k+1 while bucket k is on the wire.
    """
    buckets = bucket_named_tensors(cast_named_tensors(named_tensors, dtype), bucket_size_mib)
    current = next(buckets, None)
    while current is not None:
        following = next(buckets, None)
        if flatten:
            flat, meta = flatten_bucket(current)
        else:
            flat = [t.detach().contiguous() for _, t in current]
            meta = BucketMeta.of(current)
        yield flat, meta, following is None
        current = following
