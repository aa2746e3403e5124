"""Checkpoint conversion (one gloo rank): HF -> megatron -> HF is bit-identical; a trained run's
checkpoint exported to HF gives the same log-probs in transformers as the megatron policy."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.convert import export_to_hf, import_from_hf
from megatron_rl.checkpoint.save import save_checkpoint
from tests.distributed.test_checkpoint import _batch, _step, _trainer
from tests.distributed.tiny_qwen2 import tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(300)


def _hf_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_megatron_hf_round_trip_is_bit_identical(megatron_world1, tmp_path, tie):
    cfg = tiny_hf_config(tie_word_embeddings=tie)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=3).save_pretrained(hf_dir)
    original = _hf_tensors(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore")
    assert (tmp_path / "mcore" / "metadata.json").is_file()
    back = export_to_hf(tmp_path / "mcore", tmp_path / "back")
    exported = _hf_tensors(back)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())


def test_small_shards_get_an_index(megatron_world1, tmp_path):
    cfg = tiny_hf_config(tie_word_embeddings=False)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=1).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore")
    out = export_to_hf(tmp_path / "mcore", tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    # weights get the same permissions as the folder's other files (safetensors itself writes 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert _hf_tensors(out).keys() == _hf_tensors(hf_dir).keys()
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)  # transformers reads the sharded folder
    for name, t in _hf_tensors(hf_dir).items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_trained_checkpoint_exports_to_matching_hf_model(megatron_world1, tmp_path):
    from transformers import AutoModelForCausalLM

    # the run's model folder (config.json the export copies), and a policy trained one step from it
    cfg = tiny_hf_config(tie_word_embeddings=False)
    hf_dir = tmp_path / "base"
    tiny_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    trainer = _trainer()
    _step(trainer, seed=1)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 1, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                    run_state={}, config_yaml=f"model:\n  path: {hf_dir}\n", keep_last_n=2)
    out = export_to_hf(run_dir, tmp_path / "exported")

    batch = _batch(seed=5)
    mine = trainer.compute_logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, position_ids=batch.position_ids).logits.float()
    theirs = torch.log_softmax(logits, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask
    assert (mine[mask] - theirs[mask]).abs().max() < 1e-4
    # the trained weights were exported, not the base ones
    base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        base_logits = base(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert not torch.allclose(base_logits, logits)


def test_mismatching_config_names_the_tensor(megatron_world1, tmp_path):
    cfg = tiny_hf_config(tie_word_embeddings=True)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore")
    other = tmp_path / "other"
    other.mkdir()
    bigger = dict(cfg, intermediate_size=cfg["intermediate_size"] * 2)
    (other / "config.json").write_text(json.dumps(bigger))
    with pytest.raises(ValueError, match=r"tensor 'decoder.layers.mlp.linear_fc\d.weight' has shape"):
        export_to_hf(tmp_path / "mcore", tmp_path / "x", hf_config_dir=str(other))
    with pytest.raises(FileNotFoundError, match="no megatron checkpoint found"):
        export_to_hf(tmp_path / "nothing", tmp_path / "y")


def test_cli_round_trip_of_the_tiny_base_model(tmp_path):
    """`megatron-rl convert` both ways on the shipped base model (a real HF folder with tokenizer)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    base = root / "examples/tiny/base_model"

    def convert(*args):
        out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", *args], capture_output=True,
                             text=True, timeout=240, cwd=root)
        assert out.returncode == 0, out.stderr[-3000:]

    convert("to-megatron", "--hf", str(base), "--out", str(tmp_path / "mcore"))
    convert("to-hf", "--checkpoint", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf"))
    original, back = _hf_tensors(base), _hf_tensors(tmp_path / "hf")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (base / name).read_bytes(), name
    again = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "to-megatron", "--hf", str(base),
                            "--out", str(tmp_path / "mcore")], capture_output=True, text=True, timeout=240, cwd=root)
    assert again.returncode == 1 and "already holds a dist checkpoint" in again.stderr


