"""Hub-id syntax and a read-only look into the local Hugging Face cache, with the standard library only.

The config (which imports neither torch nor huggingface_hub) uses this to keep `model.path:
ORG/NAME[@REV]` as written instead of making it a path relative to the recipe, and to read the
cached `config.json` for its static layout checks. The resolution itself (huggingface_hub,
errors that say how to download) is `megatron_rl.models.hub.resolve_model_path`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

__all__ = ["cached_file", "hub_cache_dir", "looks_like_hub_id", "split_revision"]

# ORG/NAME as the hub validates repo ids (letters, digits, '-', '_', '.'; no '--' or '..'), with an
# optional @REVISION. Anything with a leading '.', '/', '~' or more than one '/' before '@' is a path.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w./-]+))?$")


def looks_like_hub_id(value: object) -> bool:
    """True for `ORG/NAME` or `ORG/NAME@REVISION` (syntax only: no file system or network access)."""
    if not isinstance(value, str) or not _HUB_ID.match(value):
        return False
    repo = value.split("@", 1)[0]
    return "--" not in repo and ".." not in repo and not repo.endswith((".", "-"))


def split_revision(hub_id: str) -> tuple[str, Optional[str]]:
    """`ORG/NAME@REV` -> (`ORG/NAME`, `REV`); no `@` -> (`ORG/NAME`, None)."""
    repo, _, rev = hub_id.partition("@")
    return repo, rev or None


def hub_cache_dir() -> Path:
    """The hub cache `huggingface_hub` would use now: `$HF_HUB_CACHE` (or the older
    `$HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expanduser(os.environ[var]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def cached_file(value: Optional[str], filename: str) -> Optional[Path]:
    """`filename` of hub id `value` in the local cache, read with the standard library only (for the
    static config checks, which import neither torch nor huggingface_hub); None when `value` is a
    local path, not a hub id, or not cached. A revision that is not a 40-hex commit is looked up in
    `refs/`, as the hub client does."""
    if not value or os.path.exists(value) or not looks_like_hub_id(value):
        return None
    repo, rev = split_revision(value)
    folder = hub_cache_dir() / ("models--" + repo.replace("/", "--"))
    rev = rev or "main"
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        ref = folder / "refs" / rev
        if not ref.is_file():
            return None
        rev = ref.read_text().strip()
    path = folder / "snapshots" / rev / filename
    return path if path.is_file() else None
