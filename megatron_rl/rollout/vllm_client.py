"""HTTP client for rollout servers that speak vLLM 0.33.x's API (vLLM itself, or the embedded server
with ``--api-dialect vllm``): the `vllm` and `vllm-embedded` backends of `RolloutEngine`.

The request and answer shapes are vLLM's own (docs/VLLM_API.md names the source files):

- generation: ``POST /v1/completions`` with the prompt as token ids, ``logprobs: 0`` (the sampled
  token's log-prob only), ``return_token_ids`` and ``return_tokens_as_token_ids`` (so every log-prob
  names its token id and can be checked against ``token_ids``), ``seed`` per request and
  ``request_id`` = the rollout's rid (vLLM's engine id is then ``cmpl-<rid>-0``); a prompt's
  responses with consecutive seeds as one request with ``n`` (``generate_batch``, ``vllm_group``); with router
  replay, ``choices[0].routed_experts`` (base64 ``.npy``; the server needs
  ``--enable-return-routed-experts``, there is no request field) is read and checked;
- control: ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``POST /abort_requests``
  (exact engine ids; this client keeps the ids in flight to abort by rid prefix as SGLang does),
  ``POST /reset_prefix_cache`` (answers ``{"success": bool}``), ``GET /health``, ``GET /get_world_size``,
  ``GET /weight_info``, ``GET /v1/models``;
- sleep mode (``--enable-sleep-mode``, colocation): ``POST /sleep?level=0|1|2&mode=abort|wait|keep``,
  ``POST /wake_up?tags=weights&tags=kv_cache`` (no tags: everything), ``GET /is_sleeping``. Level 2
  discards the weights (case N13): ``sleep`` refuses it unless the caller promises a full reload,
  and ``generate`` refuses to send anything until that reload finished or while a client of this
  process put the server to sleep and some of it is not awake yet (staged wake: ``weights``, then
  ``kv_cache``). That guard is per process (shared by the clients of one URL); another process
  can still generate, and a real vLLM then answers from whatever memory it holds;
- weight transfer (``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "nccl"}'``):
  ``/init_weight_transfer_engine`` {"init_info": {master_address, master_port, rank_offset,
  world_size, packed}}, ``/start_weight_update``, ``/update_weights`` {"update_info": {names,
  dtype_names, shapes}} while the trainer broadcasts one tensor after another from rank 0,
  ``/finish_weight_update`` {"weight_version"}.

What vLLM does not have, and what this client does instead: no named groups (one weight-transfer
engine per server; ``group_name`` is kept here only to answer ``destroy_weights_update_group``), no
endpoint to leave a group (a new ``/init_weight_transfer_engine`` replaces it), no
``/get_weights_by_name`` (answers as an unverifiable tensor, HTTP 400), no weight version in a
completion answer (``GenerateResult.weight_version`` is None), no dtype in any info answer (the
sender then sends its tensors as they are and vLLM casts on load).

An answer in another shape than 0.33.x's raises ``RolloutServerError`` naming the version.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.client import GenerateResult, HTTPEngineClient, StopReason
from megatron_rl.rollout.engine import check_batch
from megatron_rl.rollout.result import RoutedExpertsSpec, decode_npy_routed_experts, routed_experts_of
from megatron_rl.rollout.vllm_group import group_request_id, parallel_group, split_group_answer

logger = logging.getLogger(__name__)

__all__ = ["SLEEP_TAGS", "VLLM_VERSION", "VLLMClient", "completion_body", "result_from_vllm"]

VLLM_VERSION = "0.33.x"
"""The vLLM release whose HTTP API this client speaks (docs/VLLM_API.md)."""

#: SGLang ``sampling_params`` key -> vLLM ``CompletionRequest`` field (the rollout speaks SGLang's keys).
_SAMPLING_KEYS: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
    "logit_bias": "logit_bias",
    "n": "n",
}
#: SGLang keys vLLM's completions have no field for: accepted only at their neutral value.
_NEUTRAL_ONLY = {"stop_regex": (None, "", []), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
                 "structural_tag": (None,), "custom_params": (None,), "stream_interval": (None,),
                 "beam_width": (None, 0, 1), "watermark": (None, False), "choice": (None,)}

#: What ``/wake_up?tags=`` may name (vLLM 0.33: ``device_allocator.DEFERRABLE_TAGS``; ``scheduling``
#: resumes a level-0 sleep, ``EngineCore.wake_up``).
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


class _SleepState:
    """What this process did to one server's sleep mode (shared by every ``VLLMClient`` of that URL:
    the trainer's weight sender and the rollout use different clients of the same server)."""

    _by_url: dict[str, _SleepState] = {}
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asleep: set[str] = set()  # parts put to sleep through this process and not woken yet
        self.needs_reload = False  # slept at level 2; cleared by a finished weight update

    @classmethod
    def of(cls, base_url: str) -> _SleepState:
        with cls._registry_lock:
            return cls._by_url.setdefault(base_url.rstrip("/"), cls())


