"""DAPO math reward: the last `Answer:` line of the response against the ground truth.

DAPO (arXiv 2503.14476) and verl's `math_dapo.py`: +1 (`correct_score`) if the extracted answer
equals the ground truth after normalisation, else -1 (`incorrect_score`); `acc` is reported
separately (ALGORITHMS 1). Only the response is read, never the prompt.

Rules: the answer is the text after the last (case-insensitive) `Answer:` up to the end of its
line; both sides are normalised (Minerva-style, see `normalize_answer`), integers compare
numerically ("012" == "12").

Deliberate deviations from verl: the whole response is searched (verl keeps only the last 300
characters, CASES B17); unit words and articles are removed only at word boundaries and never
right after a backslash, so LaTeX commands (`\\tan`, `\\infty`, `\\left`) survive (CASES B19);
markdown bold around the answer is dropped.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from megatron_rl.rewards.registry import REWARD_FNS

logger = logging.getLogger(__name__)

_ANSWER_RE = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_INT_RE = re.compile(r"[+-]?\d+")

_UNIT_WORDS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "sue",
    "points", "feet", "ft", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples",
)
# a word, not preceded by a backslash or a letter (so never part of a LaTeX command name)
_UNIT_RE = re.compile(r"(?<![\\A-Za-z])(?:" + "|".join(_UNIT_WORDS) + r")(?![A-Za-z])")
_ARTICLE_RE = re.compile(r"(?<![\\A-Za-z])(?:an|a|the)\s+")
_REMOVED = (
    "\\ldots", "\\dots", "\\text{s}", "\\text{.}", "\\text{}^2", "\\text{}^3", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\!", "\\,",
)


def _unwrap(s: str, command: str) -> str:
    """Replace `\\command{X}` by `X`, with balanced braces."""
    out, i, tag = [], 0, "\\" + command + "{"
    while True:
        j = s.find(tag, i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k, depth = j + len(tag), 1
        while k < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[k], 0)
            k += 1
        out.append(s[j + len(tag) : k - 1 if depth == 0 else k])
        i = k


_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")


def normalize_answer(answer: str) -> str:
    """Normalise an answer string for exact comparison (Minerva `normalize_final_answer`, made
    LaTeX-safe). Keeps the part after the last `=`, drops `$`, bold, `\\boxed`/`\\text` wrappers,
    unit words, spaces and a trailing period; `\\left`/`\\right` are dropped on both sides;
    thousands separators are removed from plain integers. Deliberate deviation from verl's
    `normalize_final_answer`: verl drops every comma of a digit string, so `3,5,7` (a list) became
    `357`; here only well-formed groups of three (`1,234,567`) are separators."""
    s = answer.strip()
    s = s.replace("**", "")
    s = s.split("=")[-1]
    for cmd in ("boxed", "fbox", "text", "textbf", "mathrm", "mbox", "overline"):
        s = _unwrap(s, cmd)
    s = _ARTICLE_RE.sub("", s)
    s = _UNIT_RE.sub("", s)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\ ", "")
    # spaces go, except one after a command name before a letter (`\tan x` must not become `\tanx`)
    s = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    s = s.rstrip(".")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    if _THOUSANDS_RE.fullmatch(s):  # 1,000,000 -> 1000000; a list such as 3,5,7 stays a list
        s = s.replace(",", "")
    return s


def extract_answer(response: str) -> str | None:
    """Text after the last `Answer:` (case-insensitive) up to the end of that line, or None."""
    matches = _ANSWER_RE.findall(response)
    if not matches:
        return None
    return matches[-1].strip()


def answers_match(pred: str, ground_truth: str) -> bool:
    """True if the normalised strings are equal, or both are integers with equal value."""
    a, b = normalize_answer(pred), normalize_answer(ground_truth)
    if _INT_RE.fullmatch(a) and _INT_RE.fullmatch(b):
        return int(a) == int(b)
    return a == b and a != ""


@REWARD_FNS.register("dapo_math")
def compute_score(
    response: str, ground_truth: str, *, correct_score: float = 1.0, incorrect_score: float = -1.0
) -> dict[str, Any]:
    """Score a response with the DAPO rule.

    Args:
        response: decoded response text only (no prompt).
        ground_truth: reference answer (e.g. "12").
        correct_score, incorrect_score: `reward.correct_score` / `reward.incorrect_score`.

    Returns:
        `{"score": float, "acc": bool, "pred": str | None}`; `pred` is the raw extracted answer,
        None when the response has no `Answer:`.
    """
    pred = extract_answer(response)
    acc = pred is not None and answers_match(pred, ground_truth)
    return {"score": float(correct_score if acc else incorrect_score), "acc": bool(acc), "pred": pred}
