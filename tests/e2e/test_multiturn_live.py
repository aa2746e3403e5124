"""Multi-turn rollouts against a real embedded server (issue 31): stop strings, and episodes through
the rollout manager with the real sandboxed python tool.

The server is a separate process serving the tiny tool base model (examples/tiny/tool_base_model:
its folder has the tokenizer, so stop strings work; it calls the python tool on part of the hard
problems). The episode tests check token in / token out against the server itself: every model turn
is re-generated alone from the exact ids the episode sent, and must give the same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from megatron_rl.config.multi_turn import MultiTurnConfig
from megatron_rl.data.prompts import render_prompt_ids
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.multiturn import CODE_STOP, Episode, ToolEnvironment

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny" / "tool_base_model"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BASE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with launch_rollout_server(BASE, log_path=log, extra_args=["--dtype", "float32", "--weight-version", "0",
                                                               "--enable-deterministic-inference"],
                               startup_timeout_s=120) as proc:
        yield proc


def _generate(server, ids, sp):
    r = httpx.post(server.base_url + "/generate", json={"input_ids": ids, "sampling_params": sp,
                                                        "return_logprob": True}, timeout=60)
    return r


def test_stop_strings_keep_the_tokens(server, tok):
    """`stop` ends the request at the first token whose text completes the string; the ids are the
    greedy ids without a stop up to that token (token in, token out), finish_reason names the string."""
    ids = render_prompt_ids(tok, [{"role": "user", "content": "What is 3+4+5?"}])  # level 2: never the tool
    full = _generate(server, ids, {"max_new_tokens": 40, "temperature": 0}).json()
    text = tok.decode(full["output_ids"])
    assert "=" in text, text
    cut = _generate(server, ids, {"max_new_tokens": 40, "temperature": 0, "stop": ["=", "Answer"]}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": "="}
    k = len(cut["output_ids"])
    assert cut["output_ids"] == full["output_ids"][:k] and tok.decode(cut["output_ids"]).endswith("=")
    assert "=" not in tok.decode(cut["output_ids"][:-1])
    bad = _generate(server, ids, {"max_new_tokens": 4, "stop": ["", "="]})
    assert bad.status_code == 400 and "stop string must be non-empty" in bad.text


@pytest.fixture(scope="module")
def manager(server, tok):
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.manager import RolloutManager

    if not hasattr(os, "unshare"):
        pytest.skip("Linux only")
    cfg = MultiTurnConfig(enable=True, tool_config_path=str(ROOT / "examples" / "tools" / "python_tool.yaml"),
                          max_assistant_turns=3)
    env = ToolEnvironment(cfg, tok)
    client = RolloutClient(server.base_url, timeout_s=30, generate_timeout_s=60)
    with RewardPool(1, 10.0) as pool:
        m = RolloutManager([client], tok, pool, reward_fn="dapo_math", max_prompt_length=64, max_response_length=120,
                           seed=5, eos_token_ids=[tok.eos_token_id], environment=env)
        yield m
        m.close()
    client.close()


def test_episode_turns_are_what_the_engine_saw(manager, server, tok):
    """Sampled episodes on level-5 problems (the model calls the tool on about a third of them): for
    every episode, the trained sequence is the concatenation of the engine's turns and the tool's
    answers, the mask is 1 exactly on the model's turns, and re-generating each model turn alone from
    its request (same ids, same seed) gives the same tokens. At least one episode used the tool, and
    its answer is the program's real output."""
    from megatron_rl.rollout.manager import derive_seed

    prompts = ["What is 8*6+7*9-4?", "What is 9*7+8*6-5?", "What is 6*9+7*8-3?", "What is 7*7+9*8-6?"]
    used = 0
    for i, q in enumerate(prompts):
        ids = render_prompt_ids(tok, [{"role": "user", "content": q}])
        for j in range(4):
            seed = derive_seed(5, i, j)
            rid = f"mt-p{i}-r{j}"
            res = manager._generate_one(0, ids, {"temperature": 1.0, "max_new_tokens": 96, "sampling_seed": seed}, rid)
            seg = res.episode["segments"]
            assert len(res.response_mask) == len(res.output_ids) == len(res.output_logprobs)
            for t, (kind, a, b) in enumerate(seg):
                assert all(m == (kind == "model") for m in res.response_mask[a:b])
                if kind == "model":  # token in, token out: the same turn from the same ids and seed
                    sp = {"temperature": 1.0, "max_new_tokens": 96 - a, "stop": [CODE_STOP], "no_stop_trim": True,
                          "sampling_seed": seed if a == 0 else derive_seed(seed, "turn", t // 2)}
                    again = _generate(server, ids + res.output_ids[:a], sp).json()
                    assert again["output_ids"] == res.output_ids[a:b], (q, j, t)
                else:
                    answer = tok.decode(res.output_ids[a:b])
                    assert answer == f"```output\n{eval(q[8:-1])}\n\n```\n", answer
                    used += 1
            assert res.episode["turns"] == sum(1 for k, _, _ in seg if k == "model")
    assert used > 0, "no episode called the tool"
