"""Held-out evaluation through the rollout servers: greedy accuracy, avg@k, pass@k, format validity."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from typing import Sequence

from megatron_rl.data.dataset import PromptRow
from megatron_rl.eval.metrics import avg_at_k, mean_pass_at_k

logger = logging.getLogger(__name__)


def evaluate(manager, rows: Sequence[PromptRow], *, n: int, temperature: float, top_p: float, seed: int,
             max_new_tokens: int, tag: str = "eval", greedy: bool = True) -> dict:
    """Evaluate the servers' current weights on `rows`.

    Sampled: `n` responses a problem at (`temperature`, `top_p`) with seeds derived from `seed`
    only (so every evaluation of a run sees the same random stream). Greedy: one response at
    temperature 0.

    Returns:
        dict with `greedy_acc`, `avg@{n}`, `pass@{n}`, `format_valid` (share of sampled responses
        whose verifier found an answer), `num_problems`, `wall_s`, and `by_level` (the same keys per
        `extra_info.level` when rows carry one). Multi-turn runs (`rollout.multi_turn`) add
        `tool_calls_per_sample` and `tool_use_rate` (share of sampled responses with a tool call;
        also per level).
    """
    t0 = time.perf_counter()
    sampling = {"temperature": temperature, "top_p": top_p}
    progress = EvalProgress(f"{tag} sampled (n={n})", len(rows), n)
    results = manager.generate(rows, n=n, sampling_params=sampling, tag=f"{tag}-sample", seed_parts=(seed,),
                               max_new_tokens=max_new_tokens, on_response=progress.response_done)
    rewards = manager.score(rows, results)
    correct = [[bool(r.get("acc")) and not r.get("failed") for r in g] for g in rewards]
    valid = [[r.get("pred") is not None for r in g] for g in rewards]
    out = {
        "num_problems": len(rows),
        f"avg@{n}": avg_at_k(correct),
        f"pass@{n}": mean_pass_at_k(correct, n),
        "format_valid": avg_at_k(valid),
    }
    calls = tool_calls_of([[r.episode for r in g] for g in results])
    episodes = calls is not None
    if episodes:  # multi-turn (rollout.multi_turn): how often the model used its tools
        out.update(tool_use_stats(calls))
    greedy_correct = None
    if greedy:
        progress = EvalProgress(f"{tag} greedy", len(rows), 1)
        g_results = manager.generate(rows, n=1, sampling_params={"temperature": 0.0}, tag=f"{tag}-greedy",
                                     seed_parts=(seed,), max_new_tokens=max_new_tokens,
                                     on_response=progress.response_done)
        g_rewards = manager.score(rows, g_results)
        greedy_correct = [bool(g[0].get("acc")) and not g[0].get("failed") for g in g_rewards]
        out["greedy_acc"] = sum(greedy_correct) / len(rows)
    levels = defaultdict(list)
    for i, row in enumerate(rows):
        levels[level_key((row.extra_info or {}).get("level"))].append(i)
    if len(levels) > 1 or None not in levels:
        by_level = {}
        for level, idx in sorted(levels.items(), key=lambda kv: (kv[0] is None, _natural(kv[0]))):
            rec = {
                "num_problems": len(idx),
                f"avg@{n}": avg_at_k([correct[i] for i in idx]),
                f"pass@{n}": mean_pass_at_k([correct[i] for i in idx], n),
                "format_valid": avg_at_k([valid[i] for i in idx]),
            }
            if episodes:
                rec["tool_use_rate"] = tool_use_stats([calls[i] for i in idx])["tool_use_rate"]
            if greedy_correct is not None:
                rec["greedy_acc"] = sum(greedy_correct[i] for i in idx) / len(idx)
            by_level[str(level)] = rec
        out["by_level"] = by_level
    out["wall_s"] = time.perf_counter() - t0
    return out


def tool_calls_of(episodes: Sequence[Sequence[dict | None]]) -> list[list[int]] | None:
    """[P][n] tool calls of each sample from its `GenerateResult.episode` statistics (`Episode.result`),
    or None when no sample is an episode (single-turn generation: no tool metrics)."""
    if not any(e for g in episodes for e in g):
        return None
    return [[int((e or {}).get("tool_calls", 0)) for e in g] for g in episodes]


def tool_use_stats(calls: Sequence[Sequence[int]]) -> dict:
    """`tool_calls_per_sample` (mean tool calls a sample) and `tool_use_rate` (share of samples with
    at least one call) of [P][n] call counts (`tool_calls_of`)."""
    return {"tool_calls_per_sample": sum(map(sum, calls)) / max(sum(map(len, calls)), 1),
            "tool_use_rate": avg_at_k([[c > 0 for c in g] for g in calls])}


def progress_due(done: int, total: int, last_done: int, since_last_s: float, *, frac: float = 0.1,
                 every_s: float = 15.0, min_s: float = 1.0) -> bool:
    """Whether to log an evaluation progress line: at the end, every `frac` of the problems (but
    not within `min_s` of the last line), or every `every_s` seconds when a problem finished."""
    if done <= last_done:
        return False
    return (done == total or (done - last_done >= max(1, int(total * frac)) and since_last_s >= min_s)
            or since_last_s >= every_s)


class EvalProgress:
    """Counts the finished problems (all `n` responses back) of one evaluation pass and logs
    `eval <what>: 120/296 problems (41%), 35 s` when `progress_due` says so. Thread-safe."""

    def __init__(self, what: str, total: int, n: int, *, frac: float = 0.1, every_s: float = 15.0,
                 min_s: float = 1.0) -> None:
        self.what, self.total, self.n, self.frac, self.every_s, self.min_s = what, total, n, frac, every_s, min_s
        self.left = defaultdict(lambda: n)
        self.done = self.last_done = 0
        self.t0 = self.t_last = time.perf_counter()
        self._lock = threading.Lock()

    def response_done(self, i: int) -> None:
        with self._lock:
            self.left[i] -= 1
            if self.left[i]:
                return
            self.done += 1
            now = time.perf_counter()
            if progress_due(self.done, self.total, self.last_done, now - self.t_last, frac=self.frac,
                            every_s=self.every_s, min_s=self.min_s):
                self.last_done, self.t_last = self.done, now
                logger.info("eval %s: %d/%d problems (%d%%), %.0f s", self.what, self.done, self.total,
                            100 * self.done // max(1, self.total), now - self.t0)


def level_key(level) -> str | None:
    """One spelling per difficulty level, so rows labelled `3`, `"3"`, `3.0` or `"Level 3"` (MATH-500
    and lighteval MATH mixed) are one bucket `"3"`; other labels keep their text (stripped); None
    (no level) stays None."""
    if level is None:
        return None
    text = re.sub(r"(?i)^\s*level[\s_]*", "", str(level)).strip()
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else text


def _natural(level: str | None) -> tuple:
    """Sort key: numeric levels by value, then other labels by text."""
    try:
        return (0, float(level), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(level))


def eval_metric_row(res: dict, prefix: str = "eval") -> dict[str, float]:
    """Flatten an `evaluate` result into metrics.jsonl / TensorBoard / W&B keys.

    Overall float results become `{prefix}/{key}` (`eval/avg@8`, `eval/pass@8`, `eval/greedy_acc`,
    `eval/format_valid`, `eval/wall_s`); each difficulty level of `res["by_level"]` becomes
    `{prefix}/level_{L}/{key}` for the same keys (`eval/level_3/avg@8`), with `L` the level as
    written in `extra_info.level`, a leading "level" dropped and characters other than letters,
    digits, `.`, `-` and `_` replaced by `_` ("Level 3" -> `level_3`). Counts (`num_problems`) and
    other non-float values are left out, as for the overall keys, except the `weight_version` the
    trainer adds (the published weights it ran on): `{prefix}/weight_version`, as a float.
    """
    row = {f"{prefix}/{k}": v for k, v in res.items() if isinstance(v, float)}
    if isinstance(res.get("weight_version"), int):
        row[f"{prefix}/weight_version"] = float(res["weight_version"])
    for level, rec in (res.get("by_level") or {}).items():
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", re.sub(r"(?i)^\s*level[\s_]*", "", str(level)).strip()) or "none"
        row.update({f"{prefix}/level_{name}/{k}": v for k, v in rec.items() if isinstance(v, float)})
    return row


def format_before_after(before: dict, after: dict) -> str:
    """The before -> after table of two `evaluate` results (avg@k, pass@k, greedy accuracy, format
    validity, then the same per difficulty level); metrics missing from either side are left out."""
    keys = [k for k in after if isinstance(after[k], float) and k != "wall_s" and isinstance(before.get(k), float)]
    lines = [f"{'held-out eval':<24} {'before':>7} {'after':>7} {'change':>7}"]

    def add(label: str, b: float, a: float) -> None:
        lines.append(f"{label:<24} {b:7.3f} {a:7.3f} {a - b:+7.3f}")

    for k in keys:
        add(k, before[k], after[k])
    b_levels, a_levels = before.get("by_level") or {}, after.get("by_level") or {}
    for level in [lv for lv in a_levels if lv in b_levels]:
        b, a = b_levels[level], a_levels[level]
        for k in [k for k in keys if k != "format_valid" and isinstance(a.get(k), float) and isinstance(b.get(k), float)]:
            add(f"level {level} {k}", b[k], a[k])
    return "\n".join(lines)
