"""Embedded rollout server: an HF transformers model on CPU behind SGLang 0.5.23's HTTP API.

Run as its own process::

    python -m megatron_rl.rollout.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--dtype float32] [--api-key K] [--admin-api-key K] [--weight-version V]
        [--max-batch-size 256] [--random-seed S] [--enable-deterministic-inference]

It speaks the subset of SGLang's API that the trainer uses (docs/SGLANG_API.md), with
the same request fields, the same strict ``sampling_params``, the same ``{}``-body rule for
control endpoints, the same response and ``finish_reason`` shapes, the same weight-update
session and the same auth semantics, so the trainer cannot tell it from SGLang. It runs
ids-in/ids-out (like ``--skip-tokenizer-init``): ``text`` prompts and stop *strings* are refused.

Generation. A scheduler thread gathers whatever is queued (up to ``--max-batch-size``),
left-pads it, prefills, then decodes the batch with a KV cache; a request leaves the batch (and
its HTTP call returns) as soon as it finishes. Requests that arrive meanwhile are prefilled
together at the next step boundary and join the running batch (the shorter KV cache is
left-padded; padding is masked), so a late request never waits for a long one to end.
Each request samples with its own ``torch.Generator`` seeded by ``sampling_seed``
(one uniform draw per sampled token, inverse-CDF over the filtered distribution), so its tokens
depend only on its prompt, parameters, seed and the weights, up to the float32 rounding of
batched matmuls (about 1e-7 in the logits; a token can flip only at a near-tie). With
``--enable-deterministic-inference`` every request runs in a batch of its own, which makes the
results bitwise independent of what else is in flight (slower).

Log-probs (``output_token_logprobs``) are ``log_softmax`` of the model's raw logits in float32,
i.e. of the unmodified policy distribution: before temperature, top-k/top-p/min-p,
``logit_bias`` and the ``min_new_tokens`` stop-token mask. This is what the trainer's
``old_logprobs`` recompute is compared against. (SGLang 0.5.x computes its logprobs after
temperature scaling unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set; the two agree at
temperature 1.0.)

Weight updates take the model-update write lock: generation requests hold the read lock from
admission to answer, so an update waits for the requests in flight unless the server is paused
(``/pause_generation``) or the call sets ``abort_all_requests``. The weights themselves are
only written between decoding steps. Nothing from the network is ever unpickled: weights
arrive by ``torch.distributed.broadcast`` into tensors whose dtypes and shapes come from the
validated JSON metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_rl.weight_sync.buckets import BucketMeta, dtype_from_name, dtype_name, flattened_layout, unflatten_bucket

logger = logging.getLogger(__name__)

__all__ = ["GenerationEngine", "SamplingParams", "build_app", "build_arg_parser", "main", "parse_sampling_params"]

# --------------------------------------------------------------------------------------------
# Sampling parameters (strict, as SGLang's contract gate)
# --------------------------------------------------------------------------------------------

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
    "stop": lambda v: v in (None, "", []),
    "stop_regex": lambda v: v in (None, "", []),
    "json_schema": lambda v: v is None,
    "regex": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "beam_width": lambda v: v in (None, 0, 1),
    "watermark": lambda v: v in (None, False),
    "choice": lambda v: v is None,
}


class RequestError(Exception):
    """A client error answered with HTTP ``status_code`` and JSON ``body`` (SGLang's shapes)."""

    def __init__(self, body: Any, status_code: int = 400) -> None:
        super().__init__(str(body))
        self.body = body
        self.status_code = status_code


class _SamplingModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = None
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
    are out they are masked from sampling.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


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
        raise RequestError({"error": f"invalid sampling_params: {_validation_text(e)}"}) from None
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
        ignore_eos=m.ignore_eos,
        n=m.n,
        sampling_seed=m.sampling_seed,
        logit_bias=bias,
    )


