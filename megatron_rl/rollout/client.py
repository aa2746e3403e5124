"""HTTP client for rollout servers that speak SGLang 0.5.23's API (SGLang itself or the embedded server).

One code path for both: the trainer never knows which kind of server it talks to. Every call
has a timeout. Retry policy (the only one in the project for rollout HTTP calls): a call is
retried, with exponential back-off, when the request never reached the server (connection
refused/reset before sending, connect timeout); GETs are also retried on read timeouts and
5xx answers. Anything else raises ``RolloutServerError`` at once, so a ``/generate`` or a
weight update is never sent twice by accident.

``GenerateResult`` (``megatron_rl.rollout.result``, re-exported here) is the adapter from SGLang's
``/generate`` answer to the rollout sample (case B21).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.engine import RolloutEngine, check_batch
from megatron_rl.rollout.result import (  # re-exported
    GenerateResult,
    RoutedExpertsSpec,
    StopReason,
    parse_weight_versions,
)

logger = logging.getLogger(__name__)

__all__ = ["GenerateRequest", "GenerateResult", "HTTPEngineClient", "RolloutClient", "RoutedExpertsSpec",
           "StopReason", "parse_weight_versions"]

@dataclass(frozen=True)
class GenerateRequest:
    """One request for ``RolloutClient.generate_many``: ``input_ids`` [prompt length] token ids."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool = True


def _answered(error: RolloutServerError) -> RolloutServerError:
    """A malformed or inconsistent ``/generate`` answer is an answer (HTTP 200), not a lost request:
    marked with ``status_code`` 200 so that the rollout manager raises it at once instead of
    resending the request as if the server had died."""
    if error.status_code is None:
        error.status_code = 200
    return error


KEEPALIVE_EXPIRY_S = 2.0
"""Idle seconds after which a pooled connection is dropped (below uvicorn's 5 s keep-alive timeout)."""

_ssl_lock = threading.Lock()
_ssl_context: ssl.SSLContext | None = None


def shared_ssl_context() -> ssl.SSLContext:
    """The one SSL context (httpx's default: certifi's CA bundle) every ``httpx.Client`` of this
    module verifies with. httpx builds a new one per Client by default, loading the CA bundle:
    ~20 ms of CPU each, and a client makes one Client per calling thread (the rollout and
    weight-sync thread pools), which cost the first RL steps a few hundred ms and later steps a
    few ms each time a pool started a thread (benchmarks/README.md, issue 22). An SSLContext is
    safe to share between threads and clients."""
    global _ssl_context
    with _ssl_lock:
        if _ssl_context is None:
            _ssl_context = httpx.create_ssl_context()
        return _ssl_context


