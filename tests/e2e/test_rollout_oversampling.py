"""Over-sampling with abort (dynamic sampling): a real embedded server, the tiny task, real rewards.

Once enough finished groups are kept, every request of the generation batch still queued or
running is aborted through ``/abort_request`` (rid prefix); partial responses never come back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.data.dataset import load_rows
from megatron_rl.rewards.pool import RewardPool
from megatron_rl.rollout.launcher import launch_servers
from megatron_rl.rollout.manager import RolloutManager

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    log_dir = tmp_path_factory.mktemp("oversampling")
    # 4 sequences decoded at a time: most of the 64 requests are still queued when groups finish
    (server,) = launch_servers("embedded", TINY / "base_model", 1, log_dir=log_dir, startup_timeout_s=180,
                               embedded_args=["--max-batch-size", "4"])
    tok = AutoTokenizer.from_pretrained(TINY / "base_model")
    pool = RewardPool(1, 30.0)
    manager = RolloutManager([server.client(timeout_s=60, generate_timeout_s=300)], tok, pool,
                             reward_fn="dapo_math", max_prompt_length=32, max_response_length=64, seed=3,
                             eos_token_ids=[tok.eos_token_id])
    rows = load_rows(TINY / "data" / "train.parquet")[:16]
    yield server, manager, rows
    manager.close()
    pool.close()
    server.stop()


def test_abort_once_enough_groups_are_kept(setup):
    server, manager, rows = setup
    groups, stats = manager.generate_groups(rows, n=4, sampling_params={"temperature": 1.0}, step=1, gen_batch=0,
                                            stop_after=2, keep_fn=lambda g: True)
    assert 2 <= len(groups) < len(rows)
    assert stats["rollout/aborted"] > 0
    assert stats["rollout/unfinished_groups"] == len(rows) - len(groups)
    # only whole, finished groups come back, in prompt order; nothing aborted or partial
    idx = [int(g.group_uid.rsplit("-p", 1)[1]) for g in groups]
    assert idx == sorted(idx) and all(g.group_uid == f"s1-b0-p{i}" for g, i in zip(groups, idx))
    for g, i in zip(groups, idx):
        assert len(g.samples) == 4 and g.prompt_key == rows[i].prompt_key
        assert all(s.stop_reason != "abort" and s.response_ids for s in g.samples)
    # the abort reached every request of the batch: the server is idle, and serves the next batch whole
    info = server.client().server_info()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    again, stats2 = manager.generate_groups(rows[:2], n=2, sampling_params={"temperature": 1.0}, step=1,
                                            gen_batch=1)
    assert len(again) == 2 and all(s.stop_reason != "abort" for g in again for s in g.samples)
    assert "rollout/aborted" not in stats2


def test_keep_fn_decides_when_to_stop(setup):
    """Groups that are not kept do not count toward stop_after: with a keep_fn that accepts
    nothing, every group finishes and nothing is aborted."""
    _, manager, rows = setup
    groups, stats = manager.generate_groups(rows[:4], n=2, sampling_params={"temperature": 1.0}, step=2, gen_batch=0,
                                            stop_after=1, keep_fn=lambda g: False)
    assert len(groups) == 4 and stats["rollout/aborted"] == 0 and stats["rollout/unfinished_groups"] == 0
