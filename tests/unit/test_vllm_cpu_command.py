"""vLLM on CPU (issue 30), without vLLM: the command line and environment of a CPU engine with the
gloo transfer engine, the config and launch checks that allow ``weight_sync.backend: gloo`` with
``rollout.backend: vllm``, the trainer's transport choice, and the gloo plugin's worker side
(plugins/vllm_gloo) against the trainer's real gloo group, with vLLM's base class stubbed.
The same against a real vLLM CPU server: tests/live/test_vllm_cpu_live.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout.vllm_command import (
    VLLM_CPU_FLAGS,
    build_vllm_command,
    resolve_vllm_device,
    vllm_command,
    vllm_engine_env,
)

REPO = Path(__file__).resolve().parents[2]


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_gpu_command_is_unchanged_nccl_and_no_cpu_flags():
    cmd = build_vllm_command("/m", python="py", host="h", port=5, gpu_memory_utilization=0.8, seed=1)
    assert json.loads(_flag(cmd, "--weight-transfer-config")) == {"backend": "nccl"}
    assert _flag(cmd, "--gpu-memory-utilization") == "0.8"
    assert "--no-enable-chunked-prefill" not in cmd and "--dtype" not in cmd


def test_cpu_command_has_gloo_and_the_cpu_flags_before_extra_args():
    cmd = build_vllm_command("/m", python="py", host="h", port=5, gpu_memory_utilization=0.8, seed=1,
                             weight_transfer_backend="gloo", cpu=True, extra_args=["--dtype", "bfloat16"])
    assert json.loads(_flag(cmd, "--weight-transfer-config")) == {"backend": "gloo"}
    assert "--gpu-memory-utilization" not in cmd  # meaningless on CPU
    i = cmd.index("--no-enable-chunked-prefill")
    assert cmd[i - 2:i + 1] == list(VLLM_CPU_FLAGS)
    assert cmd[-2:] == ["--dtype", "bfloat16"]  # the user's flag comes last: vLLM's parser keeps the last value
    with pytest.raises(ValueError, match="weight-transfer backend 'ipc' unknown.*nccl, gloo"):
        build_vllm_command("/m", python="py", host="h", port=5, weight_transfer_backend="ipc")


def test_launch_spec_picks_device_and_backend(monkeypatch):
    from megatron_rl.rollout.launcher import LaunchSpec

    cuda = vllm_command(LaunchSpec(model_path="/m", vllm_python="py"), (7,))
    assert json.loads(_flag(cuda, "--weight-transfer-config")) == {"backend": "nccl"} and "--dtype" not in cuda
    cpu = vllm_command(LaunchSpec(model_path="/m", vllm_python="py", weight_transfer_backend="gloo",
                                  vllm_device="cpu"), (7,))
    assert json.loads(_flag(cpu, "--weight-transfer-config")) == {"backend": "gloo"}
    assert _flag(cpu, "--dtype") == "float32" and "--no-enable-chunked-prefill" in cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_vllm_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_vllm_device("auto") == "cuda" and resolve_vllm_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="vLLM device 'tpu' unknown"):
        resolve_vllm_device("tpu")


def test_cpu_engine_env_defaults_without_overriding():
    assert vllm_engine_env({"A": "1"}, "cuda") == {"A": "1"}
    assert vllm_engine_env({"A": "1"}, "cpu") == {"A": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                                  "MEGATRON_RL_VLLM_SHM_BUSY_LOOP_S": "0.005"}
    assert vllm_engine_env({"VLLM_CPU_KVCACHE_SPACE": "8"}, "cpu") == {"VLLM_CPU_KVCACHE_SPACE": "8",
                                                                       "MEGATRON_RL_VLLM_SHM_BUSY_LOOP_S": "0.005"}


def test_trainer_uses_a_torch_gloo_group_for_vllm_with_gloo_and_vllms_own_for_nccl():
    from megatron_rl.config.schema import Config
    from megatron_rl.trainer.setup import _sender_factory

    cfg = Config()
    cfg.rollout.backend = "vllm"
    assert _sender_factory(cfg, None)(["http://127.0.0.1:9"], "weight_update_group").transport == "torch"
    cfg.weight_sync.backend = "nccl"
    assert _sender_factory(cfg, None)(["http://127.0.0.1:9"], "weight_update_group").transport == "vllm-nccl"


def test_launch_check_asks_for_the_gloo_plugin_in_vllms_environment(tmp_path, caplog):
    from megatron_rl.config import load_config
    from megatron_rl.trainer.preflight import VLLM_GLOO_PLUGIN, engine_environment

    fake = tmp_path / "python"  # answers every version query; exit 3 = not installed (engine_package_version)
    fake.write_text(f'#!/bin/sh\ncase "$3" in {VLLM_GLOO_PLUGIN}) [ -f "$0.plugin" ] || exit 3;; esac\n'
                    'echo 0.32.0+cpu\n')
    fake.chmod(0o755)
    cfg = load_config(None, [f"model.path={REPO / 'examples/tiny/base_model'}", "rollout.backend=vllm",
                             f"rollout.vllm_python={fake}", "weight_sync.backend=gloo"])
    with pytest.raises(RuntimeError, match=f"gloo needs megatron-rl's gloo weight-transfer engine.*{VLLM_GLOO_PLUGIN} "
                                           "is not installed.*setup_vllm_cpu.sh"):
        engine_environment(cfg)
    (tmp_path / "python.plugin").write_text("")
    with caplog.at_level("WARNING", logger="megatron_rl.trainer.preflight"):
        assert engine_environment(cfg) is None  # no GPU needed with gloo; 0.32 only warns
    assert "vllm 0.32.0+cpu is installed" in caplog.text


WORKER = r"""
import json, sys, types
from dataclasses import dataclass
import torch

