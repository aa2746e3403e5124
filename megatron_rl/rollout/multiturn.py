"""Multi-turn rollouts: an environment runs one sample as an episode of turns (issue 31).

DESIGN.md "Directions: turns". The rollout manager hands each response of a group to the run's
`Environment` (a registry, `ENVIRONMENTS`, like the reward functions) instead of one `/generate`.
The environment calls the engine through the manager (`generate(ids, params, rid)`: the manager's
`generate_ids`, so pauses, resubmission, partial rollouts and version spans work inside a turn as
for a single completion) and appends its own tokens between turns. `Episode` assembles the result:

- **token in, token out**: the sequence trained is the prompt, then each turn's `output_ids` exactly
  as the engine returned them, then the environment's tokens (encoded as the template's text
  encodes them: `tool_answer_ids`, CASES.md T01). Nothing is re-tokenised from text (chat templates
  are not append-only, and BPE merges across a boundary would change the tokens); turn k + 1's
  request is exactly prompt + everything before it, so the trainer's sequence equals what the
  engine saw (`Episode.segments` records the parts).
- **loss mask** (`GenerateResult.response_mask`): True on the model's tokens, False on tool answers
  and template tokens the environment wrote; their rollout log-probs are 0.0 (never used: masked).
- **weight-version spans** of each turn shifted to the turn's place in the response
  (`live.concat_spans`); environment tokens fall into the span before them (masked, never trained).
  Live updates' stale aborts count from the episode's oldest token and restart it whole (`run_episode`).
- **routing** (MoE replay): like a partial rollout's parts: the earlier turns' rows as they were
  routed, then each turn's rows from the first position they never fed back (the previous turn's
  last token and the environment's tokens, routed by this turn's prefill, then its own).

The `tool` environment (`ToolEnvironment`): the model writes a call (`rollout.multi_turn.format`:
ToRL's ```python block, the turn stopping at its closing fence; or Hermes' <tool_call>, the turn ending
with the end-of-turn token), the calls run in the tools of `tool_config_path` (sandboxed; calls of
different samples run at the same time, each episode on its own manager thread), the answers are
appended, and the model continues, until it writes no call, runs out of turns
(`max_assistant_turns`) or of tokens (`data.max_response_length`, environment tokens included). Every
problem with a call (malformed, unknown tool, bad arguments, time-out, over `max_tool_calls` or
`max_parallel_calls`) reaches the model as a tool error with the reason; a turn cut at the token limit
inside a call runs nothing (CASES.md T04). A failure of the tools' infrastructure
(`ToolResult.infrastructure`) ends the episode and makes its sample invalid (CASES.md T10).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megatron_rl.registry import Registry
from megatron_rl.rollout.live import concat_spans
from megatron_rl.tools.formats import CODE_STOP, code_response_text

logger = logging.getLogger(__name__)

__all__ = ["CODE_STOP", "ENVIRONMENTS", "MAX_EPISODE_RESTARTS", "RESTART_EPISODE", "Environment", "Episode", "ToolEnvironment",
           "build_environment", "episode_stats", "max_overlap", "model_token_ids", "run_episode", "tool_answer_ids",
           "tool_answer_pieces", "tool_answer_text", "truncate_text"]

ENVIRONMENTS: Registry[type] = Registry("environment")
"""Environments by name (`rollout.multi_turn.environment`); a user adds one in one file with
`@ENVIRONMENTS.register("name")` on an `Environment` subclass."""


MAX_EPISODE_RESTARTS = 8
"""Restarts of one episode (`run_episode`) before it is given up: an abort result, so its group is
dropped (`rollout/failed_groups`) instead of the rollout spinning while updates keep outdating it."""
RESTART_EPISODE = ("aborted by a pause of the engines (rollout.partial_rollout off) or as too stale: the episode "
                   "starts again")
"""`abort_message` of a turn the rollout manager did not resubmit because its episode starts again
from its prompt (`RolloutManager.generate_ids(restart=True)`, CASES.md T09), or of a turn whose
episode holds a token older than a live update's `stale_below` (`run_episode`)."""

Generate = Callable[[list[int], dict, str], Any]
"""`generate(ids, sampling_params, rid) -> GenerateResult`: one model turn through the rollout manager."""


