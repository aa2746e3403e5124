"""Where the project's shared data is: `$MEGATRON_RL_SHARED_DIR`, else `shared/` next to the
repository checkout, else `/work/shared` (this workplace's location, for clones made elsewhere,
e.g. under /tmp). Tests that need it skip, saying so, when none exists."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _find_shared() -> Path:
    env = os.environ.get("MEGATRON_RL_SHARED_DIR")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared", Path("/work/shared")]
    for c in candidates:
        if (c / "data").is_dir():
            return c
    return candidates[0]


SHARED = _find_shared()
SHARED_DATA = SHARED / "data"
