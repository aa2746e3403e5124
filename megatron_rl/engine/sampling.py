"""The embedded server's sampling contract: strict ``sampling_params`` (SGLang's gate) and one token draw.

``parse_sampling_params`` accepts exactly the keys SGLang 0.5.23 accepts (an unknown key is a 400
naming it); keys this ids-in/ids-out HF engine cannot honour are accepted only at their neutral
value. ``sample_token`` draws one token with exactly one uniform draw from the request's own
``torch.Generator`` (inverse CDF over the filtered distribution), so a request's tokens depend only
on its prompt, parameters, seed and the weights.

Log-probs (``output_token_logprobs``) are *not* taken from the sampling distribution: they are
``log_softmax`` of the model's raw logits in float32, i.e. of the unmodified policy distribution:
before temperature, top-k/top-p/min-p, ``logit_bias`` and the ``min_new_tokens`` stop-token mask.
This is what the trainer's ``old_logprobs`` recompute is compared against. (SGLang 0.5.x computes
its logprobs after temperature scaling unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set; the two
agree at temperature 1.0. Every SGLang engine this project starts has it set: ``launcher.SGLANG_ENV``
and slurm/lib/engine.sh.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_rl.engine.bodies import RequestError, validation_text

__all__ = ["SGLANG_SAMPLING_KEYS", "SamplingParams", "is_plain", "parse_sampling_params", "sample_plain_rows",
           "sample_token"]

#: Every key SGLang 0.5.23 accepts in ``sampling_params``, with its default. Unknown keys are a 400.
SGLANG_SAMPLING_KEYS: dict[str, Any] = {
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
    "sampling_seed": None,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stream_interval": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
#: Keys accepted by SGLang that this server can only take at their neutral value.
_NEUTRAL_ONLY: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "stop_regex": lambda v: v in (None, "", []),
    "json_schema": lambda v: v is None,
    "regex": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "beam_width": lambda v: v in (None, 0, 1),
    "watermark": lambda v: v in (None, False),
    "choice": lambda v: v is None,
}


class _SamplingModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request (SGLang names and meanings).

    ``temperature == 0`` is greedy; ``top_k == -1`` is the whole vocabulary; ``stop_token_ids``
    and (unless ``ignore_eos``) the model's EOS ids end a request with
    ``{"type": "stop", "matched": id}``, the id kept in ``output_ids``; until ``min_new_tokens``
    are out they are masked from sampling. ``stop`` strings (SGLang's ``stop``) end a request when
    the decoded output contains one (``{"type": "stop", "matched": "<the string>"}``), the tokens
    that completed it kept in ``output_ids`` (token in, token out: the caller sees every token the
    engine sampled); they need the server's tokenizer (``GenerationEngine(decode=...)``).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


def _stop_strings(value: str | list[str] | None) -> tuple[str, ...]:
    """SGLang's ``stop`` (a string or a list of strings) as a tuple of non-empty strings.

    Raises:
        RequestError: 400 for an empty string in the list.
    """
    items = [value] if isinstance(value, str) else list(value or ())
    if any(not s for s in items) and items != [""]:
        raise RequestError({"error": "sampling_params.stop: every stop string must be non-empty"})
    return tuple(s for s in items if s)


def parse_sampling_params(raw: Any) -> SamplingParams:
    """Validate one ``sampling_params`` object as SGLang does.

    Raises:
        RequestError: 400 ``{"error": "unknown field `k`, expected one of ..."}`` for an unknown
            key, or 400 ``{"error": ...}`` for a bad value or a feature this server lacks.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError({"error": f"sampling_params must be an object, got {type(raw).__name__}"})
    for key in raw:
        if key not in SGLANG_SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
            raise RequestError({"error": f"unknown field `{key}`, expected one of {expected}"})
    for key, neutral in _NEUTRAL_ONLY.items():
        if key in raw and not neutral(raw[key]):
            raise RequestError(
                {
                    "error": f"sampling_params.{key}={raw[key]!r} is not supported by the embedded "
                    "server (ids-in/ids-out HF engine); leave it at its default"
                }
            )
    try:
        m = _SamplingModel.model_validate({k: v for k, v in raw.items() if v is not None or k in ("sampling_seed",)})
    except ValidationError as e:
        raise RequestError({"error": f"invalid sampling_params: {validation_text(e)}"}) from None
    if m.top_k == 0 or m.top_k < -1:
        raise RequestError({"error": f"sampling_params.top_k must be -1 (whole vocabulary) or >= 1, got {m.top_k}"})
    try:
        bias = tuple(sorted((int(k), float(v)) for k, v in (m.logit_bias or {}).items()))
    except ValueError:
        raise RequestError({"error": "sampling_params.logit_bias keys must be token ids written as strings"}) from None
    return SamplingParams(
        max_new_tokens=m.max_new_tokens,
        min_new_tokens=m.min_new_tokens,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        stop_token_ids=tuple(m.stop_token_ids or ()),
        stop=_stop_strings(m.stop),
        ignore_eos=m.ignore_eos,
        n=m.n,
        sampling_seed=m.sampling_seed,
        logit_bias=bias,
    )


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, masked: Collection[int]) -> int:
    """Draw one token from ``logits: [V] float32`` with exactly one uniform draw from ``gen``.

    ``p.logit_bias`` is added first, then the ids in ``masked`` (the stop ids while fewer than
    ``min_new_tokens`` are out) get -inf. Greedy when ``temperature == 0`` or ``top_k == 1``;
    otherwise softmax at ``temperature``, top-k, top-p and min-p filters, inverse CDF. Returns the id.
    """
    if masked or p.logit_bias:
        logits = logits.clone()
        for tok, bias in p.logit_bias:
            if 0 <= tok < logits.numel():
                logits[tok] += bias
        for tok in masked:
            if 0 <= tok < logits.numel():
                logits[tok] = float("-inf")
    if p.temperature == 0.0 or p.top_k == 1:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / p.temperature, dim=-1)  # (V,)
    if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0:  # no filter: inverse CDF in vocabulary order
        cum = torch.cumsum(probs, 0)
        u = torch.rand((), generator=gen) * cum[-1]
        return min(int(torch.searchsorted(cum, u, right=True)), probs.numel() - 1)
    probs, order = torch.sort(probs, descending=True, stable=True)
    if p.top_k > 0:
        probs = probs[: p.top_k]
        order = order[: p.top_k]
    if p.top_p < 1.0:
        cum = torch.cumsum(probs, 0)
        keep = int(torch.searchsorted(cum - probs, torch.tensor(p.top_p), right=False))
        probs, order = probs[: max(keep, 1)], order[: max(keep, 1)]
    if p.min_p > 0.0:
        keep = int((probs >= p.min_p * probs[0]).sum())
        probs, order = probs[: max(keep, 1)], order[: max(keep, 1)]
    cum = torch.cumsum(probs, 0)
    u = torch.rand((), generator=gen) * cum[-1]
    idx = min(int(torch.searchsorted(cum, u, right=True)), probs.numel() - 1)
    return int(order[idx])


