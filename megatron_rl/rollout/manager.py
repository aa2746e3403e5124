"""Rollout manager: prompts -> groups of scored responses (DESIGN.md steps 2-4).

Only the controller (trainer global rank 0) uses it. Each response has its own request id and
`sampling_seed` derived from (run seed, step, generation batch, prompt index, response index;
`partial.response_seeds`); results are ordered by (generation batch, prompt index, response index),
never by arrival. When every engine takes a batch call (`RolloutEngine.supports_batch_generate`:
SGLang's batch `/generate`; vLLM's client, which sends the group as one completion with `n` when
the seeds are consecutive, `consecutive_seeds`), the `n` responses of a prompt go out as one call
(one entry per response: its rid, seed and parameters, so nothing sampled changes); otherwise one
call per response.

Live weight updates (ALGORITHMS.md section 8): a request aborted by a pause of the engines
(`rollout.pause_mode: abort`) or as too stale before one is resubmitted once the engines continue,
with its generated prefix when `rollout.partial_rollout` is on (stale ones always from scratch);
the manager's own over-sampling aborts stay dropped. Every response records the integer weight
versions its tokens came from (`Sample.weight_version_spans`, `megatron_rl.rollout.live`). A group
with a member that failed for good (a server-side abort) is dropped as a whole, never returned
short, and counted in `rollout/failed_groups`.

Routed experts (Mixture-of-Experts policies with `actor.router_replay`; ALGORITHMS.md section 9):
with a `RoutedExpertsSpec` every request asks the engine for its routing, and each `Sample` carries
it (`Sample.routed_experts`, [prompt + response - 1, layers, top-k]). A partial rollout's parts
keep the routing each had when the engine processed them (DESIGN.md "Directions: experts"): the
continuation's request re-processes prompt + prefix under the new weights, but only its rows from
the prefix's last token on (the one position the first part never fed back) are taken
(`join_routing`); the prefix keeps the rows of the part that generated it, i.e. the routing its
tokens' log-probs were computed with.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megatron_rl.algorithms.reward_shaping import overlong_penalty
from megatron_rl.data.dataset import PromptRow
from megatron_rl.data.prompts import render_prompt_ids
from megatron_rl.rollout.live import spans_of
from megatron_rl.rollout.result import GenerateResult
from megatron_rl.rollout.partial import continuation, derive_seed, join_routing, joined, response_seeds  # noqa: F401
from megatron_rl.rollout.multiturn import RESTART_EPISODE, episode_stats, model_token_ids, run_episode

logger = logging.getLogger(__name__)


def request_id(tag: str, i: int, j: int, n: int) -> str:
    """The rid of response `j` (of `n`) to prompt `i` of batch `tag`: `{tag}-p{i}-r{j}`, with `j`
    zero-padded to the width of `n - 1`, because engines abort by rid *prefix* (SGLang's
    `/abort_request`): unpadded, aborting `...-r1` would also abort `...-r10` to `...-r15`. Prompt
    indices need no padding: `-p1-` is never a prefix of `-p10-`. Resubmissions append `-a{k}`."""
    return f"{tag}-p{i}-r{j:0{len(str(max(n - 1, 0)))}d}"


@dataclass
class Sample:
    """One response of one group, with everything the trainer needs.

    `response_ids` keep the EOS token when the response stopped on it (case B21);
    `rollout_logprobs` has one entry per response token.
    """

    prompt_key: str
    group_uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    stop_reason: str
    """eos | stop_token | stop_string | length | abort."""
    ground_truth: str
    response_text: str = ""
    score: float = 0.0
    """Shaped reward: verifier score + overlong penalty."""
    acc: bool = False
    """Raw correctness from the verifier."""
    failed: bool = False
    """The verifier failed or timed out, or a tool's infrastructure failed in the episode (CASES.md
    T10): excluded from the group's statistics, advantage 0, loss mask 0."""
    format_valid: bool = False
    overlong_penalty: float = 0.0
    advantage: float = 0.0
    extra_info: dict = field(default_factory=dict)
    weight_version_spans: list[tuple[int, int]] = field(default_factory=list)
    """`[(version, first token index), ...]`, oldest first: the trainer's weight versions the
    response's tokens were sampled under (the prefill counts toward the first token's); a start of
    -1 (`rollout.live.UNKNOWN_START`) means a server that reported only its final version, somewhere
    after the previous span's start. Empty when no version is known."""
    resubmissions: int = 0
    """Times the request was resubmitted after a pause or a staleness abort."""
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Mixture-of-Experts routing replay: [len(prompt_ids) + len(response_ids) - 1, layers, top-k]
    int16 (`GenerateResult.routed_experts`): row t = the experts each layer routed position t of
    prompt + response to in the engine (each part of a partial rollout as it was generated); None
    when routing was not asked for. Not compared by `==`."""
    response_mask: list[bool] | None = None
    """Multi-turn episodes: one bool per response token, True on the model's tokens (trained), False
    on tool answers and template tokens (rollout log-prob 0.0); None: every token is the model's."""
    episode: dict = field(default_factory=dict, compare=False)
    """Multi-turn episodes: turns, tool_calls, tool_errors, tool_s, turn_limit, segments; {} otherwise."""

    @property
    def truncated(self) -> bool:
        return self.stop_reason == "length"

    @property
    def min_weight_version(self) -> int | None:
        """The oldest weight version any token comes from (what staleness is measured by); None
        when unknown."""
        return min((v for v, _ in self.weight_version_spans), default=None)

    @property
    def max_weight_version(self) -> int | None:
        """The newest weight version any token comes from; None when unknown."""
        return max((v for v, _ in self.weight_version_spans), default=None)


