"""The embedded engine's batched draw (`sampling.sample_plain_rows`) against `sample_token` row by row."""

import pytest
import torch

from megatron_rl.engine.sampling import SamplingParams, is_plain, sample_plain_rows, sample_token


@pytest.mark.parametrize("vocab", [2, 128, 1000])
def test_batched_draw_equals_the_per_row_draw(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * 3  # (K, V)
    temps = [0.3 + 0.05 * k for k in range(64)]
    seeds = list(range(100, 164))
    batched = sample_plain_rows(logits, temps, [torch.Generator().manual_seed(s) for s in seeds])
    one_by_one = [sample_token(logits[k], SamplingParams(temperature=temps[k]), torch.Generator().manual_seed(seeds[k]),
                               masked=()) for k in range(64)]
    assert batched.tolist() == one_by_one
    assert batched.dtype == torch.long and int(batched.max()) < vocab
    assert len(set(one_by_one)) > 1


def test_each_generator_gives_exactly_one_draw():
    gens = [torch.Generator().manual_seed(7) for _ in range(3)]
    sample_plain_rows(torch.zeros(3, 5), [1.0] * 3, gens)
    # the next draw of every generator is the second draw of a fresh one
    fresh = torch.Generator().manual_seed(7)
    torch.rand((), generator=fresh)
    want = float(torch.rand((), generator=fresh))
    assert [float(torch.rand((), generator=x)) for x in gens] == [want] * 3


@pytest.mark.parametrize("params, plain", [
    (SamplingParams(), True), (SamplingParams(temperature=0.7), True), (SamplingParams(temperature=0.0), False),
    (SamplingParams(top_k=5), False), (SamplingParams(top_p=0.9), False), (SamplingParams(min_p=0.1), False),
    (SamplingParams(logit_bias=((3, 1.0),)), False), (SamplingParams(top_k=-1, top_p=1.0), True),
])
def test_is_plain(params, plain):
    assert is_plain(params) is plain
