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


def test_sglang_command_line_for_a_moe_engine_with_routed_experts():
    """Mixture-of-Experts engines (issue 29): `--ep-size` (SGLang 0.5.23's flag, srt/arg_groups/fields/parallel.py:
    the EP size inside the engine's TP world) and `--enable-return-routed-experts` (srt/arg_groups/fields/exec_.py)
    right after the base flags / before the extra args; both left out by default (the dense line is unchanged)."""
    cmd = build_sglang_command("/ckpt/qwen3-30b-a3b", python="python", host="h", port=1, nccl_port=2, tp_size=4,
                               ep_size=4, enable_return_routed_experts=True, extra_args=["--ep-size", "1"])
    assert cmd == ["python", "-m", "sglang.launch_server", "--model-path", "/ckpt/qwen3-30b-a3b", "--host", "h",
                   "--port", "1", "--nccl-port", "2", "--tp-size", "4", "--ep-size", "4", "--skip-tokenizer-init",
                   "--enable-return-routed-experts", "--ep-size", "1"]  # the extra args come last: they win
    dense = build_sglang_command("/m", python="python", host="h", port=1, nccl_port=2, tp_size=4)
    assert "--ep-size" not in dense and "--enable-return-routed-experts" not in dense
    with pytest.raises(ValueError, match="ep_size must be >= 1 and divide tp_size 4"):
        build_sglang_command("/m", python="python", host="h", port=1, nccl_port=2, tp_size=4, ep_size=3)


def test_vllm_command_line_for_a_moe_engine_with_routed_experts():
    """vLLM 0.33's `--enable-expert-parallel` (EngineArgs / ParallelConfig.enable_expert_parallel: EP over all
    the engine's TP ranks) and `--enable-return-routed-experts` (EngineArgs -> AuxOutputConfig)."""
    import json

    from megatron_rl.rollout.launcher import build_vllm_command, vllm_expert_parallel

    cmd = build_vllm_command("/m", python="py", host="h", port=5, tp_size=4, enable_expert_parallel=True,
                             enable_return_routed_experts=True, extra_args=["--enforce-eager"])
    assert cmd == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--host", "h", "--port", "5",
                   "--tensor-parallel-size", "4", "--weight-transfer-config", json.dumps({"backend": "nccl"}),
                   "--logprobs-mode", "raw_logprobs",
                   "--enable-expert-parallel", "--enable-return-routed-experts", "--enforce-eager"]
    dense = build_vllm_command("/m", python="py", host="h", port=5, tp_size=4)
    assert "--enable-expert-parallel" not in dense and "--enable-return-routed-experts" not in dense
    assert (vllm_expert_parallel(1, 4), vllm_expert_parallel(4, 4)) == (False, True)
    with pytest.raises(ValueError, match="ep_size 2 with a vLLM engine of tp_size 4.*1 or the TP size"):
        vllm_expert_parallel(2, 4)


def test_engine_ep_size_follows_the_models_experts(tmp_path):
    """An engine's EP size is its TP size for a Mixture-of-Experts model (config.json names routed experts:
    num_experts, n_routed_experts or num_local_experts) and 1 for a dense one, an engine of one GPU, or a
    folder without config.json; experts that do not divide over the engine's GPUs are refused."""
    import json

    from megatron_rl.rollout.launcher import engine_ep_size, moe_num_experts

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    moe.mkdir(), dense.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 128,
                                                 "num_experts_per_tok": 8}))
    (dense / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert (engine_ep_size(moe, 4), engine_ep_size(moe, 8), engine_ep_size(moe, 1)) == (4, 8, 1)
    assert (engine_ep_size(dense, 4), engine_ep_size(tmp_path, 4), engine_ep_size(None, 4)) == (1, 1, 1)
    assert engine_ep_size("examples/tiny/base_model", 2) == 1
    assert moe_num_experts({"n_routed_experts": 256}) == 256 and moe_num_experts({"num_local_experts": 8}) == 8
    assert moe_num_experts({"num_experts": None}) == 0 and moe_num_experts(None) == 0
    with pytest.raises(ValueError, match="128 experts do not divide over the rollout engine's 3 GPUs"):
        engine_ep_size(moe, 3)
    with pytest.raises(ValueError, match="'num_experts'='8': expected a non-negative integer"):
        moe_num_experts({"num_experts": "8"})
    (dense / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_ep_size(dense, 2)


def test_launch_servers_passes_the_moe_flags_to_each_engine(tmp_path):
    """`launch_servers` with the policy's MoE settings: SGLang gets `--ep-size <tp>` from the model's experts
    (ep_size left out) and `--enable-return-routed-experts` with return_routed_experts (actor.router_replay);
    an explicit ep_size=1 keeps the experts tensor-parallel. SGLang cannot run here: a stand-in
    `sglang.launch_server` records its argv and exits, and the launch fails as for any engine that dies."""
    import json
    import sys

    from megatron_rl.errors import RolloutServerError
    from megatron_rl.rollout.launcher import launch_servers

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(
        "import json, os, sys\n"
        "json.dump(sys.argv[1:], open(os.environ['FAKE_OUT'], 'w'))\n"
        "sys.exit(3)\n")
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8,
                                                   "num_experts_per_tok": 2}))
    for kwargs, want_ep in ((dict(return_routed_experts=True), "4"), (dict(ep_size=1), None)):
        out = tmp_path / "argv.json"
        env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), FAKE_OUT=str(out))
        with pytest.raises(RolloutServerError):
            launch_servers("sglang", model, 1, log_dir=tmp_path, startup_timeout_s=30, env=env,
                           sglang_python=sys.executable, tp_size=4, **kwargs)
        argv = json.loads(out.read_text())
        flags = dict(zip(argv, argv[1:]))
        assert flags["--tp-size"] == "4" and flags.get("--ep-size") == want_ep
        assert ("--enable-return-routed-experts" in argv) is bool(kwargs.get("return_routed_experts"))


def test_embedded_engines_get_the_routed_experts_flag():
    """The embedded server takes the engines' `--enable-return-routed-experts` (its vLLM dialect then answers
    every completion's routing, as vLLM does); no EP flag (one process)."""
    from megatron_rl.rollout.launcher import LaunchSpec, _embedded_command, _vllm_embedded_command

    spec = LaunchSpec(model_path="/m", return_routed_experts=True, ep_size=1)
    assert "--enable-return-routed-experts" in _embedded_command(spec, [5])
    assert _vllm_embedded_command(spec, [5])[-3:] == ["--enable-return-routed-experts", "--api-dialect", "vllm"]
    assert "--enable-return-routed-experts" not in _embedded_command(LaunchSpec(model_path="/m"), [5])