def _validation_text(e: ValidationError) -> str:
    n = e.error_count()
    parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']!r}" for err in e.errors(include_url=False)]
    return f"{n} validation error{'s' if n != 1 else ''}: " + "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Generation engine
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    """One sequence being generated (one output of ``/generate``)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    generator: torch.Generator
    on_done: Callable[[_Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, Any] | None = None
    abort_requested: bool = False
    num_retractions: int = 0
    weight_version: str = ""
    created_s: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Batch:
    reqs: list[_Request]
    cache: Any
    attention_mask: torch.Tensor  # (B, L) int64, 0 = left padding
    next_pos: torch.Tensor  # (B,) position id of the next input token
    next_input: torch.Tensor  # (B, 1) next input token


class GenerationEngine:
    """Batched, KV-cached sampling on one HF causal LM, driven by a scheduler thread.

    Thread-safety: ``submit``, ``abort``, ``pause``, ``resume`` and ``load_weights`` may be
    called from any thread; the model runs only on the scheduler thread, and ``load_weights``
    writes parameters only between decoding steps (``model_lock``).

    Args:
        model: an HF ``*ForCausalLM`` in eval mode on CPU.
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        max_batch_size: most sequences decoded together.
        random_seed: seeds the per-request seeds of requests without ``sampling_seed``.
        deterministic: run each request in a batch of its own (bitwise batch invariance).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 256,
        random_seed: int = 0,
        deterministic: bool = False,
        weight_version: str = "default",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.max_batch_size = 1 if deterministic else max_batch_size
        self.weight_version = weight_version
        self.max_context_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(model.config.vocab_size)
        self.model_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._batch: _Batch | None = None
        # Requests taken from the queue for the prefill now running: in neither the queue nor the
        # batch until the step ends, yet pause(abort) and abort() must reach them.
        self._prefilling: list[_Request] = []
        self._paused = False
        self._pause_mode = "abort"
        self._stepping = False
        self._stopping = False
        self._seed_rng = random.Random(random_seed)
        import inspect

        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._params = dict(model.state_dict(keep_vars=True))
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        # Joining a running batch pads its KV cache; only plain (non-sliding) layers allow that.
        self._mergeable = all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)
        self._thread = threading.Thread(target=self._run, name="rollout-scheduler", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------

    def new_generator(self, sampling_seed: int | None) -> torch.Generator:
        """A CPU generator seeded by ``sampling_seed``, or by the server seed stream when None."""
        seed = sampling_seed if sampling_seed is not None else self._seed_rng.randrange(1 << 62)
        return torch.Generator().manual_seed(int(seed) % (1 << 63))

    def submit(self, req: _Request) -> None:
        """Queue a request; ``req.on_done(req)`` is called on the scheduler thread when it ends."""
        if len(req.prompt_ids) + 1 > self.max_context_len:
            raise RequestError(
                {
                    "error": f"the input ({len(req.prompt_ids)} tokens) is longer than the model's "
                    f"context length ({self.max_context_len} tokens)"
                }
            )
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError({"error": f"input_ids contain ids outside [0, {self.vocab_size}): {bad[:5]}"})
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort queued and running requests whose rid starts with ``rid`` (all with ``abort_all``).

        Aborted requests end with ``finish_reason`` ``{"type": "abort", ...}`` and the tokens made
        so far. An empty ``rid`` without ``abort_all`` does nothing. Returns how many matched.
        """
        if not abort_all and not rid:
            logger.info("abort_request with an empty rid and abort_all=false ignored")
            return 0
        with self._cv:
            count = 0
            for req in self._live():
                if req.finish_reason is None and (abort_all or req.rid.startswith(rid)):
                    req.abort_requested = True
                    count += 1
            self._cv.notify_all()
        if count:
            self._wait_boundary()
        return count

    def pause(self, mode: str) -> None:
        """Stop generation (``abort`` | ``retract`` | ``in_place``); returns at a step boundary."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        with self._cv:
            self._paused = True
            self._pause_mode = mode
            if mode == "abort":
                for req in self._live():
                    req.abort_requested = True
            self._cv.notify_all()
        self._wait_boundary()

    def resume(self) -> None:
        """Continue generation after ``pause``."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return self._paused

    def can_flush(self) -> tuple[bool, str]:
        """Whether the KV cache may be flushed now, and why not (SGLang's rule)."""
        with self._cv:
            if self._batch is not None and not (self._paused and self._pause_mode == "retract"):
                return False, "there are running requests"
            if self._queue and not self._paused:
                return False, "there are waiting requests"
            return True, ""

    def num_live(self) -> int:
        """Queued plus running requests."""
        running, waiting = self.counts()
        return running + waiting

    def counts(self) -> tuple[int, int]:
        """``(running, waiting)``: sequences in the decoding batch and in the queue."""
        with self._cv:
            return (len(self._batch.reqs) if self._batch else 0), len(self._queue)

    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model, all or nothing.

        Every name and shape is checked before any parameter is written; values are cast to
        the parameter dtype by ``copy_``.

        Raises:
            ValueError: an unknown name or a shape mismatch (nothing written).
        """
        unknown = [n for n, _ in named_tensors if n not in self._params]
        if unknown:
            raise ValueError(f"unknown parameter name(s) {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
        wrong = [
            (n, list(t.shape), list(self._params[n].shape))
            for n, t in named_tensors
            if tuple(t.shape) != tuple(self._params[n].shape)
        ]
        if wrong:
            raise ValueError("shape mismatch (name, received, expected): " + ", ".join(map(str, wrong[:10])))
        with self.model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                self._params[name].copy_(tensor)

    def direct_targets(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                       shapes: Sequence[Sequence[int]]) -> list[torch.Tensor] | None:
        """The parameters named ``names`` (detached, sharing storage) when each one exists, is
        contiguous and has exactly the given dtype and shape, and no name repeats, so one broadcast
        per entry can land in place; None otherwise (the caller receives into a buffer and goes
        through ``load_weights``, which validates and casts)."""
        if len(set(names)) != len(names):
            return None
        out = []
        for name, dt, shape in zip(names, dtypes, shapes):
            p = self._params.get(name)
            if p is None or p.dtype != dt or list(p.shape) != [int(d) for d in shape] or not p.is_contiguous():
                return None
            out.append(p.detach())
        return out

    def get_parameter(self, name: str) -> torch.Tensor | None:
        """The parameter (or persistent buffer) named ``name`` in HF naming, or None."""
        return self._params.get(name)

    def close(self) -> None:
        """Stop the scheduler thread (requests in flight are aborted)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- scheduler ----------------------------------------------------------------------

    def _live(self) -> list[_Request]:
        """Under ``_cv``: every request not finished yet (queued, being prefilled, running)."""
        return list(self._queue) + self._prefilling + (self._batch.reqs if self._batch else [])

    def _wait_boundary(self) -> None:
        # Wait until the step running when the caller changed state is over; the scheduler
        # applies the change (abort, retract, pause) before it starts another step.
        with self._cv:
            self._cv.wait_for(lambda: not self._stepping, timeout=600)

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        req.weight_version = self.weight_version
        try:
            req.on_done(req)
        except Exception:  # the HTTP side went away; the scheduler must go on
            logger.exception("on_done callback failed for rid %s", req.rid)

    def _abort_reason(self) -> dict[str, Any]:
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def _next_work(self) -> tuple[list[tuple[_Request, dict]], list[_Request] | None, bool]:
        """Under ``_cv``: apply aborts and retraction, then wait for work.

        Returns ``(finished, new_reqs, stop)``: requests to finish now, requests to prefill
        (None: decode the running batch), and whether the thread must exit.
        """
        while True:
            if self._stopping:
                done = [
                    (r, self._abort_reason()) for r in list(self._queue) + (self._batch.reqs if self._batch else [])
                ]
                self._queue.clear()
                self._batch = None
                return done, None, True
            done = []
            for req in [r for r in self._queue if r.abort_requested]:
                self._queue.remove(req)
                done.append((req, self._abort_reason()))
            if self._batch is not None:
                done += [(r, self._abort_reason()) for r in self._batch.reqs if r.abort_requested]
                self._batch = self._compact(
                    self._batch, [i for i, r in enumerate(self._batch.reqs) if not r.abort_requested]
                )
            if self._paused and self._pause_mode == "retract" and self._batch is not None:
                for req in reversed(self._batch.reqs):  # KV dropped; recomputed from prompt + output on resume
                    req.num_retractions += 1
                    self._queue.appendleft(req)
                self._batch = None
            if done:
                return done, None, False
            if not self._paused:
                running = len(self._batch.reqs) if self._batch is not None else 0
                room = self.max_batch_size - running if (running == 0 or self._mergeable) else 0
                if self._queue and room > 0:  # new requests join at this step boundary
                    self._stepping = True
                    self._prefilling = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                    return [], list(self._prefilling), False
                if self._batch is not None:
                    self._stepping = True
                    return [], None, False
            self._cv.notify_all()
            self._cv.wait()

    def _run(self) -> None:
        while True:
            with self._cv:
                done, new_reqs, stop = self._next_work()
            for req, reason in done:
                self._finish(req, reason)
            if stop:
                return
            if done:
                continue
            try:
                with self.model_lock, torch.no_grad():
                    finished = self._prefill(new_reqs) if new_reqs is not None else self._decode()
            except Exception as exc:
                logger.exception("generation step failed")
                with self._cv:
                    if new_reqs is not None:  # the running batch is intact
                        failed = new_reqs
                    else:
                        failed, self._batch = (self._batch.reqs if self._batch else []), None
                finished = [
                    (
                        r,
                        {
                            "type": "abort",
                            "message": f"generation failed: {exc}",
                            "status_code": 500,
                            "err_type": "InternalServerError",
                        },
                    )
                    for r in failed
                ]
            with self._cv:
                self._stepping = False
                self._prefilling = []
                self._cv.notify_all()
            for req, reason in finished:
                self._finish(req, reason)

    @staticmethod
    def _compact(b: _Batch | None, keep: list[int]) -> _Batch | None:
        """Keep rows ``keep`` of batch ``b`` (None when no row is left)."""
        if b is None or len(keep) == len(b.reqs):
            return b
        if not keep:
            return None
        idx = torch.tensor(keep, dtype=torch.long)
        b.cache.batch_select_indices(idx)
        b.reqs = [b.reqs[i] for i in keep]
        b.attention_mask = b.attention_mask[idx]
        b.next_pos = b.next_pos[idx]
        b.next_input = b.next_input[idx]
        return b

    @staticmethod
    def _merge(a: _Batch, b: _Batch) -> _Batch:
        """Append the rows of ``b`` to ``a``, left-padding the shorter KV cache (padding is masked)."""
        length = max(a.attention_mask.shape[1], b.attention_mask.shape[1])

        def lpad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = length - t.shape[-dim_from_end]
            return torch.nn.functional.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0)) if missing else t

        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
            la.keys = torch.cat([lpad(la.keys, 2), lpad(lb.keys, 2)], dim=0)  # (B, H, L, D)
            la.values = torch.cat([lpad(la.values, 2), lpad(lb.values, 2)], dim=0)
        a.attention_mask = torch.cat([lpad(a.attention_mask, 1), lpad(b.attention_mask, 1)], dim=0)  # (B, L)
        a.next_pos = torch.cat([a.next_pos, b.next_pos])
        a.next_input = torch.cat([a.next_input, b.next_input])
        a.reqs = a.reqs + b.reqs
        return a

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self._cache_kw: cache},
        )
        return out.logits.float()

    def _prefill(self, reqs: list[_Request]) -> list[tuple[_Request, dict]]:
        from transformers import DynamicCache

        seqs = [r.prompt_ids + r.output_ids for r in reqs]  # retracted requests recompute their KV
        length = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)  # (B, L) left-padded
        mask = torch.zeros(len(seqs), length, dtype=torch.long)  # (B, L)
        for i, s in enumerate(seqs):
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        want_input = any(r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None for r in reqs)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, pos, cache, 0 if want_input else 1)  # (B, L or 1, V)
        if want_input:
            logp_all = torch.log_softmax(logits, dim=-1)  # (B, L, V)
            for i, r in enumerate(reqs):
                if r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None:
                    off = length - len(seqs[i])
                    vals: list[float | None] = []
                    for p in range(min(r.logprob_start_len, len(r.prompt_ids)), len(r.prompt_ids)):
                        vals.append(None if p == 0 else float(logp_all[i, off + p - 1, r.prompt_ids[p]]))
                    r.input_logprobs = vals
        new = _Batch(
            reqs=list(reqs),
            cache=cache,
            attention_mask=mask,
            next_pos=pos[:, -1] + 1,
            next_input=torch.zeros(len(reqs), 1, dtype=torch.long),
        )
        finished, new = self._sample_step(new, logits[:, -1, :])
        if new is not None:
            with self._cv:
                self._batch = new if self._batch is None else self._merge(self._batch, new)
        return finished

    def _decode(self) -> list[tuple[_Request, dict]]:
        b = self._batch
        assert b is not None
        b.attention_mask = torch.cat([b.attention_mask, torch.ones(len(b.reqs), 1, dtype=torch.long)], dim=1)
        logits = self._forward(b.next_input, b.attention_mask, b.next_pos[:, None], b.cache, 1)  # (B, 1, V)
        b.next_pos = b.next_pos + 1
        finished, remaining = self._sample_step(b, logits[:, -1, :])
        with self._cv:
            self._batch = remaining
        return finished

    def _sample_step(self, b: _Batch, logits: torch.Tensor) -> tuple[list[tuple[_Request, dict]], _Batch | None]:
        """Sample one token per row of ``logits: [B, V] float32``; return the ended rows and the rest of ``b``."""
        logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw policy log-probs
        finished: list[tuple[_Request, dict]] = []
        keep: list[int] = []
        for i, req in enumerate(b.reqs):
            p = req.params
            if len(req.output_ids) >= p.max_new_tokens:  # max_new_tokens == 0, or a retracted request at its limit
                finished.append((req, {"type": "length", "length": p.max_new_tokens}))
                continue
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            token = _sample_token(
                logits[i], p, req.generator, masked=stop_ids if len(req.output_ids) < p.min_new_tokens else ()
            )
            req.output_ids.append(token)
            req.output_logprobs.append(float(logp[i, token]))
            b.next_input[i, 0] = token
            if token in stop_ids:
                finished.append((req, {"type": "stop", "matched": token}))
            elif len(req.output_ids) >= p.max_new_tokens:
                finished.append((req, {"type": "length", "length": p.max_new_tokens}))
            elif len(req.prompt_ids) + len(req.output_ids) >= self.max_context_len:
                finished.append((req, {"type": "length", "length": len(req.output_ids)}))
            else:
                keep.append(i)
        return finished, self._compact(b, keep)


