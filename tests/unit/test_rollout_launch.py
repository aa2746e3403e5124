"""Rollout server launch: SGLang's command line, and explicit distinct ports (case B31, our part)."""

from __future__ import annotations

import os
import socket

import pytest

from megatron_rl.rollout.launcher import allocate_server_ports, build_embedded_command, build_sglang_command


def test_sglang_command_line_uses_sglang_flags_and_explicit_ports():
    cmd = build_sglang_command(
        "/ckpt/qwen", python="/opt/sglang/bin/python", host="10.0.0.5", port=30000, nccl_port=30001, tp_size=4,
        mem_fraction_static=0.7, random_seed=7, enable_deterministic_inference=True, dtype="bfloat16",
        weight_version="3", api_key="k", admin_api_key="a", extra_args=["--enable-memory-saver"],
    )
    assert cmd == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/qwen", "--host", "10.0.0.5",
        "--port", "30000", "--nccl-port", "30001", "--tp-size", "4", "--mem-fraction-static", "0.7",
        "--skip-tokenizer-init", "--random-seed", "7", "--enable-deterministic-inference", "--dtype", "bfloat16",
        "--weight-version", "3", "--api-key", "k", "--admin-api-key", "a", "--enable-memory-saver",
    ]
    minimal = build_sglang_command("/m", python="python", host="h", port=1, nccl_port=2, skip_tokenizer_init=False)
    assert minimal == ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "h", "--port", "1",
                       "--nccl-port", "2", "--tp-size", "1"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_size=0), "tp_size must be >= 1"),
    (dict(mem_fraction_static=1.0), "mem_fraction_static must be in"),
    (dict(nccl_port=30000), "must differ"),
])
def test_sglang_command_line_refuses_bad_values(kwargs, message):
    args = dict(python="python", host="h", port=30000, nccl_port=30001) | kwargs
    with pytest.raises(ValueError, match=message):
        build_sglang_command("/m", **args)


def test_embedded_command_watches_this_process():
    import os

    cmd = build_embedded_command("/m", host="127.0.0.1", port=5, extra_args=["--dtype", "float32"])
    assert cmd[1:] == ["-m", "megatron_rl.engine", "--model-path", "/m", "--host", "127.0.0.1", "--port", "5",
                       "--parent-pid", str(os.getpid()), "--dtype", "float32"]


def test_b31_ports_of_servers_started_together_are_distinct_and_free():
    """B31 (the part owned by the rollout launcher): 8 engines on one node, each an HTTP and a NCCL
    port, all distinct and free (checked by binding), none derived from another by an offset."""
    sets = allocate_server_ports(8, per_server=2)
    flat = [p for s in sets for p in s]
    assert len(sets) == 8 and all(len(s) == 2 for s in sets)
    assert len(set(flat)) == 16
    for p in flat:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free now
    # a second allocation in the same process never hands out any of them again
    again = [p for s in allocate_server_ports(8, per_server=2) for p in s]
    assert not set(again) & set(flat)


def test_explicit_ports_are_used_in_order_and_checked():
    assert allocate_server_ports(2, ports=[30000, 30001, 30010, 30011]) == [(30000, 30001), (30010, 30011)]
    with pytest.raises(ValueError, match=r"\[30001\] given more than once"):
        allocate_server_ports(2, ports=[30000, 30001, 30001, 30002])
    with pytest.raises(ValueError, match="2 server\\(s\\) need 4 ports"):
        allocate_server_ports(2, ports=[30000, 30001, 30002])
    with pytest.raises(ValueError, match=r"\[70000\] are not TCP ports"):
        allocate_server_ports(1, ports=[30000, 70000])


def test_config_checks_server_ports():
    from megatron_rl.config.schema import RolloutConfig

    RolloutConfig(backend="sglang", num_servers=2, server_ports=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="rollout.server_ports: 3 ports given, rollout.backend=sglang"):
        RolloutConfig(backend="sglang", num_servers=2, server_ports=[1, 2, 3])
    with pytest.raises(ValueError, match=r"rollout.server_ports: \[5\] appear more than once"):
        RolloutConfig(backend="embedded", num_servers=2, server_ports=[5, 5])


def test_sglang_engines_return_log_probs_of_the_unscaled_policy(tmp_path):
    """SGLang takes output_token_logprobs after temperature scaling unless SGLANG_RETURN_ORIGINAL_LOGPROB
    is set; the trainer's log-probs are of the unscaled policy, so every SGLang engine the launcher
    starts has it (launcher.SGLANG_ENV). SGLang cannot run here: a stand-in `sglang.launch_server`
    records its environment and exits, and the launch fails as for any engine that dies at start-up."""
    import json
    import sys

    from megatron_rl.errors import RolloutServerError
    from megatron_rl.rollout.launcher import launch_servers

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    out = tmp_path / "env.json"
    (fake / "launch_server.py").write_text(
        "import json, os, sys\n"
        f"json.dump(dict(os.environ), open({str(out)!r}, 'w'))\n"
        "sys.exit(3)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), SGLANG_RETURN_ORIGINAL_LOGPROB="0")
    with pytest.raises(RolloutServerError):
        launch_servers("sglang", "examples/tiny/base_model", 1, log_dir=tmp_path, startup_timeout_s=30, env=env,
                       sglang_python=sys.executable)
    got = json.loads(out.read_text())
    assert got["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"   # the launcher's value wins over the caller's
    assert got["PYTHONPATH"] == str(tmp_path / "fake")    # the caller's environment is kept otherwise
