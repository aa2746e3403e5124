"""PolicyTrainer on a real megatron-core GPTModel (one gloo rank, CPU compat layer).

- B23: the old-log-prob recompute equals the first update's log-probs exactly (ratio 1, clip 0).
- ALGORITHMS.md 6: a mini-batch's gradient and loss do not change when it is split into 1, 2 or
  4 micro-batches, or by a token budget (`actor.max_tokens_per_micro_batch`) into micro-batches of
  varying rows and widths, for all four aggregation modes (the normaliser is global).
- `actor.sequence_packing`: packed micro-batches give the unpacked log-probs, loss and gradient up
  to float32 rounding, and the recompute stays exactly on-policy.
"""

import pytest
import torch

from megatron_rl.config.schema import ActorConfig
from megatron_rl.trainer.batch import build_train_batch
from megatron_rl.trainer.policy import PolicyTrainer
from tests.distributed.tiny_qwen2 import tiny_hf_config, tiny_hf_model

pytestmark = pytest.mark.timeout(300)


def _settings(mode: str) -> ActorConfig:
    return ActorConfig(
        loss_agg_mode=mode, loss_scale_factor=10.0 if mode == "seq-mean-token-sum-norm" else None,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, kl_loss_type="k3",
    )


def _trainer(mode: str, micro_batch_size: int, max_tokens: int | None = None, packing: bool = False):
    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights

    hf_config = tiny_hf_config(tie_word_embeddings=True)
    hf = tiny_hf_model(hf_config, seed=0)
    tf_config = build_transformer_config(hf_config)
    model = build_model(hf_config, tf_config)
    load_hf_weights(model, hf.state_dict())
    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-3, clip_grad=0.0)
    trainer = PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=hf_config["vocab_size"],
                            micro_batch_size=micro_batch_size, actor=_settings(mode),
                            max_tokens_per_micro_batch=max_tokens, sequence_packing=packing)
    return trainer


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    responses = [torch.randint(11, 199, (n,), generator=g).tolist() for n in (5, 2, 7, 3)]
    batch = build_train_batch(prompts, responses, advantages=[1.0, -0.5, 0.25, -1.0],
                              rollout_logprobs=[[-1.0] * len(r) for r in responses],
                              trained=[True, True, True, True], pad_id=0)
    return batch


def test_first_update_is_on_policy(megatron_world1):
    trainer = _trainer("token-mean", micro_batch_size=2)
    batch = _batch()
    batch.old_logprobs = trainer.compute_logprobs(batch)
    assert batch.old_logprobs.shape == batch.input_ids.shape
    assert torch.isfinite(batch.old_logprobs[batch.loss_mask]).all()
    history = trainer.update(batch, mini_batch_sequences=4)
    assert len(history) == 1
    # B23: same model state, precision and micro-batch layout -> ratio exactly 1.
    assert history[0]["train/ppo_kl"] == 0.0
    assert history[0]["train/pg_clipfrac"] == 0.0
    assert history[0]["train/grad_norm"] > 0
    # after the step the policy moved: a second recompute differs
    again = trainer.compute_logprobs(batch)
    assert not torch.equal(again[batch.loss_mask], batch.old_logprobs[batch.loss_mask])


# Rows of `_batch()` hold 8, 4, 11 and 4 tokens (prompt + response; S = 11). Longest first, a
# micro-batch costs rows x its longest row: budget 11 -> [11] [8] [4, 4]; 16 -> [11] [8, 4] [4];
# 24 -> [11, 8] [4, 4]; 44 -> all four (width 11).
BUDGET_PLANS = {11: [[2], [0], [1, 3]], 16: [[2], [0, 1], [3]], 24: [[2, 0], [1, 3]], 44: [[2, 0, 1, 3]]}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gradient_invariant_to_micro_batch_split(megatron_world1, mode):
    grads, losses = {}, {}
    for split in (4, 2, 1, *(f"budget{b}" for b in BUDGET_PLANS)):
        budget = int(split[6:]) if isinstance(split, str) else None
        trainer = _trainer(mode, micro_batch_size=split if budget is None else 1, max_tokens=budget)
        batch = _batch()
        if budget is not None:
            assert [rows for rows, _ in trainer._plan(batch)] == BUDGET_PLANS[budget]
        batch.old_logprobs = trainer.compute_logprobs(batch) + 0.05  # off-policy: exercise the clip
        out = trainer.accumulate_gradients(batch)
        losses[split] = sum(float(o["loss_num"]) for o in out) / sum(float(o["loss_count"]) for o in out)
        params = [p for p in trainer.model[0].parameters() if p.requires_grad]
        grads[split] = torch.cat([p.main_grad.detach().flatten().clone() for p in params])
    ref = grads[4]
    assert ref.norm() > 0
    for split in grads:
        rel = (grads[split] - ref).norm() / ref.norm()
        assert rel < 1e-5, f"{mode}: micro-batch split {split} gradient differs by {rel:.2e}"
        assert losses[split] == pytest.approx(losses[4], rel=1e-6), (mode, split)


