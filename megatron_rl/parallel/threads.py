"""CPU thread pools sized from the cores this job may use (benchmarks/README.md "Load sharing").

Every process of a run (the local trainer ranks, the rollout servers the controller starts) used
to size its torch/OpenMP pools from the machine's core count, and OpenMP threads spin at each
barrier. Beside another CPU job that oversubscribes the cores: a descheduled thread holds up every
parallel region while the others burn their time slice spinning (generation on 2 shared cores went
12.8x slower). Here each process gets a share of the usable cores (affinity and cgroup quota),
and idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE).

The user's explicit settings win: `OMP_NUM_THREADS` in the environment of `megatron-rl train`,
`trainer.num_threads` for the trainer, `OMP_WAIT_POLICY` if set.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["ThreadShare", "apply_torch_threads", "cgroup_cpu_quota", "run_thread_share", "size_run_threads",
           "thread_env", "thread_share", "usable_cpus", "user_omp_threads"]

USER_OMP_ENV = "MEGATRON_RL_USER_OMP_NUM_THREADS"
"""The user's OMP_NUM_THREADS ("" = not set), kept by the launcher for the processes it starts."""


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the cgroup quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`),
    or None (no quota, or no cgroup file readable)."""
    try:
        with open(os.path.join(root, "cpu.max")) as fh:
            quota, period = (fh.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for sub in ("cpu", "cpu,cpuacct", ""):
        try:
            with open(os.path.join(root, sub, "cpu.cfs_quota_us")) as fh:
                quota_us = int(fh.read())
            with open(os.path.join(root, sub, "cpu.cfs_period_us")) as fh:
                period_us = int(fh.read())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def usable_cpus(affinity: int | None = None, quota: float | None = None) -> int:
    """Cores this process may use: its CPU affinity, capped by the cgroup quota (rounded up, at
    least 1). Arguments default to this process's values (`os.sched_getaffinity`, `cgroup_cpu_quota`)."""
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
        quota = cgroup_cpu_quota() if quota is None else quota
    cpus = max(1, affinity)
    if quota is not None and quota > 0:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return cpus


@dataclass(frozen=True)
class ThreadShare:
    """Threads of each process of a run: `rank` per local trainer rank, `server` per rollout server."""

    cpus: int
    rank: int
    server: int


def thread_share(cpus: int, ranks: int = 1, servers: int = 1, alternate: bool = False) -> ThreadShare:
    """Split `cpus` usable cores among `ranks` local trainer ranks and `servers` rollout servers.

    The servers get `cpus // (servers + 1)` each (what one server gets does not depend on the
    number of trainer ranks, so sampled tokens do not change with the trainer's layout); the ranks
    share the rest. Everyone gets at least one thread; with fewer cores than processes the share
    is 1 and the processes take turns.

    With `alternate` (the synchronous step, `trainer.max_staleness: 0`: the servers generate while
    the trainer waits for them, the trainer computes while the servers are idle) the ranks share
    all `cpus` instead of what the servers leave: the two sides never compute at the same time, and
    the waiting side's OpenMP threads sleep (`thread_env`'s OMP_WAIT_POLICY=PASSIVE). On 2 cores
    this made the tiny recipe's update + log-prob recompute 1.5x faster (benchmarks/README.md
    "Where megatron-rl's step goes"). The servers' share is the same either way.
    """
    cpus, ranks, servers = max(1, cpus), max(1, ranks), max(0, servers)
    server = max(1, cpus // (servers + 1)) if servers else 0
    rank = max(1, (cpus if alternate else cpus - server * servers) // ranks)
    return ThreadShare(cpus=cpus, rank=rank, server=server)


def run_thread_share(ranks: int, servers: int, alternate: bool = False) -> ThreadShare:
    """`thread_share` of this process's usable cores among `ranks` local ranks and `servers` servers."""
    return thread_share(usable_cpus(), ranks, servers, alternate)


def size_run_threads(ranks: int, servers: int, trainer_threads: int = 0, alternate: bool = False) -> ThreadShare:
    """At the start of `megatron-rl train`, before torch is imported: record the user's
    OMP_NUM_THREADS (`USER_OMP_ENV`) and set this process's environment (inherited by the local
    ranks and the reward workers) to the ranks' share, with passive OpenMP waiting. A process
    started by the local launcher (USER_OMP_ENV already set) keeps what it was given."""
    share = run_thread_share(ranks, servers, alternate)
    if USER_OMP_ENV in os.environ:
        return share
    os.environ[USER_OMP_ENV] = os.environ.get("OMP_NUM_THREADS", "")
    os.environ.update(thread_env(trainer_threads or share.rank, os.environ))
    return share


def thread_env(threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that size a child's pools to `threads` and make idle OpenMP
    threads sleep: OMP_NUM_THREADS, MKL_NUM_THREADS, OMP_WAIT_POLICY=PASSIVE. A variable already
    set in `env` (the user's) is kept."""
    env = env if env is not None else {}
    want = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in want.items() if not env.get(k)}


def user_omp_threads() -> int | None:
    """The user's OMP_NUM_THREADS for this run (set before the launcher's own), or None."""
    raw = os.environ.get(USER_OMP_ENV, os.environ.get("OMP_NUM_THREADS", ""))
    try:
        return int(raw) if raw.strip() else None
    except ValueError:
        return None


def apply_torch_threads(threads: int) -> None:
    """torch's intra-op pool = `threads`, the inter-op pool = `threads` (it can only be set once,
    before the first inter-op work: a later call is ignored)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or inter-op work already ran
        pass
