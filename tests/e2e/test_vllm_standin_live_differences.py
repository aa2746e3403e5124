"""Differences between real vLLM (CPU, 0.32) and the `vllm-embedded` stand-in that the live tier found
(issue 30, docs/VLLM_API.md section 8), checked on the stand-in so that they stay fixed there:

* a refused or failed ``/update_weights`` ends the weight-update session, as vLLM's worker does
  (``gpu_worker.update_weights`` clears ``_weight_update_active``): the ``/finish_weight_update`` that
  follows is refused (vLLM: HTTP 500 "finish_weight_update called without a matching
  start_weight_update"; the stand-in: 400), and a new session can be opened at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_rl.engine.test_hooks import FAULT_REFUSE_UPDATES_ENV
from megatron_rl.errors import RolloutServerError, WeightSyncError
from megatron_rl.rollout.launcher import launch_servers
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.weight_sync.sender import WeightSyncSender

MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "base_model"


def test_a_refused_update_ends_the_session_as_vllm_does(tmp_path):
    env = dict(os.environ, **{FAULT_REFUSE_UPDATES_ENV: "1"})  # the first /update_weights is refused
    (server,) = launch_servers("vllm-embedded", str(MODEL), 1, log_dir=tmp_path, env=env)
    try:
        client = VLLMClient(server.base_url, timeout_s=60.0)
        weights = load_file(str(MODEL / "model.safetensors"))
        sender = WeightSyncSender([client], backend="gloo", timeout_s=60.0)
        sender.init_group()
        sender.begin_update()
        with pytest.raises(WeightSyncError):
            sender.send(weights.items())
        with pytest.raises(RolloutServerError) as refused:
            client.end_weight_update()
        assert refused.value.status_code == 400
        sender.reinit([client])
        sender.sync(weights.items(), "after-refusal")  # the next session opens and completes
        assert client.weight_version() == "after-refusal"
        sender.destroy()
    finally:
        server.stop()