# vLLM's base classes, as far as the engine uses them (vllm/distributed/weight_transfer/base.py 0.32.0)
base = types.ModuleType("vllm.distributed.weight_transfer.base")
@dataclass
class WeightTransferInitInfo: pass
@dataclass
class WeightTransferUpdateInfo: pass
class WeightTransferEngine:
    def __class_getitem__(cls, item): return cls
    def __init__(self, config, vllm_config, device, model):
        self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
        self.parallel_config, self.model_config = vllm_config.parallel_config, vllm_config.model_config
    def parse_init_info(self, d):
        try: return self.init_info_cls(**d)
        except TypeError as e: raise ValueError(str(e)) from e
    def parse_update_info(self, d): return self.update_info_cls(**d)
base.WeightTransferInitInfo, base.WeightTransferUpdateInfo = WeightTransferInitInfo, WeightTransferUpdateInfo
base.WeightTransferEngine = WeightTransferEngine
for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
    sys.modules[name] = types.ModuleType(name)
sys.modules[base.__name__] = base
reload = types.ModuleType("vllm.model_executor.model_loader.reload")  # finalized after a failed update
reload.finalize_layerwise_reload = lambda model, model_config: print("finalized", flush=True)
for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
    sys.modules[name] = types.ModuleType(name)
sys.modules[reload.__name__] = reload
torch.accelerator.synchronize = lambda *a: (_ for _ in ()).throw(RuntimeError("no accelerator on CPU"))

from megatron_rl_vllm_gloo.engine import GlooWeightTransferEngine

class Model:
    loaded = []
    def load_weights(self, weights): self.loaded += [(n, w.clone()) for n, w in weights]
pc = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
engine = GlooWeightTransferEngine(None, types.SimpleNamespace(parallel_config=pc, model_config=None),
                                  torch.device("cpu"), Model())
info = json.loads(sys.argv[1])
try:
    engine.parse_init_info({**info, "packed": True})
except ValueError as e:
    print("packed refused:", e, flush=True)
engine.init_transfer_engine(engine.parse_init_info(info))
engine.update_weights({"names": ["a", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[2, 3], [4]]})
first = list(engine.model.loaded)

