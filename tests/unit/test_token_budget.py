"""`actor.max_tokens_per_micro_batch`: the split of rows under a padded-token budget (hand-worked
plans), its errors, and the config keys (our name, verl's `ppo_max_token_len_per_gpu` and
`use_dynamic_bsz`). The gradient equality of the split is tested in
tests/distributed/test_policy_trainer.py."""

import pytest

from megatron_rl.config import load_config
from megatron_rl.trainer.batch import build_train_batch, split_by_token_budget

BASE = ["model.path=/nonexistent/model", "data.max_prompt_length=32", "data.max_response_length=64"]


def test_plan_longest_first_under_padded_budget():
    # lengths 5, 9, 3, 9, 2; longest first: 9 (1), 9 (3), 5 (0), 3 (2), 2 (4)
    assert split_by_token_budget([5, 9, 3, 9, 2], 18) == [([1, 3], 9), ([0, 2, 4], 5)]
    # 3 x 5 = 15 > 12: row 4 starts a new micro-batch of width 2
    assert split_by_token_budget([5, 9, 3, 9, 2], 12) == [([1], 9), ([3], 9), ([0, 2], 5), ([4], 2)]
    # widths rounded up to the pad multiple (TP under sequence parallelism): 10, 10, 6, 4, 2
    assert split_by_token_budget([5, 9, 3, 9, 2], 20, pad_multiple=2) == [([1, 3], 10), ([0, 2, 4], 6)]
    assert split_by_token_budget([4, 4, 4], 1000) == [([0, 1, 2], 4)]


def test_at_least_n_micro_batches_halves_the_fullest():
    """An expert-parallel group spanning DP ranks needs the same micro-batch count on each: a rank
    whose rows pack into fewer halves its fullest micro-batch (longest rows stay first)."""
    # packed: [1, 3] (width 9), [0, 2, 4] (width 5); 3 asked: [0, 2, 4] -> [0, 2] (5), [4] (2)
    assert split_by_token_budget([5, 9, 3, 9, 2], 18, min_micro_batches=3) == [([1, 3], 9), ([0, 2], 5), ([4], 2)]
    # 4 asked: then the first of the two-row ones, [1, 3], halves: [1] (9), [3] (9)
    assert split_by_token_budget([5, 9, 3, 9, 2], 18, min_micro_batches=4) == [
        ([1], 9), ([3], 9), ([0, 2], 5), ([4], 2)]
    assert split_by_token_budget([4, 4, 4], 1000, min_micro_batches=2) == [([0, 1], 4), ([2], 4)]
    assert split_by_token_budget([4, 4, 4], 1000, min_micro_batches=1) == [([0, 1, 2], 4)]
    with pytest.raises(ValueError, match="4 micro-batches asked of 3 rows"):
        split_by_token_budget([4, 4, 4], 1000, min_micro_batches=4)


def test_budget_smaller_than_a_sequence_names_the_key():
    with pytest.raises(ValueError, match=r"^actor.max_tokens_per_micro_batch \(8\) is smaller than one sequence: "
                                         r"row 1 has 9 tokens"):
        split_by_token_budget([5, 9], 8)
    with pytest.raises(ValueError, match=r"row 1 has 9 tokens \(prompt \+ response, padded to 10\)"):
        split_by_token_budget([5, 9], 9, pad_multiple=2)


def test_micro_batches_are_cut_to_their_width():
    batch = build_train_batch([[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10], [11, 12, 13, 14]],
                              advantages=[1.0, 2.0, 3.0], rollout_logprobs=[[-1.0] * 3, [-1.0], [-1.0] * 4],
                              trained=[True, True, True], pad_id=0)
    assert batch.seq_lengths.tolist() == [5, 2, 7] and batch.input_ids.shape == (3, 7)
    plan = batch.token_budget_micro_batches(10)  # [7] alone (2 x 7 > 10), then [5, 2] at width 5
    assert [rows for rows, _ in plan] == [[2], [0, 1]]
    mb = plan[1][1]
    assert mb.input_ids.tolist() == [[1, 2, 7, 8, 9], [3, 10, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True, False], [True, False, False, False, False]]
    assert mb.advantages.tolist() == [1.0, 2.0] and mb.seq_lengths.tolist() == [5, 2]
    assert plan[0][1].input_ids.shape == (1, 7)


def test_config_names_and_verl_aliases():
    assert load_config(None, BASE).actor.token_budget is None
    assert load_config(None, BASE + ["actor.max_tokens_per_micro_batch=256"]).actor.token_budget == 256
    cfg = load_config(None, BASE + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
                                    "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert cfg.actor.max_tokens_per_micro_batch == 512 and cfg.actor.token_budget == 512
    assert load_config(None, BASE + ["actor.ppo_max_token_len_per_gpu=512"]).actor.token_budget == 512
    # verl's default budget with use_dynamic_bsz off: fixed micro-batches
    cfg = load_config(None, BASE + ["actor.ppo_max_token_len_per_gpu=16384", "actor.use_dynamic_bsz=false"])
    assert cfg.actor.token_budget is None


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"actor.use_dynamic_bsz: true needs actor.max_tokens_per_micro_batch"):
        load_config(None, BASE + ["actor.use_dynamic_bsz=true"])
    with pytest.raises(ValueError, match=r"actor.max_tokens_per_micro_batch: 0 must be > 0"):
        load_config(None, BASE + ["actor.max_tokens_per_micro_batch=0"])
    with pytest.raises(ValueError, match=r"actor.max_tokens_per_micro_batch \(95\) is smaller than one sequence of up "
                                         r"to data.max_prompt_length \+ data.max_response_length = 96 tokens"):
        load_config(None, BASE + ["actor.max_tokens_per_micro_batch=95"])