#: ``/pause`` modes for the SGLang-named modes of ``RolloutEngine.pause_generation``.
_PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


def _shape_error(what: str, detail: str, body: Any) -> RolloutServerError:
    return RolloutServerError(
        f"{what}: the answer is not in vLLM {VLLM_VERSION}'s shape ({detail}); is the server another vLLM "
        f"version? (docs/VLLM_API.md): {str(body)[:500]}", body=body)


def completion_body(input_ids: list[int], sampling_params: Mapping[str, Any], rid: str,
                    return_logprob: bool = True) -> dict[str, Any]:
    """The ``POST /v1/completions`` body for one prompt of token ids and SGLang-keyed ``sampling_params``.

    Raises:
        ValueError: empty ``input_ids``, ``n`` > 1, an unknown key, or a key vLLM's completions
            cannot take at a non-neutral value.
    """
    if not input_ids:
        raise ValueError("input_ids must not be empty")
    body: dict[str, Any] = {
        "prompt": [int(t) for t in input_ids],
        "request_id": rid,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    if return_logprob:
        body["logprobs"] = 0
    for key, value in sampling_params.items():
        if key in _NEUTRAL_ONLY:
            if value not in _NEUTRAL_ONLY[key]:
                raise ValueError(f"sampling_params[{key!r}] = {value!r}: vLLM's /v1/completions has no such "
                                 "parameter (only its neutral value is accepted)")
            continue
        if key not in _SAMPLING_KEYS:
            raise ValueError(f"sampling_params: unknown key {key!r} (SGLang's keys are mapped onto vLLM's: "
                             f"{', '.join(sorted(_SAMPLING_KEYS))})")
        if value is None:
            continue
        if key == "top_k" and int(value) == -1:  # SGLang's "off" is vLLM's 0 (its default)
            continue
        body[_SAMPLING_KEYS[key]] = value
    if int(body.get("n", 1)) != 1:
        raise ValueError("generate() makes one response; send one request per response (own rid and seed)")
    body.pop("n", None)
    return body


def _token_id(token: Any, what: str, body: Any) -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) -> 123."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            pass
    raise _shape_error(what, f"logprobs.tokens entry {token!r} is not 'token_id:<id>'", body)