class Episode:
    """The response of one sample being built turn by turn (see the module docstring).

    Args:
        prompt_ids: the rendered prompt, [P] token ids.
        max_tokens: the response budget (`data.max_response_length`), model and environment tokens together.

    Attributes:
        response_ids / logprobs / mask: [R] each: the tokens after the prompt, the engine's log-prob
            of each model token (0.0 on environment tokens), True on model tokens.
        segments: `(kind, start, end)` over response indices, kind `model` or `env`, in order.
        turns, tool_calls, tool_errors: counts; tool_s: seconds spent in tools (wall clock).
        tool_infra_failures: calls that failed in the tools' infrastructure (`ToolResult.infrastructure`):
            the episode ends there and its sample is invalid (CASES.md T10).
    """

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = int(max_tokens)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[bool] = []
        self.segments: list[tuple[str, int, int]] = []
        self.spans: list[tuple[int, int]] = []
        self.routing: np.ndarray | None = None
        self.last = None
        self.stop_reason: str | None = None
        self.turns = self.tool_calls = self.tool_errors = self.resubmissions = self.tool_infra_failures = 0
        self.tool_s = 0.0
        self.tool_windows: list[tuple[float, float]] = []
        self.started = time.perf_counter()
        self.turn_limit_hit = False

    def context(self) -> list[int]:
        """Prompt + response so far: the next turn's request, [P + R] ids."""
        return self.prompt_ids + self.response_ids

    def remaining(self) -> int:
        """Tokens of the response budget left (>= 0)."""
        return max(self.max_tokens - len(self.response_ids), 0)

    def add_model_turn(self, res) -> None:
        """Append a turn's `GenerateResult` (its request was `context()`): ids, log-probs, spans, routing.

        Raises:
            ValueError: the turn has no log-probs, or routing that does not cover its request.
        """
        if res.output_logprobs is None or len(res.output_logprobs) != len(res.output_ids):
            raise ValueError(f"turn {res.rid!r}: the engine returned no log-prob per token")
        start = len(self.response_ids)
        if self.last is None:
            self.routing = res.routed_experts
        elif self.routing is not None and res.output_ids:  # like a partial rollout's continuation
            tail = res.routed_experts
            if tail is None and res.finish_type == "abort":  # the episode ends aborted (dropped with its group)
                tail = self.routing
            if tail is None or tail.shape[0] < self.routing.shape[0] or tail.shape[1:] != self.routing.shape[1:]:
                raise ValueError(f"turn {res.rid!r}: routed_experts {None if tail is None else list(tail.shape)} do "
                                 f"not cover the episode's {self.routing.shape[0]} routed positions")
            # the earlier turns' rows as they were routed, then this turn's from the first position
            # they never fed back (the previous turn's last token, the environment's tokens, its own)
            self.routing = np.concatenate([self.routing, tail[self.routing.shape[0]:]], axis=0)
        self.spans = concat_spans(self.spans, start, list(res.version_spans)) if self.last is not None else \
            list(res.version_spans)
        self.response_ids += list(res.output_ids)
        self.logprobs += [float(x) for x in res.output_logprobs]
        self.mask += [True] * len(res.output_ids)
        self.segments.append(("model", start, len(self.response_ids)))
        self.turns += 1
        self.resubmissions += res.resubmissions
        self.stop_reason = res.stop_reason
        self.last = res

    def add_env_tokens(self, ids: Sequence[int]) -> bool:
        """Append environment tokens (loss mask 0). False, appending nothing, when they would leave
        no token of the budget for the model (the episode then ends as `length`)."""
        if len(ids) >= self.remaining():
            self.stop_reason = "length"
            return False
        start = len(self.response_ids)
        self.response_ids += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.segments.append(("env", start, len(self.response_ids)))
        return True

    def result(self):
        """The episode as one `GenerateResult` (the last turn's finish, the whole response, its mask,
        `episode` statistics). Routing is None when a turn came without it."""
        res = self.last
        stop = self.stop_reason
        finish = res.finish_type if res.finish_type == "abort" else ("length" if stop == "length" else res.finish_type)
        routing = self.routing
        if routing is not None and routing.shape[0] != len(self.prompt_ids) + len(self.response_ids) - 1:
            routing = None  # an episode that ended on environment tokens: no row for them (never here: see add_env_tokens)
        return dataclasses.replace(
            res, output_ids=list(self.response_ids), output_logprobs=list(self.logprobs),
            prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.response_ids), weight_versions=None,
            version_spans=tuple(self.spans), routed_experts=routing,
            finish_type=finish, stop_reason=stop, resubmissions=self.resubmissions,
            response_mask=tuple(self.mask),
            episode={"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                     "tool_s": self.tool_s, "turn_limit": int(self.turn_limit_hit),
                     "tool_infra_failures": self.tool_infra_failures,
                     "tool_windows": list(self.tool_windows), "episode_s": time.perf_counter() - self.started,
                     "segments": list(self.segments)})


