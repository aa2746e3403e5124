"""The torch versions the parts that touch torch internals support, checked when they start.

`parallel/cpu_compat.py` (a TorchFunctionMode over torch's tensor factories, patched `torch.cuda`
functions) and `weight_sync/group.py` (the private `distributed_c10d._new_process_group_helper`)
depend on torch internals. Their supported range is setup.py's `torch>=2.6.0,<3`:

- below 2.6.0: refused (megatron-core 0.19's floor; `_new_process_group_helper`'s
  `backend_options` parameter is named `pg_options` before 2.6);
- 3.x: refused (a new major may drop the private API);
- above the newest minor tested (`TORCH_TESTED`): allowed, with one warning naming the range.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

TORCH_MIN = (2, 6)
TORCH_BELOW = (3, 0)
TORCH_TESTED = ((2, 6), (2, 14))
"""Oldest and newest torch minor the unit tier passed on (tests/install and the CI venv)."""
SUPPORTED_TORCH = ">=2.6.0,<3 (tested 2.6 and 2.14)"

_warned: set[str] = set()


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise RuntimeError(f"cannot read the torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(component: str, version: str | None = None) -> None:
    """Raise (outside the supported range) or warn once (newer than tested) for `component`.

    Args:
        component: who asks, named in the message (e.g. "megatron_rl.parallel.cpu_compat").
        version: the torch version (default: the installed `torch.__version__`).

    Raises:
        RuntimeError: a torch below 2.6 or of major 3+, naming the supported range.
    """
    if version is None:
        import torch

        version = torch.__version__
    v = _minor(version)
    if v < TORCH_MIN or v >= TORCH_BELOW:
        raise RuntimeError(
            f"{component} supports torch {SUPPORTED_TORCH}; this is torch {version}. It uses torch internals "
            "(see megatron_rl/versions.py): install a supported torch, e.g. `pip install -c constraints.txt -e .`"
        )
    if v > TORCH_TESTED[1] and component not in _warned:
        _warned.add(component)
        logger.warning("%s: torch %s is newer than the newest tested torch %d.%d (supported: %s); it touches torch "
                       "internals, so report anything odd", component, version, *TORCH_TESTED[1], SUPPORTED_TORCH)