class Failing(Model):  # the load of "d" fails: the rest must still be received (the trainer's broadcast completes)
    loaded = []
    def load_weights(self, weights):
        if weights[0][0] == "d": raise RuntimeError("load of d failed")
        super().load_weights(weights)
import megatron_rl_vllm_gloo.engine as eng
eng.RECEIVE_AHEAD_BYTES = 8  # at most one tensor ahead of the load
engine.model = Failing()
try:
    engine.update_weights({"names": list("cdef"), "dtype_names": ["float32"] * 4, "shapes": [[3]] * 4})
except RuntimeError as e:
    print("update failed:", e, [n for n, _ in engine.model.loaded], flush=True)
engine.model.loaded = first
engine.shutdown()

from megatron_rl_vllm_gloo.engine import refresh_cpu_lm_heads

class UnquantizedEmbeddingMethod:  # vLLM's class name; counts the repacks
    calls = 0
    def process_weights_after_loading(self, layer): UnquantizedEmbeddingMethod.calls += 1
layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
layers[0].quant_method, layers[0].cpu_linear = UnquantizedEmbeddingMethod(), None  # a CPU embedding-method layer
layers[1].quant_method = UnquantizedEmbeddingMethod()  # no CPU GEMM (a GPU layer)
print("refreshed", refresh_cpu_lm_heads(layers), UnquantizedEmbeddingMethod.calls, flush=True)  # no head class: all
class VocabParallelEmbedding(torch.nn.Module): pass
class ParallelLMHead(VocabParallelEmbedding): pass
def layer(cls, weight):
    m = cls(); m.quant_method, m.cpu_linear, m.weight = UnquantizedEmbeddingMethod(), None, weight; return m
