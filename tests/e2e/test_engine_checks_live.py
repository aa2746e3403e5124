"""Issue 32 (trust at the seams) against the real embedded server, in both dialects (SGLang's and vLLM's):
the start-up check of the engines' log-probs (`megatron_rl.rollout.engine_checks`) and the context
limit the rollout manager enforces before sending.

Per dialect two servers of the tiny SFT'd model (examples/tiny/base_model, float32): a right one
started with `--context-length 48`, and one under the fault hook `MEGATRON_RL_FAULT_PROCESSED_LOGPROBS=1`
(a stand-in for SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB, or vLLM with processed log-probs). The
expected log-probs are computed here with the same model in transformers: raw `log_softmax(z)` for the
right server, `log_softmax(z / 3)` for the faulty one at the probe's temperature 3.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engine_checks import (PROBE_TEMPERATURE, PROBE_TOKENS, PROBE_TOP_P, check_engines,
                                               engine_context_limit, probe_prompt)
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.vllm_client import VLLMClient

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "tiny" / "base_model"
TEST_ROWS = ROOT / "examples" / "tiny" / "data" / "test.jsonl"
CONTEXT = 48
VOCAB = 121  # len(tokenizer) of the tiny model (its config's vocab_size is 128)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def engines(request, tmp_path_factory):
    """The two servers of one dialect: `good` (its context cut to 48 tokens) and `faulty`."""
    dialect = request.param
    logs = tmp_path_factory.mktemp(f"logs_{dialect}")
    extra = ["--dtype", "float32", "--api-dialect", dialect]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS"}
    client = VLLMClient if dialect == "vllm" else RolloutClient
    with launch_rollout_server(MODEL, log_path=logs / "good.log", extra_args=[*extra, "--context-length", str(CONTEXT)],
                               env=env, startup_timeout_s=180) as good, \
            launch_rollout_server(MODEL, log_path=logs / "faulty.log", extra_args=extra, startup_timeout_s=180,
                                  env={**env, "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS": "1"}) as faulty:
        g, f = client(good.base_url, timeout_s=60), client(faulty.base_url, timeout_s=60)
        yield SimpleNamespace(dialect=dialect, good=g, faulty=f,
                              backend="embedded" if dialect == "sglang" else "vllm-embedded")
        g.close()
        f.close()


def _probe(engine):
    """The probe's tokens and reported log-probs (as `check_logprob_semantics` asks), and the same
    tokens re-scored as prompt tokens."""
    prompt = probe_prompt(VOCAB)
    res = engine.generate(prompt, {"max_new_tokens": PROBE_TOKENS, "temperature": PROBE_TEMPERATURE,
                                   "top_p": PROBE_TOP_P, "ignore_eos": True, "sampling_seed": 32}, "probe")
    return prompt, res.output_ids, res.output_logprobs, engine.score_tokens(prompt, res.output_ids)


def _expected(model, prompt, tokens, temperature):
    """log_softmax(logits / temperature) of each token after prompt + the tokens before it, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()  # (P + C, V)
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)] / temperature  # (C, V)
    return torch.log_softmax(rows, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_check_accepts_an_engine_that_reports_the_policys_logprobs(engines, hf):
    prompt, tokens, reported, rescored = _probe(engines.good)
    raw = _expected(hf[0], prompt, tokens, 1.0)
    assert len(tokens) == PROBE_TOKENS
    assert reported == pytest.approx(raw, abs=1e-4) and rescored == pytest.approx(raw, abs=1e-4)
    [check] = check_engines([engines.good], vocab_size=VOCAB, backend=engines.backend)
    assert check.url == engines.good.base_url and check.tokens == PROBE_TOKENS
    assert check.mean_abs_diff < 1e-4
    assert check.seconds < 2.0  # issue 32: under 2 s per engine on the tiny model


def test_check_refuses_an_engine_that_reports_temperature_scaled_logprobs(engines, hf):
    prompt, tokens, reported, rescored = _probe(engines.faulty)
    scaled, raw = _expected(hf[0], prompt, tokens, PROBE_TEMPERATURE), _expected(hf[0], prompt, tokens, 1.0)
    assert reported == pytest.approx(scaled, abs=1e-4)  # what SGLang reports without its variable
    assert rescored == pytest.approx(raw, abs=1e-4)  # prompt log-probs stay raw, as in both engines
    fix = "SGLANG_RETURN_ORIGINAL_LOGPROB=1" if engines.dialect == "sglang" else "--logprobs-mode raw_logprobs"
    with pytest.raises(RolloutServerError) as err:
        check_engines([engines.good, engines.faulty], vocab_size=VOCAB, backend=engines.backend)
    msg = str(err.value)
    assert msg.startswith(f"rollout engine {engines.faulty.base_url} does not report the policy's log-probs")
    assert engines.good.base_url not in msg  # only the faulty engine is named
    assert f"Fix: {'set ' if engines.dialect == 'sglang' else 'start vLLM with '}{fix}" in msg
    assert "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS" in msg and "rollout.check_logprob_semantics=false" in msg
    mean = sum(abs(a - b) for a, b in zip(scaled, raw)) / len(raw)
    assert f"came with log-probs {mean:.3f} nats (mean" in msg


def test_context_limit_is_known_and_a_prompt_that_does_not_fit_is_refused_before_sending(engines, hf):
    from megatron_rl.data.dataset import load_rows
    from megatron_rl.rollout.manager import RolloutManager

    assert engines.good.context_length() == CONTEXT and engines.faulty.context_length() == 256  # the model's
    limit = engine_context_limit([engines.faulty, engines.good])
    assert limit == (CONTEXT, engines.good.base_url)
    rows = load_rows(TEST_ROWS)[:2]
    sent = []

    class Counting(type(engines.good)):
        def generate(self, *a, **k):
            sent.append(a[2])
            return super().generate(*a, **k)

        def generate_batch(self, *a, **k):
            sent.extend(a[2])
            return super().generate_batch(*a, **k)

    client = Counting(engines.good.base_url, timeout_s=60)
    m = RolloutManager([client], hf[1], None, reward_fn="dapo_math", max_prompt_length=64, max_response_length=32,
                       context_limit=limit, max_concurrency=2)
    lengths = [len(m.prompt_ids(r)) for r in rows]
    budget = CONTEXT - max(lengths) + 1  # one token too many for the longer prompt
    longer = rows[lengths.index(max(lengths))]
    with pytest.raises(ValueError) as err:
        m.generate(rows, n=2, sampling_params={"temperature": 1.0}, tag="s1", seed_parts=(0,), max_new_tokens=budget)
    assert str(err.value) == (
        f"prompt {longer.prompt_key} ({longer.origin}) has {max(lengths)} tokens; with the response budget of {budget} "
        f"tokens (data.max_response_length; eval.max_response_length for evaluation in training; --max-new-tokens "
        f"of megatron-rl eval) that is {CONTEXT + 1} > "
        f"{CONTEXT}, the context limit of the rollout engine at {engines.good.base_url}: lower "
        "data.max_prompt_length (longer prompts are refused) or the response budget, or start the engine with a "
        "longer context")
    assert sent == []  # refused before any request went out
    out = m.generate(rows, n=1, sampling_params={"temperature": 1.0, "ignore_eos": True}, tag="s2", seed_parts=(0,),
                     max_new_tokens=budget - 1)  # prompt + budget = 48: fits, and is generated in full
    assert [len(g[0].output_ids) for g in out] == [budget - 1] * 2 and len(sent) == 2
    m.close()
    client.close()
