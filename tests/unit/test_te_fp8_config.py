"""Transformer Engine / FP8 settings: the trainer section mapped to megatron-core's
TransformerConfig in one place (models.builder.transformer_config_for), static validation, and
the launch-time environment check (TE cannot run on CPU: a bf16-vs-FP8 step is the GPU check
script's job)."""

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.trainer.preflight import environment_checks
from megatron_rl.models.builder import transformer_config_for, use_te_for

BASE = ["model.path=/models/x"]
HF = json.loads((Path(__file__).parents[2] / "examples/tiny/base_model/config.json").read_text())


def test_fp8_knobs_reach_transformer_config():
    cfg = load_config(None, BASE + [
        "trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.fp8_recipe=delayed",
        "trainer.fp8_amax_history_len=16", "trainer.fp8_amax_compute_algo=most_recent", "trainer.fp8_margin=2",
        "trainer.use_distributed_optimizer=true", "trainer.fp8_param_gather=true",
    ])
    c = transformer_config_for(HF, cfg.trainer)
    assert (c.fp8, c.fp8_recipe, c.fp8_amax_history_len, c.fp8_amax_compute_algo, c.fp8_margin, c.fp8_param) == (
        "hybrid", "delayed", 16, "most_recent", 2, True)
    assert c.bf16 and str(c.params_dtype) == "torch.bfloat16"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipes(recipe):
    cfg = load_config(None, BASE + ["trainer.precision=bf16", "trainer.fp8=e4m3", f"trainer.fp8_recipe={recipe}"])
    c = transformer_config_for(HF, cfg.trainer)
    assert (c.fp8, c.fp8_recipe) == ("e4m3", recipe)


def test_no_fp8_by_default():
    c = transformer_config_for(HF, load_config(None, BASE).trainer)
    assert c.fp8 is None and not c.bf16 and not c.fp8_param


@pytest.mark.parametrize("overrides, message", [
    (["trainer.fp8=hybrid"], "needs trainer.precision: bf16"),
    (["trainer.precision=bf16", "trainer.fp8=e5m2"], "trainer.fp8"),
    (["trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.fp8_recipe=per_tensor"], "fp8_recipe"),
    (["trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.fp8_amax_compute_algo=mean"], "fp8_amax_compute_algo"),
    (["trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.fp8_amax_history_len=0"], "fp8_amax_history_len"),
    (["trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.transformer_impl=local"], "transformer_impl"),
    (["trainer.precision=bf16", "trainer.fp8=hybrid", "trainer.fp8_param_gather=true"], "fp8_param_gather"),
    (["trainer.transformer_impl=te"], "transformer_impl"),
])
def test_bad_fp8_settings_refused_statically(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, BASE + overrides)


def test_use_te_mapping():
    assert (use_te_for("auto"), use_te_for("transformer_engine"), use_te_for("local")) == (None, True, False)
    with pytest.raises(ValueError, match="transformer_impl"):
        use_te_for("apex")


def _check(cfg, name):
    return environment_checks(cfg)[name]


def test_environment_check_refuses_fp8_and_te_without_te_gpu(monkeypatch):
    """On this CPU machine (no TE, no CUDA) FP8 and a forced TE spec are refused at launch with a
    message naming the setting; unset, the checks report that they do not apply."""
    import importlib.util

    import torch

    if importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available():
        pytest.skip("Transformer Engine and CUDA present: the refusal path does not apply")
    cfg = load_config(None, BASE + ["trainer.precision=bf16", "trainer.fp8=hybrid"])
    with pytest.raises(RuntimeError, match="trainer.fp8"):
        _check(cfg, "fp8")()
    cfg = load_config(None, BASE + ["trainer.transformer_impl=transformer_engine"])
    with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine"):
        _check(cfg, "transformer_impl")()
    plain = load_config(None, BASE)
    assert _check(plain, "fp8")().startswith("not applicable")
    assert _check(plain, "transformer_impl")().startswith("not applicable")


def test_environment_check_refuses_pre_hopper_gpu(monkeypatch):
    """With TE importable and an Ampere GPU (both faked: neither exists here), FP8 is refused."""
    import importlib.util

    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    cfg = load_config(None, BASE + ["trainer.precision=bf16", "trainer.fp8=hybrid"])
    with pytest.raises(RuntimeError, match="Hopper"):
        _check(cfg, "fp8")()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert _check(cfg, "fp8")() is None


def test_environment_check_refuses_mxfp8_before_blackwell(monkeypatch):
    """MXFP8 exists in Transformer Engine only on sm100+: on a (faked) Hopper it is refused naming
    trainer.fp8_recipe, while the delayed recipe passes; on a (faked) sm100 MXFP8 passes."""
    import importlib.util

    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    mx = load_config(None, BASE + ["trainer.precision=bf16", "trainer.fp8=e4m3", "trainer.fp8_recipe=mxfp8"])
    with pytest.raises(RuntimeError, match=r"trainer.fp8_recipe=mxfp8 needs a Blackwell \(sm100\).*9\.x"):
        _check(mx, "fp8")()
    delayed = load_config(None, BASE + ["trainer.precision=bf16", "trainer.fp8=e4m3", "trainer.fp8_recipe=delayed"])
    assert _check(delayed, "fp8")() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert _check(mx, "fp8")() is None


def test_tp_must_divide_the_ffn_width(tmp_path):
    """Megatron's RowParallelLinear asserts TP | intermediate_size when the model is built; the static
    check says so first, naming the key, the value and the config file."""
    model = tmp_path / "m"
    model.mkdir()
    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 129}
    (model / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"trainer.tensor_model_parallel_size 2 must divide intermediate_size 129 .*config.json"):
        load_config(None, [f"model.path={model}", "trainer.tensor_model_parallel_size=2"])
    hf["intermediate_size"] = 128
    (model / "config.json").write_text(json.dumps(hf))
    assert load_config(None, [f"model.path={model}", "trainer.tensor_model_parallel_size=2"]).trainer.tensor_model_parallel_size == 2


def test_world_size_check_names_the_keys(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2"])
    with pytest.raises(RuntimeError, match=r"world size 1 \(trainer.nproc_per_node\) is not divisible by "
                                           r"trainer.tensor_model_parallel_size x .* = 2 x 1 x 1 = 2: set "
                                           r"trainer.nproc_per_node to a multiple of 2"):
        _check(cfg, "world_size")()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match=r"world size 3 \(WORLD_SIZE from the launcher"):
        _check(cfg, "world_size")()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _check(cfg, "world_size")() is None