shared, own = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
UnquantizedEmbeddingMethod.calls = 0
tied = torch.nn.ModuleList([layer(VocabParallelEmbedding, shared), layer(ParallelLMHead, shared)])
untied = torch.nn.ModuleList([layer(VocabParallelEmbedding, shared), layer(ParallelLMHead, own)])
print("tied", refresh_cpu_lm_heads(tied), "untied", refresh_cpu_lm_heads(untied), UnquantizedEmbeddingMethod.calls, flush=True)
print(json.dumps({n: [str(w.dtype), w.float().tolist()] for n, w in engine.model.loaded}))
"""


def test_gloo_plugin_engine_receives_from_the_trainers_group():
    """The plugin's worker side joins ``megatron_rl.weight_sync.group``'s group (the trainer's, rank 0),
    receives one broadcast per tensor in the posted order and dtype and loads each (received on a thread
    ahead of the loads: `received`); a load that fails stops the loads but every broadcast of the update
    is still received, so the trainer's collective completes; packed is refused;
    no accelerator synchronize on CPU; only CPU embedding-method layers are repacked after an update
    (`refresh_cpu_lm_heads`). vLLM itself is stubbed (its base class), in a subprocess."""
    from megatron_rl.ports import find_free_port
    from megatron_rl.weight_sync.group import destroy_custom_process_group, init_custom_process_group

    port = find_free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "gloo_plugin_unit"}
    env = {"PYTHONPATH": str(REPO / "plugins" / "vllm_gloo"), "PATH": "/usr/bin:/bin"}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(info)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=0,
                                   group_name="gloo_plugin_unit", timeout_s=60)
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([0.5, 1.5, -2.0, 4.0], dtype=torch.bfloat16)
    try:
        for t in (a, b):
            torch.distributed.broadcast(t, src=0, group=pg)
        for k in range(4):  # the second update: every broadcast completes although the load of "d" fails
            torch.distributed.broadcast(torch.full((3,), float(k)), src=0, group=pg)
        out, err = worker.communicate(timeout=60)
    finally:
        destroy_custom_process_group(pg)
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("packed refused: the gloo weight transfer receives one broadcast per tensor")
    assert lines.index("finalized") < lines.index("update failed: load of d failed ['c']")  # received ahead, loaded in order, stopped at "d"
    assert "refreshed 1 1" in lines  # only the layer with a CPU GEMM is repacked (tied lm_head fix)
    assert "tied 1 untied 0 1" in lines  # only a tied head: the reload repacked the embedding and an untied head
    assert json.loads(lines[-1]) == {"a": ["torch.float32", a.tolist()], "b": ["torch.bfloat16", b.float().tolist()]}


def test_plugin_is_a_vllm_general_plugin():
    text = (REPO / "plugins" / "vllm_gloo" / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'megatron_rl_gloo = "megatron_rl_vllm_gloo:register"' in text


def test_vllm_temperature_limit_in_config_and_start_up_probe():
    """vLLM refuses temperatures above 2 (found by the live tier): the config check says so for
    rollout.backend=vllm, and the start-up probe samples real vLLM at 2 (the stand-in keeps 3)."""
    from megatron_rl.config.schema import Config
    from megatron_rl.config.validate import _check_vllm
    from megatron_rl.errors import ConfigError
    from megatron_rl.rollout.engine_checks import PROBE_TEMPERATURE, probe_temperature

    assert probe_temperature("vllm") == 2.0 and probe_temperature("vllm-embedded") == PROBE_TEMPERATURE == 3.0
    assert probe_temperature("sglang") == PROBE_TEMPERATURE
    cfg = Config()
    cfg.rollout.backend = "vllm"
    cfg.rollout.temperature = 2.0
    _check_vllm(cfg)
    cfg.rollout.temperature = 2.5
    with pytest.raises(ConfigError, match=r"rollout.temperature 2.5: vLLM refuses a temperature above 2"):
        _check_vllm(cfg)
    cfg.rollout.backend = "vllm-embedded"
    _check_vllm(cfg)


def test_busy_loop_cap_also_shortens_the_idle_recheck(monkeypatch):
    """`shorten_shm_busy_loop` caps vLLM's SpinCondition busy loop and its idle readers' recheck interval
    (5 s in vLLM 0.32): with the cap alone a lost zmq notification stalled the engine 5 s (3 of 10
    rounds of 96 requests, measured); vLLM's module is stubbed with the names the plugin touches."""
    import importlib
    import types

    monkeypatch.syspath_prepend(str(REPO / "plugins" / "vllm_gloo"))
    plugin = importlib.import_module("megatron_rl_vllm_gloo")

    shm = types.ModuleType("vllm.distributed.device_communicators.shm_broadcast")

    class SpinCondition:
        def __init__(self, busy_loop_s=1):
            self.busy_loop_s = busy_loop_s

    shm.SpinCondition, shm.SHM_READER_RECHECK_INTERVAL_MS = SpinCondition, 5000
    comm = types.ModuleType("vllm.distributed.device_communicators")
    comm.shm_broadcast = shm
    for name, mod in (("vllm", types.ModuleType("vllm")), ("vllm.distributed", types.ModuleType("vllm.distributed")),
                      (comm.__name__, comm), (shm.__name__, shm)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["vllm.distributed"].device_communicators = comm
    monkeypatch.delenv(plugin.SHM_BUSY_LOOP_ENV, raising=False)
    assert plugin.shorten_shm_busy_loop() is None and shm.SHM_READER_RECHECK_INTERVAL_MS == 5000
    monkeypatch.setenv(plugin.SHM_BUSY_LOOP_ENV, "0.005")
    assert plugin.shorten_shm_busy_loop() == 0.005
    assert SpinCondition().busy_loop_s == 0.005 and SpinCondition(0.001).busy_loop_s == 0.001
    assert shm.SHM_READER_RECHECK_INTERVAL_MS == plugin.SHM_RECHECK_MS == 20
    monkeypatch.setenv(plugin.SHM_BUSY_LOOP_ENV, "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        plugin.shorten_shm_busy_loop()