def matched_stop_string(output_ids: list[int], stops: tuple[str, ...], decode) -> str | None:
    """The first of ``stops`` that the decoded output now contains (SGLang checks the decoded tail
    the same way), or None (also when ``decode`` is None). Only the last ``len(longest stop) + 8``
    ids are decoded: a match that ends in the newest token lies within them (a token is at least
    one character), and an earlier match would have ended the request before."""
    if decode is None or not stops:
        return None
    text = decode(output_ids[-(max(len(s) for s in stops) + 8):])
    return next((s for s in stops if s in text), None)


def is_plain(p: SamplingParams) -> bool:
    """True when ``sample_token`` would take its unfiltered path for ``p`` (temperature > 0, no
    top-k / top-p / min-p filter, no ``logit_bias``); the caller also checks that no stop id is
    masked for the request at this token."""
    return p.temperature > 0.0 and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and not p.logit_bias


def sample_plain_rows(logits: torch.Tensor, temperatures: list[float], gens: list[torch.Generator]) -> torch.Tensor:
    """``sample_token`` for K rows that are all ``is_plain``, batched: ``logits: [K, V] float32``,
    one temperature and one generator per row; returns ``[K]`` int64 token ids. Each row draws
    exactly one uniform from its own generator and inverts the CDF in vocabulary order, the same
    operations as ``sample_token``'s unfiltered path row by row (the same ids; a unit test checks
    it), without a Python loop over the softmax, cumsum and search."""
    temps = torch.tensor(temperatures, dtype=logits.dtype)[:, None]  # (K, 1)
    cum = torch.cumsum(torch.softmax(logits / temps, dim=-1), dim=-1)  # (K, V)
    u = torch.stack([torch.rand((), generator=g) for g in gens]) * cum[:, -1]  # (K,)
    return torch.searchsorted(cum, u[:, None], right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
