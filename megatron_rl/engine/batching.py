"""The embedded server's generation engine: batched, KV-cached sampling on one HF causal LM.

A scheduler thread gathers whatever is queued (up to ``max_batch_size``), left-pads it, prefills,
then decodes the batch with a KV cache; a request leaves the batch (and its HTTP call returns) as
soon as it finishes. Requests that arrive meanwhile are prefilled together at the next step
boundary and join the running batch (the shorter KV cache is left-padded; padding is masked), so a
late request never waits for a long one to end. Each request samples with its own
``torch.Generator`` seeded by ``sampling_seed`` (see ``megatron_rl.engine.sampling``), so its tokens
depend only on its prompt, parameters, seed and the weights, up to the float32 rounding of batched
matmuls (about 1e-7 in the logits; a token can flip only at a near-tie). With ``deterministic``
(``--enable-deterministic-inference``) every request runs in a batch of its own, which makes the
results bitwise independent of what else is in flight (slower).

The weights are only written between decoding steps (``GenerationEngine.model_lock``), and no step
runs from the first update call of a weight-update session to its end (``hold`` / ``release_hold``):
a multi-bucket update is never seen half applied. Every request records the weight version each of its tokens was sampled
under (``Request.version_spans``; the prefill counts toward the first token's version).

Mixture-of-Experts models (``megatron_rl.engine.moe``): weight updates take the per-expert HF names
(``...mlp.experts.E.{gate,up,down}_proj.weight``) and write them into transformers' fused in-memory
experts; a request with ``return_routed_experts`` records, for every position the engine feeds
through the model (prompt, then each generated token but the last), the top-k expert ids of every
layer's router (``Request.routed``), from the forward that processed it: a retracted request's
recomputation overwrites its earlier positions, as SGLang's capture buffer would. The hooks are
armed only for forwards that hold such a request.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.engine.bodies import RequestError
from megatron_rl.engine.moe import ExpertViews, RouterCapture
from megatron_rl.engine.sampling import (SamplingParams, is_plain, matched_stop_string, sample_plain_rows,
                                         sample_token)

logger = logging.getLogger(__name__)

__all__ = ["GenerationEngine", "Request"]


@dataclass(eq=False)
class Request:
    """One sequence being generated (one output of ``/generate``)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    generator: torch.Generator
    on_done: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, Any] | None = None
    abort_requested: bool = False
    num_retractions: int = 0
    weight_version: str = ""
    version_spans: list[list] = field(default_factory=list)
    """``[version, start, end]`` over output token indices, one per version the tokens were sampled
    under, in order (SGLang 0.5.23's ``meta_info.weight_versions``)."""
    created_s: float = field(default_factory=time.monotonic)
    stop_ids: frozenset[int] | None = None
    """The ids that end this request (set by the engine on its first token)."""
    return_routed_experts: bool = False
    """Record the routed experts of every position processed (SGLang's ``return_routed_experts``)."""
    routed_start: int = 0
    """First position reported (SGLang's ``routed_experts_start_len``, 0 <= it <= prompt length)."""
    routed: torch.Tensor | None = None
    """[capacity, L, K] int32: row t = the top-k expert ids, per MoE layer, of position t of
    prompt + output as the engine processed it; rows ``[0, routed_len)`` are written (allocated
    by the first prefill that holds the request, with room for prompt + ``max_new_tokens``)."""
    routed_len: int = 0
    """Positions of ``routed`` written: prompt + output - 1 once a token was made, 0 before any forward."""

    def routed_experts(self) -> torch.Tensor | None:
        """What the answer reports: rows ``[routed_start, prompt + output - 1)`` of ``routed``,
        [T, L, K] int32; None when routing was not asked for or no forward processed the request."""
        if not self.return_routed_experts or self.routed is None or self.routed_len == 0:
            return None
        end = min(self.routed_len, max(len(self.prompt_ids) + len(self.output_ids) - 1, 0))
        return self.routed[min(self.routed_start, end) : end]

    def note_token(self, version: str) -> None:
        """Count the token just appended to ``output_ids`` as sampled under ``version``."""
        n = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = n
        else:
            self.version_spans.append([version, n - 1, n])