class Environment(ABC):
    """Runs one sample as an episode (see the module docstring).

    Args:
        cfg: the run's `rollout.multi_turn` section (`MultiTurnConfig`).
        tokenizer: the policy's Hugging Face tokenizer (decodes turns, encodes environment text).
    """

    def __init__(self, cfg, tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer

    @abstractmethod
    def run(self, episode: Episode, generate: Generate, params: dict, rid: str) -> None:
        """Fill `episode` (its prompt set, nothing generated yet): model turns through `generate`
        (`params` are the sample's sampling params, `max_new_tokens` = the whole budget,
        `sampling_seed` its seed; `rid` its request id, the prefix of every turn's rid) and
        environment tokens between them. Returns after the last turn."""

    def close(self) -> None:
        """Release the environment's resources (tools, sandboxes). Calling it twice is harmless."""

    def chat_tools(self) -> list[dict] | None:
        """Function schemas the chat template renders into every prompt (`tools=`), or None."""
        return None


def turn_params(params: dict, turn: int, episode: Episode, stop: Sequence[str] = ()) -> dict:
    """Sampling params of turn `turn` (0-based): the remaining budget, the sample's seed for turn 0
    and a derived one after (`derive_seed(seed, "turn", t)`), `stop` strings added to the sample's."""
    from megatron_rl.rollout.manager import derive_seed

    p = dict(params, max_new_tokens=episode.remaining())
    if turn and params.get("sampling_seed") is not None:
        p["sampling_seed"] = derive_seed(params["sampling_seed"], "turn", turn)
    if stop:  # no_stop_trim: the engines keep the stop string's text (vLLM's include_stop_str_in_output)
        p["no_stop_trim"] = True
        given = params.get("stop") or []
        p["stop"] = list(dict.fromkeys(([given] if isinstance(given, str) else list(given)) + list(stop)))
    return p


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to at most `limit` characters (plus a marker) on `side`: `right` keeps the start,
    `left` the end, `middle` both ends; unchanged when it fits."""
    if len(text) <= limit:
        return text
    mark = "...(truncated)..."
    if side == "right":
        return text[:limit] + mark
    if side == "left":
        return mark + text[-limit:]
    head = limit // 2
    return text[:head] + mark + text[len(text) - (limit - head):]


def tool_answer_pieces(messages: Sequence[str], fmt: str) -> list[tuple[str, bool]]:
    """What the environment appends after a turn with calls, given each call's message (in order), as
    `(text, is_template)` pieces: `code`: one "```output\n<message>\n```\n" block a call
    (`tools.formats.code_response_text`); `hermes`
    (Qwen2.5's template): the end of the assistant turn's line, a user turn holding one
    <tool_response> a call, and the next assistant header. Template pieces may hold special tokens;
    messages never do (`tool_answer_ids`)."""
    if fmt == "code":  # no special token in it: each block one piece, encoded as the tiny SFT encodes it
        return [(code_response_text(m), False) for m in messages]
    if fmt != "hermes":
        raise ValueError(f"unknown tool call format {fmt!r}")
    pieces: list[tuple[str, bool]] = [("\n<|im_start|>user\n", True)]
    for k, m in enumerate(messages):
        pieces += [(("\n" if k else "") + "<tool_response>\n", True), (m, False), ("\n</tool_response>", True)]
    return pieces + [("<|im_end|>\n<|im_start|>assistant\n", True)]


def tool_answer_text(messages: Sequence[str], fmt: str) -> str:
    """`tool_answer_pieces` joined: the text the model reads after its call."""
    return "".join(text for text, _ in tool_answer_pieces(messages, fmt))


def tool_answer_ids(tokenizer, messages: Sequence[str], fmt: str) -> list[int]:
    """The token ids of the tool answer, exactly as the chat template's text encodes (CASES.md T01).

    `hermes`: the pieces are joined and cut only at the special tokens of the TEMPLATE's pieces
    (`<|im_end|>`, `<|im_start|>`: their ids as such); each maximal run of text between them (the
    template's text and the messages together) is encoded as one string, as Hugging Face tokenizers
    encode a rendered chat (added tokens first, then BPE on the text between): "5\n" followed by
    the template's "\n</tool_response>" gives "\n\n" -> one id, never two. Runs are encoded with
    `split_special_tokens`, so a program that prints "<|im_end|>" cannot forge a turn boundary or a
    chat-template header (its characters stay plain text). `code`: each call's block encoded on its
    own, as the tiny SFT encodes its one block (tools/train_tiny_base.py).

    Returns:
        [T] ids; with a message that holds no special token, `hermes` equals the template's
        rendering between the assistant's <|im_end|> and the next assistant header.
    """
    ids: list[int] = []

    def flush(run: str) -> None:
        if run:
            ids.extend(tokenizer.encode(run, add_special_tokens=False, split_special_tokens=True))

    pieces = tool_answer_pieces(messages, fmt)
    if fmt == "code":
        for text, _ in pieces:
            flush(text)
        return ids
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    cut = re.compile("(" + "|".join(re.escape(t) for t in added) + ")") if added else None
    run = ""
    for text, template in pieces:
        if not template or cut is None:
            run += text
            continue
        for k, part in enumerate(cut.split(text)):
            if k % 2:  # a special token the template wrote
                flush(run)
                run = ""
                ids.append(int(tokenizer.convert_tokens_to_ids(part)))
            else:
                run += part
    flush(run)
    return ids


def _cut_at_stop(res, tokenizer, stop: str):
    """`res` ended after the first occurrence of `stop` in its decoded text (an engine that ignores
    stop strings, e.g. SGLang with --skip-tokenizer-init, generates past it): the shortest token
    prefix whose text contains it, with its log-probs, spans and routing; `res` itself when the
    stop is absent or already at the end."""
    ids = list(res.output_ids)
    if stop not in tokenizer.decode(ids, skip_special_tokens=False):
        return res
    lo, hi = 1, len(ids)
    while lo < hi:  # the shortest prefix containing the stop (containment grows with the prefix)
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(ids):
        return res
    routing = res.routed_experts
    if routing is not None:
        routing = routing[: res.prompt_tokens + lo - 1]
    return dataclasses.replace(res, output_ids=ids[:lo], output_logprobs=list(res.output_logprobs or [])[:lo],
                               completion_tokens=lo, finish_type="stop", stop_reason="stop_string",
                               matched_stop=stop, version_spans=tuple((v, s) for v, s in res.version_spans if s < lo),
                               routed_experts=routing)


@ENVIRONMENTS.register("tool")
class ToolEnvironment(Environment):
    """The model calls the tools of `rollout.multi_turn.tool_config_path` (see the module docstring).

    Args:
        cfg: `MultiTurnConfig`.
        tokenizer: the policy's tokenizer.
        tools: `{name: Tool}`; default: built from `cfg.tool_config_path` (`tools.tool_config.build_tools`).

    Raises:
        ValueError: the tool config file is bad (names the file and key).
    """

    def __init__(self, cfg, tokenizer, tools: dict | None = None) -> None:
        super().__init__(cfg, tokenizer)
        if tools is None:
            from megatron_rl.tools.tool_config import build_tools

            tools = build_tools(cfg.tool_config_path)
        self.tools = tools
        self.stop = (CODE_STOP,) if cfg.format == "code" else ()

    def run(self, episode: Episode, generate: Generate, params: dict, rid: str) -> None:
        from megatron_rl.tools.base import ToolResult
        from megatron_rl.tools.parsing import parse_tool_calls, run_tool_calls

        cfg = self.cfg
        for turn in range(cfg.max_assistant_turns):
            res = generate(episode.context(), turn_params(params, turn, episode, self.stop),
                           rid if turn == 0 else f"{rid}-t{turn}")
            if self.stop and res.finish_type != "abort":
                res = _cut_at_stop(res, self.tokenizer, self.stop[0])
            episode.add_model_turn(res)
            if res.finish_type == "abort" or res.stop_reason == "length":
                return
            calls = parse_tool_calls(self.tokenizer.decode(res.output_ids, skip_special_tokens=True), fmt=cfg.format)
            if not calls:
                return
            if turn == cfg.max_assistant_turns - 1:
                episode.turn_limit_hit = True
                return
            runnable, answers = [], [None] * len(calls)
            for k, call in enumerate(calls):
                if isinstance(call, ToolResult):  # malformed: its error is the answer, nothing runs
                    answers[k] = call
                elif k >= cfg.max_parallel_calls:
                    answers[k] = ToolResult(ok=False, error=f"only {cfg.max_parallel_calls} tool call(s) run per turn "
                                                            "(rollout.multi_turn.max_parallel_calls); this one did not run")
                elif episode.tool_calls + len(runnable) >= cfg.max_tool_calls:
                    answers[k] = ToolResult(ok=False, error=f"tool call limit reached ({cfg.max_tool_calls} per "
                                                            "episode, rollout.multi_turn.max_tool_calls): give the answer")
                else:
                    runnable.append(k)
            t0 = time.perf_counter()
            for k, out in zip(runnable, run_tool_calls([calls[k] for k in runnable], self.tools,
                                                                timeout_s=cfg.tool_timeout_s)):
                answers[k] = out
            episode.tool_s += time.perf_counter() - t0
            episode.tool_windows.append((t0, time.perf_counter()))
            episode.tool_calls += len(runnable)
            episode.tool_errors += sum(1 for a in answers if not a.ok)
            episode.tool_infra_failures += sum(1 for a in answers if a.infrastructure)
            if episode.tool_infra_failures:  # not the model's doing: the sample is invalid, stop here (T10)
                return
            messages = [truncate_text(a.to_message(), cfg.max_tool_response_length, cfg.tool_response_truncate_side)
                        for a in answers]  # unstripped: the python tool's "77\n" as the tiny SFT saw it
            ids = tool_answer_ids(self.tokenizer, messages, cfg.format)
            if not episode.add_env_tokens(ids):
                return

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()

    def chat_tools(self) -> list[dict] | None:
        """`hermes`: every tool's function schema (Qwen2.5's template lists them in the system turn and
        asks for <tool_call> JSON); `code`: None (the prompt or the model's training says how to call)."""
        return [t.schema() for t in self.tools.values()] if self.cfg.format == "hermes" else None


def build_environment(cfg, tokenizer) -> Environment | None:
    """The run's environment for `rollout.multi_turn` (`MultiTurnConfig`), or None when it is off.

    Raises:
        KeyError: an unknown `environment` name (lists the registered ones).
        ValueError: the environment refuses its config (e.g. a bad tool config file).
    """
    if not cfg.enable:
        return None
    return ENVIRONMENTS.get(cfg.environment)(cfg, tokenizer)


def run_episode(environment: Environment, ids: Sequence[int], params: dict, rid: str, generate, gate=None):
    """One sample as an episode of `environment` from the prompt `ids` ([P]; `params` its sampling
    params, `max_new_tokens` the whole budget), its turns through `generate(ids, params, rid, oldest)`
    (the rollout manager's `generate_ids`; `oldest`: the oldest weight version of the episode's
    tokens so far, None before any): the episode's `GenerateResult`.

    A turn that comes back with `abort_message == RESTART_EPISODE` (a pause of the engines with
    `rollout.partial_rollout` off, or a stale abort) ends the episode; it then starts again from its prompt as
    `{rid}-a{k}` (same seed; the tools run again), so the sample holds only the tokens of one attempt,
    never an earlier attempt's turns at an older weight version (CASES.md T09). With partial
    rollouts the manager continues a turn aborted by a pause itself: the tool is not run again and the
    turn count does not move. `resubmissions` adds the restarts.

    Staleness is bounded by the episode's oldest token, as a single completion's by its oldest
    (docs/ASYNC.md "Live weight updates"): each turn's request is registered with it (a live update's
    `stale_below` above it aborts the turn, and the episode restarts whatever `partial_rollout`), and
    a turn sent or finished once `gate.stale_floor` (the highest `stale_below` so far) is above it, e.g.
    after an update that came while the tools ran, ends as `RESTART_EPISODE` too.
    """
    for attempt in range(MAX_EPISODE_RESTARTS + 1):
        episode = Episode(ids, int(params["max_new_tokens"]))
        environment.run(episode, lambda i, p, r, ep=episode: _episode_turn(ep, generate, gate, i, p, r), params,
                        f"{rid}-a{attempt}" if attempt else rid)
        res = episode.result()
        if res.abort_message != RESTART_EPISODE:
            return dataclasses.replace(res, resubmissions=res.resubmissions + attempt)
    logger.warning("episode %s: restarted %d times, every attempt outdated by weight updates; its group is dropped",
                   rid, MAX_EPISODE_RESTARTS)
    return dataclasses.replace(res, resubmissions=res.resubmissions + MAX_EPISODE_RESTARTS, abort_message=(
        f"episode restarted {MAX_EPISODE_RESTARTS} times (multiturn.MAX_EPISODE_RESTARTS), each attempt aborted by a "
        "pause or as too stale: given up (raise trainer.max_staleness, or turn rollout.partial_rollout on)"))


def _episode_turn(episode: Episode, generate, gate, ids: list[int], params: dict, rid: str):
    """One turn of `episode` (see `run_episode`): `generate(ids, params, rid, oldest)`, or an abort with
    `RESTART_EPISODE` when the episode's oldest version (with the turn's, once done) is below
    `gate.stale_floor` (then without sending when it already is before)."""
    from megatron_rl.rollout.result import GenerateResult

    oldest = min((v for v, _ in episode.spans), default=None)
    floor = None if gate is None else gate.stale_floor
    if oldest is not None and floor is not None and oldest < floor:
        return GenerateResult.unsent_abort(rid, len(ids), RESTART_EPISODE)
    res = generate(ids, params, rid, oldest)
    floor = None if gate is None else gate.stale_floor
    versions = [v for v, _ in res.version_spans] + ([] if oldest is None else [oldest])
    if res.finish_type != "abort" and floor is not None and versions and min(versions) < floor:
        return dataclasses.replace(res, finish_type="abort", stop_reason="abort", abort_message=RESTART_EPISODE)
    return res


def model_token_ids(res) -> list[int]:
    """The model's own tokens of a result (all of them for a single completion; the masked-in ones
    of an episode): what the verifier reads, so a tool's output can never be scored as the answer."""
    if getattr(res, "response_mask", None) is None:
        return list(res.output_ids)
    return [t for t, m in zip(res.output_ids, res.response_mask) if m]


def episode_stats(results: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Sums over [P][n] results (None: never finished) of their episodes: `rollout/episodes`,
    `rollout/turns`, `rollout/tool_calls`, `rollout/tool_errors`, `rollout/turn_limit`,
    `rollout/tool_infra_failures` (tool calls whose infrastructure failed: their samples are
    invalid, CASES.md T10), `timing/tool_s`,
    `timing/episode_s` (seconds summed over episodes, so `timing/tool_s / timing/episode_s` is the
    share of an episode's time spent in tools),
    and `rollout/tool_concurrency_max`: the most tool runs of different samples in progress at one
    time (`perf_counter` windows); {} when none is an episode."""
    eps = [r.episode for grp in results for r in grp if r is not None and getattr(r, "episode", None)]
    if not eps:
        return {}
    return {"rollout/episodes": len(eps), "rollout/turns": sum(e["turns"] for e in eps),
            "rollout/tool_calls": sum(e["tool_calls"] for e in eps),
            "rollout/tool_errors": sum(e["tool_errors"] for e in eps),
            "rollout/turn_limit": sum(e["turn_limit"] for e in eps), "timing/tool_s": sum(e["tool_s"] for e in eps),
            "rollout/tool_infra_failures": sum(e.get("tool_infra_failures", 0) for e in eps),
            "timing/episode_s": sum(e.get("episode_s", 0.0) for e in eps),
            "rollout/tool_concurrency_max": max_overlap([w for e in eps for w in e.get("tool_windows", ())])}


def max_overlap(windows: Sequence[tuple[float, float]]) -> int:
    """The largest number of `(start, end)` windows open at one instant (an end before a start at a tie)."""
    events = sorted([(a, 1) for a, _ in windows] + [(b, -1) for _, b in windows], key=lambda e: (e[0], e[1]))
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
