"""Seeds of the responses, and partial rollouts: the request that continues a response aborted by
a weight update, and the joined result (tokens, log-probs, version spans and routing of its parts).

Seeds: response `j` of prompt `i` (generation batch `b` of step `s`, run seed `r`) samples with
`derive_seed(r, s, b, i, j)`; with `consecutive` (`response_seeds`: engines that run a prompt's
`n` responses as one request, vLLM's parallel sampling, which seeds child `j` with the request's
seed + j) with `derive_seed(r, s, b, i) + j` instead, so one request with `n` samples exactly what
`n` requests with those seeds would.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from megatron_rl.rollout.live import concat_spans

__all__ = ["continuation", "derive_seed", "join_routing", "joined", "response_seeds"]


def derive_seed(*parts: int | str) -> int:
    """A stable 31-bit seed from (run seed, step, batch, prompt, response); independent of Python's hash salt."""
    h = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def response_seeds(parts: tuple, i: int, n: int, *, consecutive: bool = False) -> list[int]:
    """The `sampling_seed`s of the `n` responses to prompt `i` (`parts`: run seed, step, batch, ...):
    `derive_seed(*parts, i, j)` each, or with `consecutive` `derive_seed(*parts, i) + j` (at most
    2**31 - 1 + n - 1; vLLM's parallel sampling seeds child j with seed + j, module docstring)."""
    if consecutive:
        base = derive_seed(*parts, i)
        return [base + j for j in range(n)]
    return [derive_seed(*parts, i, j) for j in range(n)]


def continuation(ids: list[int], params: dict, done, attempt: int) -> tuple[list[int], dict]:
    """Prompt ([P + m] ids) and params that continue `done` (m tokens made of the prompt `ids`):
    the prefix appended, the remaining token budget, a fresh seed (`derive_seed(seed, "continue",
    attempt)`: the prefix's draws are not replayed)."""
    made = len(done.output_ids)
    sub = dict(params, max_new_tokens=int(params["max_new_tokens"]) - made)
    if params.get("min_new_tokens"):
        sub["min_new_tokens"] = max(int(params["min_new_tokens"]) - made, 0)
    if params.get("sampling_seed") is not None:
        sub["sampling_seed"] = derive_seed(params["sampling_seed"], "continue", attempt)
    return list(ids) + list(done.output_ids), sub


def joined(done, res):
    """`done` followed by its continuation `res` (ids, log-probs, spans and routing concatenated)."""
    logprobs = None
    if done.output_logprobs is not None and res.output_logprobs is not None:
        logprobs = list(done.output_logprobs) + list(res.output_logprobs)
    made = len(done.output_ids)
    spans = concat_spans(list(done.version_spans), made, list(res.version_spans)) if res.output_ids else \
        list(done.version_spans)
    return dataclasses.replace(
        res, output_ids=list(done.output_ids) + list(res.output_ids), output_logprobs=logprobs,
        prompt_tokens=done.prompt_tokens, completion_tokens=made + res.completion_tokens, weight_versions=None,
        version_spans=tuple(spans), routed_experts=join_routing(done, res))


def join_routing(done, res) -> np.ndarray | None:
    """The routing of a partial rollout `done` (prompt P, m tokens) continued by `res` (its request:
    prompt P + m, c tokens), [P + m + c - 1, layers, top-k]: `done`'s rows for positions
    [0, P + m - 1), as they were routed when those tokens were generated, then `res`'s rows from
    position P + m - 1 (the prefix's last token, which `done` never fed back) on, as the
    continuation routed them. A continuation without tokens (aborted again at once) adds nothing:
    `done`'s rows (then P + m - 1 of them, as the joined result's counts say). None when `done`
    carries no routing (not asked for), or when `res` is an abort that came without routing (the
    manager then resubmits the response from scratch: its parts cannot all be replayed).

    Raises:
        ValueError: a finished continuation without routing, or routing that does not cover its
            prompt (names the request).
    """
    if done.routed_experts is None:
        return None
    if not res.output_ids:
        return done.routed_experts
    start = done.prompt_tokens + len(done.output_ids) - 1
    tail = res.routed_experts
    if tail is None and res.finish_type == "abort":
        return None
    if tail is None or tail.shape[0] < start or tail.shape[1:] != done.routed_experts.shape[1:]:
        raise ValueError(f"continuation {res.rid!r} of a partial rollout: routed_experts "
                         f"{None if tail is None else list(tail.shape)} do not cover its prompt of {start + 1} tokens "
                         f"with the first part's [layers, top-k] {list(done.routed_experts.shape[1:])}")
    return np.concatenate([done.routed_experts[:start], tail[start:]], axis=0)
