"""Checkpoints of the policy (megatron-core dist_checkpointing): exact round trip, incomplete
folders, mismatch errors (one gloo rank, CPU compat layer).

The round trip is checked through training: model A trains step 1, saves, trains step 2; model B
is freshly built from the base weights, loads A's checkpoint of step 1 and trains step 2 on the
same batch. A's and B's parameters after step 2 must be bit-identical, which needs the weights,
Adam moments, step counter, and LR schedule all restored.
"""

import json
import shutil

import pytest
import torch

from megatron_rl.checkpoint.save import (
    LATEST_FILE,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_rl.config.schema import ActorConfig
from megatron_rl.trainer.batch import build_train_batch
from megatron_rl.trainer.policy import PolicyTrainer
from tests.distributed.tiny_qwen2 import tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(300)


def _trainer(hf_config=None, distributed_optimizer=False, bf16=False):
    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights

    hf_config = hf_config or tiny_hf_config(tie_word_embeddings=False)
    hf = tiny_hf_model(hf_config, seed=0)
    tf_config = build_transformer_config(hf_config, **({"params_dtype": torch.bfloat16, "bf16": True} if bf16 else {}))
    model = build_model(hf_config, tf_config)
    load_hf_weights(model, hf.state_dict())
    # cosine decay: the scheduler's state sets the LR of step 2
    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-3, clip_grad=1.0, lr_warmup_steps=0,
                                lr_decay_steps=10, lr_decay_style="cosine",
                                use_distributed_optimizer=distributed_optimizer)
    loss = ActorConfig(
        loss_agg_mode="token-mean", loss_scale_factor=None,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, kl_loss_type="k3",
    )
    return PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=hf_config["vocab_size"],
                         micro_batch_size=2, actor=loss)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    responses = [torch.randint(11, 199, (n,), generator=g).tolist() for n in (5, 2, 7, 3)]
    return build_train_batch(prompts, responses, advantages=[1.0, -0.5, 0.25, -1.0],
                             rollout_logprobs=[[-1.0] * len(r) for r in responses],
                             trained=[True] * 4, pad_id=0)


def _step(trainer, seed):
    batch = _batch(seed)
    batch.old_logprobs = trainer.compute_logprobs(batch)
    return trainer.update(batch, mini_batch_sequences=4)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()}


def _save(trainer, run_dir, step, keep=3, **state):
    return save_checkpoint(run_dir, step, model=trainer.model, optimizer=trainer.optimizer,
                           scheduler=trainer.scheduler, run_state={"data": {"position": step}, **state},
                           config_yaml="a: 1\n", keep_last_n=keep)


@pytest.mark.parametrize("distributed_optimizer, bf16", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["optimizer", "distributed_optimizer", "bf16", "bf16-distributed_optimizer"])
def test_resume_is_bit_exact(megatron_world1, tmp_path, distributed_optimizer, bf16):
    """Also with megatron-core's distributed optimizer and in bf16 (every 32B recipe): the distributed
    optimizer's state is saved in the `fully_reshardable` format (megatron-core 0.19 refuses
    `fully_sharded_model_space`'s flattened ranges at save time: `CheckpointingException:
    ShardedTensor.flattened_range is not supported`); in bf16 every parameter is bf16, norms included
    (fp32 norms broke the Float16Optimizer's save: "Optimizer shape (128,) does not match model shape")."""
    a = _trainer(distributed_optimizer=distributed_optimizer, bf16=bf16)
    _step(a, seed=1)
    torch.manual_seed(77)  # the RNG state is part of the checkpoint
    _save(a, tmp_path, 1, weight_version=1)
    rng_after_save = torch.rand(3)
    hist_a = _step(a, seed=2)
    after_a = _params(a)

    b = _trainer(distributed_optimizer=distributed_optimizer, bf16=bf16)
    before_load = _params(b)
    state = load_checkpoint(tmp_path, 1, model=b.model, optimizer=b.optimizer, scheduler=b.scheduler)
    assert state["step"] == 1 and state["weight_version"] == 1 and state["data"] == {"position": 1}
    assert torch.equal(torch.rand(3), rng_after_save)
    assert any(not torch.equal(before_load[n], p) for n, p in _params(b).items())  # weights did change
    assert b.scheduler.num_steps == a.scheduler.num_steps - 1
    hist_b = _step(b, seed=2)
    after_b = _params(b)
    assert after_a.keys() == after_b.keys()
    for name in after_a:
        assert torch.equal(after_a[name], after_b[name]), name
    assert hist_a[0]["train/grad_norm"] == hist_b[0]["train/grad_norm"]
    assert hist_a[0]["train/lr"] == hist_b[0]["train/lr"]


def test_without_optimizer_state_resume_differs(megatron_world1, tmp_path):
    """The bit-exact test above can fail: resuming weights without the Adam moments gives another step."""
    a = _trainer()
    _step(a, seed=1)
    _save(a, tmp_path, 1)
    _step(a, seed=2)
    b = _trainer()
    load_checkpoint(tmp_path, 1, model=b.model, optimizer=b.optimizer, scheduler=b.scheduler, load_optimizer=False)
    _step(b, seed=2)
    pa, pb = _params(a), _params(b)
    assert any(not torch.equal(pa[n], pb[n]) for n in pa)


def test_latest_marker_incomplete_folders_and_pruning(megatron_world1, tmp_path, caplog):
    t = _trainer()
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        _save(t, tmp_path, step, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert (root / LATEST_FILE).read_text() == "3"
    assert latest_checkpoint(tmp_path) == 3
    # a save of step 4 that died before its run state: ignored with a warning
    shutil.copytree(checkpoint_dir(tmp_path, 3) / "model_optim", checkpoint_dir(tmp_path, 4) / "model_optim")
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(tmp_path) == 3
    assert "iter_0000004" in caplog.text
    # the marker names a folder deleted by hand: the newest complete one is used
    shutil.rmtree(checkpoint_dir(tmp_path, 3))
    assert latest_checkpoint(tmp_path) == 2
    (root / LATEST_FILE).write_text("three")
    with pytest.raises(ValueError, match="expected an iteration number"):
        latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="iter_0000004"):
        load_checkpoint(tmp_path, 4, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)


def test_shape_mismatch_names_the_tensor(megatron_world1, tmp_path):
    small = _trainer()
    _save(small, tmp_path, 1)
    cfg = tiny_hf_config(tie_word_embeddings=False)
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    big = _trainer(cfg)
    with pytest.raises(ValueError, match=r"tensor 'decoder.layers.mlp.linear_fc\d.weight' has shape \(2, \d+, \d+\), the model expects"):
        load_checkpoint(tmp_path, 1, model=big.model, optimizer=big.optimizer, scheduler=big.scheduler)


def test_run_state_is_json_with_scheduler_and_rng(megatron_world1, tmp_path):
    t = _trainer()
    ckpt = _save(t, tmp_path, 5, weight_version=5)
    state = json.loads((ckpt / "run_state.json").read_text())
    assert state["step"] == 5 and state["weight_version"] == 5
    assert set(state["rng"]) == {"python", "numpy", "torch"}
    assert "num_steps" in state["scheduler"]
    assert (ckpt / "config.yaml").read_text() == "a: 1\n"
