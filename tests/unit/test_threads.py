"""Thread pools sized from the usable cores (megatron_rl/parallel/threads.py)."""

import os

import pytest

from megatron_rl.parallel import threads
from megatron_rl.parallel.threads import ThreadShare, cgroup_cpu_quota, thread_env, thread_share, usable_cpus


@pytest.mark.parametrize("cpus, ranks, servers, want", [
    (2, 1, 1, ThreadShare(2, 1, 1)),      # the tiny recipe on 2 cores
    (2, 2, 1, ThreadShare(2, 1, 1)),      # TP=2: fewer cores than processes -> 1 each
    (8, 1, 1, ThreadShare(8, 4, 4)),
    (8, 2, 1, ThreadShare(8, 2, 4)),      # the server's share does not depend on the ranks
    (8, 4, 1, ThreadShare(8, 1, 4)),
    (16, 2, 3, ThreadShare(16, 2, 4)),
    (8, 2, 0, ThreadShare(8, 4, 0)),      # servers at rollout.server_urls: the ranks take all
    (1, 1, 1, ThreadShare(1, 1, 1)),
    (0, 0, 1, ThreadShare(1, 1, 1)),
])
def test_thread_share(cpus, ranks, servers, want):
    assert thread_share(cpus, ranks, servers) == want


@pytest.mark.parametrize("cpus, ranks, servers, want", [
    (2, 1, 2, ThreadShare(2, 2, 1)),      # the tiny grpo recipe: the trainer takes both cores in its phases
    (2, 1, 1, ThreadShare(2, 2, 1)),
    (8, 2, 1, ThreadShare(8, 4, 4)),      # the ranks share every core; the server's share is unchanged
    (1, 1, 1, ThreadShare(1, 1, 1)),
])
def test_thread_share_synchronous_step_alternates(cpus, ranks, servers, want):
    assert thread_share(cpus, ranks, servers, alternate=True) == want
    assert thread_share(cpus, ranks, servers, alternate=True).server == thread_share(cpus, ranks, servers).server


def test_server_share_independent_of_ranks():
    for cpus in range(1, 65):
        assert len({thread_share(cpus, r, 1).server for r in range(1, 9)}) == 1


@pytest.mark.parametrize("affinity, quota, want", [
    (8, None, 8), (8, 2.0, 2), (8, 2.5, 3), (2, 16.0, 2), (4, 0.5, 1), (0, None, 1)])
def test_usable_cpus(affinity, quota, want):
    assert usable_cpus(affinity, quota) == want


def test_usable_cpus_of_this_process():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    assert cgroup_cpu_quota(str(tmp_path / "absent")) is None


def test_thread_env_keeps_the_users_settings():
    assert thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(3, {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}) == {"MKL_NUM_THREADS": "3"}


def test_size_run_threads_and_server_env(monkeypatch):
    from megatron_rl.rollout.engine_set import rollout_server_env

    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", threads.USER_OMP_ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda *a, **k: 8)
    share = threads.size_run_threads(ranks=2, servers=1)
    assert share == ThreadShare(8, 2, 4)
    assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ[threads.USER_OMP_ENV] == "" and threads.user_omp_threads() is None
    env = rollout_server_env(1)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4" and threads.USER_OMP_ENV not in env
    # the user's OMP_NUM_THREADS wins for the ranks and the server
    monkeypatch.delenv(threads.USER_OMP_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    threads.size_run_threads(ranks=2, servers=1)
    assert os.environ["OMP_NUM_THREADS"] == "3" and threads.user_omp_threads() == 3
    assert rollout_server_env(1)["OMP_NUM_THREADS"] == "3"
