"""Multi-turn tool episodes against a real vLLM CPU engine (issues 30 and 31).

vLLM serves the tiny tool-calling model (examples/tiny/tool_base_model); the rollout manager runs
episodes through `VLLMClient` with the real sandboxed python tool. What only a real vLLM can show:
its stop-string handling keeps the stop string's tokens in `token_ids` (the code format's turn ends
on the closing fence, and the next turn's request must hold it: token in, token out), and a turn's
tokens come back with one log-prob each. Same environment and skip rules as test_vllm_cpu_live.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.live.vllm_live import VLLM_PYTHON, WHY

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "tiny" / "tool_base_model"
pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.skipif(VLLM_PYTHON is None, reason=WHY),
              pytest.mark.skipif(not hasattr(os, "unshare"), reason="Linux only")]


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_rl.config.multi_turn import MultiTurnConfig
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.rollout.multiturn import ToolEnvironment
    from megatron_rl.rollout.vllm_client import VLLMClient

    tok = AutoTokenizer.from_pretrained(MODEL)
    (server,) = launch_servers("vllm", str(MODEL), 1, log_dir=tmp_path_factory.mktemp("vllm-mt"),
                               startup_timeout_s=900.0, vllm_python=VLLM_PYTHON, weight_transfer_backend="gloo",
                               vllm_device="cpu", random_seed=0, vllm_args=("--enforce-eager",))
    client = VLLMClient(server.base_url, timeout_s=120.0)
    env = ToolEnvironment(MultiTurnConfig(enable=True, tool_config_path=str(REPO / "examples/tools/tiny_python_tool.yaml"),
                                          max_assistant_turns=3), tok)
    try:
        with RewardPool(1, 10.0) as pool:
            m = RolloutManager([client], tok, pool, reward_fn="dapo_math", max_prompt_length=64,
                               max_response_length=96, seed=3, eos_token_ids=[tok.eos_token_id], environment=env)
            yield m, tok
            m.close()
    finally:
        client.close()
        server.stop(timeout_s=30.0)


def test_tool_episodes_through_vllm(manager):
    """Sampled episodes on level-5 problems: every model turn that called the tool ends with the
    closing fence's tokens (vLLM kept the stop string), the next turn's request held them, each
    tool answer is the program's real output, and the mask is 1 exactly on the model's turns."""
    from megatron_rl.data.prompts import render_prompt_ids
    from megatron_rl.rollout.manager import derive_seed
    from megatron_rl.rollout.multiturn import CODE_STOP

    m, tok = manager
    used = 0
    for i, q in enumerate(["What is 8*6+7*9-4?", "What is 9*7+8*6-5?", "What is 6*9+7*8-3?"]):
        ids = render_prompt_ids(tok, [{"role": "user", "content": q}])
        for j in range(6):
            res = m._generate_one(0, ids, {"temperature": 1.0, "max_new_tokens": 96,
                                           "sampling_seed": derive_seed(3, i, j)}, f"vmt-p{i}-r{j}")
            assert res.finish_type != "abort", res.abort_message
            seg = res.episode["segments"]
            assert len(res.response_mask) == len(res.output_ids) == len(res.output_logprobs)
            for k, (kind, a, b) in enumerate(seg):
                assert all(mk == (kind == "model") for mk in res.response_mask[a:b])
                if kind == "env":
                    assert tok.decode(res.output_ids[seg[k - 1][1]:seg[k - 1][2]]).endswith(CODE_STOP)
                    assert tok.decode(res.output_ids[a:b]) == f"```output\n{eval(q[8:-1])}\n\n```\n"
                    used += 1
    assert used > 0, "no episode called the tool"
