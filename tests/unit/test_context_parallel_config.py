"""Context parallelism: megatron-core runs it only in Transformer Engine's attention, and this
trainer does not split sequences over CP ranks, so `context_parallel_size > 1` is refused by the
static checks (`--dry-run` included), with the reason that applies: the local layer spec's
attention for `transformer_impl: local`, the trainer's missing sequence splitting otherwise."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.trainer.preflight import environment_checks

BASE = ["model.path=/models/x"]
ROOT = Path(__file__).resolve().parents[2]


def test_megatron_core_local_attention_refuses_context_parallelism():
    """The fact the messages state: megatron-core's local (non-TE) attention asserts CP == 1."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    src = inspect.getsource(DotProductAttention.__init__)
    assert "context_parallel_size == 1" in src and "TEDotProductAttention" in src


def test_cp_one_passes_and_world_size_counts_cp():
    cfg = load_config(None, BASE + ["trainer.nproc_per_node=4", "trainer.tensor_model_parallel_size=2"])
    assert cfg.trainer.context_parallel_size == 1
    assert environment_checks(cfg)["world_size"]() is None


def test_cp_with_local_layers_refused_statically():
    with pytest.raises(ValueError, match=r"^trainer.context_parallel_size > 1 needs trainer.transformer_impl: "
                                         r"transformer_engine: megatron-core runs context parallelism only in "
                                         r"Transformer Engine's attention \(TEDotProductAttention\)"):
        load_config(None, BASE + ["trainer.context_parallel_size=2", "trainer.transformer_impl=local"])


@pytest.mark.parametrize("impl", ["auto", "transformer_engine"])
def test_cp_refused_statically_with_any_layer_spec(impl):
    with pytest.raises(ValueError) as err:
        load_config(None, BASE + ["trainer.context_parallel_size=2", "trainer.nproc_per_node=2",
                                  f"trainer.transformer_impl={impl}"])
    msg = str(err.value)
    assert msg.startswith("trainer.context_parallel_size=2: this trainer does not implement context parallelism: "
                          "it does not split each sequence over the context-parallel ranks")
    assert msg.endswith("Set trainer.context_parallel_size=1 and use tensor/pipeline/data parallelism")


def test_dry_run_refuses_cp(tmp_path):
    """The refusal happens before launch: `--dry-run` exits 2 with the message, as for any config error."""
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", "examples/tiny/grpo.yaml",
                          "--dry-run", f"run_dir={tmp_path}", "trainer.context_parallel_size=2",
                          "trainer.nproc_per_node=2", "trainer.transformer_impl=auto", "trainer.attention_backend=auto"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "config error: trainer.context_parallel_size=2: this trainer does not implement" in out.stderr