def _sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, masked) -> int:
    """Draw one token from ``logits: [V] float32`` with exactly one uniform draw from ``gen``."""
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


# --------------------------------------------------------------------------------------------
# Model-update read/write lock (asyncio side)
# --------------------------------------------------------------------------------------------


class _ModelUpdateLock:
    """SGLang's model-update lock on the event loop: generate = reader, updates = writer."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False

    @property
    def writer_active(self) -> bool:
        return self._writer

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self, wait_for_readers: bool) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._writer = True
            if wait_for_readers:
                await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()


# --------------------------------------------------------------------------------------------
# Request bodies (control endpoints: unknown keys ignored, missing body/fields -> 400)
# --------------------------------------------------------------------------------------------


class _Body(BaseModel):
    """Control bodies: unknown keys are ignored; a missing body or field is a 400."""

    model_config = ConfigDict(extra="ignore")
    rid: Any = None
    http_worker_ipc: Any = None


class InitGroupBody(_Body):
    """Body of ``POST /init_weights_update_group`` (SGLANG_API.md 2.1)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupBody(_Body):
    """Body of ``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


class BeginBody(_Body):
    """Body of ``POST /begin_weight_update``."""

    selector: Literal["all", "target", "draft"] = "all"


class EmptyBody(_Body):
    """A control body with no fields of its own (``{}``): ``/end_weight_update``, ``/flush_cache``."""

    pass


class UpdateDistBody(_Body):
    """Body of ``POST /update_weights_from_distributed`` (SGLANG_API.md 2.3)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["all", "target", "draft"] = "all"
    torch_empty_cache: bool = False


