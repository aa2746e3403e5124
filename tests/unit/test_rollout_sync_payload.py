"""Case B26: the sync payload contract (dtype cast in one helper; bucket-size invariance).

The engine below is a FAKE of SGLang's model loader (SGLang cannot run on this CPU machine): it
holds bf16 parameters under SGLang's fused names (``qkv_proj``, ``gate_up_proj``), loads each
received bucket through a ``stacked_params_mapping`` like SGLang's ``load_weights``, and runs its
post-load step once per update session, after the last bucket (SGLang PR #17114's contract).
What is under test is the project's side: ``wire_buckets`` (cast -> bucket -> flatten) and
``unflatten_bucket``, the only path from trainer tensors to payloads.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.weight_sync.buckets import (
    MIB,
    dtype_from_name,
    server_weight_dtype,
    unflatten_bucket,
    wire_buckets,
)

H, I, V = 8, 16, 8  # hidden, intermediate, vocab of the toy layer (bf16: 128-256 bytes a matrix)

# (fused SGLang name, HF shard name, shard id) as in SGLang's Qwen2/Llama stacked_params_mapping
STACKED = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def _master_state() -> list[tuple[str, torch.Tensor]]:
    """fp32 master params {embed, q, norm, k, v, o, gate, up, down}; q and k are 2 apart so that
    buckets of 1 and of 3 tensors put them in different buckets."""
    g = torch.Generator().manual_seed(26)
    shapes = [
        ("model.embed_tokens.weight", (V, H)),
        ("model.layers.0.self_attn.q_proj.weight", (H, H)),
        ("model.norm.weight", (H,)),
        ("model.layers.0.self_attn.k_proj.weight", (H, H)),
        ("model.layers.0.self_attn.v_proj.weight", (H, H)),
        ("model.layers.0.self_attn.o_proj.weight", (H, H)),
        ("model.layers.0.mlp.gate_proj.weight", (I, H)),
        ("model.layers.0.mlp.up_proj.weight", (I, H)),
        ("model.layers.0.mlp.down_proj.weight", (H, I)),
    ]
    return [(n, torch.randn(s, generator=g, dtype=torch.float32) / 3) for n, s in shapes]


class FakeSGLangEngine:
    """bf16 params under fused names; shard-wise loading; post-load once per session."""

    def __init__(self) -> None:
        z = lambda *s: torch.zeros(s, dtype=torch.bfloat16)  # noqa: E731
        self.params = {
            "model.embed_tokens.weight": z(V, H),
            "model.layers.0.self_attn.qkv_proj.weight": z(3 * H, H),
            "model.layers.0.self_attn.o_proj.weight": z(H, H),
            "model.layers.0.mlp.gate_up_proj.weight": z(2 * I, H),
            "model.layers.0.mlp.down_proj.weight": z(H, I),
            "model.norm.weight": z(H),
        }
        self.loaded_shards: dict[str, set] = {}
        self.post_load_calls = 0
        self.session = False

    def begin(self) -> None:
        assert not self.session
        self.session, self.loaded_shards = True, {}

    def load_weights(self, named: list[tuple[str, torch.Tensor]], declared_dtypes: list[str]) -> None:
        assert self.session, "load outside a session"
        for (name, t), declared in zip(named, declared_dtypes, strict=True):
            # SGLang allocates the receive buffer from the declared dtype: it must be the real one
            # and the engine's (the OpenRLHF #1348 failure was fp32 declared against bf16 params).
            assert dtype_from_name(declared) == t.dtype == torch.bfloat16, (name, declared, t.dtype)
            for fused, shard, shard_id in STACKED:
                if f".{shard}." in name:
                    target = name.replace(shard, fused)
                    p = self.params[target]
                    if fused == "qkv_proj":
                        rows = {"q": slice(0, H), "k": slice(H, 2 * H), "v": slice(2 * H, 3 * H)}[shard_id]
                    else:
                        rows = slice(shard_id * I, (shard_id + 1) * I)
                    p[rows].copy_(t)
                    self.loaded_shards.setdefault(target, set()).add(shard_id)
                    break
            else:
                self.params[name].copy_(t)
                self.loaded_shards.setdefault(name, set()).add(None)

    def end(self) -> None:
        # the post-load step (e.g. re-packing into a kernel layout) needs every part of a fused param
        for name, parts in (("model.layers.0.self_attn.qkv_proj.weight", {"q", "k", "v"}),
                            ("model.layers.0.mlp.gate_up_proj.weight", {0, 1})):
            assert self.loaded_shards.get(name) == parts, f"{name} finalised with parts {self.loaded_shards.get(name)}"
        self.post_load_calls += 1
        self.session = False


def _expected_fused(master: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    m = {n.split("model.")[-1]: t.to(torch.bfloat16) for n, t in master}
    L = "layers.0."
    return {
        "model.embed_tokens.weight": m["embed_tokens.weight"],
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
            [m[L + "self_attn.q_proj.weight"], m[L + "self_attn.k_proj.weight"], m[L + "self_attn.v_proj.weight"]]
        ),
        "model.layers.0.self_attn.o_proj.weight": m[L + "self_attn.o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([m[L + "mlp.gate_proj.weight"], m[L + "mlp.up_proj.weight"]]),
        "model.layers.0.mlp.down_proj.weight": m[L + "mlp.down_proj.weight"],
        "model.norm.weight": m["norm.weight"],
    }


def _sync(engine: FakeSGLangEngine, master, bucket_size_mib: float) -> list[list[str]]:
    dtype = server_weight_dtype({"model_path": "x", "dtype": "bfloat16"})
    engine.begin()
    layout = []
    buckets = list(wire_buckets(iter(master), dtype=dtype, bucket_size_mib=bucket_size_mib))
    assert [last for _, _, last in buckets] == [False] * (len(buckets) - 1) + [True]
    for flat, meta, _ in buckets:
        assert flat.dtype == torch.uint8 and flat.numel() == meta.nbytes
        assert set(meta.dtypes) == {"bfloat16"}
        engine.load_weights(unflatten_bucket(flat.clone(), meta), meta.dtypes)
        layout.append(meta.names)
    engine.end()
    return layout


def test_b26_payload_is_engine_dtype_and_bucket_size_invariant():
    """B26: fp32 master params reach a bf16 engine as bf16 payloads whose declared dtype is the real
    one; the engine state equals param.to(bf16) through the fusion, bitwise, for buckets of 1 tensor,
    3 tensors and all tensors; q and k travel in different buckets; post-load runs once per update,
    after the last bucket, with every part of each fused param received."""
    master = _master_state()
    one_tensor = H * H * 2 / MIB  # every tensor here is >= H*H bf16 elements: 1 tensor per bucket
    three = 300 / MIB  # [embed, q, norm] (272 B), [k, v], [o], ...: about 3 tensors a bucket, q and k apart
    expected = _expected_fused(master)
    layouts = {}
    for label, size in (("1", one_tensor), ("3", three), ("all", 512.0)):
        engine = FakeSGLangEngine()
        layouts[label] = _sync(engine, master, size)
        assert engine.post_load_calls == 1
        for name, want in expected.items():
            assert engine.params[name].dtype == torch.bfloat16
            assert torch.equal(engine.params[name].view(torch.int16), want.view(torch.int16)), (label, name)
        # the master params were not cast in place
        assert all(t.dtype == torch.float32 for _, t in master)
    assert [len(b) for b in layouts["1"]] == [1] * 9
    assert len(layouts["all"]) == 1 and len(layouts["3"]) > 2
    for label in ("1", "3"):
        where = {n: i for i, names in enumerate(layouts[label]) for n in names}
        assert where["model.layers.0.self_attn.q_proj.weight"] != where["model.layers.0.self_attn.k_proj.weight"]


def test_b26_cast_leaves_integer_buffers_and_rejects_unknown_dtype():
    named = [("w", torch.ones(4, dtype=torch.float32)), ("step", torch.tensor([7], dtype=torch.int64))]
    (flat, meta, last), = wire_buckets(named, dtype=torch.bfloat16, bucket_size_mib=1)
    assert meta.dtypes == ["bfloat16", "int64"] and last
    got = dict(unflatten_bucket(flat, meta))
    assert got["step"].tolist() == [7] and got["w"].dtype == torch.bfloat16
    assert server_weight_dtype({"dtype": None}) is None and server_weight_dtype({}) is None
    with pytest.raises(ValueError, match="http://s:1 /model_info reports dtype 'bf17'"):
        server_weight_dtype({"dtype": "bf17"}, url="http://s:1")
