"""Issue 32 (seams) end to end: the weight sync's trust in what engines report, against real embedded servers.

- a sync whose cache flush is refused (``MEGATRON_RL_FAULT_REFUSE_FLUSH=1``) fails naming the
  engine, and the engine, asked through its own HTTP API, still reports the OLD weight version:
  the label is set only after the flush (DESIGN.md step 7), in both dialects;
- a vLLM-dialect stand-in counted as 2 data-parallel replicas (``--stand-in-data-parallel-size 2``)
  answers ``/get_world_size`` as vLLM does (TP x PP x DP, TP x PP without ``include_dp``) and joins
  the transfer group at two ranks (vLLM's ``rank_offset + dp_rank * TP * PP + rank``); a sync to it
  and to a second stand-in at DP 1 lands on both replicas; an init whose world size cannot hold its
  ranks is refused at once, naming the numbers, instead of hanging the rendezvous.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import torch

from megatron_rl.engine.test_hooks import FAULT_REFUSE_FLUSH_ENV
from megatron_rl.errors import WeightSyncError
from megatron_rl.ports import find_free_port
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.weight_sync.sender import WeightSyncSender
from tests.e2e.random_qwen2 import save_random_qwen2

PROMPT = [1, 2, 3]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_qwen2(tmp_path_factory.mktemp("tiny_qwen2_seams"), vocab_size=128, hidden_size=32,
                             intermediate_size=64)


def _stand_in(model_dir, log, *extra, env=None):
    args = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "60", "--api-dialect", "vllm",
            *extra]
    return launch_rollout_server(model_dir, log_path=log, extra_args=args, startup_timeout_s=120, env=env)


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_a_refused_flush_leaves_the_engine_reporting_the_old_version(model_dir, tmp_path, dialect):
    env = dict(os.environ, **{FAULT_REFUSE_FLUSH_ENV: "1"})
    args = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "60", "--api-dialect", dialect]
    with launch_rollout_server(model_dir, log_path=tmp_path / "server.log", extra_args=args, startup_timeout_s=120,
                               env=env) as proc:
        client = (RolloutClient(proc.base_url, timeout_s=60) if dialect == "sglang"
                  else VLLMClient(proc.base_url, max_retries=0, timeout_s=60))
        sender = WeightSyncSender([client], backend="gloo", timeout_s=60)
        try:
            sender.init_group()
            with pytest.raises(WeightSyncError) as e:
                sender.sync(_perturbed(model_dir, 2).items(), weight_version="1")
        finally:
            sender.close()
            client.close()
        # what the engine itself says, over its HTTP API
        if dialect == "sglang":
            reported = httpx.get(proc.base_url + "/model_info", timeout=10).json()["weight_version"]
        else:
            reported = httpx.get(proc.base_url + "/weight_info", timeout=10).json()["weight_version"]
        assert reported == "0", proc.log_tail()
        assert proc.base_url in str(e.value) and "refused the cache flush" in str(e.value), str(e.value)


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_a_stand_in_at_dp2_joins_at_two_ranks_and_both_replicas_receive(model_dir, tmp_path):
    with _stand_in(model_dir, tmp_path / "dp2.log", "--stand-in-data-parallel-size", "2") as dp2, \
            _stand_in(model_dir, tmp_path / "dp1.log") as dp1:
        assert httpx.get(dp2.base_url + "/get_world_size", timeout=10).json() == {"world_size": 2}
        assert httpx.get(dp2.base_url + "/get_world_size", params={"include_dp": "false"},
                         timeout=10).json() == {"world_size": 1}
        clients = [VLLMClient(dp2.base_url, max_retries=0, timeout_s=60),
                   VLLMClient(dp1.base_url, max_retries=0, timeout_s=60)]
        assert [c.transfer_world_size() for c in clients] == [2, 1]
        before = [c.generate(PROMPT, dict(GREEDY), f"before{i}").output_ids for i, c in enumerate(clients)]
        sender = WeightSyncSender(clients, backend="gloo", timeout_s=60)
        try:
            sender.init_group()  # world 4: trainer 0, dp2 replicas at 1 and 2, dp1 at 3
            sender.sync(_perturbed(model_dir, 1).items(), weight_version="1")
            assert [c.weight_version() for c in clients] == ["1", "1"]
            after = [c.generate(PROMPT, dict(GREEDY), f"after{i}").output_ids for i, c in enumerate(clients)]
        finally:
            sender.close()
            for c in clients:
                c.close()
        assert before[0] == before[1] and after[0] == after[1] and after[0] != before[0]
        assert "joined the transfer group at ranks [2]" in dp2.log_tail()


def test_an_init_that_cannot_hold_the_dp_ranks_is_refused_at_once(model_dir, tmp_path):
    with _stand_in(model_dir, tmp_path / "dp2.log", "--stand-in-data-parallel-size", "2") as dp2:
        info = {"master_address": "127.0.0.1", "master_port": find_free_port("127.0.0.1"), "rank_offset": 1,
                "world_size": 2, "packed": False}  # a trainer that counted 1 rank for a DP-2 engine
        t0 = time.monotonic()
        r = httpx.post(dp2.base_url + "/init_weight_transfer_engine", json={"init_info": info}, timeout=60)
        assert r.status_code == 400 and time.monotonic() - t0 < 10, r.text
        message = r.json()["error"]["message"]
        assert "2 transfer ranks" in message and "at least 3 ranks, got world_size 2" in message, message


def test_a_label_refused_part_way_rolls_back_the_labels_already_set(model_dir, tmp_path):
    """`label_engines` over [a live engine, an engine that is gone]: the live one is labelled "1",
    the second cannot be reached, and the live one gets "0" back (it reports the version of the
    last whole sync); the error names the unreachable engine and the roll-back."""
    from megatron_rl.weight_sync.receiver import label_engines

    args = ["--dtype", "float32", "--weight-version", "0", "--api-dialect", "sglang"]
    with launch_rollout_server(model_dir, log_path=tmp_path / "server.log", extra_args=args,
                               startup_timeout_s=120) as proc:
        live = RolloutClient(proc.base_url, timeout_s=30)
        gone = RolloutClient(f"http://127.0.0.1:{find_free_port()}", timeout_s=5, max_retries=0)
        try:
            with pytest.raises(WeightSyncError) as e:
                label_engines([live, gone], "1")
            assert httpx.get(proc.base_url + "/model_info", timeout=10).json()["weight_version"] == "0"
        finally:
            live.close()
            gone.close()
    msg = str(e.value)
    assert gone.base_url in msg and "'1'" in msg and "1 engine(s) labelled before it got their old label back" in msg
