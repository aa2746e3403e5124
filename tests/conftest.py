"""Shared pytest fixtures."""

from __future__ import annotations

import os
import socket
import warnings

import pytest


@pytest.fixture(scope="module")
def megatron_world1():
    """megatron-core parallel state on a one-rank gloo world (CPU compat layer on without CUDA).

    Yields the ``ProcessGroups``; tears down the parallel state, the compat layer and the env
    vars after the module, so other tests in the process see plain torch.
    """
    from megatron_rl.parallel.cpu_compat import disable_cpu_compat
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    try:
        yield initialize_parallel(tensor_model_parallel_size=1, backend="gloo", timeout_s=60)
    finally:
        destroy_parallel()
        disable_cpu_compat()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
