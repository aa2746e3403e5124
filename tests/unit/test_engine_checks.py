"""Issue 32 (trust at the seams), the parts that need no server: vLLM's `--logprobs-mode` pinned by the
launcher and refused in `rollout.vllm_extra_args`, the `rollout.check_logprob_semantics` key, the probe
prompt, and the rollout manager's context check. The checks against running engines (both dialects of
the embedded server): tests/e2e/test_engine_checks_live.py."""

import pytest

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError

BASE = ["model.path=/models/x"]


def test_vllm_command_pins_raw_logprobs_and_refuses_another_mode():
    from megatron_rl.rollout.launcher import build_vllm_command

    cmd = build_vllm_command("/m", python="py", host="h", port=5)
    i = cmd.index("--logprobs-mode")
    assert cmd[i + 1] == "raw_logprobs" and cmd.count("--logprobs-mode") == 1
    same = build_vllm_command("/m", python="py", host="h", port=5, extra_args=["--logprobs-mode=raw_logprobs"])
    assert same[-1] == "--logprobs-mode=raw_logprobs"  # the same value again is harmless
    for extra in (["--logprobs-mode", "processed_logprobs"], ["--logprobs_mode=raw_logits"],
                  ["--logprobs-mode", "raw_logprobs", "--logprobs-mode", "processed_logits"]):
        with pytest.raises(ValueError, match=r"rollout.vllm_extra_args.*--logprobs-mode (processed_logprobs|"
                                             r"raw_logits|processed_logits) conflicts with the pinned "
                                             r"--logprobs-mode raw_logprobs"):
            build_vllm_command("/m", python="py", host="h", port=5, extra_args=extra)


def test_config_refuses_another_logprobs_mode_and_has_the_check_key():
    cfg = load_config(None, BASE)
    assert cfg.rollout.check_logprob_semantics is True
    assert load_config(None, BASE + ["rollout.check_logprob_semantics=false"]).rollout.check_logprob_semantics is False
    ok = load_config(None, BASE + ["rollout.vllm_extra_args=[--enforce-eager, --logprobs-mode, raw_logprobs]"])
    assert ok.rollout.vllm_extra_args == ["--enforce-eager", "--logprobs-mode", "raw_logprobs"]
    with pytest.raises(ConfigError, match=r"rollout.vllm_extra_args: --logprobs-mode processed_logprobs is not "
                                          r"allowed.*--logprobs-mode raw_logprobs"):
        load_config(None, BASE + ["rollout.vllm_extra_args=[--logprobs-mode, processed_logprobs]"])


def test_probe_prompt_spreads_ids_over_the_vocabulary():
    from megatron_rl.rollout.engine_checks import probe_prompt

    # 3 + (121 - 3) * k // 9 for k = 1..8, by hand: 118k/9 = 13.1, 26.2, 39.3, 52.4, 65.6, 78.7, 91.8, 104.9
    assert probe_prompt(121) == [16, 29, 42, 55, 68, 81, 94, 107]
    assert max(probe_prompt(151_665)) < 151_665 and len(set(probe_prompt(151_665))) == 8
    with pytest.raises(ValueError, match="vocab_size must be >= 4"):
        probe_prompt(3)


def test_manager_refuses_a_prompt_that_does_not_fit_the_engine_context():
    """The limit comes from the engines (`engine_checks.engine_context_limit`); the message names the
    row, the prompt length, the response budget, the limit and the engine, and nothing is sent."""
    from megatron_rl.data.dataset import PromptRow
    from megatron_rl.rollout.manager import RolloutManager

    class NoEngine:
        base_url = "http://engine:1"

        def generate(self, *a, **k):
            raise AssertionError("nothing may be sent")

    m = RolloutManager([NoEngine()], tokenizer=None, reward_pool=None, reward_fn="dapo_math", max_prompt_length=64,
                       max_response_length=16, context_limit=(48, "http://engine:1"), max_concurrency=2)
    rows = [PromptRow(prompt_key=f"train:{i}", messages=[], ground_truth="", data_source="x",
                      origin=f"data/train.jsonl: line {i + 1}") for i in range(2)]
    m._prompt_cache.update({"train:0": list(range(32)), "train:1": list(range(33))})  # 32 + 16 = 48 fits
    with pytest.raises(ValueError, match=r"prompt train:1 \(data/train.jsonl: line 2\) has 33 tokens; with the "
                                         r"response budget of 16 tokens .* that is 49 > 48, the context limit of the "
                                         r"rollout engine at http://engine:1"):
        m.generate(rows, n=1, sampling_params={}, tag="s1", seed_parts=(0,))
    with pytest.raises(ValueError, match=r"has 32 tokens; with the response budget of 20 tokens .* 52 > 48"):
        m.generate(rows[:1], n=1, sampling_params={}, tag="e0", seed_parts=(0,), max_new_tokens=20)
    m.close()


class _Answers:
    """An engine whose answers no client validated (a third-party `RolloutEngine`): generates 8
    tokens with log-probs, re-scores them as `rescored`."""

    base_url = "http://odd-engine"

    def __init__(self, rescored):
        self.rescored = rescored

    def generate(self, prompt, params, rid, logprobs, timeout_s=None):
        from megatron_rl.rollout.client import GenerateResult

        return GenerateResult(rid=rid, output_ids=list(range(8)), output_logprobs=[-1.0] * 8, finish_type="length",
                              matched_stop=None, stop_reason=None, prompt_tokens=len(prompt), completion_tokens=8,
                              weight_version="0")

    def score_tokens(self, prompt, tokens, timeout_s=None):
        return self.rescored


@pytest.mark.parametrize("rescored, reason", [
    ([-1.0], "1 re-scored log-probs for 8 tokens"), ([], "0 re-scored log-probs for 8 tokens"),
    ([None] * 8, "float\\(\\) argument must be"),
])
def test_an_unusable_rescoring_is_refused_naming_the_engine(rescored, reason):
    from megatron_rl.errors import RolloutServerError
    from megatron_rl.rollout.engine_checks import check_logprob_semantics

    with pytest.raises(RolloutServerError, match=f"rollout engine http://odd-engine: .*{reason}"):
        check_logprob_semantics(_Answers(rescored), vocab_size=128, backend="sglang")
    assert check_logprob_semantics(_Answers([-1.0] * 8), vocab_size=128, backend="sglang").tokens == 8