def _megatron_own_save(hf_config, hf_dir, out):
    """The reference: the whole model built in memory, HF weights loaded, saved by megatron-core."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.save import _in_process_results_queue, _model_sharded_state_dict
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights

    model = build_model(hf_config, build_transformer_config(hf_config))
    load_hf_weights(model, hf_dir)
    out.mkdir()
    _in_process_results_queue()
    dist_checkpointing.save(_model_sharded_state_dict([model]), str(out))
    return model


@pytest.mark.parametrize("arch, tie, kv_heads", [("qwen2", False, 2), ("qwen3", True, 1), ("llama", False, 4)])
def test_streaming_import_equals_megatrons_own_save(megatron_world1, tmp_path, arch, tie, kv_heads):
    """The streamed checkpoint has megatron-core's own metadata (keys, global shapes, dtypes, chunks,
    objects) and the same tensors as a model built in memory and saved by dist_checkpointing; it
    loads into a fresh model through the trainer's loader path (`_model_sharded_state_dict`)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.checkpoint.save import _model_sharded_state_dict
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config

    cfg = tiny_hf_config(tie_word_embeddings=tie, model_type=arch, num_key_value_heads=kv_heads)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=4).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "streamed")
    reference = _megatron_own_save(cfg, hf_dir, tmp_path / "reference")
    ours = FileSystemReader(str(tmp_path / "streamed")).read_metadata().state_dict_metadata
    theirs = FileSystemReader(str(tmp_path / "reference")).read_metadata().state_dict_metadata
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)
    # one .distcp file per unit (objects + embedding, each layer, head): nothing waits for the whole model
    assert len(list((tmp_path / "streamed").glob("*.distcp"))) == cfg["num_hidden_layers"] + 2

    fresh = build_model(cfg, build_transformer_config(cfg))
    loaded = dist_checkpointing.load(_model_sharded_state_dict([fresh]), str(tmp_path / "streamed"))
    fresh.load_state_dict(loaded["model"], strict=True)
    want = reference.state_dict()
    for name, tensor in fresh.state_dict().items():
        if "_extra_state" not in name:
            assert torch.equal(tensor, want[name]), name


def test_vocab_padding_for_the_target_tp_and_trim_on_export(megatron_world1, tmp_path):
    """B29: padded vocab = ceil(V / (d x TP)) x d x TP with zero rows; export trims to exactly V."""
    from megatron.core import dist_checkpointing

    cfg = tiny_hf_config(tie_word_embeddings=False)  # V = 200
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=5).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore", tensor_model_parallel_size=2, make_vocab_size_divisible_by=96)
    meta = dist_checkpointing.load_tensors_metadata(str(tmp_path / "mcore"))
    assert tuple(meta["embedding.word_embeddings.weight"].global_shape) == (384, 64)  # ceil(200/192) * 192
    assert tuple(meta["output_layer.weight"].global_shape) == (384, 64)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    req = {"e": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.empty(384, 64))}
    emb = dist_checkpointing.load(req, str(tmp_path / "mcore"), validate_access_integrity=False)["e"]
    assert torch.equal(emb[:200], _hf_tensors(hf_dir)["model.embed_tokens.weight"])
    assert not emb[200:].any()
    back = export_to_hf(tmp_path / "mcore", tmp_path / "back")
    exported, original = _hf_tensors(back), _hf_tensors(hf_dir)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_import_refuses_weights_that_do_not_match_the_config(megatron_world1, tmp_path):
    """Checked from the safetensors headers before anything is written; the message names the tensor
    and both shapes. An unsupported architecture is refused by name in both directions."""
    cfg = tiny_hf_config(tie_word_embeddings=False)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "good")
    lying = dict(cfg, intermediate_size=96)
    (hf_dir / "config.json").write_text(json.dumps(lying))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                         r"config.json expects \[96, 64\]"):
        import_from_hf(hf_dir, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    (hf_dir / "config.json").write_text(json.dumps(dict(cfg, model_type="mixtral", architectures=["MixtralForCausalLM"])))
    with pytest.raises(ValueError, match=r"unsupported HF config key 'model_type'='mixtral'"):
        import_from_hf(hf_dir, tmp_path / "bad")
    with pytest.raises(ValueError, match=r"unsupported HF config key 'model_type'='mixtral'"):
        export_to_hf(tmp_path / "good", tmp_path / "bad_out", hf_config_dir=str(hf_dir))


def test_failed_export_keeps_the_weights_already_in_out(megatron_world1, tmp_path):
    """A failing export (here: a config that does not match) leaves an existing HF folder's
    weights untouched and no staging files; a successful one replaces them (breaker finding)."""
    cfg = tiny_hf_config(tie_word_embeddings=True)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore")
    out = tmp_path / "existing"
    tiny_hf_model(cfg, seed=5).save_pretrained(out)
    before = _hf_tensors(out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=cfg["intermediate_size"] * 2)))
    with pytest.raises(ValueError, match="has shape"):
        export_to_hf(tmp_path / "mcore", out, hf_config_dir=str(other))
    after = _hf_tensors(out)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    export_to_hf(tmp_path / "mcore", out)
    assert torch.equal(_hf_tensors(out)["model.embed_tokens.weight"], _hf_tensors(hf_dir)["model.embed_tokens.weight"])


def test_untied_checkpoint_with_a_tied_config_is_refused(megatron_world1, tmp_path):
    """Exporting an untied model under tie_word_embeddings=true would silently drop the trained
    lm_head (breaker finding): refused with the reason."""
    cfg = tiny_hf_config(tie_word_embeddings=False)
    hf_dir = tmp_path / "hf"
    tiny_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    import_from_hf(hf_dir, tmp_path / "mcore")
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        export_to_hf(tmp_path / "mcore", tmp_path / "x", hf_config_dir=str(tied))
    assert not list((tmp_path / "x").glob("*.safetensors"))
