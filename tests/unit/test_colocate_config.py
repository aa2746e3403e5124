"""`rollout.colocate` (issue 17): aliases, and the config errors naming the keys."""

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.config import colocate as colocate_mod
from megatron_rl.config.colocate import estimate_params

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny" / "ci.yaml"


@pytest.mark.parametrize("alias", ["rollout.colocate", "actor_rollout_ref.hybrid_engine", "colocate"])
def test_colocate_and_its_verl_slime_spellings(alias):
    assert load_config(TINY, [f"{alias}=true"]).rollout.colocate is True
    assert load_config(TINY, []).rollout.colocate is False


def test_memory_fraction_and_tp_aliases():
    cfg = load_config(TINY, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
                             "rollout_num_gpus_per_engine=1"])
    assert cfg.rollout.mem_fraction_static == 0.4 and cfg.rollout.tp_size == 1


@pytest.mark.parametrize("overrides, words", [
    (["trainer.max_staleness=1"], r"rollout.colocate: true needs trainer.max_staleness: 0 \(got 1\)"),
    (["rollout.num_servers=2"], r"rollout.num_servers: 2 engines .* trainer.nproc_per_node 1 / rollout.tp_size 1"),
    (["trainer.nproc_per_node=4", "rollout.tp_size=2", "rollout.num_servers=3"],
     r"rollout.num_servers: 3 engines .* = 2 devices groups hold at most 2"),
    (["trainer.nproc_per_node=3", "rollout.tp_size=2"], "rollout.tp_size 2 must divide trainer.nproc_per_node 3"),
    (["rollout.backend=vllm-embedded"], "rollout.colocate: true with rollout.backend=vllm-embedded"),
    (["trainer.nproc_per_node=3", "trainer.tensor_model_parallel_size=2"],
     "trainer.tensor_model_parallel_size 2 must divide trainer.nproc_per_node 3 with rollout.colocate: true"),
    (["rollout.server_urls=[http://127.0.0.1:30000]"],
     r"rollout.server_urls: 1 running server\(s\) with rollout.colocate: true; .* unset rollout.server_urls"),
])
def test_colocate_conflicts_name_the_keys(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(TINY, ["rollout.colocate=true", *overrides])


def test_more_engines_allowed_when_devices_suffice():
    cfg = load_config(TINY, ["rollout.colocate=true", "trainer.nproc_per_node=2", "rollout.num_servers=2"])
    assert cfg.rollout.num_servers == 2


def test_memory_fraction_that_cannot_hold_the_weights(monkeypatch):
    hf = json.loads((ROOT / "examples/tiny/base_model/config.json").read_text())
    need_gib = estimate_params(hf) * 4 / 2**30
    # a device of 10x the weights: 0.05 of it cannot hold them, 0.5 can
    monkeypatch.setattr(colocate_mod, "device_memory_gib", lambda cfg: 10 * need_gib)
    with pytest.raises(ValueError, match=r"rollout.mem_fraction_static 0.05 .* cannot hold the engine's weights: "
                                         r"model.path has .* / rollout.tp_size 1"):
        load_config(TINY, ["rollout.colocate=true", "rollout.mem_fraction_static=0.05"])
    load_config(TINY, ["rollout.colocate=true", "rollout.mem_fraction_static=0.5"])
    # disaggregated: not checked
    load_config(TINY, ["rollout.mem_fraction_static=0.05"])


def test_param_estimate_matches_qwen2_0_5b():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings)
    hf = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen2"}
    assert estimate_params(hf) == 494_032_768
    assert estimate_params({"hidden_size": 8}) is None


def test_colocated_sglang_engines_take_their_gpus():
    from megatron_rl.rollout.engine_set import colocated_engine_args

    cfg = load_config(ROOT / "examples/qwen2.5-7b/dapo-colocate.yaml", ["model.path=/ckpt/x"])
    args, per = colocated_engine_args(cfg.rollout)
    assert args.count("--enable-memory-saver") == 1
    assert per == [["--base-gpu-id", "0"], ["--base-gpu-id", "2"], ["--base-gpu-id", "4"], ["--base-gpu-id", "6"]]
    plain = load_config(TINY, [])
    assert colocated_engine_args(plain.rollout) == ([], [])
