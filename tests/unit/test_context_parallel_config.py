"""Context parallelism: megatron-core runs it only in Transformer Engine's attention, and this
trainer does not split sequences over CP ranks. The refusal is exact about which case applies:
statically for `transformer_impl: local`, at launch without TE (this CPU machine), and at launch
with TE present (faked here) where the missing piece is the trainer's own sequence splitting."""

import importlib.util

import pytest
import torch

from megatron_rl.config import environment_checks, load_config

BASE = ["model.path=/models/x"]


def _cp_check(cfg):
    return dict(environment_checks(cfg))["context parallelism (Transformer Engine attention)"]


def test_megatron_core_local_attention_refuses_context_parallelism():
    """The fact the messages state: megatron-core's local (non-TE) attention asserts CP == 1."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    src = inspect.getsource(DotProductAttention.__init__)
    assert "context_parallel_size == 1" in src and "TEDotProductAttention" in src


def test_cp_one_does_not_apply():
    assert _cp_check(load_config(None, BASE))() == "not applicable: trainer.context_parallel_size is 1"


def test_cp_with_local_layers_refused_statically():
    with pytest.raises(ValueError, match=r"^trainer.context_parallel_size > 1 needs trainer.transformer_impl: "
                                         r"transformer_engine: megatron-core runs context parallelism only in "
                                         r"Transformer Engine's attention \(TEDotProductAttention\)"):
        load_config(None, BASE + ["trainer.context_parallel_size=2", "trainer.transformer_impl=local"])


def test_cp_without_transformer_engine_refused_at_launch():
    if importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available():
        pytest.skip("Transformer Engine and CUDA present: the no-TE path does not apply")
    cfg = load_config(None, BASE + ["trainer.context_parallel_size=2", "trainer.nproc_per_node=2"])
    with pytest.raises(RuntimeError) as err:
        _cp_check(cfg)()
    assert str(err.value) == (
        "trainer.context_parallel_size=2 needs trainer.transformer_impl=transformer_engine (auto picks it when TE is "
        "usable) with Transformer Engine installed and a CUDA GPU: megatron-core runs context parallelism only in "
        "TE's attention (TEDotProductAttention); its local attention, the one used without TE (e.g. on CPU), refuses "
        "context_parallel_size > 1. Set trainer.context_parallel_size=1")


def test_cp_with_transformer_engine_says_the_trainer_lacks_sequence_splitting(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(None, BASE + ["trainer.context_parallel_size=2", "trainer.nproc_per_node=2",
                                    "trainer.transformer_impl=transformer_engine"])
    with pytest.raises(RuntimeError, match=r"^trainer.context_parallel_size=2: Transformer Engine is available, but "
                                           r"this trainer does not implement context parallelism: it does not split "
                                           r"each sequence over the context-parallel ranks"):
        _cp_check(cfg)()