@dataclass(eq=False)
class _Batch:
    reqs: list[Request]
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
        weight_version: the initial version label.
        on_forward: called on the scheduler thread with ``"prefill"`` or ``"decode"`` right before
            every model forward, under ``model_lock`` (tests record what each forward sees; see
            ``megatron_rl.engine.test_hooks``). None in normal use.
        step_delay_s: seconds slept before every step, outside the lock (tests only: slow decoding).
        context_length: tokens a sequence (prompt + output) may hold (SGLang's ``--context-length``);
            None = the model's ``max_position_embeddings``. Must be >= 2 and at most that.
        processed_logprobs: report ``log_softmax(logits / temperature)`` of each sampled token instead
            of the raw policy's (tests only: a misconfigured engine, ``test_hooks.PROCESSED_LOGPROBS_ENV``).

    Raises:
        ValueError: ``max_batch_size`` < 1 or ``context_length`` out of range.
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
        on_forward: Callable[[str], None] | None = None,
        step_delay_s: float = 0.0,
        context_length: int | None = None,
        processed_logprobs: bool = False,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.max_batch_size = 1 if deterministic else max_batch_size
        self.weight_version = weight_version
        self.max_context_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        if context_length is not None and not 2 <= context_length <= self.max_context_len:
            raise ValueError(f"context_length must be in [2, {self.max_context_len}] (the model's "
                             f"max_position_embeddings), got {context_length}")
        self.max_context_len = context_length or self.max_context_len
        self.processed_logprobs = processed_logprobs
        self.decode = decode  # ids -> text (the server's tokenizer) for stop strings; None: refused (app.py)
        self.vocab_size = int(model.config.vocab_size)
        self.model_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: deque[Request] = deque()
        self._batch: _Batch | None = None
        # Requests taken from the queue for the prefill now running: in neither the queue nor the
        # batch until the step ends, yet pause(abort) and abort() must reach them.
        self._prefilling: list[Request] = []
        self._paused = False
        self._pause_mode = "abort"
        self._held = False
        self.on_forward = on_forward
        self.step_delay_s = step_delay_s
        self._stepping = False
        self._steps_ended = 0  # steps (prefill or decode) ended so far; see _wait_boundary
        self._stopping = False
        self._seed_rng = random.Random(random_seed)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._params = dict(model.state_dict(keep_vars=True))
        self._experts = ExpertViews(self._params)
        self.routers = RouterCapture(model)
        """The MoE routers' capture hooks (``routers.supported``: whether routing can be returned)."""
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

    def submit(self, req: Request) -> None:
        """Queue a request; ``req.on_done(req)`` is called on the scheduler thread when it ends.

        Raises:
            RequestError: 400 when the prompt does not fit the context or holds ids outside the vocabulary.
        """
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
        if req.return_routed_experts and not self.routers.supported:
            raise RequestError({"error": f"return_routed_experts: the model ({type(self.model).__name__}) has no "
                                         "Mixture-of-Experts router"})
        if req.return_routed_experts and not 0 <= req.routed_start <= len(req.prompt_ids):
            raise RequestError({"error": f"routed_experts_start_len={req.routed_start} must be in [0, "
                                         f"{len(req.prompt_ids)}] (the number of input tokens)"})
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

    def hold(self) -> None:
        """Run no step until ``release_hold`` (a weight-update session has written weights); returns
        at a step boundary. Aborts are still applied while held."""
        with self._cv:
            self._held = True
            self._cv.notify_all()
        self._wait_boundary()

    def release_hold(self) -> None:
        """Let the scheduler step again (the weight-update session ended or failed)."""
        with self._cv:
            self._held = False
            self._cv.notify_all()

    @property
    def held(self) -> bool:
        """True between ``hold`` and ``release_hold``."""
        return self._held

    def wait_unheld(self, timeout_s: float) -> bool:
        """Block until no hold is on (at most ``timeout_s`` seconds); returns whether none is."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._held, timeout=timeout_s)

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

    def _target(self, name: str) -> torch.Tensor | None:
        """The tensor ``name`` writes: a parameter (or persistent buffer) by its in-memory HF name,
        or a per-expert HF name's view of its fused parameter (``ExpertViews``); None if unknown."""
        p = self._params.get(name)
        return p if p is not None else self._experts.view(name)

    def weight_names(self) -> list[str]:
        """The HF names a complete weight update sends: the in-memory names with fused experts
        replaced by their per-expert names (as on disk and on the wire)."""
        fused = self._experts.fused_names()
        return [n for n in self._params if n not in fused] + self._experts.names()

    def weight_units(self, name: str) -> list:
        """What writing ``name`` rewrites, as hashable keys: ``id`` of the parameter (tied names share
        one), or ``(id(fused parameter), expert, part)`` per expert part; [] for an unknown name."""
        units = self._experts.units(name)
        if units is not None:
            return units
        p = self._params.get(name)
        return [] if p is None else [id(p)]

    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model, all or nothing.

        Names are the in-memory ones or, for Mixture-of-Experts layers, the per-expert names
        (``...mlp.experts.E.{gate,up,down}_proj.weight``, written into the fused experts). Every
        name and shape is checked before any parameter is written; values are cast to the
        parameter dtype by ``copy_``.

        Raises:
            ValueError: an unknown name or a shape mismatch (nothing written).
        """
        targets = [self._target(n) for n, _ in named_tensors]
        unknown = [n for (n, _), t in zip(named_tensors, targets) if t is None]
        if unknown:
            raise ValueError(f"unknown parameter name(s) {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
        wrong = [
            (n, list(t.shape), list(p.shape))
            for (n, t), p in zip(named_tensors, targets)
            if tuple(t.shape) != tuple(p.shape)
        ]
        if wrong:
            raise ValueError("shape mismatch (name, received, expected): " + ", ".join(map(str, wrong[:10])))
        with self.model_lock, torch.no_grad():
            for (_, tensor), p in zip(named_tensors, targets):
                p.copy_(tensor)

    def direct_targets(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                       shapes: Sequence[Sequence[int]]) -> list[torch.Tensor] | None:
        """The parameters named ``names`` (detached, sharing storage; a per-expert name gives its view
        of the fused experts) when each one exists, is contiguous and has exactly the given dtype and
        shape, and no name repeats, so one broadcast per entry can land in place; None otherwise (the
        caller receives into a buffer and goes through ``load_weights``, which validates and casts)."""
        if len(set(names)) != len(names):
            return None
        out = []
        for name, dt, shape in zip(names, dtypes, shapes):
            p = self._target(name)
            if p is None or p.dtype != dt or list(p.shape) != [int(d) for d in shape] or not p.is_contiguous():
                return None
            out.append(p.detach())
        return out

    def get_parameter(self, name: str) -> torch.Tensor | None:
        """The parameter (or persistent buffer) named ``name`` in HF naming, a per-expert name's view
        of the fused experts, or None."""
        return self._target(name)

    def close(self) -> None:
        """Stop the scheduler thread (requests in flight are aborted)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- scheduler ----------------------------------------------------------------------

    def _live(self) -> list[Request]:
        """Under ``_cv``: every request not finished yet (queued, being prefilled, running)."""
        return list(self._queue) + self._prefilling + (self._batch.reqs if self._batch else [])

    def _wait_boundary(self) -> None:
        # Wait until the step running when the caller changed state is over; the scheduler
        # applies the change (abort, retract, pause) before it starts another step. "Over" is
        # counted, not seen: the scheduler starts the next step as soon as one ends, so a waiter
        # looking only for "no step running" could miss every boundary until the batch finished.
        with self._cv:
            if not self._stepping:
                return
            running = self._steps_ended
            self._cv.wait_for(lambda: not self._stepping or self._steps_ended != running, timeout=600)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        # SGLang: the version of the last token (the current one when no token was made)
        req.weight_version = req.version_spans[-1][0] if req.version_spans else self.weight_version
        try:
            req.on_done(req)
        except Exception:  # the HTTP side went away; the scheduler must go on
            logger.exception("on_done callback failed for rid %s", req.rid)

    def _abort_reason(self) -> dict[str, Any]:
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def _next_work(self) -> tuple[list[tuple[Request, dict]], list[Request] | None, bool]:
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
            if not self._paused and not self._held:
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
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)
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
                self._steps_ended += 1
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

    def _forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep, routed: bool = False):
        """One model forward: ``(logits [B, kept, V] float32, routing)``; routing is the routers'
        top-k of every input position, [B, S, L, K] int32 (S = ``input_ids.shape[1]``), when
        ``routed``, else None."""
        if self.on_forward is not None:
            self.on_forward("prefill" if cache.get_seq_length() == 0 else "decode")
        if routed:
            self.routers.arm()
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kw: cache},
            )
        except BaseException:
            self.routers.disarm()
            raise
        routing = self.routers.collect(*input_ids.shape) if routed else None
        return out.logits.float(), routing

    def _alloc_routed(self, req: Request) -> None:
        """Give ``req`` its routing buffer (room for prompt + ``max_new_tokens`` positions)."""
        if req.routed is None:
            cap = min(len(req.prompt_ids) + req.params.max_new_tokens, self.max_context_len) + 1
            req.routed = torch.zeros(cap, self.routers.num_layers, self.routers.topk, dtype=torch.int32)

    def _prefill(self, reqs: list[Request]) -> list[tuple[Request, dict]]:
        from transformers import DynamicCache

        seqs = [r.prompt_ids + r.output_ids for r in reqs]  # retracted requests recompute their KV
        length = max(len(s) for s in seqs)
        # Shared prefill: identical sequences (the n responses of one prompt) are run once and their
        # KV cache and logits repeated, as SGLang's radix cache shares a group's prompt.
        first: dict[tuple[int, ...], int] = {}
        expand = torch.tensor([first.setdefault(tuple(s), len(first)) for s in seqs], dtype=torch.long)  # (B,)
        uniq = list(first)
        ids = torch.zeros(len(uniq), length, dtype=torch.long)  # (U, L) left-padded
        mask = torch.zeros(len(uniq), length, dtype=torch.long)  # (U, L)
        for i, s in enumerate(uniq):
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, L)
        want_input = any(r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None for r in reqs)
        want_routed = any(r.return_routed_experts for r in reqs)
        cache = DynamicCache(config=self.model.config)
        logits, routing = self._forward(ids, mask, pos, cache, 0 if want_input else 1, want_routed)  # (U, L or 1, V)
        if len(uniq) < len(seqs):
            cache.batch_select_indices(expand)
            logits, mask, pos = logits[expand], mask[expand], pos[expand]  # (B, ...)
        if routing is not None:  # (U, L, layers, K): every position of prompt + output so far
            for i, r in enumerate(reqs):
                if r.return_routed_experts:
                    self._alloc_routed(r)
                    n = len(seqs[i])
                    r.routed[:n] = routing[int(expand[i]), length - n :]
                    r.routed_len = n
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

    def _decode(self) -> list[tuple[Request, dict]]:
        b = self._batch
        assert b is not None
        b.attention_mask = torch.cat([b.attention_mask, torch.ones(len(b.reqs), 1, dtype=torch.long)], dim=1)
        want_routed = any(r.return_routed_experts for r in b.reqs)
        logits, routing = self._forward(b.next_input, b.attention_mask, b.next_pos[:, None], b.cache, 1,
                                        want_routed)  # (B, 1, V)
        b.next_pos = b.next_pos + 1
        if routing is not None:  # (B, 1, layers, K): the position of each row's last output token
            for i, r in enumerate(b.reqs):
                if r.return_routed_experts and r.routed is not None and r.routed_len < r.routed.shape[0]:
                    r.routed[r.routed_len] = routing[i, 0]
                    r.routed_len += 1
        finished, remaining = self._sample_step(b, logits[:, -1, :])
        with self._cv:
            self._batch = remaining
        return finished

    def _sample_step(self, b: _Batch, logits: torch.Tensor) -> tuple[list[tuple[Request, dict]], _Batch | None]:
        """Sample one token per row of ``logits: [B, V] float32``; return the ended rows and the rest of ``b``.

        Rows whose parameters are plain (``sampling.is_plain``, no stop id masked) are drawn together
        (``sample_plain_rows``); the others one by one (``sample_token``): the same token either way."""
        logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw policy log-probs
        if self.processed_logprobs:  # tests only: an engine reporting temperature-scaled ones (greedy: raw)
            temps = torch.tensor([r.params.temperature or 1.0 for r in b.reqs], dtype=logits.dtype)[:, None]
            logp = torch.log_softmax(logits / temps, dim=-1)  # (B, V)
        finished: list[tuple[Request, dict]] = []
        tokens: dict[int, int] = {}
        plain: list[int] = []
        for i, req in enumerate(b.reqs):
            p = req.params
            if len(req.output_ids) >= p.max_new_tokens:  # max_new_tokens == 0, or a retracted request at its limit
                finished.append((req, {"type": "length", "length": p.max_new_tokens}))
                continue
            masking = len(req.output_ids) < p.min_new_tokens and bool(self._stop_ids(req))
            if is_plain(p) and not masking:
                plain.append(i)
            else:
                tokens[i] = sample_token(logits[i], p, req.generator, masked=self._stop_ids(req) if masking else ())
        if plain:
            rows = torch.tensor(plain, dtype=torch.long)
            drawn = sample_plain_rows(logits[rows], [b.reqs[i].params.temperature for i in plain],
                                      [b.reqs[i].generator for i in plain])
            tokens.update(zip(plain, drawn.tolist()))
        order = sorted(tokens)
        if order:
            idx = torch.tensor(order, dtype=torch.long)
            toks = torch.tensor([tokens[i] for i in order], dtype=torch.long)
            b.next_input[idx, 0] = toks
            chosen = logp[idx, toks].tolist()
        keep: list[int] = []
        for k, i in enumerate(order):
            req, token = b.reqs[i], tokens[i]
            p = req.params
            req.output_ids.append(token)
            req.output_logprobs.append(chosen[k])
            req.note_token(self.weight_version)
            if token in self._stop_ids(req):
                finished.append((req, {"type": "stop", "matched": token}))
            elif p.stop and (matched := matched_stop_string(req.output_ids, p.stop, self.decode)) is not None:
                finished.append((req, {"type": "stop", "matched": matched}))
            elif len(req.output_ids) >= p.max_new_tokens:
                finished.append((req, {"type": "length", "length": p.max_new_tokens}))
            elif len(req.prompt_ids) + len(req.output_ids) >= self.max_context_len:
                finished.append((req, {"type": "length", "length": len(req.output_ids)}))
            else:
                keep.append(i)
        return finished, self._compact(b, keep)

    def _stop_ids(self, req: Request) -> frozenset[int]:
        """The ids that end ``req``: its ``stop_token_ids`` plus the EOS ids unless ``ignore_eos``."""
        if req.stop_ids is None:
            p = req.params
            req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        return req.stop_ids
