"""Rollout manager: prompts -> groups of scored responses (DESIGN.md steps 2-4).

Only the controller (trainer global rank 0) uses it. Each response is its own `/generate`
request with its own request id and `sampling_seed` derived from (run seed, step, generation
batch, prompt index, response index); results are ordered by (generation batch, prompt index,
response index), never by arrival.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.algorithms.reward_shaping import overlong_penalty
from megatron_rl.data.dataset import PromptRow
from megatron_rl.data.prompts import render_prompt_ids

logger = logging.getLogger(__name__)


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
    """The verifier failed or timed out: excluded from the group's statistics, advantage 0."""
    format_valid: bool = False
    overlong_penalty: float = 0.0
    advantage: float = 0.0
    extra_info: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.stop_reason == "length"


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


def derive_seed(*parts: int | str) -> int:
    """A stable 31-bit seed from (run seed, step, batch, prompt, response); independent of Python's hash salt."""
    h = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


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
        self._prompt_cache: dict[str, list[int]] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def prompt_ids(self, row: PromptRow) -> list[int]:
        """Token ids of a row's chat prompt (with the generation prompt); cached by prompt_key.

        Raises:
            ValueError: the prompt is longer than `data.max_prompt_length` (names the row).
        """
        ids = self._prompt_cache.get(row.prompt_key)
        if ids is None:
            ids = render_prompt_ids(self.tokenizer, row.messages)
            if len(ids) > self.max_prompt_length:
                raise ValueError(
                    f"prompt of {row.origin or row.prompt_key} has {len(ids)} tokens > data.max_prompt_length "
                    f"({self.max_prompt_length})"
                )
            self._prompt_cache[row.prompt_key] = ids
        return ids

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

        `tag` prefixes every request id (`{tag}-p{i}-r{j}`) so a whole batch can be aborted by
        prefix; `seed_parts` (e.g. (seed, step, batch)) are mixed into each `sampling_seed`.
        `on_response(i)`, if given, is called (on a worker thread) when a response of row i ends.
        """
        max_new = max_new_tokens or self.max_response_length
        futures = []
        for i, row in enumerate(rows):
            ids = self.prompt_ids(row)
            for j in range(n):
                params = dict(sampling_params)
                params["max_new_tokens"] = max_new
                params["sampling_seed"] = derive_seed(*seed_parts, i, j)
                futures.append(self._executor.submit(self._generate_one, i * n + j, ids, params, f"{tag}-p{i}-r{j}"))
                if on_response is not None:
                    futures[-1].add_done_callback(lambda f, i=i: on_response(i))
        results = [f.result() for f in futures]
        return [results[i * n : (i + 1) * n] for i in range(len(rows))]

    def _generate_one(self, key: int, ids: list[int], params: dict, rid: str):
        """One `/generate` on the server picked for `key`; retried on a live server when it got no
        answer (the server died or hung; `ServerFleet.report_failure` recovers). An HTTP error answer
        is raised at once. The retry repeats the same rid and `sampling_seed`."""
        from megatron_rl.errors import RolloutServerError

        for attempt in range(2 * len(self.clients) + 2):
            index, epoch = self.fleet.pick(key)
            try:
                return self.clients[index].generate(ids, params, rid, eos_token_ids=self.eos_token_ids)
            except RolloutServerError as e:
                if e.status_code is not None:
                    raise
                self.fleet.report_failure(index, epoch, e)
                logger.info("retrying request %s (attempt %d)", rid, attempt + 2)
        raise RolloutServerError(f"request {rid} got no answer from any rollout server")

    def abort(self, rid_prefix: str) -> None:
        """`/abort_request` on every server that is up: every request whose rid starts with `rid_prefix`."""
        from megatron_rl.errors import RolloutServerError

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
                text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
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
        """
        if stop_after is not None:
            return self._generate_groups_until(rows, n=n, sampling_params=sampling_params, step=step,
                                               gen_batch=gen_batch, stop_after=stop_after, keep_fn=keep_fn)
        t0 = time.perf_counter()
        tag = f"s{step}-b{gen_batch}"
        results = self.generate(rows, n=n, sampling_params=sampling_params, tag=tag,
                                seed_parts=(self.seed, step, gen_batch))
        t1 = time.perf_counter()
        rewards = self.score(rows, results)
        t2 = time.perf_counter()
        groups = self._build_groups(rows, results, rewards, tag, range(len(rows)))
        return groups, {"timing/generate_s": t1 - t0, "timing/reward_s": t2 - t1}

    def _generate_groups_until(self, rows, *, n, sampling_params, step, gen_batch, stop_after, keep_fn):
        if keep_fn is None or stop_after < 1:
            raise ValueError("over-sampling needs keep_fn and stop_after >= 1")
        t0 = time.perf_counter()
        tag = f"s{step}-b{gen_batch}"
        max_new = self.max_response_length
        futures: dict = {}
        for i, row in enumerate(rows):
            ids = self.prompt_ids(row)
            for j in range(n):
                params = dict(sampling_params, max_new_tokens=max_new,
                              sampling_seed=derive_seed(self.seed, step, gen_batch, i, j))
                futures[self._executor.submit(self._generate_one, i * n + j, ids, params, f"{tag}-p{i}-r{j}")] = (i, j)
        results: list[list] = [[None] * n for _ in rows]
        remaining = [n] * len(rows)
        finished: dict[int, Group] = {}
        kept = 0
        reward_s = 0.0
        aborted_at = None
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
            if any(r.finish_type == "abort" for i in ready for r in results[i]):
                ready = [i for i in ready if all(r.finish_type != "abort" for r in results[i])]
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
                        "rollout/aborted": aborted, "rollout/unfinished_groups": len(rows) - len(groups)}

    def _build_groups(self, rows, results, rewards, tag: str, indices) -> list[Group]:
        """Groups of the rows at `indices` (uids keep the prompt index in the batch)."""
        enable, buf_len, factor = self.overlong
        groups = []
        for i, res_group, rew_group in zip(indices, results, rewards):
            row = rows[i]
            lengths = torch.tensor([len(r.output_ids) for r in res_group], dtype=torch.long)
            if enable:
                pens = overlong_penalty(lengths, max_response_length=self.max_response_length,
                                        overlong_buffer_len=buf_len, penalty_factor=factor).tolist()
            else:
                pens = [0.0] * len(res_group)
            uid = f"{tag}-p{i}"
            samples = []
            for res, rew, pen in zip(res_group, rew_group, pens):
                failed = bool(rew.get("failed", False))
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
                    )
                )
            groups.append(Group(prompt_key=row.prompt_key, group_uid=uid, samples=samples))
        return groups
