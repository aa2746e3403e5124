"""Hub ids (`ORG/NAME[@REV]`) for model.path, convert --hf, eval --checkpoint and the rollout server,
resolved offline from a Hugging Face cache laid out exactly as huggingface_hub lays it out
(`<HF_HOME>/hub/models--ORG--NAME/{refs/main, snapshots/<commit>/...}`); no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.models.hub import (HubModelNotFound, cached_file, hub_cache_dir, looks_like_hub_id,
                                    resolve_model_path)

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "89abcdef0123456789abcdef0123456789abcdef"
CONFIG = '{"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2, ' \
         '"num_hidden_layers": 2, "intermediate_size": 64, "max_position_embeddings": 4096}\n'


def _make_cache(hub: Path, repo: str = "Org/Tiny-Model") -> Path:
    """A cache as huggingface_hub writes it: blobs/<sha>, snapshots/<commit>/<file> -> ../../blobs/<sha>
    symlinks, refs/main holding the commit, and a second commit reachable by refs/dev."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    for commit, ref, text in ((COMMIT, "main", CONFIG), (OTHER, "dev", CONFIG.replace("4096", "8192"))):
        blob = folder / "blobs" / f"{abs(hash(text)):x}"
        blob.write_text(text)
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").symlink_to(Path("../../blobs") / blob.name)
        (folder / "refs" / ref).write_text(commit)
    return folder


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "MEGATRON_RL_HUB_DOWNLOAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    _make_cache(tmp_path / "hf" / "hub")
    return tmp_path / "hf"


def test_hub_id_syntax():
    for ok in ("Qwen/Qwen2.5-32B", "Org/Tiny-Model@main", f"Org/Tiny_Model@{COMMIT}", "a/b@refs/pr/1"):
        assert looks_like_hub_id(ok), ok
    for bad in ("/abs/path", "./rel", "../up/model", "~/m", "a/b/c", "single", "a--b/c", "a/b..c", "", None,
                "https://hf.co/a/b", "org/name@"):
        assert not looks_like_hub_id(bad), bad


def test_resolves_from_hf_home_offline(hf_home):
    assert hub_cache_dir() == hf_home / "hub"
    snap = hf_home / "hub" / "models--Org--Tiny-Model" / "snapshots"
    assert resolve_model_path("Org/Tiny-Model") == str(snap / COMMIT)  # refs/main
    assert resolve_model_path("Org/Tiny-Model@dev") == str(snap / OTHER)  # a branch in refs/
    assert resolve_model_path(f"Org/Tiny-Model@{OTHER}") == str(snap / OTHER)  # a commit
    assert cached_file("Org/Tiny-Model@dev", "config.json") == snap / OTHER / "config.json"
    assert cached_file("Org/Nope", "config.json") is None


def test_hf_hub_cache_wins_over_hf_home(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other"))
    assert hub_cache_dir() == tmp_path / "other"
    with pytest.raises(HubModelNotFound, match="other"):
        resolve_model_path("Org/Tiny-Model")
    _make_cache(tmp_path / "other")
    assert resolve_model_path("Org/Tiny-Model").startswith(str(tmp_path / "other"))


def test_local_paths_pass_through(hf_home, tmp_path):
    local = tmp_path / "Org" / "Tiny-Model"  # a relative folder that looks like an id wins
    local.mkdir(parents=True)
    assert resolve_model_path("Org/Tiny-Model") == "Org/Tiny-Model"
    assert resolve_model_path("/no/such/folder") == "/no/such/folder"  # the caller reports it as before
    assert resolve_model_path(None) is None


def test_missing_model_error_names_id_cache_and_download(hf_home):
    with pytest.raises(HubModelNotFound) as e:
        resolve_model_path("Qwen/Qwen2.5-32B", what="model.path")
    msg = str(e.value)
    for part in ("model.path", "'Qwen/Qwen2.5-32B'", str(hf_home / "hub"), "models--Qwen--Qwen2.5-32B",
                 "hf download Qwen/Qwen2.5-32B", "huggingface-cli download Qwen/Qwen2.5-32B", "HF_HUB_OFFLINE"):
        assert part in msg, part
    with pytest.raises(HubModelNotFound, match="revision 'v2'.*--revision v2"):
        resolve_model_path("Org/Tiny-Model@v2")
    assert isinstance(e.value, FileNotFoundError)  # the CLIs' error paths catch it


def test_incomplete_snapshot_is_reported(hf_home):
    snap = hf_home / "hub" / "models--Org--Tiny-Model" / "snapshots" / COMMIT
    (snap / "config.json").unlink()
    (snap / "tokenizer.json").write_text("{}")
    with pytest.raises(HubModelNotFound, match="no config.json.*incomplete"):
        resolve_model_path("Org/Tiny-Model")
    assert resolve_model_path("Org/Tiny-Model", require="") == str(snap)  # a tokenizer folder needs no config


def test_config_keeps_hub_ids_and_checks_layout_from_the_cache(hf_home, tmp_path):
    from megatron_rl.config import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.models.hub import resolve_config_models

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: Org/Tiny-Model\n  tokenizer_path: Org/Tiny-Model@dev\n")
    cfg = load_config(recipe)
    assert cfg.model.path == "Org/Tiny-Model"  # not made relative to the recipe's folder
    with pytest.raises(ConfigError, match="must divide num_attention_heads 4 .*models--Org--Tiny-Model"):
        load_config(recipe, ["trainer.tensor_model_parallel_size=3"])  # config.json read from the cache
    resolve_config_models(cfg)
    assert cfg.model.path.endswith(COMMIT) and cfg.model.tokenizer_path.endswith(OTHER)
    recipe.write_text("model:\n  path: base_model\n")  # a plain relative folder still resolves as before
    assert load_config(recipe).model.path == str(tmp_path / "base_model")


def test_config_import_pulls_neither_torch_nor_hub_client():
    code = ("import sys, megatron_rl.config, megatron_rl.models.hub; "
            "print(sorted(m for m in ('torch', 'huggingface_hub', 'transformers') if m in sys.modules))")
    # (megatron_rl.config itself imports only config.hub_ids for this: tests/unit/test_config_keys.py)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_convert_and_eval_resolve_hub_ids(hf_home, tmp_path):
    from megatron_rl.checkpoint.convert import import_from_hf
    from megatron_rl.eval.benchmark import run_eval

    with pytest.raises(HubModelNotFound, match="--hf 'Org/Missing'.*hf download Org/Missing"):
        import_from_hf("Org/Missing", tmp_path / "out")
    # a cached id is opened: the snapshot's config.json (which lacks model_type here) is what is read
    with pytest.raises(ValueError, match="model_type"):
        import_from_hf("Org/Tiny-Model", tmp_path / "out2")
    with pytest.raises(HubModelNotFound, match="--checkpoint 'Org/Missing'"):
        run_eval(datasets=["aime24"], out_dir=tmp_path / "ev", checkpoint="Org/Missing")


def test_rollout_launcher_resolves_hub_ids(hf_home, tmp_path):
    from megatron_rl.rollout import launcher

    with pytest.raises(HubModelNotFound, match="rollout server --model-path 'Org/Missing'"):
        launcher.launch_rollout_server("Org/Missing")
    with pytest.raises(HubModelNotFound, match="rollout server --model-path"):
        launcher.launch_servers("embedded", "Org/Missing", 1)


def test_cli_convert_reports_a_missing_hub_id(hf_home, tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "to-megatron", "--hf", "Org/Missing",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path,
                       env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1
    assert "megatron-rl convert: error:" in r.stderr and "hf download Org/Missing" in r.stderr
    assert "Traceback" not in r.stderr
