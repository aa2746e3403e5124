"""`actor.sequence_packing`: the packed layout by hand, and the config checks that name the keys.

The packed forward against the padded one (log-probs, loss, gradient) on a real megatron-core
model is tests/distributed/test_policy_trainer.py::test_sequence_packing_equals_padded.
"""

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.trainer.batch import build_train_batch, pack_sequences


def _mb():
    # rows of 3 + 2 = 5, 2 + 1 = 3 and 1 + 1 = 2 tokens
    return build_train_batch([[11, 12, 13], [21, 22], [31]], [[14, 15], [23], [32]], advantages=[1.0, 1.0, 1.0],
                             rollout_logprobs=[[0.0, 0.0], [0.0], [0.0]], trained=[True] * 3, pad_id=0)


def test_layout_by_hand():
    mb = _mb()
    pk = pack_sequences(mb, width=8)  # longest first: row 0 = seq 0 (5) + seq 1 (3); row 1 = seq 2 (2)
    assert pk.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23], [31, 32, 0, 0, 0, 0, 0, 0]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert pk.labels.tolist() == [[12, 13, 14, 15, 0, 22, 23, 0], [32, 0, 0, 0, 0, 0, 0, 0]]
    assert pk.index[0].tolist() == [0, 1, 2, 3, 4]
    assert pk.index[1].tolist()[:3] == [5, 6, 7] and pk.index[2].tolist()[:2] == [8, 9]
    allowed = ~pk.attention_mask[0, 0]  # True where position q may attend to position k
    want = torch.zeros(8, 8, dtype=torch.bool)
    want[:5, :5] = torch.ones(5, 5).tril().bool()
    want[5:, 5:] = torch.ones(3, 3).tril().bool()
    assert torch.equal(allowed, want)
    # every real position unpacks to itself
    real = torch.arange(mb.input_ids.shape[1])[None, :] < mb.seq_lengths[:, None]
    assert torch.equal(pk.unpack(pk.input_ids)[real], mb.input_ids[real])
    assert torch.equal(pk.unpack(pk.labels)[mb.loss_mask], mb.labels[mb.loss_mask])


def test_default_width_is_one_and_a_half_longest_and_gradients_flow_back():
    pk = pack_sequences(_mb())  # width 8 (1.5 x 5, rounded up): rows [seq 0, seq 1] and [seq 2]
    assert pk.input_ids.shape == (2, 8)
    assert pk.input_ids[1, :2].tolist() == [31, 32]
    x = torch.arange(16.0, requires_grad=True)
    pk.unpack(x.view(2, 8)).sum().backward()
    # each packed token is read once by its own position; the 5 padding positions of the unpacked
    # [3, 5] layout read flat position 0 again (never trained); row 1's padding is read by no one
    assert x.grad.tolist() == [6.0] + [1.0] * 9 + [0.0] * 6
    with pytest.raises(ValueError, match="packing width 4 < the longest sequence"):
        pack_sequences(_mb(), width=4)


def test_config_alias_and_errors_name_the_keys():
    base = ["model.path=/models/x"]
    assert load_config(None, base + ["actor_rollout_ref.model.use_remove_padding=true"]).actor.sequence_packing
    with pytest.raises(ConfigError, match=r"actor.sequence_packing: true cannot run with trainer.pipeline_model_"
                                          r"parallel_size 2 .*; trainer.transformer_impl transformer_engine"):
        load_config(None, base + ["actor.sequence_packing=true", "trainer.pipeline_model_parallel_size=2",
                                  "trainer.transformer_impl=transformer_engine"])


def test_sequence_parallel_is_named():
    with pytest.raises(ConfigError, match="trainer.sequence_parallel"):
        load_config(None, ["model.path=/models/x", "actor.sequence_packing=true", "trainer.tensor_model_parallel_size=2",
                           "trainer.sequence_parallel=true"])
