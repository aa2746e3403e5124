"""``GenerateResult``: the adapter from SGLang's ``/generate`` answer to the rollout sample (case B21).

It keeps the matched stop/EOS id in ``output_ids``, checks that the number of ids, the number of
log-probs and ``completion_tokens`` agree, and records where the stop came from. Shared by the
HTTP clients of ``megatron_rl.rollout.client`` (which re-exports it) and ``vllm_client``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.errors import RolloutServerError

__all__ = ["GenerateResult", "StopReason", "parse_weight_versions"]

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

    @classmethod
    def from_sglang(
        cls,
        response: Mapping[str, Any],
        *,
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        """Build a result from one SGLang ``/generate`` answer object and check its consistency.

        Args:
            response: one answer object (``output_ids``, ``meta_info``).
            stop_token_ids: the request's ``sampling_params.stop_token_ids``.
            eos_token_ids: the model's EOS ids when known. A matched id counts as ``eos`` when it is
                one of them, else as ``stop_token`` when it is one of ``stop_token_ids``, else as
                ``eos`` (SGLang matches ids only for EOS and ``stop_token_ids``).
            return_logprob: whether log-probs were asked for (then they must be there).

        Raises:
            RolloutServerError: the answer is malformed, or ``len(output_ids)``, the number of
                log-probs and ``completion_tokens`` disagree (a server that drops the stop id from
                the ids, case B21).
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
