"""Issue 32 (trust at the seams), the parts that need no server: vLLM's `--logprobs-mode` pinned by the
launcher and refused in `rollout.vllm_extra_args`, and the `rollout.check_logprob_semantics` key."""

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