def test_token_budget_recompute_is_on_policy(megatron_world1):
    """B23 with a token budget: micro-batches cut to their own width, old log-probs put back in
    row order at full width, and the first update sees ratio exactly 1."""
    ref = _trainer("token-mean", micro_batch_size=4)
    trainer = _trainer("token-mean", micro_batch_size=1, max_tokens=16)
    batch = _batch()
    old = trainer.compute_logprobs(batch, mini_batch_sequences=4)
    assert old.shape == batch.input_ids.shape
    assert torch.all(old[3, 4:] == 0)  # row 3 ran alone at width 4: nothing computed beyond it
    want = ref.compute_logprobs(batch, mini_batch_sequences=4)
    assert (old - want)[batch.loss_mask].abs().max() < 1e-5
    batch.old_logprobs = old
    history = trainer.update(batch, mini_batch_sequences=4)
    assert history[0]["train/ppo_kl"] == 0.0 and history[0]["train/pg_clipfrac"] == 0.0


def test_token_budget_smaller_than_a_sequence(megatron_world1):
    trainer = _trainer("token-mean", micro_batch_size=1, max_tokens=10)
    with pytest.raises(ValueError, match=r"actor.max_tokens_per_micro_batch \(10\) is smaller than one sequence: "
                                         r"row 2 has 11 tokens"):
        trainer.compute_logprobs(_batch())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("micro", [4, 2])
def test_sequence_packing_equals_padded(megatron_world1, mode, micro):
    """Rows of 8, 4, 11 and 4 tokens packed (first-fit, longest first, width 1.5 x longest): the
    log-probs, the loss and the gradient equal the padded run's up to float32 rounding (the
    rotary angles of a packed row start further along; see trainer.batch.pack_sequences)."""
    runs = {}
    for packing in (False, True):
        trainer = _trainer(mode, micro_batch_size=micro, packing=packing)
        batch = _batch()
        if packing:
            plan = trainer._plan(batch)
            assert all(mb.packing is not None for _, mb in plan)
            if micro == 4:  # rows of at most 17 tokens: [11, 4] [8, 4]
                assert plan[0][1].packing.input_ids.shape == (2, 15)
        lp = trainer.compute_logprobs(batch)
        batch.old_logprobs = lp + 0.05  # off-policy: exercise the clip
        out = trainer.accumulate_gradients(batch)
        loss = sum(float(o["loss_num"]) for o in out) / sum(float(o["loss_count"]) for o in out)
        params = [p for p in trainer.model[0].parameters() if p.requires_grad]
        runs[packing] = (lp, loss, torch.cat([p.main_grad.detach().flatten().clone() for p in params]))
    (lp0, loss0, g0), (lp1, loss1, g1) = runs[False], runs[True]
    mask = _batch().loss_mask
    assert (lp1 - lp0)[mask].abs().max() < 1e-4
    assert not torch.equal(lp1[mask], torch.zeros_like(lp1[mask]))
    assert loss1 == pytest.approx(loss0, rel=1e-4)
    assert ((g1 - g0).norm() / g0.norm()) < 1e-4


def test_sequence_packing_recompute_is_on_policy(megatron_world1):
    """B23 with packing: the recompute and the first update run the same packed rows, ratio 1."""
    trainer = _trainer("token-mean", micro_batch_size=4, packing=True)
    batch = _batch()
    batch.old_logprobs = trainer.compute_logprobs(batch, mini_batch_sequences=4)
    history = trainer.update(batch, mini_batch_sequences=4)
    assert history[0]["train/ppo_kl"] == 0.0 and history[0]["train/pg_clipfrac"] == 0.0