class HTTPEngineClient(RolloutEngine):
    """What every HTTP rollout client shares: keys, timeouts, per-thread connection pools, the retry
    policy (module docstring), error answers as ``RolloutServerError``, ``GET /health`` and
    ``generate_many``. The dialects are its subclasses: ``RolloutClient`` (SGLang) and
    ``megatron_rl.rollout.vllm_client.VLLMClient`` (vLLM).

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        api_key: Bearer key for ``/generate`` and the info endpoints (``--api-key``).
        admin_api_key: Bearer key for control endpoints (``--admin-api-key``); when None the
            control endpoints get ``api_key``.
        timeout_s: default timeout of every call, seconds (``generate`` and the weight-update
            calls take their own).
        max_retries: retries of calls that never reached the server (see the module docstring).
        transport: an ``httpx`` transport (tests use ``httpx.MockTransport``), shared by all threads.

    Errors: every method raises ``RolloutServerError`` when the server cannot be reached, answers
    with an HTTP error, or answers ``success: false``; ``ValueError`` for bad arguments.
    Thread-safe: one client may serve many threads (``generate_many`` does); each thread gets its
    own connection pool (a shared httpcore pool can close a connection under another thread's
    request, which then hangs until its read timeout).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float = 60.0,
        generate_timeout_s: float = 3600.0,
        max_retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if timeout_s <= 0 or generate_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, generate_timeout_s={generate_timeout_s}"
            )
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.max_retries = max_retries
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self._transport = transport
        # One httpx.Client (one connection pool) per calling thread, never shared: httpcore's pool
        # closes connections it sees as idle outside its lock, so a pool shared by many threads can
        # close a connection another thread was just given and is already waiting on (the socket is
        # closed under a blocked recv; its fd is reused, and the request hangs until the read
        # timeout even though the server answered: encode/httpcore#1110). A pool used by one
        # thread cannot race with itself.
        self._clients_lock = threading.Lock()
        self._clients: dict[threading.Thread, httpx.Client] = {}
        self._closed = False

    def __repr__(self) -> str:  # never show keys
        return f"{type(self).__name__}({self.base_url!r})"

    @property
    def _http(self) -> httpx.Client:
        """This thread's ``httpx.Client`` (created on first use; those of finished threads are closed)."""
        me = threading.current_thread()
        http = self._clients.get(me)
        if http is not None:
            return http
        with self._clients_lock:
            if self._closed:
                raise RolloutServerError(f"{self!r} is closed", url=self.base_url)
            for t in [t for t in self._clients if not t.is_alive()]:
                stale = self._clients.pop(t)
                if self._transport is None:  # a caller's transport is shared: closed once, by close()
                    stale.close()
            http = self._clients[me] = httpx.Client(
                base_url=self.base_url,
                timeout=self.timeout_s,
                transport=self._transport,
                # (a caller's transport does its own TLS: no context is built for it)
                **({} if self._transport is not None else {"verify": shared_ssl_context()}),
                # one thread: one request at a time; keep its connection alive between calls, but
                # drop it after 2 s idle: uvicorn (SGLang's server and ours) closes idle
                # connections after its keep-alive timeout (5 s by default), and a request sent on a
                # connection the server is closing at that moment is reset without an answer.
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=4,
                                    keepalive_expiry=KEEPALIVE_EXPIRY_S),
            )
        return http

    def close(self) -> None:
        """Close the connection pools (of every thread that used this client)."""
        with self._clients_lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for http in clients:
            http.close()
        if self._transport is not None:
            self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transport ----------------------------------------------------------------------

    def _headers(self, admin: bool) -> dict[str, str]:
        key = (self._admin_api_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        admin: bool = False,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        url = self.base_url + path
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        delay = 0.2
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._http.request(
                    method, path, json=json, params=params, headers=self._headers(admin), timeout=timeout
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                err: Exception = e
            except httpx.TimeoutException as e:
                if method != "GET":
                    raise RolloutServerError(f"{method} {url} timed out after {timeout:.0f} s", url=url) from e
                err = e
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                # "Server disconnected without sending a response" / "Connection reset by peer": the
                # keep-alive race above, the server closed a reused idle connection as the request
                # went out, so it never ran. Sending it again is safe (generation is keyed by rid
                # and seeded); a second failure on a fresh connection is a real error.
                if attempt >= 1:
                    raise RolloutServerError(f"{method} {url} failed: {e!r}", url=url) from e
                logger.warning("%s %s: %r on a reused connection; retrying once on a new one", method, url, e)
                err = e
            except httpx.HTTPError as e:
                raise RolloutServerError(f"{method} {url} failed: {e!r}", url=url) from e
            else:
                if resp.status_code >= 500 and method == "GET" and attempt < self.max_retries:
                    err = RolloutServerError(
                        f"{method} {url}: HTTP {resp.status_code}", url=url, status_code=resp.status_code
                    )
                else:
                    return resp
            if attempt < self.max_retries:
                logger.warning(
                    "%s %s: %r; retry %d/%d in %.1f s", method, url, err, attempt + 1, self.max_retries, delay
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise RolloutServerError(f"{method} {url} failed after {self.max_retries + 1} attempts: {err!r}", url=url)

    @staticmethod
    def _body(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def _check(self, resp: httpx.Response, what: str) -> Any:
        body = self._body(resp)
        if resp.status_code != 200:
            raise RolloutServerError(
                f"{what} at {self.base_url}: HTTP {resp.status_code}: {str(body)[:1000]}",
                url=str(resp.request.url),
                status_code=resp.status_code,
                body=body,
            )
        return body

    # ---- health and info ----------------------------------------------------------------

    def health(self) -> None:
        """``GET /health``; raises ``RolloutServerError`` unless it answers 200."""
        self._check(self._request("GET", "/health"), "/health")

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s`` (no retries)."""
        try:
            return self._http.get("/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise ``RolloutServerError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if time.monotonic() > deadline:
                raise RolloutServerError(f"{self.base_url} not healthy after {timeout_s:.0f} s", url=self.base_url)
            time.sleep(0.2)

    def generate_many(
        self,
        requests: Sequence[GenerateRequest],
        max_concurrency: int = 64,
        *,
        eos_token_ids: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:
        """Run ``requests`` concurrently (at most ``max_concurrency`` in flight).

        Returns the results in the order of ``requests``, never in arrival order. The first
        failure is raised (``RolloutServerError``) after the requests already sent complete.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not requests:
            return []
        eos = list(eos_token_ids) if eos_token_ids is not None else None
        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(requests)), thread_name_prefix="generate") as pool:
            futures = [
                pool.submit(
                    self.generate,
                    r.input_ids,
                    r.sampling_params,
                    r.rid,
                    r.return_logprob,
                    eos_token_ids=eos,
                    timeout_s=timeout_s,
                )
                for r in requests
            ]
            return [f.result() for f in futures]

class RolloutClient(HTTPEngineClient):
    """Client of one rollout server speaking SGLang's HTTP API (the `embedded` and `sglang` backends
    of `RolloutEngine`), one method per endpoint. Arguments and errors: ``HTTPEngineClient``; a
    control call answered ``success: false`` raises ``RolloutServerError`` too."""

    def _control(self, path: str, body: dict, *, timeout_s: float | None = None) -> dict:
        """POST a control body; raise unless the answer is ``success: true``."""
        resp = self._request("POST", path, json=body, admin=True, timeout_s=timeout_s)
        data = self._check(resp, path)
        if isinstance(data, dict) and data.get("success") is False:
            raise RolloutServerError(
                f"{path} at {self.base_url} failed: {data.get('message')}",
                url=self.base_url + path,
                status_code=resp.status_code,
                body=data,
            )
        return data if isinstance(data, dict) else {"result": data}

    def health_generate(self) -> None:
        """``GET /health_generate`` (a one-token generation); raises unless 200."""
        self._check(self._request("GET", "/health_generate"), "/health_generate")

    def model_info(self) -> dict:
        """``GET /model_info``: ``model_path``, ``weight_version`` and (embedded server) ``dtype``."""
        return self._check(self._request("GET", "/model_info"), "/model_info")

    def server_info(self) -> dict:
        """``GET /server_info``: the server's arguments and state (``tp_size``, ...)."""
        return self._check(self._request("GET", "/server_info"), "/server_info")

    def weight_version(self) -> str:
        """The server's current weight version label (``/model_info``)."""
        return str(self.model_info()["weight_version"])

    def transfer_world_size(self) -> int:
        """Ranks the server adds to a weight-update group: SGLang's TP workers, each joining at
        ``rank_offset + tp_rank`` (``/server_info`` ``tp_size``; 1 when not reported).

        Raises:
            RolloutServerError: ``tp_size`` is not a whole number >= 1, or the server runs pipeline
                or data parallelism (``pp_size`` / ``dp_size`` > 1): SGLang's workers join at
                ``rank_offset + tp_rank`` only, so two of them would take one rank and the
                rendezvous would hang. Names the server.
        """
        info = self.server_info()
        tp = info.get("tp_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise RolloutServerError(f"rollout server {self.base_url}: /server_info tp_size is {tp!r}, expected a "
                                     "whole number >= 1", url=self.base_url, status_code=200)
        for key in ("pp_size", "dp_size"):
            n = info.get(key) or 1
            if isinstance(n, int) and n > 1:
                raise RolloutServerError(
                    f"rollout server {self.base_url} runs {key} {n}: SGLang's workers join the weight-update group at "
                    f"rank_offset + tp_rank only, so its {key.split('_')[0].upper()} replicas would take the same "
                    "ranks; run one engine per replica (rollout.num_servers / rollout.server_urls) instead",
                    url=self.base_url, status_code=200)
        return tp

    def context_length(self) -> int | None:
        """Tokens prompt + response may hold (SGLang refuses ``input + max_new_tokens`` beyond its
        context): the smaller of ``/server_info``'s ``context_length`` (SGLang reports it when started
        with ``--context-length``, null otherwise: the model's, which the config check compares with
        the data lengths) and ``max_total_num_tokens`` (the KV pool); None when it reports neither."""
        info = self.server_info()
        known = [int(info[k]) for k in ("context_length", "max_total_num_tokens")
                 if isinstance(info.get(k), int) and not isinstance(info.get(k), bool) and info[k] > 0]
        return min(known, default=None)

    def score_tokens(self, prompt_ids: list[int], continuation_ids: list[int], *,
                     timeout_s: float | None = None) -> list[float]:
        """``RolloutEngine.score_tokens``: one ``/generate`` of prompt + continuation with
        ``return_logprob``, ``logprob_start_len`` = P and one new token at temperature 1; the last C
        entries of ``meta_info.input_token_logprobs`` (SGLang computes them from the raw logits).

        Raises:
            ValueError: an empty prompt or continuation.
            RolloutServerError: HTTP error, or an answer without C log-probs of those ids.
        """
        if not prompt_ids or not continuation_ids:
            raise ValueError("score_tokens needs a prompt and a continuation of at least one token each")
        ids = [int(t) for t in [*prompt_ids, *continuation_ids]]
        body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": len(prompt_ids),
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1}}
        data = self.generate_raw(body, timeout_s=timeout_s)
        entries = (data.get("meta_info") or {}).get("input_token_logprobs") if isinstance(data, dict) else None
        tail = list(entries or [])[-len(continuation_ids):]
        try:
            if [int(e[1]) for e in tail] != [int(t) for t in continuation_ids]:
                raise ValueError
            return [float(e[0]) for e in tail]
        except (TypeError, ValueError, IndexError):
            raise RolloutServerError(f"/generate at {self.base_url}: meta_info.input_token_logprobs "
                                     f"{str(entries)[:300]} do not score the {len(continuation_ids)} tokens "
                                     f"{list(continuation_ids)[:8]} "
                                     f"after position {len(prompt_ids)}", url=self.base_url, status_code=200,
                                     body=data) from None

    # ---- generation ---------------------------------------------------------------------

    def generate_raw(self, body: dict, *, timeout_s: float | None = None) -> Any:
        """``POST /generate`` with ``body`` as is; returns the decoded answer (object or list)."""
        resp = self._request("POST", "/generate", json=body, timeout_s=timeout_s or self.generate_timeout_s)
        return self._check(resp, "/generate")

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str,
        return_logprob: bool = True,
        *,
        eos_token_ids: Iterable[int] | None = None,
        timeout_s: float | None = None,
        routed_experts: RoutedExpertsSpec | None = None,
    ) -> GenerateResult:
        """Generate one response for ``input_ids`` ([prompt length] token ids).

        ``sampling_params`` uses SGLang's keys (``max_new_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``sampling_seed``, ``stop_token_ids``, ...; an unknown key is a 400 and raises).
        ``rid`` is the request id, usable with ``abort_request``. Must have ``n`` == 1.
        ``routed_experts`` (the policy's MoE layout): ask for the routing (``return_routed_experts:
        true``; SGLang must run with ``--enable-return-routed-experts``) and check it
        (``GenerateResult.routed_experts``).

        Raises:
            RolloutServerError: HTTP error, timeout, or an inconsistent answer (see ``GenerateResult``).
            ValueError: ``n`` > 1 or empty ``input_ids``.
        """
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if int(sampling_params.get("n", 1)) != 1:
            raise ValueError("generate() makes one response; send one request per response (own rid and seed)")
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "rid": rid,
            "return_logprob": return_logprob,
        }
        if routed_experts is not None:
            body["return_routed_experts"] = True
        data = self.generate_raw(body, timeout_s=timeout_s)
        try:
            if not isinstance(data, dict):
                raise RolloutServerError(f"/generate answered a {type(data).__name__} for one prompt", body=data)
            return GenerateResult.from_sglang(
                data,
                stop_token_ids=sampling_params.get("stop_token_ids") or (),
                eos_token_ids=eos_token_ids,
                return_logprob=return_logprob,
                routed_experts=routed_experts,
            )
        except RolloutServerError as e:
            raise _answered(e) from None

    supports_batch_generate = True

    def generate_batch(
        self,
        input_ids: Sequence[list[int]],
        sampling_params: Sequence[dict[str, Any]],
        rids: Sequence[str],
        return_logprob: bool = True,
        *,
        eos_token_ids: Iterable[int] | None = None,
        timeout_s: float | None = None,
        routed_experts: RoutedExpertsSpec | None = None,
    ) -> list[GenerateResult]:
        """K responses in one ``POST /generate`` (SGLang's batch form: ``input_ids`` a list of K
        prompts, ``sampling_params`` and ``rid`` lists of K): entry k is ``input_ids[k]`` with
        ``sampling_params[k]`` (its own ``sampling_seed``) and request id ``rids[k]`` (each one
        abortable on its own). Returns the K results in entry order; the answer must be a list of K
        objects whose ``meta_info.id`` are ``rids`` in order. ``routed_experts``: as ``generate``
        (SGLang's ``return_routed_experts`` is one flag for the whole batch).

        Raises:
            RolloutServerError: HTTP error, timeout, or an answer that is no such list (or an
                inconsistent entry, see ``GenerateResult``); a malformed answer has ``status_code`` 200.
            ValueError: lengths differ, an empty prompt, or ``n`` > 1 in an entry.
        """
        check_batch(input_ids, sampling_params, rids)
        k = len(input_ids)
        if any(not ids for ids in input_ids):
            raise ValueError("input_ids must not be empty")
        if any(int(sp.get("n", 1)) != 1 for sp in sampling_params):
            raise ValueError("generate_batch() makes one response per entry; give each response its own entry")
        body = {
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": [dict(sp) for sp in sampling_params],
            "rid": list(rids),
            "return_logprob": return_logprob,
        }
        if routed_experts is not None:
            body["return_routed_experts"] = True
        data = self.generate_raw(body, timeout_s=timeout_s)
        eos = None if eos_token_ids is None else list(eos_token_ids)  # read once per entry below
        try:
            if not isinstance(data, list) or len(data) != k:
                raise RolloutServerError(f"/generate answered {type(data).__name__}"
                                         f"{f' of {len(data)}' if isinstance(data, list) else ''} for a batch of {k}",
                                         body=data)
            out = [GenerateResult.from_sglang(d, stop_token_ids=sp.get("stop_token_ids") or (), eos_token_ids=eos,
                                              return_logprob=return_logprob, routed_experts=routed_experts)
                   for d, sp in zip(data, sampling_params)]
            got = [r.rid for r in out]
            if got != list(rids):
                raise RolloutServerError(f"/generate batch answer ids {got[:4]}... do not follow the rids "
                                         f"{list(rids)[:4]}...", body=data)
        except RolloutServerError as e:
            raise _answered(e) from None
        return out

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request``: abort every request whose rid starts with ``rid`` (or all)."""
        self._check(
            self._request("POST", "/abort_request", json={"rid": rid, "abort_all": abort_all}, admin=True),
            "/abort_request",
        )

    # ---- generation control -------------------------------------------------------------

    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> dict:
        """``POST /pause_generation``."""
        return self._control("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        """``POST /continue_generation``."""
        return self._control("/continue_generation", {})

    def flush_cache(self, timeout_s: float = 0.0) -> str:
        """``POST /flush_cache``; returns the server's text. Raises on 400 (requests in flight)."""
        resp = self._request(
            "POST",
            "/flush_cache",
            json={},
            params={"timeout": timeout_s},
            admin=True,
            timeout_s=self.timeout_s + timeout_s,
        )
        return str(self._check(resp, "/flush_cache"))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """``POST /update_weight_version``: relabel the weights only.

        Args:
            new_version: the new label (``weight_version`` of every later generation).
            abort_all_requests: also abort every request in the engine first. Default False (the
                safe one; SGLang's own default is True): a relabel after an in-place update must
                not abort the requests paused in place. Callers that want the abort pass True.

        Raises:
            RolloutServerError: the server refused or could not be reached.
        """
        return self._control(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """``POST /get_weights_by_name``: the parameter's first ``truncate_size`` rows/values."""
        resp = self._request(
            "POST", "/get_weights_by_name", json={"name": name, "truncate_size": truncate_size}, admin=True
        )
        return self._check(resp, "/get_weights_by_name")

    # ---- weight update ------------------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        *,
        timeout_s: float | None = None,
    ) -> dict:
        """``POST /init_weights_update_group``; blocks until every rank joined (call it from a thread)."""
        return self._control(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            timeout_s=timeout_s,
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """``POST /destroy_weights_update_group``."""
        return self._control("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(
        self, selector: Literal["all", "target", "draft"] = "all", *, timeout_s: float | None = None
    ) -> dict:
        """``POST /begin_weight_update`` (opens the session the update calls need)."""
        return self._control("/begin_weight_update", {"selector": selector}, timeout_s=timeout_s)

    def end_weight_update(self, *, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        """``POST /end_weight_update`` (closes the session). ``weight_version`` is ignored: SGLang
        takes the label with the last bucket (``update_weights_from_distributed``)."""
        return self._control("/end_weight_update", {}, timeout_s=timeout_s)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
        timeout_s: float | None = None,
    ) -> dict:
        """``POST /update_weights_from_distributed``: answers after the broadcasts and the load.

        The caller must broadcast the matching tensors (or one flattened bucket) over the group
        meanwhile, so call this from a thread.
        """
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return self._control("/update_weights_from_distributed", body, timeout_s=timeout_s)

    # ---- colocated mode (issue 17) ------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> dict:
        """``POST /release_memory_occupation`` (``tags`` None = all of ``weights``, ``kv_cache``,
        ``cuda_graph``); needs an idle server. Returns ``{"rss_before", "rss_after"}`` in bytes
        when the server reports them (the embedded server's ``X-RSS-*`` headers), else ``{}``.
        Raises ``RolloutServerError`` unless 200."""
        return self._memory_call("/release_memory_occupation", tags, timeout_s)

    def resume_memory_occupation(self, tags: list[str] | None = None, *, timeout_s: float | None = None) -> dict:
        """``POST /resume_memory_occupation``; answers as ``release_memory_occupation``."""
        return self._memory_call("/resume_memory_occupation", tags, timeout_s)

    def _memory_call(self, path: str, tags: list[str] | None, timeout_s: float | None) -> dict:
        resp = self._request("POST", path, json={"tags": tags}, admin=True, timeout_s=timeout_s)
        self._check(resp, path)
        out = {}
        for key, header in (("rss_before", "x-rss-before"), ("rss_after", "x-rss-after")):
            if header in resp.headers:
                out[key] = int(resp.headers[header])
        return out

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None,
                                   abort_all_requests: bool = False, timeout_s: float | None = None) -> dict:
        """``POST /update_weights_from_tensor`` (SGLANG_API.md 2.4): one payload per TP rank
        (``megatron_rl.weight_sync.ipc.serialize_named_tensors``); answers after the load."""
        body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors), "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._control("/update_weights_from_tensor", body, timeout_s=timeout_s)

    def memory_occupation(self) -> dict:
        """``GET /memory_occupation`` (embedded server only): ``weights``, ``kv_cache``, ``rss_bytes``."""
        return self._check(self._request("GET", "/memory_occupation"), "/memory_occupation")