class PauseBody(_Body):
    """Body of ``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    """Body of ``POST /continue_generation``."""

    torch_empty_cache: bool = True


class AbortBody(_Body):
    """Body of ``POST /abort_request`` (rid prefix match, or all)."""

    rid: str = ""
    abort_all: bool = False


class UpdateVersionBody(_Body):
    """Body of ``POST /update_weight_version``."""

    new_version: str
    abort_all_requests: bool = True


class WeightsByNameBody(_Body):
    """Body of ``POST /get_weights_by_name``."""

    name: str
    truncate_size: int = Field(100, ge=0)


class GenerateBody(BaseModel):
    """Body of ``POST /generate`` (top-level keys; ``sampling_params`` is checked by ``parse_sampling_params``)."""

    model_config = ConfigDict(extra="ignore")
    text: Any = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False


# --------------------------------------------------------------------------------------------
# HTTP application
# --------------------------------------------------------------------------------------------

_OPEN_PATHS = {"/health", "/health_generate", "/ready", "/metrics"}
_NORMAL_PATHS = {"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info"}


PARTIAL_VERSION_SUFFIX = "+partial"
"""Appended to ``weight_version`` when a failed update left the weights partly written."""


@dataclass
class ServerState:
    """Everything the HTTP handlers share (one per server process)."""

    engine: GenerationEngine
    model_path: str
    dtype: torch.dtype
    args: argparse.Namespace
    groups: dict[str, Any] = field(default_factory=dict)
    session_open: bool = False
    session_wrote: bool = False
    """An ``/update_weights_from_distributed`` call of the open session has written weights."""
    recv_buffer: torch.Tensor | None = None
    """Receive buffer of flattened buckets, grown to the largest bucket seen."""
    lock: _ModelUpdateLock = field(default_factory=_ModelUpdateLock)
    update_calls: int = 0
    """``/update_weights_from_distributed`` calls seen (numbering for ``FAULT_REFUSE_UPDATES_ENV``)."""
    control_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="control")
    )


FAULT_REFUSE_UPDATES_ENV = "MEGATRON_RL_FAULT_REFUSE_WEIGHT_UPDATES"
"""Fault injection, for tests of the trainer's sync retry: a comma-separated list of 1-based
``/update_weights_from_distributed`` call numbers that this server refuses (HTTP 400, before joining
the broadcast, as a server that rejects a bucket does). Unset in normal use."""


def _fault_refused_update_calls() -> frozenset[int]:
    """The call numbers of ``FAULT_REFUSE_UPDATES_ENV``. Raises ValueError naming the variable on junk."""
    raw = os.environ.get(FAULT_REFUSE_UPDATES_ENV, "").strip()
    if not raw:
        return frozenset()
    try:
        calls = frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{FAULT_REFUSE_UPDATES_ENV}={raw!r}: expected comma-separated call numbers like 2,3") from None
    if any(c < 1 for c in calls):
        raise ValueError(f"{FAULT_REFUSE_UPDATES_ENV}={raw!r}: call numbers start at 1")
    return calls


def build_app(state: ServerState):
    """Build the FastAPI app for ``state`` (SGLang's endpoints, bodies, answers and auth)."""
    app = FastAPI(title="megatron-rl embedded rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    args = state.args
    engine = state.engine

    def key_ok(request: Request, key: str | None) -> bool:
        header = request.headers.get("authorization", "")
        return (
            key is not None and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), key.encode())
        )

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if path not in _OPEN_PATHS:
            if path in _NORMAL_PATHS:
                ok = args.api_key is None or key_ok(request, args.api_key) or key_ok(request, args.admin_api_key)
            elif args.admin_api_key is not None:
                ok = key_ok(request, args.admin_api_key)
            else:
                ok = args.api_key is None or key_ok(request, args.api_key)
            if not ok:
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return JSONResponse(exc.body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"object": "error", "message": str(exc.errors())}, status_code=400)

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        if not raw.strip():
            raise RequestError({"object": "error", "message": "1 validation error: body: 'Field required'"})
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise RequestError({"object": "error", "message": _validation_text(e)}) from None

    def ok(message: str = "Success", **extra) -> JSONResponse:
        return JSONResponse({"success": True, "message": message, **extra}, status_code=200)

    def fail(message: str, **extra) -> JSONResponse:
        return JSONResponse({"success": False, "message": message, **extra}, status_code=400)

    async def in_control_thread(fn, *a):
        return await asyncio.get_running_loop().run_in_executor(state.control_pool, fn, *a)

    # ---- health and info ----------------------------------------------------------------

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if engine.paused or state.lock.writer_active:
            return Response(status_code=200)
        try:
            outs = await asyncio.wait_for(
                run_requests(
                    [[0]],
                    [SamplingParams(max_new_tokens=1, temperature=0.0)],
                    [f"HEALTH_CHECK_{uuid.uuid4().hex}"],
                    [False],
                    [-1],
                ),
                timeout=60,
            )
        except (TimeoutError, RequestError):
            return Response(status_code=503)
        return Response(status_code=200 if outs and outs[0]["meta_info"]["finish_reason"]["type"] != "abort" else 503)

    def model_info_body() -> dict:
        cfg = engine.model.config
        return {
            "model_path": state.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "dtype": dtype_name(state.dtype),
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return JSONResponse(model_info_body())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        from megatron_rl import __version__

        return JSONResponse(
            {
                "server": "megatron-rl embedded HF server",
                "version": __version__,
                "model_path": state.model_path,
                "host": args.host,
                "port": args.port,
                "dtype": dtype_name(state.dtype),
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "max_running_requests": engine.max_batch_size,
                "random_seed": args.random_seed,
                "skip_tokenizer_init": True,
                "enable_deterministic_inference": bool(args.enable_deterministic_inference),
                "weight_version": engine.weight_version,
                "eos_token_ids": list(engine.eos_token_ids),
                "context_length": engine.max_context_len,
                "paused": engine.paused,
                "num_running_reqs": engine.counts()[0],
                "num_waiting_reqs": engine.counts()[1],
            }
        )

    # ---- generation ---------------------------------------------------------------------

    async def run_requests(prompts, params, rids, return_logprobs, start_lens) -> list[dict]:
        loop = asyncio.get_running_loop()
        futures = []
        reqs = []
        for prompt, p, rid, rl, sl in zip(prompts, params, rids, return_logprobs, start_lens):
            fut = loop.create_future()

            def on_done(req, fut=fut):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

            reqs.append(
                _Request(
                    rid=rid,
                    prompt_ids=list(prompt),
                    params=p,
                    return_logprob=rl,
                    logprob_start_len=sl,
                    generator=engine.new_generator(p.sampling_seed),
                    on_done=on_done,
                )
            )
            futures.append(fut)
        await state.lock.acquire_read()
        try:
            for req in reqs:
                engine.submit(req)
            done = await asyncio.gather(*futures)
        finally:
            await state.lock.release_read()
        return [response_of(r) for r in done]

    def response_of(req: _Request) -> dict:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "num_retractions": req.num_retractions,
            "weight_version": req.weight_version,
            "e2e_latency": time.monotonic() - req.created_s,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)]
            meta["output_token_logprobs_length"] = len(req.output_ids)
            if req.input_logprobs is not None:
                start = len(req.prompt_ids) - len(req.input_logprobs)
                meta["input_token_logprobs"] = [
                    [lp, tok, None] for lp, tok in zip(req.input_logprobs, req.prompt_ids[start:])
                ]
        return {"output_ids": list(req.output_ids), "meta_info": meta}

    def per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, list):
            if len(value) != n:
                raise RequestError({"error": f"{name} has {len(value)} entries for a batch of {n} prompts"})
            return list(value)
        return [value] * n

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        raw = await request.body()
        try:
            data = json.loads(raw or b"null")
        except json.JSONDecodeError as e:
            raise RequestError({"error": f"invalid JSON body: {e}"}) from None
        if not isinstance(data, dict):
            raise RequestError({"error": "the body must be a JSON object"})
        # sampling_params is checked first and by hand, so that an unknown key names itself.
        sp_raw = data.get("sampling_params")
        for sp in sp_raw if isinstance(sp_raw, list) else [sp_raw]:
            parse_sampling_params(sp)
        try:
            body = GenerateBody.model_validate(data)
        except ValidationError as e:
            raise RequestError({"error": _validation_text(e)}) from None
        if body.text is not None or body.input_embeds is not None:
            raise RequestError(
                {"error": "the embedded server runs without a tokenizer (ids in, ids out): send input_ids"}
            )
        if body.input_ids is None:
            raise RequestError({"error": "Either text, input_ids or input_embeds should be provided."})
        if body.stream:
            raise RequestError({"error": "stream=true is not supported by the embedded server"})
        for name, val, neutral in (
            ("top_logprobs_num", body.top_logprobs_num, 0),
            ("token_ids_logprob", body.token_ids_logprob, None),
        ):
            if any(v not in (neutral, None) for v in (val if isinstance(val, list) else [val])):
                raise RequestError({"error": f"{name} is not supported by the embedded server"})
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RequestError({"error": "input_ids must not be empty"})
        k = len(prompts)
        params = [parse_sampling_params(sp) for sp in per_prompt(sp_raw, k, "sampling_params")]
        if batch:
            rids = (
                per_prompt(body.rid, k, "rid")
                if isinstance(body.rid, list)
                else ([f"{body.rid}_{i}" for i in range(k)] if body.rid is not None else [None] * k)
            )
        else:
            if isinstance(body.rid, list):
                raise RequestError({"error": "rid must be a string for a single prompt"})
            rids = [body.rid]
        rls = per_prompt(body.return_logprob, k, "return_logprob")
        sls = per_prompt(body.logprob_start_len, k, "logprob_start_len")
        exp_prompts, exp_params, exp_rids, exp_rls, exp_sls = [], [], [], [], []
        for prompt, p, rid, rl, sl in zip(prompts, params, rids, rls, sls):
            base = rid if rid is not None else uuid.uuid4().hex
            for j in range(p.n):
                seed = None if p.sampling_seed is None else p.sampling_seed + j
                exp_prompts.append(prompt)
                exp_params.append(SamplingParams(**{**p.__dict__, "n": 1, "sampling_seed": seed}))
                exp_rids.append(base if p.n == 1 else f"{base}_{j}")
                exp_rls.append(bool(rl))
                exp_sls.append(int(sl))
        outs = await run_requests(exp_prompts, exp_params, exp_rids, exp_rls, exp_sls)
        if not batch and len(outs) == 1:
            return JSONResponse(outs[0])
        return JSONResponse(outs)

    # ---- control ------------------------------------------------------------------------

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse(request, AbortBody)
        await in_control_thread(lambda: engine.abort(body.rid, body.abort_all))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await parse(request, PauseBody)
        await in_control_thread(engine.pause, body.mode)
        return ok("Generation paused")

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await parse(request, ContinueBody)
        engine.resume()
        return ok("Generation continued")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request, timeout: float = 0.0):
        await parse(request, EmptyBody)
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            can, why = engine.can_flush()
            if can or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if not can:
            return PlainTextResponse(f"Cache not flushed: {why}.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n", status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await parse(request, UpdateVersionBody)
        if body.abort_all_requests:
            await in_control_thread(lambda: engine.abort("", True))
        engine.weight_version = body.new_version
        return ok(f"Weight version updated to {body.new_version}", new_version=body.new_version)

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request):
        body = await parse(request, WeightsByNameBody)
        param = engine.get_parameter(body.name)
        if param is None:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)

        def read():
            with engine.model_lock:
                return param.detach().float().cpu()[: body.truncate_size].tolist()

        return JSONResponse(await in_control_thread(read))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await parse(request, InitGroupBody)
        if body.group_name in state.groups:
            return fail(f"Failed to init group: a group named {body.group_name!r} already exists")
        if body.backend == "nccl" and not torch.cuda.is_available():
            return fail("Failed to init group: backend 'nccl' needs CUDA; the embedded server runs on CPU, use 'gloo'")

        def join():
            from megatron_rl.weight_sync.group import init_custom_process_group

            return init_custom_process_group(
                backend=body.backend,
                host=body.master_address,
                port=body.master_port,
                world_size=body.world_size,
                rank=body.rank_offset,
                group_name=body.group_name,
                timeout_s=args.weight_sync_timeout_s,
            )

        try:
            state.groups[body.group_name] = await in_control_thread(join)
        except Exception as e:
            logger.exception("init_weights_update_group failed")
            return fail(f"Failed to init group: {e}")
        return ok("Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await parse(request, DestroyGroupBody)
        pg = state.groups.pop(body.group_name, None)
        if pg is None:
            return fail(f"Failed to destroy group: no group named {body.group_name!r}")
        from megatron_rl.weight_sync.group import destroy_custom_process_group

        try:
            await in_control_thread(destroy_custom_process_group, pg)
        except Exception as e:
            return fail(f"Failed to destroy group: {e}")
        return ok("Succeeded to destroy custom process group.")

    async def with_write_lock(fn, abort_all: bool = False):
        if abort_all:
            await in_control_thread(lambda: engine.abort("", True))
        await state.lock.acquire_write(wait_for_readers=not engine.paused)
        try:
            return await fn()
        finally:
            await state.lock.release_write()

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        body = await parse(request, BeginBody)

        async def run():
            if body.selector == "draft":
                return fail("begin_weight_update failed: the server has no draft model")
            if state.session_open:
                return fail(
                    "begin_weight_update() called while a weight update session is already open; "
                    "call end_weight_update() first"
                )
            state.session_open = True
            state.session_wrote = False
            return ok("Weight update session started")

        return await with_write_lock(run)

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await parse(request, EmptyBody)

        async def run():
            if not state.session_open:
                return fail(
                    "end_weight_update() called without an open weight update session; call begin_weight_update() first"
                )
            state.session_open = False
            return ok("Weight update session ended")

        return await with_write_lock(run)

    refuse_calls = _fault_refused_update_calls()

    def mark_partial() -> str:
        # the weights match no version: say so wherever the version shows (/model_info, every
        # generation's meta_info), so no one takes them for the old version
        if not engine.weight_version.endswith(PARTIAL_VERSION_SUFFIX):
            engine.weight_version += PARTIAL_VERSION_SUFFIX
        logger.warning("weights partly updated by a failed update; weight_version is now %r until all "
                       "weights are sent again", engine.weight_version)
        return (f"The weights may be partly updated (weight_version is now {engine.weight_version!r}); "
                "send all of them again")

    def refuse(message: str, *, before_writing: bool = True):
        """A failed update call. It wrote nothing (``before_writing``), but an earlier call of the open
        session may have: then the weights are a mix of two versions and the version says so."""
        if state.session_open and state.session_wrote:
            earlier = " This call changed no weight, but earlier calls of this session did." if before_writing else ""
            return fail(f"{message}.{earlier} {mark_partial()}.")
        return fail(f"{message}. No weight was changed.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await parse(request, UpdateDistBody)
        state.update_calls += 1
        if state.update_calls in refuse_calls:  # fault injection for tests (FAULT_REFUSE_UPDATES_ENV)
            logger.warning("refusing update_weights_from_distributed call %d (%s)", state.update_calls,
                           FAULT_REFUSE_UPDATES_ENV)
            return refuse(f"Failed to update weights: call {state.update_calls} refused by {FAULT_REFUSE_UPDATES_ENV}")
        if not state.session_open:
            return fail(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        if not (len(body.names) == len(body.dtypes) == len(body.shapes)) or not body.names:
            return refuse(
                f"Failed to update weights: names, dtypes and shapes must be non-empty lists of one length, "
                f"got {len(body.names)}, {len(body.dtypes)}, {len(body.shapes)}"
            )
        if body.load_format not in (None, "flattened_bucket"):
            return refuse(
                f"Failed to update weights: load_format {body.load_format!r} is not supported "
                "(use null or 'flattened_bucket')"
            )
        if body.selector == "draft":
            return refuse("Failed to update weights: the server has no draft model")
        try:
            dtypes = [dtype_from_name(d) for d in body.dtypes]
            flattened_layout(dtypes, body.shapes)
        except ValueError as e:
            return refuse(f"Failed to update weights: {e}")
        pg = state.groups.get(body.group_name)
        if pg is None:
            return refuse(f"Failed to update weights: no weight update group named {body.group_name!r}")

        def receive_and_load() -> None:
            import torch.distributed as dist

            if body.load_format is None:
                targets = engine.direct_targets(body.names, dtypes, body.shapes)
                if targets is not None:  # every entry is a parameter as it is: receive in place, no copy
                    with engine.model_lock, torch.no_grad():
                        state.session_wrote = True  # from the first byte on (a failure leaves a mix)
                        for t in targets:
                            dist.broadcast(t, src=0, group=pg)
                    return
            meta = BucketMeta(names=body.names, dtypes=body.dtypes, shapes=body.shapes)
            # one receive buffer kept across buckets and syncs (load_weights copies out of it; update
            # calls run one at a time under the write lock): no fresh pages to fault in per bucket
            if state.recv_buffer is None or state.recv_buffer.numel() < meta.nbytes:
                state.recv_buffer = None
                state.recv_buffer = torch.empty(meta.nbytes, dtype=torch.uint8)
            flat = state.recv_buffer[: meta.nbytes]  # (nbytes,)
            named = unflatten_bucket(flat, meta)  # views into flat
            if body.load_format == "flattened_bucket":
                dist.broadcast(flat, src=0, group=pg)
            else:  # null: one broadcast per tensor, in list order, each into its view
                for _, t in named:
                    dist.broadcast(t, src=0, group=pg)
            engine.load_weights(named)  # validates every name and shape before writing any
            state.session_wrote = True

        async def run():
            try:
                await in_control_thread(receive_and_load)
            except ValueError as e:  # refused after receiving, before writing
                return refuse(f"Failed to update weights: {e}")
            except Exception as e:  # a failed collective or allocation: the group may be out of step
                logger.exception("update_weights_from_distributed failed")
                return refuse(f"Failed to update weights: {e}; the group may be out of step (destroy and "
                              "re-create it before the next update)", before_writing=False)
            if body.weight_version is not None:  # a complete version: what follows starts a new mix
                engine.weight_version = body.weight_version
                state.session_wrote = False
            if body.flush_cache:
                can, why = engine.can_flush()
                if not can:
                    return fail(f"Weights updated but the cache flush failed: {why}")
            return ok("Succeeded to update parameter online from distributed.")

        return await with_write_lock(run, abort_all=body.abort_all_requests)

    return app


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def build_arg_parser() -> argparse.ArgumentParser:
    """Command-line flags of the embedded server (SGLang's names where SGLang has the flag)."""
    p = argparse.ArgumentParser(prog="megatron-rl rollout-server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight dtype; auto = the checkpoint's torch_dtype, float32 when unset",
    )
    p.add_argument(
        "--api-key", default=None, help="Bearer key for /generate (and control endpoints without --admin-api-key)"
    )
    p.add_argument("--admin-api-key", default=None, help="Bearer key required by the control endpoints")
    p.add_argument("--weight-version", default="default", help="initial weight version label")
    p.add_argument("--max-batch-size", type=int, default=256, help="most sequences decoded together")
    p.add_argument("--random-seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="run every request in a batch of its own (results bitwise independent of other requests)",
    )
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument(
        "--weight-sync-timeout-s",
        type=float,
        default=600.0,
        help="rendezvous and broadcast timeout of weight-update groups",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process dies (the trainer that launched the server; SGLang's watchdog does the same)",
    )
    return p


def _watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Daemon thread: once `parent_pid` is gone (killed with SIGKILL, so it could not stop us),
    send ourselves SIGTERM for a clean shutdown, and exit hard 10 s later if that hangs."""
    import signal

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(parent_pid, 0)
                alive = os.getppid() == parent_pid
            except ProcessLookupError:
                alive = False
            except PermissionError:  # exists, owned by someone else: not our parent any more
                alive = os.getppid() == parent_pid
            if not alive:
                logger.warning("parent process %d is gone; shutting down", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
                os._exit(1)

    threading.Thread(target=run, name="parent-watchdog", daemon=True).start()


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail in milliseconds, before the model loads: exits 2 with a usage message naming the flag."""
    import socket
    from pathlib import Path

    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: not a Hugging Face model folder (no config.json)")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 1-65535")
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size {args.max_batch_size}: must be >= 1")
    if args.weight_sync_timeout_s <= 0:
        parser.error(f"--weight-sync-timeout-s {args.weight_sync_timeout_s}: must be > 0")
    with socket.socket() as sock:  # the port is free now (uvicorn binds it after the model loads)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            parser.error(f"--host {args.host} --port {args.port}: cannot bind ({e.strerror})")


def _load_model(model_path: str, dtype: str, attn_implementation: str):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    if dtype == "auto":
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        torch_dtype = (
            cfg_dtype
            if isinstance(cfg_dtype, torch.dtype)
            else (dtype_from_name(cfg_dtype) if isinstance(cfg_dtype, str) else torch.float32)
        )
    else:
        torch_dtype = dtype_from_name(dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.eval()
    eos: list[int] = []
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        gen_eos = None
    for src in (gen_eos, getattr(config, "eos_token_id", None)):
        if src is not None:
            eos += [src] if isinstance(src, int) else list(src)
    return model, torch_dtype, sorted(set(eos))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the process exit code."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [rollout-server:%(process)d] %(name)s: %(message)s",
    )
    import uvicorn

    import faulthandler

    faulthandler.enable()  # a crash in native code leaves its stack in the log
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    torch.manual_seed(args.random_seed)
    logger.info("loading %s (dtype=%s)", args.model_path, args.dtype)
    model, torch_dtype, eos = _load_model(args.model_path, args.dtype, args.attn_implementation)
    engine = GenerationEngine(
        model,
        eos_token_ids=eos,
        max_batch_size=args.max_batch_size,
        random_seed=args.random_seed,
        deterministic=args.enable_deterministic_inference,
        weight_version=args.weight_version,
    )
    state = ServerState(engine=engine, model_path=args.model_path, dtype=torch_dtype, args=args)
    app = build_app(state)
    logger.info(
        "serving on http://%s:%d (eos ids %s, weight_version %s)", args.host, args.port, eos, args.weight_version
    )
    # keep idle connections longer than clients keep them (KEEPALIVE_EXPIRY_S) so the server is
    # never the side that closes a connection a client is about to reuse
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_keep_alive=75)
    logger.info("shut down (signal or parent exit)")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
