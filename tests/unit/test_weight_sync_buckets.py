"""Buckets for the weight broadcast: SGLang flattened_bucket layout, round trip, alignment, invariance."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_rl.weight_sync.buckets import (
    MIB,
    BucketMeta,
    bucket_named_tensors,
    cast_named_tensors,
    dtype_from_name,
    dtype_name,
    flatten_bucket,
    flattened_layout,
    unflatten_bucket,
)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes -> next starts unaligned
        ("b.bias", torch.randn(7, generator=g)),  # float32, must start at a multiple of 4
        ("c.count", torch.tensor([1, 2, 3], dtype=torch.int64)),  # int64 -> multiple of 8
        ("d.mask", torch.tensor([True, False, True])),
        ("e.scalar", torch.tensor(2.5, dtype=torch.float16)),
        ("f.big", torch.randn(300, 1000, generator=g)),  # 1.14 MiB: larger than a 1 MiB bucket
        ("g.t", torch.randn(4, 6, generator=g).t()),  # non-contiguous
    ]


def _roundtrip(named, bucket_size_mib):
    out = []
    for bucket in bucket_named_tensors(named, bucket_size_mib):
        flat, meta = flatten_bucket(bucket)
        assert flat.dtype == torch.uint8 and flat.numel() == meta.nbytes
        out += [(n, t.clone()) for n, t in unflatten_bucket(flat, meta)]
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def test_round_trip_is_bitwise():
    named = _named()
    named.append(("h.nan", torch.tensor([float("nan"), -0.0, float("inf")])))
    got = _roundtrip(named, 512)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got):
        assert _bitwise_equal(want, have)


def test_each_tensor_starts_at_a_multiple_of_its_element_size():
    named = _named()
    offsets, total = flattened_layout([t.dtype for _, t in named], [list(t.shape) for _, t in named])
    for (_, t), off in zip(named, offsets):
        assert off % t.element_size() == 0
    # hand-computed: a: 0..30, b: 32..60, c: 64..88, d: 88..91, e: 92..94, f: 96..1_200_096
    assert offsets[:6] == [0, 32, 64, 88, 92, 96]
    assert offsets[6] == 96 + 300 * 1000 * 4
    assert total == offsets[6] + 24 * 4


def test_bucket_size_invariance_1_mib_vs_512_mib():
    named = _named()
    small = list(bucket_named_tensors(named, 1))
    large = list(bucket_named_tensors(named, 512))
    assert len(large) == 1 and len(small) >= 3
    assert any(len(b) == 1 and b[0][0] == "f.big" for b in small)  # too big for a bucket: alone
    for b in small:
        if len(b) > 1:
            assert flatten_bucket(b)[1].nbytes <= 1 * MIB
    for (n1, t1), (n2, t2) in zip(_roundtrip(named, 1), _roundtrip(named, 512), strict=True):
        assert n1 == n2 and _bitwise_equal(t1, t2)


def test_declared_dtype_and_shape_match_the_tensors():
    for bucket in bucket_named_tensors(_named(), 1):
        flat, meta = flatten_bucket(bucket)
        for (name, t), mname, dt, shape in zip(bucket, meta.names, meta.dtypes, meta.shapes):
            assert name == mname
            assert dtype_from_name(dt) == t.dtype and dt == dtype_name(t.dtype)
            assert shape == list(t.shape)
        for (_, t), (_, u) in zip(bucket, unflatten_bucket(flat, meta)):
            assert u.dtype == t.dtype and u.shape == t.shape


def test_dtype_names_are_sglang_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("float32") is torch.float32
    assert dtype_from_name("torch.float16") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("nope")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("nn")  # an attribute of torch that is not a dtype


def test_cast_only_floating_tensors():
    named = [("w", torch.ones(2, dtype=torch.float32)), ("i", torch.ones(2, dtype=torch.int64))]
    out = dict(cast_named_tensors(named, "bfloat16"))
    assert out["w"].dtype == torch.bfloat16 and out["i"].dtype == torch.int64
    assert dict(cast_named_tensors(named, None))["w"].dtype == torch.float32


def test_errors():
    with pytest.raises(ValueError, match="bucket_size_mib"):
        list(bucket_named_tensors(_named(), 0))
    with pytest.raises(ValueError, match="twice"):
        list(bucket_named_tensors([("x", torch.ones(1)), ("x", torch.ones(1))], 1))
    with pytest.raises(ValueError, match="metadata implies"):
        unflatten_bucket(torch.zeros(3, dtype=torch.uint8), BucketMeta(["x"], ["float32"], [[1]]))
    with pytest.raises(ValueError, match="same length"):
        BucketMeta(["x"], [], [[1]])
    with pytest.raises(ValueError, match="empty"):
        flatten_bucket([])


def test_unflattened_wire_buckets_same_meta_and_no_copy_of_contiguous_tensors():
    """`load_format` null: the same buckets and metadata as flattened_bucket, the tensors themselves
    (contiguous ones not copied, the non-contiguous one made contiguous), cast like the flat path."""
    from megatron_rl.weight_sync.buckets import wire_buckets

    named = _named()
    flat_path = list(wire_buckets(iter(named), dtype=torch.float32, bucket_size_mib=1))
    plain = list(wire_buckets(iter(named), dtype=torch.float32, bucket_size_mib=1, flatten=False))
    assert [m for _, m, _ in plain] == [m for _, m, _ in flat_path]
    assert [last for *_, last in plain] == [last for *_, last in flat_path] == [False] * (len(plain) - 1) + [True]
    sent = [t for tensors, _, _ in plain for t in tensors]
    received = [t for flat, meta, _ in flat_path for _, t in unflatten_bucket(flat, meta)]
    assert len(sent) == len(named)
    for t, u in zip(sent, received, strict=True):
        assert t.is_contiguous() and _bitwise_equal(t, u)
    by_name = dict(named)
    assert sent[1].dtype == torch.float32 and sent[1].data_ptr() == by_name["b.bias"].data_ptr()  # no copy
    assert sent[5].data_ptr() == by_name["f.big"].data_ptr()
    assert sent[0].dtype == torch.float32  # bf16 cast to the server's dtype
    assert sent[2].dtype == torch.int64  # buffers keep theirs


def test_non_pairs_are_refused_by_the_first_stage_that_reads_them():
    from megatron_rl.weight_sync.buckets import wire_buckets

    for bad, words in ((("a", [1.0]), "(str, list)"), (("a", torch.zeros(1), 3), "(str, Tensor, int)"),
                       ("a.weight", "'a.weight'")):
        with pytest.raises(TypeError, match=r"expected \(str, torch.Tensor\) pairs, got .*" + re.escape(words)):
            list(wire_buckets(iter([("ok", torch.zeros(2)), bad]), dtype=torch.float32, bucket_size_mib=1))
