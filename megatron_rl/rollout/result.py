"""``GenerateResult``: the adapter from SGLang's ``/generate`` answer to the rollout sample (case B21).

It keeps the matched stop/EOS id in ``output_ids``, checks that the number of ids, the number of
log-probs and ``completion_tokens`` agree, and records where the stop came from. Shared by the
HTTP clients of ``megatron_rl.rollout.client`` (which re-exports it) and ``vllm_client``.

Routed experts (Mixture-of-Experts policies, rollout routing replay; ALGORITHMS.md section 9): when
the request asked for them (``RoutedExpertsSpec``), the answer's routing is decoded, checked against
the model and the answer's token counts, and kept compact (``GenerateResult.routed_experts``). Wire
forms: SGLang 0.5.23 ``meta_info.routed_experts`` = base64 of raw int32 bytes
(``decode_sglang_routed_experts``); vLLM 0.33 ``choices[i].routed_experts`` = base64 of a ``.npy``
file, uint8 / uint16 / int32 (``decode_npy_routed_experts``). Both hold one row per position of
prompt + completion except the last (never fed back): [prompt + completion - 1, layers, top-k].
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from megatron_rl.errors import RolloutServerError

__all__ = ["GenerateResult", "RoutedExpertsSpec", "StopReason", "check_routed_experts", "compact_routing",
           "decode_npy_routed_experts", "decode_sglang_routed_experts", "parse_weight_versions", "routed_experts_of"]


@dataclass(frozen=True)
class RoutedExpertsSpec:
    """What the routing of one response must look like (the policy's MoE layout), and that it is asked for.

    Attributes:
        num_layers: decoder layers (HF ``num_hidden_layers``; every layer is an MoE layer), the L of
            [tokens, L, K].
        topk: experts per token (HF ``num_experts_per_tok``), the K.
        num_experts: experts per layer (HF ``num_experts``): every id must be in ``[0, num_experts)``.
    """

    num_layers: int
    topk: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"RoutedExpertsSpec: need num_layers >= 1 and 1 <= topk <= num_experts, got {self}")

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> RoutedExpertsSpec:
        """The spec of an HF config dict (``num_hidden_layers``, ``num_experts_per_tok``, and
        ``num_experts``, or ``num_local_experts`` as transformers >= 5 writes it in ``save_pretrained``).

        Raises:
            ValueError: a key is missing (not a Mixture-of-Experts config) or out of range.
        """
        try:
            experts = hf_config["num_experts"] if hf_config.get("num_experts") is not None else \
                hf_config["num_local_experts"]
            return cls(int(hf_config["num_hidden_layers"]), int(hf_config["num_experts_per_tok"]), int(experts))
        except KeyError as e:
            raise ValueError(f"the model config has no {e.args[0]!r}: routed experts need a Mixture-of-Experts "
                             f"model (model_type {hf_config.get('model_type')!r})") from None

    def dtype(self) -> np.dtype:
        """The compact dtype of routing arrays: int16 (int32 beyond 32767 experts)."""
        return np.dtype(np.int16 if self.num_experts <= np.iinfo(np.int16).max + 1 else np.int32)


def compact_routing(arr: np.ndarray, spec: RoutedExpertsSpec | None = None) -> np.ndarray:
    """``arr`` as a C-contiguous int16 array (int32 when an id does not fit, or ``spec.dtype()``)."""
    arr = np.asarray(arr)
    if spec is not None:
        dtype = spec.dtype()
    else:
        dtype = np.dtype(np.int16 if arr.size == 0 or (arr.min() >= np.iinfo(np.int16).min
                                                        and arr.max() <= np.iinfo(np.int16).max) else np.int32)
    out = np.ascontiguousarray(arr, dtype=dtype)
    return out if out.flags.writeable else out.copy()


def _bad_routing(what: str, message: str, response: Any) -> RolloutServerError:
    return RolloutServerError(f"{what}: routed_experts {message}", body=response)


def decode_sglang_routed_experts(value: Any, spec: RoutedExpertsSpec, *, what: str, response: Any = None) -> np.ndarray:
    """SGLang 0.5.23's ``meta_info.routed_experts`` (base64 of int32 little-endian bytes, shape
    [T, L, K] flattened; ``sglang/srt/managers/tokenizer_manager.py``) as [T, L, K] int32, L and K
    from ``spec``.

    Raises:
        RolloutServerError: not a base64 string, or a byte count that is no whole number of rows
            of L x K int32 (names ``what``: the request).
    """
    if not isinstance(value, str):
        raise _bad_routing(what, f"is a {type(value).__name__}, not SGLang's base64 string", response)
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise _bad_routing(what, "is not valid base64", response) from None
    row = spec.num_layers * spec.topk * 4
    if len(raw) % row:
        raise _bad_routing(what, f"has {len(raw)} bytes: not a whole number of rows of {spec.num_layers} layers x "
                                 f"top-{spec.topk} int32 ({row} bytes; does the server's model have another number "
                                 "of layers or experts per token than the trainer's?)", response)
    return np.frombuffer(raw, dtype="<i4").reshape(-1, spec.num_layers, spec.topk)


def decode_npy_routed_experts(value: Any, *, what: str, response: Any = None) -> np.ndarray:
    """vLLM 0.33's ``choices[i].routed_experts`` (base64 of a ``.npy`` file, uint8 / uint16 / int32,
    [T, L, K]; ``vllm/utils/serial_utils.py numpy2base64``) as an array, never unpickling.

    Raises:
        RolloutServerError: not base64 of a 3-D integer ``.npy`` array (names ``what``: the request).
    """
    if not isinstance(value, str):
        raise _bad_routing(what, f"is a {type(value).__name__}, not vLLM's base64 .npy string", response)
    try:
        arr = np.load(io.BytesIO(base64.b64decode(value.encode("ascii"), validate=True)), allow_pickle=False)
    except (binascii.Error, UnicodeEncodeError, ValueError, OSError, EOFError):
        raise _bad_routing(what, "is not base64 of a .npy array", response) from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise _bad_routing(what, f"is a {getattr(arr, 'dtype', type(arr))} array of shape "
                                 f"{getattr(arr, 'shape', None)}, not [tokens, layers, top-k] integers", response)
    return arr


def check_routed_experts(arr: np.ndarray, spec: RoutedExpertsSpec, *, rows: int, what: str,
                         response: Any = None) -> np.ndarray:
    """``arr`` [T, L, K] checked against the model (``spec``) and the answer's token counts
    (``rows`` = prompt + completion - 1), returned compact (``compact_routing``).

    Raises:
        RolloutServerError: another L or K than the model's, T != ``rows``, or an id outside
            ``[0, spec.num_experts)``; the message names ``what`` (the request).
    """
    if arr.ndim != 3 or arr.shape[1:] != (spec.num_layers, spec.topk):
        raise _bad_routing(what, f"has shape {list(arr.shape)}, the model needs [tokens, {spec.num_layers} layers, "
                                 f"top-{spec.topk}]", response)
    if arr.shape[0] != rows:
        raise _bad_routing(what, f"has {arr.shape[0]} positions; prompt + completion - 1 = {rows} expected (one "
                                 "per token the engine processed, the last generated one excepted)", response)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= spec.num_experts):
        raise _bad_routing(what, f"holds expert ids in [{int(arr.min())}, {int(arr.max())}], outside the model's "
                                 f"[0, {spec.num_experts})", response)
    return compact_routing(arr, spec)


def routed_experts_of(value: Any, spec: RoutedExpertsSpec | None, *, decode, prompt_tokens: int,
                      completion_tokens: int, finish_type: str, what: str, response: Any = None) -> np.ndarray | None:
    """The checked, compact routing of one answer, or None when not asked for (``spec`` None), or
    when an aborted answer has none or no token (SGLang answers no routing for a request aborted
    while queued, a retracted one included; the rollout manager then resubmits it from scratch).

    Raises:
        RolloutServerError: asked for but absent from a finished answer (the engine was started
            without the routed-experts flag, or cannot capture), or malformed (see ``check_routed_experts``).
    """
    if spec is None:
        return None
    if finish_type == "abort" and (completion_tokens == 0 or value is None):
        return None
    if value is None:
        raise _bad_routing(what, "are missing from the answer although the request asked for them (is the engine "
                                 "started with --enable-return-routed-experts, on the same Mixture-of-Experts model?)",
                           response)
    arr = decode(value, what=what, response=response)
    return check_routed_experts(arr, spec, rows=prompt_tokens + completion_tokens - 1, what=what, response=response)

StopReason = Literal["eos", "stop_token", "stop_string", "length", "abort"]


@dataclass(frozen=True)
class GenerateResult:
    """One generated response, as the rollout keeps it.

    Attributes:
        rid: the request id (``meta_info.id``).
        output_ids: generated token ids, the matched EOS / stop token id INCLUDED as the last
            id (it is trained on: the loss mask covers it).
        output_logprobs: rollout log-probs, one per ``output_ids`` entry (None when not asked).
        finish_type: ``"stop"``, ``"length"`` or ``"abort"`` (SGLang's ``finish_reason.type``).
        matched_stop: the matched token id (int), stop string (str) or other matched item, or None.
        stop_reason: where the end came from: ``eos`` | ``stop_token`` | ``stop_string`` |
            ``length`` | ``abort``.
        prompt_tokens, completion_tokens: token counts from ``meta_info``.
        weight_version: label of the weights that produced the response (SGLang: of its last token).
        abort_message: ``finish_reason.message`` of an aborted request, else None.
        weight_versions: the server's per-token spans as ``(label, first token index)``, from
            SGLang 0.5.23's ``meta_info.weight_versions`` (the embedded server reports them too);
            None when the server reported none.
        abort_status_code: ``finish_reason.status_code`` of an aborted request (a server-side
            failure carries one; a pause or ``/abort_request`` does not), else None.
        version_spans: integer ``(version, first token index)`` spans resolved by the rollout
            manager (``megatron_rl.rollout.live``); empty as the client returns it.
        resubmissions: times the rollout manager resubmitted the request after a pause or a
            staleness abort (its tokens may come from several requests).
        routed_experts: [prompt_tokens + completion_tokens - 1, layers, top-k] int16 (int32 beyond
            32767 experts), C-contiguous: row t = the expert ids each MoE layer routed position t
            of prompt + output to, in the engine's order (ALGORITHMS.md section 9); None when not
            asked for (``RoutedExpertsSpec``), or for an abort that came without it (e.g. aborted
            while queued). Not compared by ``==``.
        response_mask: multi-turn episodes (``rollout.multiturn``): one bool per ``output_ids``
            entry, True on the model's tokens, False on tokens the environment wrote (tool answers,
            template); None for a single completion (every token is the model's).
        episode: multi-turn episodes: ``turns``, ``tool_calls``, ``tool_errors``, ``tool_s``,
            ``turn_limit`` and ``segments`` (``(kind, start, end)`` over ``output_ids``); else None.
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_type: Literal["stop", "length", "abort"]
    matched_stop: int | str | list | None
    stop_reason: StopReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None
    abort_message: str | None = None
    weight_versions: tuple[tuple[str, int], ...] | None = None
    abort_status_code: int | None = None
    version_spans: tuple[tuple[int, int], ...] = ()
    resubmissions: int = 0
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    response_mask: tuple[bool, ...] | None = None
    episode: dict | None = field(default=None, compare=False)

    @classmethod
    def unsent_abort(cls, rid: str, prompt_tokens: int, message: str) -> GenerateResult:
        """An abort with no tokens for a request that was not sent (or not kept): `message` says why."""
        return cls(rid=rid, output_ids=[], output_logprobs=[], finish_type="abort", matched_stop=None,
                   stop_reason="abort", prompt_tokens=prompt_tokens, completion_tokens=0, weight_version=None,
                   abort_message=message)

    @classmethod
    def from_sglang(
        cls,
        response: Mapping[str, Any],
        *,
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] | None = None,
        return_logprob: bool = True,
        routed_experts: RoutedExpertsSpec | None = None,
    ) -> GenerateResult:
        """Build a result from one SGLang ``/generate`` answer object and check its consistency.

        Args:
            response: one answer object (``output_ids``, ``meta_info``).
            stop_token_ids: the request's ``sampling_params.stop_token_ids``.
            eos_token_ids: the model's EOS ids when known. A matched id counts as ``eos`` when it is
                one of them, else as ``stop_token`` when it is one of ``stop_token_ids``, else as
                ``eos`` (SGLang matches ids only for EOS and ``stop_token_ids``).
            return_logprob: whether log-probs were asked for (then they must be there).
            routed_experts: the routing's expected layout when the request asked for it
                (``return_routed_experts``): ``meta_info.routed_experts`` must then be there (but
                for an abort before any token) and match it; None: ignored.

        Raises:
            RolloutServerError: the answer is malformed, or ``len(output_ids)``, the number of
                log-probs and ``completion_tokens`` disagree (a server that drops the stop id from
                the ids, case B21), or the routing asked for is missing or does not match the
                model and the token counts (``check_routed_experts``).
        """
        try:
            meta = response["meta_info"]
            output_ids = [int(t) for t in response["output_ids"]]
            finish = meta["finish_reason"]
            completion_tokens = int(meta["completion_tokens"])
            prompt_tokens = int(meta["prompt_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutServerError(
                f"malformed /generate answer (missing or bad {e!s}): {str(response)[:500]}", body=response
            ) from None
        rid = str(meta.get("id", ""))
        logprobs: list[float] | None = None
        if return_logprob:
            entries = meta.get("output_token_logprobs")
            if entries is None:
                raise RolloutServerError(f"/generate answer for {rid!r} has no output_token_logprobs", body=response)
            logprobs = [float(e[0]) for e in entries]
            ids_of_logprobs = [int(e[1]) for e in entries]
            if ids_of_logprobs != output_ids[: len(ids_of_logprobs)]:
                raise RolloutServerError(
                    f"/generate answer for {rid!r}: output_token_logprobs token ids "
                    f"{ids_of_logprobs[:8]}... do not follow output_ids {output_ids[:8]}...",
                    body=response,
                )
        if len(output_ids) != completion_tokens or (logprobs is not None and len(logprobs) != len(output_ids)):
            raise RolloutServerError(
                f"/generate answer for {rid!r} is inconsistent: {len(output_ids)} output_ids, "
                f"{'n/a' if logprobs is None else len(logprobs)} logprobs, completion_tokens={completion_tokens} "
                "(did a layer strip the stop token id?)",
                body=response,
            )
        if finish is None:
            raise RolloutServerError(f"/generate answer for {rid!r} has finish_reason null (unfinished)", body=response)
        ftype = finish.get("type")
        matched = finish.get("matched")
        abort_message = abort_status = None
        if ftype == "length":
            reason: StopReason = "length"
        elif ftype == "abort":
            reason = "abort"
            abort_message = finish.get("message")
            abort_status = finish.get("status_code")
        elif ftype == "stop":
            if isinstance(matched, bool):
                raise RolloutServerError(f"/generate answer for {rid!r}: matched={matched!r}", body=response)
            if isinstance(matched, int):
                eos = set(eos_token_ids) if eos_token_ids is not None else set()
                reason = "eos" if matched in eos or matched not in set(stop_token_ids) else "stop_token"
                if not output_ids or output_ids[-1] != matched:
                    raise RolloutServerError(
                        f"/generate answer for {rid!r}: stop token {matched} is not the last "
                        f"output id {output_ids[-1:]} (stripped?)",
                        body=response,
                    )
            elif matched is None:
                reason = "eos"
            else:
                reason = "stop_string"
        else:
            raise RolloutServerError(f"/generate answer for {rid!r}: unknown finish_reason {finish!r}", body=response)
        return cls(
            rid=rid,
            output_ids=output_ids,
            output_logprobs=logprobs,
            finish_type=ftype,
            matched_stop=matched,
            stop_reason=reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            weight_version=meta.get("weight_version"),
            abort_message=abort_message,
            weight_versions=parse_weight_versions(meta.get("weight_versions"), completion_tokens, rid, response),
            abort_status_code=abort_status if isinstance(abort_status, int) else None,
            routed_experts=routed_experts_of(
                meta.get("routed_experts"), routed_experts,
                decode=lambda v, **kw: decode_sglang_routed_experts(v, routed_experts, **kw),
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, finish_type=ftype,
                what=f"/generate answer for {rid!r}", response=response),
        )


def parse_weight_versions(spans: Any, completion_tokens: int, rid: str,
                          response: Any = None) -> tuple[tuple[str, int], ...] | None:
    """SGLang 0.5.23's ``meta_info.weight_versions`` (``[{"version", "start", "end"}, ...]``) as
    ``((label, start), ...)``; None when absent.

    Raises:
        RolloutServerError: the spans do not cover ``[0, completion_tokens)`` in order without gaps.
    """
    if spans is None:
        return None
    try:
        out = tuple((str(sp["version"]), int(sp["start"]), int(sp["end"])) for sp in spans)
    except (KeyError, TypeError, ValueError):
        raise RolloutServerError(f"/generate answer for {rid!r}: malformed weight_versions {spans!r}",
                                 body=response) from None
    ends = [0] + [e for _, _, e in out]
    if not out or any(s != ends[k] or e < s for k, (_, s, e) in enumerate(out)) or ends[-1] != completion_tokens:
        raise RolloutServerError(f"/generate answer for {rid!r}: weight_versions {spans!r} do not cover its "
                                 f"{completion_tokens} tokens in order", body=response)
    return tuple((v, s) for v, s, _ in out)
