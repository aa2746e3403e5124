"""A prompt's responses as one vLLM completion with ``n`` (vLLM's parallel sampling).

vLLM's per-request cost (HTTP, input processing, scheduling) is larger than a tiny model's forward
on CPU; ``n`` entries of one prompt sent as one ``/v1/completions`` with ``n`` share the prefill
and that cost (issue 30: the tiny recipe's rollout 0.78 s as one request per response). vLLM runs
child ``j`` of a request with ``seed`` s as its own request seeded s + j
(``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest``) and answers ``choices[j]`` (``index``
j) for it, so the group samples exactly what ``n`` requests with seeds s, s + 1, ... would
(``tests/live/``: checked against a real vLLM; the stand-in does the same). The rollout manager
gives a prompt's responses consecutive seeds when `rollout.parallel_sampling` is on
(``partial.response_seeds``); entries that are not such a group (a partial rollout's continuations,
other seeds) go out one request each.

Aborts: the group's engine id is ``cmpl-<rid of its first entry>-n<k>-0``; vLLM aborts a parent's
children with it, so an abort by any member's rid prefix ends the whole group (the manager aborts
by batch prefix, which holds every member).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["group_request_id", "parallel_group", "split_group_answer"]


def parallel_group(input_ids: Sequence[Sequence[int]], sampling_params: Sequence[Mapping[str, Any]]) -> bool:
    """Whether K >= 2 entries can go as one completion with ``n`` = K: one prompt, the same
    sampling params but ``sampling_seed``, and seeds s, s + 1, ..., s + K - 1 (or none at all)."""
    if len(input_ids) < 2 or len(input_ids) != len(sampling_params):
        return False
    first = list(input_ids[0])
    if any(list(ids) != first for ids in input_ids[1:]):
        return False
    rest = [{k: v for k, v in sp.items() if k != "sampling_seed"} for sp in sampling_params]
    if any(r != rest[0] for r in rest[1:]):
        return False
    seeds = [sp.get("sampling_seed") for sp in sampling_params]
    if all(s is None for s in seeds):
        return True
    if any(s is None for s in seeds):
        return False
    return all(int(s) == int(seeds[0]) + j for j, s in enumerate(seeds))


def group_request_id(rids: Sequence[str]) -> str:
    """The ``request_id`` of the completion that carries the entries ``rids`` (their first rid + ``-n<k>``)."""
    return f"{rids[0]}-n{len(rids)}"


def split_group_answer(response: Mapping[str, Any], k: int, what: str) -> list[dict]:
    """One answer of a completion with ``n`` = k -> k one-choice answers in the shape of an
    ``n`` = 1 answer (``choices[0]``, ``usage`` with that choice's ``completion_tokens``), in
    ``index`` order, for ``vllm_client.result_from_vllm``.

    Raises:
        ValueError: not k choices with indices 0..k-1, or ``usage.completion_tokens`` that is not the
            sum of the choices' ``token_ids`` (the message starts with ``what``).
    """
    try:
        choices = sorted(response["choices"], key=lambda c: int(c["index"]))
        usage = response["usage"]
        prompt_tokens = int(usage["prompt_tokens"])
        total = int(usage["completion_tokens"])
        lengths = [len(c["token_ids"]) for c in choices]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{what}: missing or bad {e!s}") from None
    if [int(c["index"]) for c in choices] != list(range(k)):
        raise ValueError(f"{what}: choices with indices {[c.get('index') for c in response['choices']]}, "
                         f"expected 0..{k - 1} (n={k})")
    if sum(lengths) != total:
        raise ValueError(f"{what}: usage.completion_tokens={total} is not the sum of the choices' token_ids "
                         f"({sum(lengths)})")
    return [dict(response, choices=[c], usage={"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                               "total_tokens": prompt_tokens + n})
            for c, n in zip(choices, lengths)]
