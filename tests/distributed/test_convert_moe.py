"""Streaming checkpoint conversion of a Mixture-of-Experts model (issue 29): a random tiny qwen3_moe
HF folder (per-expert on-disk names) -> `import_from_hf` -> a dist checkpoint that loads at EP1 and
EP2 with every parameter equal to `load_hf_weights`; `export_to_hf` gives the HF tensors back bit
for bit; checkpoints written at EP2 (model only, and a trained run's) export like one written at EP1.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.convert import _meta_sharded_state_dict, export_to_hf, import_from_hf
from tests.distributed.tiny_qwen2 import TINY_EXPERTS, hf_state_dict, run_ranks, tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(600)

LAYERS, H, F = 2, 64, 32  # the tiny qwen3_moe: 2 layers, hidden 64, 4 experts of width 32


def _hf_folder(path, *, tie: bool, seed: int):
    """A random tiny qwen3_moe saved as HF does on disk: per-expert names, safetensors + config.json.
    Returns (config, the HF state dict)."""
    cfg = tiny_hf_config(tie_word_embeddings=tie, model_type="qwen3_moe")
    sd = hf_state_dict(tiny_hf_model(cfg, seed=seed), cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in sd and "model.layers.0.mlp.gate.weight" in sd
    path.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg, sd


def _hf_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_hf(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (what, name)
        assert torch.equal(got[name], tensor), (what, name)


def _build(cfg):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config

    return build_model(cfg, build_transformer_config(cfg))


def test_moe_sharded_keys_and_their_hf_names(megatron_world1):
    """The expert keys are stacked over (layer, global expert); each maps to the per-expert HF names."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_rl.models.hf_weights import hf_from_global, sharded_key_axes, sharded_key_to_hf

    cfg = tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe")
    sd = _meta_sharded_state_dict(cfg, torch.float32, 128)
    apply_factories(sd)
    shapes = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            shapes.setdefault(sh.key, set()).add((tuple(sh.global_shape), tuple(sh.global_offset)))
    fc1, fc2 = "decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    router = "decoder.layers.mlp.router.weight"
    # fc1: gate rows [0, F) and up rows [F, 2F) of each (layer, expert)
    assert shapes[fc1] == {((LAYERS, TINY_EXPERTS, 2 * F, H), (L, e, r, 0))
                           for L in range(LAYERS) for e in range(TINY_EXPERTS) for r in (0, F)}
    assert shapes[fc2] == {((LAYERS, TINY_EXPERTS, H, F), (L, e, 0, 0))
                           for L in range(LAYERS) for e in range(TINY_EXPERTS)}
    assert shapes[router] == {((LAYERS, TINY_EXPERTS, H), (L, 0, 0)) for L in range(LAYERS)}
    assert (sharded_key_axes(fc1), sharded_key_axes(fc2), sharded_key_axes(router)) == (2, 2, 1)
    assert sharded_key_to_hf(fc1, 1, 3) == (("model.layers.1.mlp.experts.3.gate_proj.weight",
                                             "model.layers.1.mlp.experts.3.up_proj.weight"), "fc1")
    assert sharded_key_to_hf(router, 0) == (("model.layers.0.mlp.gate.weight",), None)
    layer = torch.randn(TINY_EXPERTS, H, F)
    named = hf_from_global(fc2, layer, layer=1, num_query_groups=2, head_dim=16, vocab_size=200)
    assert [n for n, _ in named] == [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(TINY_EXPERTS)]
    assert all(torch.equal(t, layer[e]) for e, (_, t) in enumerate(named))
    with pytest.raises(ValueError, match=r"'decoder.layers.mlp.experts.experts.linear_fc2.weight' .* expert index"):
        sharded_key_to_hf(fc2, 0)
    with pytest.raises(ValueError, match=r"'decoder.layers.mlp.shared_experts.linear_fc1.weight' has no HF counterpart"):
        sharded_key_axes("decoder.layers.mlp.shared_experts.linear_fc1.weight")


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_moe_import_loads_at_ep1_and_exports_bit_exact(megatron_world1, tmp_path, tie):
    """HF -> streamed checkpoint (megatron-core's own metadata: the same as dist_checkpointing.save of
    the HF-loaded model) -> a fresh EP1 model equal to `load_hf_weights`; both checkpoints export the
    HF tensors back bit for bit, under the on-disk names and shapes."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.checkpoint.save import _in_process_results_queue, _model_sharded_state_dict
    from megatron_rl.models.hf_weights import load_hf_weights

    cfg, sd = _hf_folder(tmp_path / "hf", tie=tie, seed=3)
    import_from_hf(tmp_path / "hf", tmp_path / "streamed")
    # one .distcp file per unit (objects + embedding, each layer with its experts, head)
    assert len(list((tmp_path / "streamed").glob("*.distcp"))) == LAYERS + 2

    reference = _build(cfg)
    load_hf_weights(reference, tmp_path / "hf")
    _in_process_results_queue()
    (tmp_path / "ep1").mkdir()
    dist_checkpointing.save(_model_sharded_state_dict([reference]), str(tmp_path / "ep1"))
    ours = FileSystemReader(str(tmp_path / "streamed")).read_metadata().state_dict_metadata
    theirs = FileSystemReader(str(tmp_path / "ep1")).read_metadata().state_dict_metadata
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)

    fresh = _build(cfg)
    loaded = dist_checkpointing.load(_model_sharded_state_dict([fresh]), str(tmp_path / "streamed"))
    fresh.load_state_dict(loaded["model"], strict=True)
    want = dict(reference.named_parameters())
    assert any(".local_experts.3.linear_fc1" in n for n in want)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, want[name]), name

    _assert_same_hf(_hf_tensors(export_to_hf(tmp_path / "streamed", tmp_path / "back")), sd, "streamed")
    _assert_same_hf(_hf_tensors(export_to_hf(tmp_path / "ep1", tmp_path / "back_ep1", hf_config_dir=str(tmp_path / "hf"))),
                    sd, "written at EP1")
    # small shards: the experts of a layer are split over files, the index names each
    out = export_to_hf(tmp_path / "streamed", tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == sd.keys()
    _assert_same_hf(_hf_tensors(out), sd, "sharded")


def test_moe_checkpoints_load_and_export_across_expert_parallel_sizes(megatron_world1, tmp_path):
    """EP2 (2 gloo ranks): the streamed checkpoint loads into each rank's experts equal to
    `load_hf_weights`; the model checkpoint written at EP2 exports the HF tensors bit for bit (= the
    EP1 export); a run checkpoint written at EP2 after a PPO update exports the trained weights
    (gathered over EP in the ranks) bit for bit, and loads into one process at EP1."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.save import _model_sharded_state_dict, checkpoint_dir

    cfg, sd = _hf_folder(tmp_path / "hf", tie=False, seed=5)
    import_from_hf(tmp_path / "hf", tmp_path / "streamed")
    (tmp_path / "out").mkdir()
    (tmp_path / "ep2").mkdir()
    results = run_ranks("convert_moe", 2, timeout_s=400, extra_env={
        "HF_DIR": str(tmp_path / "hf"), "CKPT": str(tmp_path / "streamed"), "SAVE_DIR": str(tmp_path / "ep2"),
        "RUN_DIR": str(tmp_path / "run"), "OUT_DIR": str(tmp_path / "out")})
    assert sorted(r["ep_rank"] for r in results) == [0, 1]
    assert all(r["changed"] == r["params"] for r in results), results

    hf_dir = str(tmp_path / "hf")
    _assert_same_hf(_hf_tensors(export_to_hf(tmp_path / "ep2", tmp_path / "back_ep2", hf_config_dir=hf_dir)),
                    sd, "written at EP2")
    trained = torch.load(tmp_path / "out" / "trained.pt")
    assert trained.keys() == sd.keys() and not torch.equal(trained["model.layers.1.mlp.experts.3.down_proj.weight"],
                                                           sd["model.layers.1.mlp.experts.3.down_proj.weight"])
    exported = _hf_tensors(export_to_hf(tmp_path / "run", tmp_path / "trained_hf", hf_config_dir=hf_dir))
    _assert_same_hf(exported, trained, "run checkpoint written at EP2")
    # the EP2 run checkpoint's model loads into one process (EP1)
    model = _build(cfg)
    ckpt = checkpoint_dir(tmp_path / "run", 1) / "model_optim"
    loaded = dist_checkpointing.load(_model_sharded_state_dict([model]), str(ckpt), validate_access_integrity=False)
    model.load_state_dict(loaded["model"], strict=True)
    w = model.decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight
    assert torch.equal(w, trained["model.layers.1.mlp.experts.3.down_proj.weight"])


def test_an_unsupported_tensor_is_refused_by_key(megatron_world1, tmp_path, monkeypatch):
    """A model tensor the HF mapping does not know is refused by its key before anything is written
    (import) or exported (export)."""
    import megatron_rl.models.hf_sharded as hw

    _hf_folder(tmp_path / "hf", tie=False, seed=1)
    import_from_hf(tmp_path / "hf", tmp_path / "mcore")
    key = "mlp.experts.experts.linear_fc2.weight"
    monkeypatch.setattr(hw, "_SHARDED_EXPERT_KEYS", {k: v for k, v in hw._SHARDED_EXPERT_KEYS.items() if k != key})
    with pytest.raises(ValueError, match=r"megatron tensor 'decoder.layers.mlp.experts.experts.linear_fc2.weight' "
                                         r"has no HF counterpart"):
        import_from_hf(tmp_path / "hf", tmp_path / "bad")
    assert not (tmp_path / "bad" / "metadata.json").exists() and not list((tmp_path / "bad").glob("*.distcp"))
    with pytest.raises(ValueError, match=r"'decoder.layers.mlp.experts.experts.linear_fc2.weight' has no HF counterpart"):
        export_to_hf(tmp_path / "mcore", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors"))