@dataclass
class Group:
    """All responses to one drawn prompt; `group_uid` is fresh for every draw."""

    prompt_key: str
    group_uid: str
    samples: list[Sample]

    @property
    def num_correct(self) -> int:
        return sum(1 for s in self.samples if s.acc and not s.failed)

    @property
    def num_valid(self) -> int:
        return sum(1 for s in self.samples if not s.failed)

    def metric_values(self, metric: str) -> list[float]:
        """Values of the dynamic-sampling metric over valid responses (`acc` or `score`)."""
        return [float(s.acc) if metric == "acc" else s.score for s in self.samples if not s.failed]


class RolloutManager:
    """Generates and scores groups through one or more SGLang-API servers.

    Args:
        clients: a `ServerFleet`, or `RolloutClient`s (a fleet without restarts is made of them);
            requests are spread round-robin by (prompt, response) over the servers that are up, and
            a request that got no answer is retried on a live server (see `ServerFleet`).
        tokenizer: a Hugging Face tokenizer (prompt rendering and response decoding).
        reward_pool: a `RewardPool` (verifiers in processes, with a timeout per call).
        reward_fn: registry name of the verifier.
        max_prompt_length / max_response_length: tokens.
        correct_score / incorrect_score: the verifier's score for acc True / False.
        overlong: (enable, buffer_len, penalty_factor) of DAPO's overlong reward shaping.
        seed: run seed, mixed into every `sampling_seed`.
        max_concurrency: HTTP requests in flight in total.
        eos_token_ids: the tokenizer's EOS ids (tells an EOS stop from a stop-token stop, case B21).
        partial_rollout: resubmit a request aborted by a pause with its generated prefix
            (`rollout.partial_rollout`); False: from scratch.
        pause_timeout_s: how long a request aborted by a pause waits for the engines to continue
            before it counts as failed, seconds.
        routed_experts: the policy's MoE layout (`RoutedExpertsSpec`) when every response must carry
            the engine's routing (`actor.router_replay`); None (default): not asked for. Also set
            later by `request_routed_experts`.
        context_limit: `(tokens, engine URL)` of the shortest engine context
            (`engine_checks.engine_context_limit`): a prompt whose tokens plus the response budget
            exceed it is refused before it is sent (`ValueError` naming the row); None (default):
            not checked.
        environment: a `multiturn.Environment` that runs every response as an episode of turns
            (`rollout.multi_turn`); None (default): one completion a response. Closed by `close`.
        consecutive_seeds: response j of a prompt samples with the prompt's seed + j
            (`partial.response_seeds`), so that engines with parallel sampling (vLLM: one request
            with `n`, `rollout.parallel_sampling`) take a prompt's responses as one request;
            False (default): a seed derived per response.
    """

    def __init__(
        self,
        clients: Sequence,
        tokenizer,
        reward_pool,
        *,
        reward_fn: str,
        max_prompt_length: int,
        max_response_length: int,
        correct_score: float = 1.0,
        incorrect_score: float = -1.0,
        overlong: tuple[bool, int, float] = (False, 1, 1.0),
        seed: int = 0,
        max_concurrency: int = 256,
        eos_token_ids: Sequence[int] = (),
        partial_rollout: bool = False,
        pause_timeout_s: float = 3600.0,
        routed_experts=None,
        context_limit: tuple[int, str] | None = None,
        environment=None,
        consecutive_seeds: bool = False,
    ) -> None:
        from megatron_rl.rollout.fleet import ServerFleet

        self.fleet = clients if isinstance(clients, ServerFleet) else ServerFleet(list(clients) or [], None)
        self.clients = self.fleet.clients
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool
        self.reward_fn = reward_fn
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.correct_score = correct_score
        self.incorrect_score = incorrect_score
        self.overlong = overlong
        self.seed = seed
        self.max_concurrency = max_concurrency
        self.eos_token_ids = list(eos_token_ids) or None
        self.partial_rollout = partial_rollout
        self.pause_timeout_s = pause_timeout_s
        self.routed_experts = routed_experts
        """`RoutedExpertsSpec` of the routing every response carries, or None."""
        self.context_limit = context_limit
        self.environment = environment
        self.consecutive_seeds = consecutive_seeds
        self.gate = self.fleet.gate
        self._own_aborts: set[str] = set()
        self._own_lock = threading.Lock()
        self._prompt_cache: dict[str, list[int]] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.environment is not None:
            self.environment.close()

    def request_routed_experts(self, spec) -> None:
        """From now on ask every engine for the routing of every response and check it against
        `spec` (a `RoutedExpertsSpec`: the policy's layers, top-k and experts); None stops asking."""
        self.routed_experts = spec

    def prompt_ids(self, row: PromptRow) -> list[int]:
        """Token ids of a row's chat prompt (with the generation prompt); cached by prompt_key.

        Raises:
            ValueError: the prompt is longer than `data.max_prompt_length` (names the row).
        """
        ids = self._prompt_cache.get(row.prompt_key)
        if ids is None:
            tools = None if self.environment is None else self.environment.chat_tools()
            ids = render_prompt_ids(self.tokenizer, row.messages, tools)
            if len(ids) > self.max_prompt_length:
                raise ValueError(
                    f"prompt of {row.origin or row.prompt_key} has {len(ids)} tokens > data.max_prompt_length "
                    f"({self.max_prompt_length})"
                )
            self._prompt_cache[row.prompt_key] = ids
        return ids

    def check_fits(self, row: PromptRow, ids: list[int], max_new_tokens: int) -> None:
        """Refuse `row` (its prompt `ids`) when prompt + `max_new_tokens` exceed `context_limit`.

        Raises:
            ValueError: naming the row, the prompt length, the response budget, the limit and the engine.
        """
        if self.context_limit is not None and len(ids) + max_new_tokens > self.context_limit[0]:
            limit, url = self.context_limit
            raise ValueError(
                f"prompt {row.prompt_key} ({row.origin or 'no file row'}) has {len(ids)} tokens; with the response "
                f"budget of {max_new_tokens} tokens (data.max_response_length; eval.max_response_length for "
                f"evaluation in training; --max-new-tokens of megatron-rl eval) that is {len(ids) + max_new_tokens} > {limit}, the context limit of the rollout engine "
                f"at {url}: lower data.max_prompt_length (longer prompts are refused) or the response budget, or "
                f"start the engine with a longer context")

    def generate(
        self,
        rows: Sequence[PromptRow],
        *,
        n: int,
        sampling_params: dict,
        tag: str,
        seed_parts: tuple,
        max_new_tokens: Optional[int] = None,
        on_response=None,
    ) -> list[list]:
        """Sample `n` responses for every row; returns GenerateResults as [P][n], in input order.

        `tag` prefixes every request id (`request_id`: `{tag}-p{i}-r{j}`) so a whole batch can be aborted by
        prefix; `seed_parts` (e.g. (seed, step, batch)) are mixed into each `sampling_seed`.
        `on_response(i)`, if given, is called (on a worker thread) when a response of row i ends.
        """
        max_new = max_new_tokens or self.max_response_length
        futures = []
        for row in rows:  # every row checked before any request goes out
            self.check_fits(row, self.prompt_ids(row), max_new)
        for i, row in enumerate(rows):
            ids = self.prompt_ids(row)
            params = [dict(sampling_params, max_new_tokens=max_new, sampling_seed=seed)
                      for seed in response_seeds(seed_parts, i, n, consecutive=self.consecutive_seeds)]
            for f in self._submit_row(i, n, ids, params, [request_id(tag, i, j, n) for j in range(n)]):
                futures.append(f)
                if on_response is not None:
                    f.add_done_callback(lambda f, i=i: on_response(i))
        results = [f.result() for f in futures]
        return [results[i * n : (i + 1) * n] for i in range(len(rows))]

    def _batch_calls(self, ids: list[int], params: list[dict]) -> bool:
        """Whether every engine takes a prompt's responses (`params`) as one call (SGLang's batch
        `/generate`; vLLM's completion with `n`, for consecutive seeds only): then one task per group."""
        one = [list(ids)] * len(params)
        return bool(self.clients) and all(c.takes_as_one_call(one, params) if hasattr(c, "takes_as_one_call")
                                          else getattr(c, "supports_batch_generate", False) for c in self.clients)

    def _submit_row(self, i: int, n: int, ids: list[int], params: list[dict], rids: list[str]) -> list[Future]:
        """Start the `n` responses of prompt `i`; one future per response (in order). With batch
        calls the group is one task on the pool (one `/generate` to the server picked for prompt `i`)
        whose results are fanned out to the `n` futures; otherwise one task per response (the server
        picked for response `i * n + j`)."""
        if n == 1 or self.environment is not None or not self._batch_calls(ids, params):
            return [self._executor.submit(self._generate_one, i * n + j, ids, params[j], rids[j]) for j in range(n)]
        group = self._executor.submit(self.generate_batch_ids, [(ids, p, r) for p, r in zip(params, rids)], i)
        outs: list[Future] = [Future() for _ in range(n)]

        def fan_out(f: Future) -> None:
            if f.cancelled():
                for o in outs:
                    o.cancel()
                return
            exc = f.exception()
            for j, o in enumerate(outs):
                if exc is not None:
                    o.set_exception(exc)
                else:
                    o.set_result(f.result()[j])

        group.add_done_callback(fan_out)
        return outs

    def _post(self, key: int, subs: list[tuple[list[int], dict, str]]) -> list:
        """`subs` ((ids, params, rid) each) as one `/generate` on the server picked for `key` (a batch
        call for more than one entry), retried on a live server when it got no answer (the server
        died or hung; `ServerFleet.report_failure` recovers). An HTTP error answer, or a malformed
        one, is raised at once. The retry repeats the same rids and `sampling_seed`s."""
        from megatron_rl.errors import RolloutServerError

        what = f"request {subs[0][2]}" if len(subs) == 1 else f"requests {subs[0][2]}.. ({len(subs)})"
        for attempt in range(2 * len(self.clients) + 2):
            index, epoch = self.fleet.pick(key)
            client = self.clients[index]
            extra = {} if self.routed_experts is None else {"routed_experts": self.routed_experts}
            try:
                if len(subs) == 1:
                    return [client.generate(*subs[0], eos_token_ids=self.eos_token_ids, **extra)]
                return client.generate_batch([s[0] for s in subs], [s[1] for s in subs], [s[2] for s in subs],
                                             eos_token_ids=self.eos_token_ids, **extra)
            except RolloutServerError as e:
                if e.status_code is not None:
                    raise
                self.fleet.report_failure(index, epoch, e)
                logger.info("retrying %s (attempt %d)", what, attempt + 2)
        raise RolloutServerError(f"{what} got no answer from any rollout server")

    def generate_ids(self, ids: list[int], params: dict, rid: str, key: int = 0, *, restart: bool = False,
                     oldest: int | None = None):
        """One response to the prompt `ids` ([prompt length] token ids) with SGLang `params`
        (`max_new_tokens` and `sampling_seed` included) as a `GenerateResult` whose `version_spans`
        are set, resubmitted across live weight updates (module docstring): attempt k > 0 goes out
        as `{rid}-a{k}`; a continuation (partial rollout) is sent as prompt + prefix with the
        remaining `max_new_tokens` and its own seed, and the parts' tokens, log-probs and spans are
        concatenated. Ends with finish type `abort` only for the manager's own aborts or a failure,
        or, with `restart` (a turn of an episode without partial rollouts), for a request that would
        be resubmitted: then once the engines continue, with `abort_message` `RESTART_EPISODE`
        (the caller starts the whole episode again: CASES.md T09). `oldest`: an episode's turn, the oldest
        version of the episode's tokens so far: the request's oldest for the stale aborts, and a stale
        abort ends it as `RESTART_EPISODE` (its earlier turns are as stale).

        Raises:
            RolloutServerError: no server answered, or one answered with an HTTP error.
        """
        return self.generate_batch_ids([(ids, params, rid)], key, restart=restart, oldest=oldest)[0]

    def generate_batch_ids(self, items: Sequence[tuple[list[int], dict, str]], key: int = 0, *,
                           restart: bool = False, oldest: int | None = None) -> list:
        """`generate_ids` for several (ids, params, rid) entries at once: every attempt of the
        entries still going is one `/generate` (a batch call for more than one entry, on the server
        picked for `key`); results in the order of `items`. Same resubmission rules per entry.

        Raises:
            RolloutServerError: as `generate_ids`.
        """
        k = len(items)
        done: list = [None] * k  # what earlier attempts made and keep (partial rollout)
        out: list = [None] * k
        attempt = 0
        active = list(range(k))
        while active:
            if attempt == 0:  # aborted by us while it waited in the pool (over-sampling): never sent
                for e in [e for e in active if self._own_abort(items[e][2])]:
                    out[e] = GenerateResult.unsent_abort(items[e][2], len(items[e][0]),
                                                         "aborted by the rollout manager before it was sent")
                active = [e for e in active if out[e] is None]
                if not active:
                    break
            subs = []
            for e in active:
                ids, params, rid = items[e]
                sub = (ids, params, rid)
                if attempt:
                    sub = (ids, params, f"{rid}-a{attempt}")
                    if done[e] is not None:
                        sub = (*continuation(ids, params, done[e], attempt), sub[2])
                subs.append(sub)
            gate = self.gate
            epoch, submitted = gate.pause_epoch, gate.version
            for e, sub in zip(active, subs):
                own = min((v for v, _ in done[e].version_spans), default=submitted) if done[e] is not None \
                    else submitted
                gate.register(sub[2], min((v for v in (own, oldest) if v is not None), default=None))
            stale = {}
            try:
                answers = self._post(key, subs)
            finally:
                for e, sub in zip(active, subs):
                    gate.unregister(sub[2])
                    stale[e] = gate.pop_stale(sub[2])  # marked while in flight (whatever the answer)
            again = []
            for e, res in zip(active, answers):
                spans = spans_of(res.weight_versions, res.weight_version, submitted=submitted, published=gate.version)
                res = dataclasses.replace(res, version_spans=tuple(spans), resubmissions=attempt)
                if done[e] is not None:
                    res = joined(done[e], res)
                out[e] = res
                if res.finish_type != "abort":
                    continue
                if self._own_abort(items[e][2]) or res.abort_status_code is not None or not (
                        stale[e] or gate.pause_epoch != epoch or gate.paused):
                    continue  # ours (dropped with its group) or a failure (the group is dropped)
                again.append(e)
            if again and not gate.wait_resumed(self.pause_timeout_s):
                logger.warning("requests %s: the engines did not continue within %.0f s after a pause",
                               [items[e][2] for e in again], self.pause_timeout_s)
                break
            again = [e for e in again if not self._own_abort(items[e][2])]  # aborted by us meanwhile: dropped
            if restart or (oldest is not None and any(stale[e] for e in again)):  # its episode restarts (T09)
                for e in again:
                    out[e] = dataclasses.replace(out[e], abort_message=RESTART_EPISODE)
                break
            active = []
            for e in again:
                res = out[e]
                keep = self.partial_rollout and not stale[e] and res.output_ids and (
                    self.routed_experts is None or res.routed_experts is not None)  # no routing: from scratch
                done[e] = res if keep else None
                if done[e] is not None and len(done[e].output_ids) >= int(items[e][1]["max_new_tokens"]):
                    out[e] = dataclasses.replace(done[e], finish_type="length", stop_reason="length",
                                                 abort_message=None, matched_stop=None)
                else:
                    active.append(e)
            attempt += 1
        return out

    def _generate_one(self, key: int, ids: list[int], params: dict, rid: str):
        if self.environment is None:
            return self.generate_ids(ids, params, rid, key)
        restart = not self.partial_rollout  # a turn aborted by a pause restarts its episode (CASES.md T09)
        return run_episode(self.environment, ids, params, rid, lambda i, p, r, old: self.generate_ids(
            i, p, r, key, restart=restart, oldest=old), self.gate)

    def _own_abort(self, rid: str) -> bool:
        with self._own_lock:
            return any(rid.startswith(p) for p in self._own_aborts)

    def abort(self, rid_prefix: str) -> None:
        """`/abort_request` on every server that is up: every request whose rid starts with `rid_prefix`."""
        from megatron_rl.errors import RolloutServerError

        with self._own_lock:  # before the abort lands: its results are told from a pause's
            self._own_aborts.add(rid_prefix)
        for i in self.fleet.up_indices():
            try:
                self.clients[i].abort_request(rid=rid_prefix)
            except RolloutServerError as e:  # a server that fails here fails its requests too
                logger.warning("abort_request(%r) on %s failed: %s", rid_prefix, self.clients[i].base_url, e)

    def score(self, rows: Sequence[PromptRow], results: list[list]) -> list[list[dict]]:
        """Run the verifier on every response ([P][n] GenerateResults) -> [P][n] reward dicts."""
        items = []
        for row, group in zip(rows, results):
            for res in group:
                text = self.tokenizer.decode(model_token_ids(res), skip_special_tokens=True)
                items.append((self.reward_fn, text, row.ground_truth))
        flat = self.reward_pool.map(items)
        for (_, text, _), out in zip(items, flat):
            out["response_text"] = text
        errors = Counter(out.get("error", "unknown error") for out in flat if out.get("failed"))
        for error, count in errors.most_common(3):
            logger.warning("reward %r failed on %d of %d responses: %s", self.reward_fn, count, len(flat), error)
        n = len(results[0]) if results else 0
        return [flat[i * n : (i + 1) * n] for i in range(len(results))]

    def generate_groups(self, rows: Sequence[PromptRow], *, n: int, sampling_params: dict, step: int,
                        gen_batch: int, stop_after: Optional[int] = None,
                        keep_fn: Optional[Callable[[Group], bool]] = None) -> tuple[list[Group], dict]:
        """One generation batch: sample, verify, shape rewards -> Groups (input order) and timings.

        With `stop_after` (over-sampling with abort, slime's dynamic sampling): groups are scored as
        soon as all `n` of their responses are in; once `stop_after` finished groups pass `keep_fn`,
        every request of this batch still running is aborted (`/abort_request` by rid prefix) and
        the unfinished groups are dropped: partial responses are never returned, so never trained
        on. The finished groups come back in prompt order (kept or not; the caller filters again).
        Stats then add `rollout/aborted` (responses aborted) and `rollout/unfinished_groups`.

        Always: a request aborted by a pause of the engines is resubmitted (`generate_ids`); a
        group with a member that still ends aborted (a server-side failure) is dropped whole, never
        returned short, and counted in `rollout/failed_groups`; `rollout/resubmitted` counts the
        resubmissions.
        """
        if stop_after is not None:
            return self._generate_groups_until(rows, n=n, sampling_params=sampling_params, step=step,
                                               gen_batch=gen_batch, stop_after=stop_after, keep_fn=keep_fn)
        t0 = time.perf_counter()
        tag = f"s{step}-b{gen_batch}"
        results = self.generate(rows, n=n, sampling_params=sampling_params, tag=tag,
                                seed_parts=(self.seed, step, gen_batch))
        t1 = time.perf_counter()
        whole = [i for i, grp in enumerate(results) if all(r.finish_type != "abort" for r in grp)]
        if len(whole) < len(rows):
            logger.warning("dropped %d of %d groups with a failed response (never trained short): %s",
                           len(rows) - len(whole), len(rows), _abort_messages(results))
        rewards = self.score([rows[i] for i in whole], [results[i] for i in whole])
        t2 = time.perf_counter()
        groups = self._build_groups(rows, [results[i] for i in whole], rewards, tag, whole)
        return groups, {"timing/generate_s": t1 - t0, "timing/reward_s": t2 - t1,
                        "rollout/failed_groups": len(rows) - len(whole), "rollout/resubmitted": _resubmitted(results),
                        **episode_stats(results)}

    def _generate_groups_until(self, rows, *, n, sampling_params, step, gen_batch, stop_after, keep_fn):
        if keep_fn is None or stop_after < 1:
            raise ValueError("over-sampling needs keep_fn and stop_after >= 1")
        t0 = time.perf_counter()
        tag = f"s{step}-b{gen_batch}"
        max_new = self.max_response_length
        futures: dict = {}
        for row in rows:
            self.check_fits(row, self.prompt_ids(row), max_new)
        for i, row in enumerate(rows):
            ids = self.prompt_ids(row)
            params = [dict(sampling_params, max_new_tokens=max_new, sampling_seed=seed)
                      for seed in response_seeds((self.seed, step, gen_batch), i, n, consecutive=self.consecutive_seeds)]
            for j, f in enumerate(self._submit_row(i, n, ids, params, [request_id(tag, i, j, n) for j in range(n)])):
                futures[f] = (i, j)
        results: list[list] = [[None] * n for _ in rows]
        remaining = [n] * len(rows)
        finished: dict[int, Group] = {}
        kept = 0
        reward_s = 0.0
        aborted_at = None
        failed = 0
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            ready = []
            for f in done:
                i, j = futures[f]
                results[i][j] = f.result()
                remaining[i] -= 1
                if remaining[i] == 0 and aborted_at is None:
                    ready.append(i)
            if not ready:
                continue
            ready.sort()
            if any(r.finish_type == "abort" for i in ready for r in results[i]):  # failed (ours come later)
                whole = [i for i in ready if all(r.finish_type != "abort" for r in results[i])]
                failed += len(ready) - len(whole)
                logger.warning("dropped %d groups with a failed response (never trained short): %s",
                               len(ready) - len(whole), _abort_messages([results[i] for i in ready]))
                ready = whole
            tr = time.perf_counter()
            rewards = self.score([rows[i] for i in ready], [results[i] for i in ready])
            reward_s += time.perf_counter() - tr
            for g, i in zip(self._build_groups(rows, [results[i] for i in ready], rewards, tag, ready), ready):
                finished[i] = g
                kept += bool(keep_fn(g))
            if kept >= stop_after and pending and aborted_at is None:
                aborted_at = time.perf_counter()
                self.abort(f"{tag}-")
        aborted = sum(1 for grp in results for r in grp if r is not None and r.finish_type == "abort")
        groups = [finished[i] for i in sorted(finished)]
        t1 = time.perf_counter()
        if aborted_at is not None:
            logger.info("over-sampling: %d groups kept of %d finished; aborted %d responses of %d unfinished "
                        "groups (%.2f s to drain)", kept, len(groups), aborted, len(rows) - len(groups), t1 - aborted_at)
        return groups, {"timing/generate_s": t1 - t0 - reward_s, "timing/reward_s": reward_s,
                        "rollout/aborted": aborted, "rollout/unfinished_groups": len(rows) - len(groups),
                        "rollout/failed_groups": failed, "rollout/resubmitted": _resubmitted(results),
                        **episode_stats(results)}

    def _build_groups(self, rows, results, rewards, tag: str, indices) -> list[Group]:
        """Groups of the rows at `indices` (uids keep the prompt index in the batch)."""
        enable, buf_len, factor = self.overlong
        groups = []
        for i, res_group, rew_group in zip(indices, results, rewards):
            row = rows[i]
            # the model's own tokens: a multi-turn episode's tool answers are not its length (CASES.md overlong (a))
            lengths = torch.tensor([len(model_token_ids(r)) for r in res_group], dtype=torch.long)
            if enable:
                pens = overlong_penalty(lengths, max_response_length=self.max_response_length,
                                        overlong_buffer_len=buf_len, penalty_factor=factor).tolist()
            else:
                pens = [0.0] * len(res_group)
            uid = f"{tag}-p{i}"
            samples = []
            for res, rew, pen in zip(res_group, rew_group, pens):
                # a tool's infrastructure failed (CASES.md T10): invalid like a failed verifier, not a reward of 0
                failed = bool(rew.get("failed", False)) or bool((res.episode or {}).get("tool_infra_failures"))
                acc = bool(rew.get("acc", False)) and not failed
                base = self.correct_score if acc else self.incorrect_score
                samples.append(
                    Sample(
                        prompt_key=row.prompt_key,
                        group_uid=uid,
                        prompt_ids=self.prompt_ids(row),
                        response_ids=list(res.output_ids),
                        rollout_logprobs=list(res.output_logprobs),
                        stop_reason=res.stop_reason,
                        ground_truth=row.ground_truth,
                        response_text=rew.get("response_text", ""),
                        score=0.0 if failed else base + float(pen),
                        acc=acc,
                        failed=failed,
                        format_valid=rew.get("pred") is not None,
                        overlong_penalty=float(pen),
                        extra_info=dict(row.extra_info or {}),
                        weight_version_spans=list(res.version_spans),
                        resubmissions=res.resubmissions,
                        routed_experts=res.routed_experts,
                        response_mask=None if res.response_mask is None else list(res.response_mask),
                        episode=dict(res.episode or {}),
                    )
                )
            groups.append(Group(prompt_key=row.prompt_key, group_uid=uid, samples=samples))
        return groups


def _resubmitted(results: list[list]) -> int:
    """Resubmissions over [P][n] results (None: never finished)."""
    return sum(r.resubmissions for grp in results for r in grp if r is not None)


def _abort_messages(results: list[list]) -> str:
    """The distinct abort messages of [P][n] results, for a log line."""
    return "; ".join(sorted({str(r.abort_message) for grp in results for r in grp
                             if r is not None and r.finish_type == "abort"}))[:500]
