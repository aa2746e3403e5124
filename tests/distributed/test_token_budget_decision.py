"""`trainer.max_generated_tokens` on several ranks: only the controller (rank 0) counts generated
tokens, so `loop._budget_reached` broadcasts its total and every rank takes the same decision."""

import os
import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out) -> None:
    from megatron_rl.trainer.loop import _budget_reached

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        decisions = []
        # the controller's running totals after steps 1-3; the other ranks saw no tokens
        for total in (1000, 2500, 3700):
            run = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(max_generated_tokens=3600)),
                                  pgs=SimpleNamespace(world_size=world), total_tokens=total if rank == 0 else 0)
            decisions.append((_budget_reached(run), run.total_tokens))
        out.put((rank, decisions))
    finally:
        dist.destroy_process_group()


def test_every_rank_decides_with_the_controllers_total():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=150) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    expected = [(False, 1000), (False, 2500), (True, 3700)]
    assert results == {0: expected, 1: expected}