def result_from_vllm(response: Mapping[str, Any], *, rid: str, stop_token_ids: Iterable[int] = (),
                     eos_token_ids: Iterable[int] | None = None, return_logprob: bool = True,
                     routed_experts: RoutedExpertsSpec | None = None) -> GenerateResult:
    """Build a `GenerateResult` from one ``/v1/completions`` answer (one choice) and check it.

    vLLM keeps the matched EOS / stop token id in ``token_ids``; ``stop_reason`` is that stop token
    id (``stop_token_ids``) or stop string, and null for EOS. Checks as ``GenerateResult.from_sglang``:
    ids, log-probs and ``usage.completion_tokens`` agree, and every log-prob names the id it follows.
    ``routed_experts`` (the policy's MoE layout): ``choices[0].routed_experts`` (vLLM 0.33: base64
    ``.npy``, uint8 / uint16 / int32 [prompt + completion - 1, layers, top-k]; the server needs
    ``--enable-return-routed-experts``, there is no request field) must be there, but for an abort
    before any token, and match it; None: ignored.

    Raises:
        RolloutServerError: another shape than vLLM 0.33.x's, an inconsistent answer, or the routing
            asked for missing or not matching (``megatron_rl.rollout.result.check_routed_experts``).
    """
    what = f"/v1/completions answer for {rid!r}"
    try:
        choice = response["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
        finish = choice["finish_reason"]
        matched = choice.get("stop_reason")
        usage = response["usage"]
        completion_tokens = int(usage["completion_tokens"])
        prompt_tokens = int(usage["prompt_tokens"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise _shape_error(what, f"missing or bad {e!s}", response) from None
    logprobs: list[float] | None = None
    if return_logprob:
        lp = choice.get("logprobs")
        if not isinstance(lp, Mapping) or "token_logprobs" not in lp or "tokens" not in lp:
            raise _shape_error(what, "no logprobs.token_logprobs / logprobs.tokens", response)
        try:
            logprobs = [float(v) for v in lp["token_logprobs"]]
        except (TypeError, ValueError):
            raise _shape_error(what, "logprobs.token_logprobs holds a non-number", response) from None
        ids_of_logprobs = [_token_id(t, what, response) for t in lp["tokens"]]
        if ids_of_logprobs != output_ids[: len(ids_of_logprobs)]:
            raise RolloutServerError(f"{what}: logprobs.tokens {ids_of_logprobs[:8]}... do not follow token_ids "
                                     f"{output_ids[:8]}...", body=response)
    if len(output_ids) != completion_tokens or (logprobs is not None and len(logprobs) != len(output_ids)):
        raise RolloutServerError(
            f"{what} is inconsistent: {len(output_ids)} token_ids, {'n/a' if logprobs is None else len(logprobs)} "
            f"logprobs, usage.completion_tokens={completion_tokens} (did a layer strip the stop token id?)",
            body=response)
    abort_message = None
    if finish == "length":
        reason: StopReason = "length"
    elif finish == "abort":
        reason, abort_message = "abort", "aborted by the server (/abort_requests or /pause?mode=abort)"
    elif finish == "stop":
        if isinstance(matched, bool):
            raise _shape_error(what, f"stop_reason={matched!r}", response)
        if isinstance(matched, int):
            eos = set(eos_token_ids) if eos_token_ids is not None else set()
            reason = "eos" if matched in eos or matched not in set(stop_token_ids) else "stop_token"
            if not output_ids or output_ids[-1] != matched:
                raise RolloutServerError(f"{what}: stop token {matched} is not the last token id {output_ids[-1:]} "
                                         "(stripped?)", body=response)
        elif matched is None:  # EOS: vLLM reports no stop_reason, the id is the last one
            reason = "eos"
            matched = output_ids[-1] if output_ids else None
        else:
            reason = "stop_string"
    elif finish is None:
        raise RolloutServerError(f"{what} has finish_reason null (unfinished)", body=response)
    else:
        raise _shape_error(what, f"unknown finish_reason {finish!r}", response)
    routed = routed_experts_of(choice.get("routed_experts"), routed_experts, decode=decode_npy_routed_experts,
                               prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, finish_type=finish,
                               what=what, response=response)
    return GenerateResult(rid=rid, output_ids=output_ids, output_logprobs=logprobs, finish_type=finish,
                          matched_stop=matched, stop_reason=reason, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens, weight_version=None, abort_message=abort_message,
                          routed_experts=routed)


def engine_request_id(rid: str) -> str:
    """vLLM's engine id of the completion request sent with ``request_id`` = ``rid`` (one prompt):
    ``cmpl-<rid>-0`` (``OpenAIServingCompletion``), the id ``/abort_requests`` takes."""
    return f"cmpl-{rid}-0"


class VLLMClient(HTTPEngineClient):
    """Client of one rollout server speaking vLLM 0.33.x's HTTP API (see the module docstring).

    Arguments as ``HTTPEngineClient``; ``admin_api_key`` is not used (vLLM has one ``--api-key``,
    sent with every call). Thread-safe like ``RolloutClient``.
    """

    def __init__(self, base_url: str, **kwargs) -> None:
        super().__init__(base_url, **kwargs)
        self._admin_api_key = None
        self._inflight: dict[str, str] = {}  # rid -> the engine id of the request that carries it
        self._inflight_lock = threading.Lock()
        self._group: str | None = None
        self._sleep = _SleepState.of(self.base_url)

    # ---- helpers -----------------------------------------------------------------------

    def _json(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              timeout_s: float | None = None) -> Any:
        try:
            return self._check(self._request(method, path, json=json, params=params, timeout_s=timeout_s), path)
        except RolloutServerError as e:
            if e.status_code != 404 or path.startswith("/v1/") or path in ("/health", "/sleep", "/wake_up",
                                                                            "/is_sleeping"):
                raise  # the sleep routes' 404 means no --enable-sleep-mode (documented at `sleep`)
            raise RolloutServerError(
                f"{method} {path} at {self.base_url}: HTTP 404 - the server has no such route. megatron-rl speaks "
                f"vLLM {VLLM_VERSION}'s RL API, which `vllm serve` exposes only with VLLM_SERVER_DEV_MODE=1 and "
                "--weight-transfer-config '{\"backend\": \"nccl\"}' (\"gloo\" for vLLM's CPU build: docs/engines.md; "
                "what `megatron-rl train` starts it with); is "
                "this server another vLLM version, started without them, or not vLLM at all? (docs/VLLM_API.md): "
                f"{e}", url=e.url, status_code=404, body=e.body) from e

    def _dict(self, method: str, path: str, keys: tuple[str, ...] = (), **kw) -> dict:
        data = self._json(method, path, **kw)
        if not isinstance(data, dict) or any(k not in data for k in keys):
            raise _shape_error(f"{method} {path} at {self.base_url}", f"expected an object with {list(keys)}", data)
        return data

    # ---- health and identity -----------------------------------------------------------

    def model_info(self) -> dict:
        """``GET /v1/models`` and ``GET /weight_info``: ``model_path``, ``max_model_len``,
        ``weight_version`` (no ``dtype``: vLLM reports none)."""
        models = self._dict("GET", "/v1/models", ("data",))
        try:
            card = models["data"][0]
            info = {"model_path": card.get("root") or card["id"], "max_model_len": card.get("max_model_len")}
        except (IndexError, KeyError, TypeError, AttributeError):
            raise _shape_error("GET /v1/models", "data[0] with id", models) from None
        info["weight_version"] = self.weight_version()
        return info

    def weight_version(self) -> str:
        """``GET /weight_info`` -> ``weight_version``."""
        return str(self._dict("GET", "/weight_info", ("weight_version",))["weight_version"])

    def transfer_world_size(self) -> int:
        """``GET /get_world_size`` (``include_dp`` true, vLLM's default): the server's workers across
        its data-parallel replicas, TP x PP x DP, its ranks in the transfer group (vLLM's worker of
        DP replica d and rank r joins at ``rank_offset + d * TP * PP + r``).

        Raises:
            RolloutServerError: no answer, or ``world_size`` is not an integer.
        """
        try:
            return int(self._dict("GET", "/get_world_size", ("world_size",))["world_size"])
        except (TypeError, ValueError):
            raise _shape_error("GET /get_world_size", "world_size is not an integer", None) from None

    def context_length(self) -> int | None:
        """``GET /v1/models`` ``data[0].max_model_len``: tokens prompt + completion may hold (vLLM
        refuses ``prompt + max_tokens`` beyond it); None when the card has none."""
        value = self.model_info().get("max_model_len")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def score_tokens(self, prompt_ids: list[int], continuation_ids: list[int], *,
                     timeout_s: float | None = None) -> list[float]:
        """``RolloutEngine.score_tokens``: one ``/v1/completions`` of prompt + continuation with
        ``prompt_logprobs: 0`` and one token at temperature 1; the entries of
        ``choices[0].prompt_logprobs`` from position P on, each ``{"<id>": {"logprob", ...}}`` (vLLM
        computes prompt log-probs from the raw logits whatever ``--logprobs-mode`` says).

        Raises:
            ValueError: an empty prompt or continuation.
            RolloutServerError: HTTP error, or an answer without a log-prob of each of those ids.
        """
        if not prompt_ids or not continuation_ids:
            raise ValueError("score_tokens needs a prompt and a continuation of at least one token each")
        rid = f"score-{uuid.uuid4().hex}"
        body = completion_body([*prompt_ids, *continuation_ids], {"max_new_tokens": 1, "temperature": 1.0,
                                                                  "top_p": 1.0}, rid, return_logprob=False)
        body["prompt_logprobs"] = 0
        self._check_awake(rid)
        data = self._check(self._request("POST", "/v1/completions", json=body,
                                         timeout_s=timeout_s or self.generate_timeout_s), "/v1/completions")
        try:
            entries = data["choices"][0]["prompt_logprobs"][len(prompt_ids):]
            if len(entries) != len(continuation_ids):
                raise ValueError
            return [float(e[str(int(t))]["logprob"]) for e, t in zip(entries, continuation_ids)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise _shape_error(f"/v1/completions at {self.base_url} with prompt_logprobs",
                               f"no prompt_logprobs entry for each of the {len(continuation_ids)} tokens "
                               f"{list(continuation_ids)[:8]} after position {len(prompt_ids)}", data) from None

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return bool(self._dict("GET", "/is_paused", ("is_paused",))["is_paused"])

    # ---- generation --------------------------------------------------------------------

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, return_logprob: bool = True,
                 *, eos_token_ids: Iterable[int] | None = None, timeout_s: float | None = None,
                 routed_experts: RoutedExpertsSpec | None = None) -> GenerateResult:
        """``POST /v1/completions`` for one prompt of token ids (``sampling_params`` in SGLang's keys,
        mapped by ``completion_body``). ``rid`` is the request id ``abort_request`` takes.
        ``routed_experts``: read and check ``choices[0].routed_experts`` (``result_from_vllm``); vLLM
        has no request field for it (the server's ``--enable-return-routed-experts`` decides).

        Raises:
            RolloutServerError: HTTP error, timeout, or an answer in another shape or inconsistent.
            ValueError: ``n`` > 1, empty ``input_ids``, or a parameter vLLM has no field for.
        """
        body = completion_body(input_ids, sampling_params, rid, return_logprob)
        data = self._complete(body, [rid], rid, timeout_s)
        return result_from_vllm(data, rid=rid, stop_token_ids=sampling_params.get("stop_token_ids") or (),
                                eos_token_ids=eos_token_ids, return_logprob=return_logprob,
                                routed_experts=routed_experts)

    supports_batch_generate = True
    """K entries that are one prompt's responses (same prompt and params, seeds s, s + 1, ...) go out
    as one completion with ``n`` = K (``vllm_group``: what vLLM samples for them is what K requests
    would); any other batch as K requests side by side."""

    def takes_as_one_call(self, input_ids: Sequence[list[int]], sampling_params: Sequence[dict[str, Any]]) -> bool:
        """Only a parallel-sampling group is one call (``vllm_group.parallel_group``)."""
        return parallel_group(input_ids, sampling_params)

    def generate_batch(self, input_ids: Sequence[list[int]], sampling_params: Sequence[dict[str, Any]],
                       rids: Sequence[str], return_logprob: bool = True, *, eos_token_ids: Iterable[int] | None = None,
                       timeout_s: float | None = None, routed_experts: RoutedExpertsSpec | None = None) -> list:
        """`generate` for K entries, results in entry order: one ``/v1/completions`` with ``n`` = K
        when they form a parallel-sampling group (``vllm_group.parallel_group``), else K requests.
        Every entry's rid stays abortable (``abort_request`` by any prefix of it ends its group).

        Raises:
            RolloutServerError: as `generate`; an answer whose choices are not K (indices 0..K-1) or
                whose ``usage`` does not add up.
            ValueError: lengths differ, an empty prompt, or a parameter vLLM has no field for.
        """
        check_batch(input_ids, sampling_params, rids)
        if not parallel_group(input_ids, sampling_params):
            return super().generate_batch(input_ids, sampling_params, rids, return_logprob, eos_token_ids=eos_token_ids,
                                          timeout_s=timeout_s,
                                          **({} if routed_experts is None else {"routed_experts": routed_experts}))
        k, group = len(rids), group_request_id(rids)
        body = completion_body(input_ids[0], sampling_params[0], group, return_logprob)
        body["n"] = k
        data = self._complete(body, list(rids), group, timeout_s)
        try:
            parts = split_group_answer(data, k, f"/v1/completions answer for {group!r} (n={k})")
        except ValueError as e:
            raise _shape_error("/v1/completions", str(e), data) from None
        eos = None if eos_token_ids is None else list(eos_token_ids)
        stops = sampling_params[0].get("stop_token_ids") or ()
        return [result_from_vllm(part, rid=rid, stop_token_ids=stops, eos_token_ids=eos, return_logprob=return_logprob,
                                 routed_experts=routed_experts) for part, rid in zip(parts, rids)]

    def _complete(self, body: dict, rids: list[str], request: str, timeout_s: float | None) -> dict:
        """POST ``body`` (request id ``request``) with ``rids`` in flight (each aborts the request)."""
        self._check_awake(request)
        engine_id = engine_request_id(request)
        with self._inflight_lock:
            self._inflight.update((r, engine_id) for r in rids)
        try:
            resp = self._request("POST", "/v1/completions", json=body, timeout_s=timeout_s or self.generate_timeout_s)
        finally:
            with self._inflight_lock:
                for r in rids:
                    self._inflight.pop(r, None)
        data = self._check(resp, "/v1/completions")
        if not isinstance(data, dict):
            raise _shape_error("/v1/completions", f"a {type(data).__name__}, not an object", data)
        return data

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_requests``: the requests of this client whose rid starts with ``rid`` (their
        engine ids), or every request of the server (``abort_all``: empty ``request_ids``). An empty
        ``rid`` without ``abort_all`` does nothing (as SGLang)."""
        if abort_all:
            ids: list[str] = []
        else:
            if not rid:
                return
            with self._inflight_lock:
                ids = sorted({e for r, e in self._inflight.items() if r.startswith(rid)})
            if not ids:
                return
        self._dict("POST", "/abort_requests", ("status",), json={"request_ids": ids})

    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> dict:
        """``POST /pause?mode=...`` (``abort`` -> abort, ``in_place`` and ``retract`` -> keep)."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}")
        return self._dict("POST", "/pause", ("status",), params={"mode": _PAUSE_MODES[mode]})

    def continue_generation(self) -> dict:
        """``POST /resume``."""
        return self._dict("POST", "/resume", ("status",))

    def flush_cache(self, timeout_s: float = 0.0) -> str:
        """``POST /reset_prefix_cache``; returns the answer as text.

        Raises:
            RolloutServerError: ``{"success": false}`` (status 400, as SGLang's refusal: blocks are
                still held by running requests), or another shape than 0.33.x's.
        """
        data = self._dict("POST", "/reset_prefix_cache", ("success",), timeout_s=self.timeout_s + timeout_s)
        if data["success"] is not True:
            raise RolloutServerError(f"{self.base_url}: /reset_prefix_cache refused (blocks still held by running "
                                     f"requests): {data}", url=self.base_url, status_code=400, body=data)
        return str(data)

    # ---- sleep mode (case N13) ---------------------------------------------------------

    def sleep(self, level: int = 1, *, mode: Literal["abort", "wait", "keep"] = "abort",
              will_reload_weights: bool = False) -> dict:
        """``POST /sleep?level=...&mode=...`` (the server needs ``--enable-sleep-mode``).

        Level 0 pauses scheduling only; level 1 offloads the weights to CPU and discards the KV cache;
        level 2 discards both. After level 2 the engine has no valid weights: one woken without a
        reload of every weight *and* buffer generates from uninitialised memory without any error
        (case N13). So level 2 is refused unless ``will_reload_weights`` states that the caller will
        push all of them (``begin_weight_update`` ... ``end_weight_update``) before generating, and
        ``generate`` refuses to send anything until such an update finished.

        Returns:
            vLLM's answer, ``{"status": "sleeping", "level": level}``.

        Raises:
            ValueError: a level other than 0, 1, 2; a bad mode; level 2 without ``will_reload_weights``.
            RolloutServerError: HTTP error (404 when the server runs without ``--enable-sleep-mode``
                or ``VLLM_SERVER_DEV_MODE``), or another shape than 0.33.x's.
        """
        if level not in (0, 1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 0, 1 or 2 (vLLM {VLLM_VERSION}), got {level!r}")
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"sleep mode must be abort, wait or keep, got {mode!r}")
        if level == 2 and not will_reload_weights:
            raise ValueError(
                "sleep level 2 discards the model's weights (and, before vLLM's fix #16889, its non-parameter "
                "buffers such as rotary inv_freq): an engine woken without reloading every weight and buffer "
                "generates garbage from uninitialised memory and nothing fails (case N13). Use level=1, or pass "
                "will_reload_weights=True only if every weight and buffer is pushed again "
                "(begin_weight_update ... end_weight_update) before the next generation")
        data = self._dict("POST", "/sleep", ("status",), params={"level": level, "mode": mode})
        with self._sleep.lock:
            self._sleep.asleep = {"scheduling"} if level == 0 else {"weights", "kv_cache"}
            self._sleep.needs_reload = self._sleep.needs_reload or level == 2
        return data

    def wake_up(self, tags: Iterable[str] | None = None) -> dict:
        """``POST /wake_up`` (every part) or ``POST /wake_up?tags=...`` (the named parts only).

        The staged wake of a colocated engine: ``wake_up(["weights"])``, push the new weights, then
        ``wake_up(["kv_cache"])``; ``generate`` refuses to send anything in between (vLLM keeps
        scheduling paused and ``/is_sleeping`` true until every part is awake).

        Returns:
            vLLM's answer, ``{"status": "awake" | "sleeping", "tags": [...] | null}``.

        Raises:
            ValueError: an empty list or a tag not in ``SLEEP_TAGS``.
            RolloutServerError: HTTP error or another shape than 0.33.x's.
        """
        names = None if tags is None else list(tags)
        if names is not None and (not names or any(t not in SLEEP_TAGS for t in names)):
            raise ValueError(f"wake_up tags must be a non-empty list of {SLEEP_TAGS} (None: all), got {names!r}")
        data = self._dict("POST", "/wake_up", ("status",), params={"tags": names} if names else None)
        if data["status"] not in ("awake", "sleeping"):
            raise _shape_error("POST /wake_up", f"status {data['status']!r}", data)
        with self._sleep.lock:
            awake = names is None or data["status"] == "awake"
            self._sleep.asleep = set() if awake else self._sleep.asleep - set(names)
        return data

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: true while the server sleeps at any level (until every part is awake)."""
        value = self._dict("GET", "/is_sleeping", ("is_sleeping",))["is_sleeping"]
        if not isinstance(value, bool):
            raise _shape_error("GET /is_sleeping", "is_sleeping is not a boolean", value)
        return value

    def _check_awake(self, rid: str) -> None:
        """Refuse to send a generation the server would answer from missing weights or KV (case N13)."""
        with self._sleep.lock:
            asleep, needs_reload = sorted(self._sleep.asleep), self._sleep.needs_reload
        if asleep:
            raise RolloutServerError(f"{self.base_url}: not sending generation {rid!r}: the server sleeps "
                                     f"({', '.join(asleep)} not awake); wake_up first", url=self.base_url,
                                     status_code=503)
        if needs_reload:
            raise RolloutServerError(f"{self.base_url}: not sending generation {rid!r}: the server slept at level 2 "
                                     "and its weights were not reloaded since (case N13: it would generate from "
                                     "uninitialised memory); push all weights first", url=self.base_url,
                                     status_code=409)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """vLLM has no such endpoint: raises ``RolloutServerError`` with status 400, which the checksum
        check (``WeightSyncSender.check_checksums``) counts as an unverifiable tensor."""
        raise RolloutServerError(f"{self.base_url}: vLLM {VLLM_VERSION} has no /get_weights_by_name ({name})",
                                 url=self.base_url, status_code=400)

    # ---- weight transfer ---------------------------------------------------------------

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl", *,
                                  timeout_s: float | None = None) -> dict:
        """``POST /init_weight_transfer_engine``; blocks until every rank joined (call it from a thread).

        vLLM's transfer group is NCCL (its ``StatelessProcessGroup``); ``backend`` is not sent (the
        `vllm-embedded` stand-in joins with gloo on CPU). ``group_name`` is remembered only here.
        """
        init_info = {"master_address": master_address, "master_port": int(master_port),
                     "rank_offset": int(rank_offset), "world_size": int(world_size), "packed": False}
        data = self._dict("POST", "/init_weight_transfer_engine", ("message",), json={"init_info": init_info},
                          timeout_s=timeout_s)
        self._group = group_name
        return data

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """vLLM has no endpoint to leave a group (the next ``/init_weight_transfer_engine`` replaces it):
        forgets the group this client joined; raises ``RolloutServerError`` (400) when it joined none,
        as SGLang answers for an unknown group."""
        if self._group != group_name:
            raise RolloutServerError(f"{self.base_url}: no weight-transfer group {group_name!r} joined by this client",
                                     url=self.base_url, status_code=400)
        self._group = None
        return {"success": True, "message": "forgotten (vLLM replaces the group at the next init)"}

    def begin_weight_update(self, selector: Literal["all", "target", "draft"] = "all", *,
                            timeout_s: float | None = None) -> dict:
        """``POST /start_weight_update`` (``/start_draft_weight_update`` for ``draft``)."""
        path = "/start_draft_weight_update" if selector == "draft" else "/start_weight_update"
        return self._dict("POST", path, ("message",), timeout_s=timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str = "weight_update_group", flush_cache: bool = False,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        timeout_s: float | None = None) -> dict:
        """``POST /update_weights`` {"update_info": {names, dtype_names, shapes}}: answers after the
        server received (one broadcast per tensor, in list order, from rank 0) and loaded them, so
        call it from a thread while broadcasting. ``weight_version`` is not sent here (vLLM takes it
        at ``/finish_weight_update``: ``end_weight_update``); ``flush_cache`` is not sent either.

        Raises:
            ValueError: ``load_format`` is not None (vLLM has no flattened bucket).
        """
        if load_format is not None:
            raise ValueError(f"load_format {load_format!r}: vLLM's /update_weights receives one broadcast per tensor "
                             "(weight_sync.load_format must be null)")
        update_info = {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}
        return self._dict("POST", "/update_weights", ("message",), json={"update_info": update_info},
                          timeout_s=timeout_s)

    def end_weight_update(self, *, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        """``POST /finish_weight_update`` {"weight_version": ...} (the body left out when None)."""
        body = {"weight_version": str(weight_version)} if weight_version is not None else None
        data = self._dict("POST", "/finish_weight_update", ("message",), json=body, timeout_s=timeout_s)
        with self._sleep.lock:
            self._sleep.needs_reload = False  # the caller of sleep(level=2) promised a full reload: this is it
        return data

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """``POST /update_weight_version`` {"new_version"}: relabel the weights only.

        ``abort_all_requests`` (default False, as ``RolloutClient``'s): vLLM's endpoint takes no such
        field, so True aborts every request first (``POST /abort_requests`` {}), then relabels.

        Raises:
            RolloutServerError: the server refused or could not be reached.
        """
        if abort_all_requests:
            self.abort_request(abort_all=True)
        return self._dict("POST", "/update_weight_version", ("new_version",), json={"new_version": new_version})
