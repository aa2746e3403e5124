"""Hugging Face hub ids (`Qwen/Qwen2.5-32B`, `Qwen/Qwen2.5-32B@<revision>`) as model paths.

One resolver for every place that opens a model: `model.path` / `model.tokenizer_path` /
`model.hf_config_path` (the trainer, at start), `convert to-megatron --hf`, `convert to-hf
--hf-config-dir`, `eval --checkpoint` and the rollout server's `--model-path`.

A value that names an existing local path is returned unchanged. Otherwise, when it reads as a hub
id (`ORG/NAME`, optionally `@REVISION`: a branch, tag or commit), it is looked up **offline first**
in the local Hugging Face cache, laid out as `huggingface_hub` lays it out
(`<cache>/models--ORG--NAME/snapshots/<commit>/...`, `refs/<branch>` holding the commit). The cache
is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (read at call time, so a
test or a job script may set them after import). Nothing is downloaded unless
`MEGATRON_RL_HUB_DOWNLOAD=1` is set and `HF_HUB_OFFLINE` is not: a training job's ranks and
compute nodes often have no network, and a 32B download should be a deliberate step
(`hf download ORG/NAME`). When the model is not in the cache, :class:`HubModelNotFound` names the
id, the revision, the cache searched and the command that downloads it.

Importing this module is cheap and torch-free; `huggingface_hub` is imported only when an id has to
be resolved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from megatron_rl.config.hub_ids import cached_file, hub_cache_dir, looks_like_hub_id, split_revision

__all__ = [
    "HubModelNotFound", "cached_file", "hub_cache_dir", "looks_like_hub_id", "resolve_model_path", "split_revision",
]


class HubModelNotFound(FileNotFoundError):
    """A hub id that is neither a local folder nor in the local Hugging Face cache."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _download_allowed() -> bool:
    return os.environ.get("MEGATRON_RL_HUB_DOWNLOAD", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _not_found(what: str, repo: str, rev: Optional[str], cache: Path, detail: str) -> HubModelNotFound:
    rev_txt = f" at revision {rev!r}" if rev else ""
    rev_flag = f" --revision {rev}" if rev else ""
    folder = cache / ("models--" + repo.replace("/", "--"))
    return HubModelNotFound(
        f"{what} {repo!r}{rev_txt}: not a local folder, and not in the Hugging Face cache {cache} "
        f"(looked for {folder}: {detail}). Download it first with `hf download {repo}{rev_flag}` "
        f"(older clients: `huggingface-cli download {repo}{rev_flag}`), with HF_HOME/HF_HUB_CACHE set as "
        "for this run, or give a local model folder; set MEGATRON_RL_HUB_DOWNLOAD=1 (without HF_HUB_OFFLINE) "
        "to let this command download it"
    )


def resolve_model_path(value: Optional[str], *, what: str = "model", require: str = "config.json") -> Optional[str]:
    """The local folder for `value`: itself when it exists (or is not a hub id: the caller reports a
    missing path as before), else the cached snapshot of the hub id.

    Args:
        value: a local path, a hub id (`ORG/NAME[@REV]`), or None (returned as is).
        what: how the caller names the setting, for the error (e.g. "model.path", "--hf").
        require: a file the snapshot must hold (an incomplete snapshot, e.g. one that only a
            config lookup cached, is reported instead of failing later); "" for none.

    Raises:
        HubModelNotFound: a hub id not in the cache (and no download allowed / possible).
    """
    if value is None or os.path.exists(value) or not looks_like_hub_id(value):
        return value
    repo, rev = split_revision(value)
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo, revision=rev, cache_dir=str(cache), local_files_only=True)
    except LocalEntryNotFoundError as e:
        if not _download_allowed() or _offline():
            why = "HF_HUB_OFFLINE is set" if _offline() else "downloads are off"
            raise _not_found(what, repo, rev, cache, f"no snapshot for this revision; {why}") from e
        path = snapshot_download(repo, revision=rev, cache_dir=str(cache))
    if require and not (Path(path) / require).is_file():
        have = sorted(p.name for p in Path(path).iterdir())[:8]
        raise _not_found(what, repo, rev, cache, f"the snapshot {path} has no {require} (holds {have}): "
                         "an incomplete download")
    return str(path)


def resolve_config_models(cfg) -> None:
    """Replace hub ids in `cfg.model.path` / `cfg.model.tokenizer_path` by their cached snapshot
    folders, in place (the trainer calls this once at start, before anything opens the model; the
    rollout servers it launches then get the local folder). Local paths are left unchanged."""
    m = cfg.model
    m.path = resolve_model_path(m.path, what="model.path")
    m.tokenizer_path = resolve_model_path(m.tokenizer_path, what="model.tokenizer_path", require="")
