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
