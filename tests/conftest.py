"""Shared pytest fixtures."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture(scope="module")
def megatron_world1():
    """megatron-core parallel state on a one-rank gloo world (CPU compat layer on without CUDA).

    Yields the ``ProcessGroups``; tears down the parallel state, the compat layer and the env
    vars after the module, so other tests in the process see plain torch.
    """
    from megatron_rl.parallel.cpu_compat import disable_cpu_compat
    from megatron_rl.parallel.groups import world_of_one

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    try:
        with world_of_one(tensor_model_parallel_size=1, backend="gloo", timeout_s=60) as pgs:
            yield pgs
    finally:
        disable_cpu_compat()
