"""Where the project's test data is.

- The eval benchmarks (aime24/aime25/amc23/math500/gsm8k) ship inside the package
  (`megatron_rl/eval/data`, see its PROVENANCE.md): `BENCHMARK_DATA` and `data_file` find them
  there, so tests of them run from any clone or installed copy.
- Everything else (tokenizer, HF configs, DAPO samples, model samples) is the project's shared
  folder: `$MEGATRON_RL_SHARED_DIR`, else `shared/` next to the repository checkout, else
  `/work/shared` (this workplace's location, for clones made elsewhere, e.g. under /tmp). Tests
  that need it skip, saying so, when none exists."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARK_DATA = REPO / "megatron_rl" / "eval" / "data"
"""The benchmark files shipped in the package (the checkout's copy: the one under test)."""


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


def data_file(name: str) -> Path:
    """`name` from the package's benchmark files when shipped there, else from the shared data."""
    shipped = BENCHMARK_DATA / name
    return shipped if shipped.is_file() else SHARED_DATA / name
