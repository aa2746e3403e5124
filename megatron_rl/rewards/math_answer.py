"""Final-answer extraction and answer equivalence for math benchmarks (`\\boxed{}`, `Answer:`, `####`).

Extraction (CASES B17):
    - `last_boxed(text)`: the content of the LAST `\\boxed{...}`, `\\boxed X` (space form) or
      `\\fbox{...}` in the text, by position, with balanced braces (so `\\boxed{\\frac{1}{2}}` gives
      `\\frac{1}{2}`, not `\\frac{1`), over the whole text (no fixed character window).
    - `extract_gsm8k(text)`: the number after the last `#### ` (no 300-character window as in verl).
    - `extract_final_answer(text, mode)`: one of the above or DAPO's last `Answer:` line
      (`math_dapo.extract_answer`); mode `auto` takes whichever marker comes last in the text.

Equivalence (`is_equiv`, CASES B16): both sides are normalised LaTeX-safely (CASES B19,
`math_dapo.normalize_answer`); equal strings match. Otherwise Hugging Face Math-Verify decides, with
three guards against its known false positives/negatives:
    - mixed numbers in plain text (`1 1/4`, `2\\frac{1}{2}`) are rewritten as improper fractions
      first (Math-Verify 0.9 reads `1 1/4` as 1/2);
    - when both sides parse to exact rationals (no floats), they must be exactly equal (Math-Verify's
      numeric tolerance calls 1/2004! equal to 1/2006!);
    - percent policy: `percent_equals_number=True` (the default, Math-Verify's and MATH's
      convention) lets `28\\%` match `28`; False makes a percent on one side only a mismatch.
      `28\\%` always matches `28 percent`.
Math-Verify uses `signal.alarm` timeouts: call these functions from a process's main thread (the
reward pool's workers, or a test).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Literal, Optional

from megatron_rl.rewards.math_dapo import extract_answer as extract_answer_line
from megatron_rl.rewards.math_dapo import normalize_answer
from megatron_rl.rewards.registry import REWARD_FNS

ExtractMode = Literal["boxed", "answer", "gsm8k", "auto"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_GSM8K_RE = re.compile(r"####[ \t]*\$?[ \t]*([+-]?(?:\d[\d,]*)?\.?\d+(?:/\d+)?)")  # a number (or a/b): not a `#### Step` heading
_PERCENT_RE = re.compile(r"\\?%|\bpercent\b")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` / `\\boxed X` / `\\fbox{...}` of `text`, or None.

    Braces are matched with a depth counter (nested `\\frac{1}{2}` stays whole). The space form
    `\\boxed 5` takes the token up to the next whitespace or `$`. An unclosed brace gives None
    (never an exception). The last opener by position wins, whatever its form.
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip()
                j += 1
            continue  # unclosed: try an earlier box
        if i > m.end():  # `\boxed 5`
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0).rstrip(".,;")
    return None


def extract_gsm8k(text: str) -> Optional[str]:
    """The number (or fraction `a/b`) after the last `#### ` marker (commas and `$` dropped), or None."""
    matches = _GSM8K_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_final_answer(text: str, mode: ExtractMode = "auto") -> Optional[str]:
    """The final answer of a response.

    Args:
        text: the decoded response.
        mode: `boxed` (last box), `answer` (last `Answer:` line, DAPO), `gsm8k` (last `####`), or
            `auto`: among the markers present, the one that occurs LAST in the text.

    Returns:
        The raw answer string, or None when the response has no marker of that kind.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "boxed":
        return last_boxed(text)
    if mode == "answer":
        return extract_answer_line(text)
    if mode == "gsm8k":
        return extract_gsm8k(text)
    if mode != "auto":
        raise ValueError(f"extract_final_answer: mode must be boxed|answer|gsm8k|auto, got {mode!r}")
    positions = []
    boxes = list(_BOX_RE.finditer(text))
    if boxes:
        positions.append((boxes[-1].start(), last_boxed))
    answers = list(re.finditer(r"answer\s*:", text, re.IGNORECASE))
    if answers:
        positions.append((answers[-1].start(), extract_answer_line))
    marks = list(_GSM8K_RE.finditer(text))
    if marks:
        positions.append((marks[-1].start(), extract_gsm8k))
    for _, fn in sorted(positions, key=lambda p: -p[0]):
        out = fn(text)
        if out:
            # an `Answer: \boxed{7}` line: the box inside the line is the answer
            return last_boxed(out) or out
    return None


_MIXED_PLAIN = re.compile(r"^([+-]?)(\d+)\s+(\d+)\s*/\s*(\d+)$")
_MIXED_LATEX = re.compile(r"^([+-]?)(\d+)\s*\\[dt]?frac\s*\{?(\d+)\}?\s*\{?(\d+)\}?$")


def _mixed_to_improper(s: str) -> str:
    """`1 1/4` / `2\\frac{1}{2}` (proper fraction part only) -> `\\frac{5}{4}`; else unchanged."""
    t = s.strip()
    for rx in (_MIXED_PLAIN, _MIXED_LATEX):
        m = rx.match(t)
        if m:
            sign, whole, num, den = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
            if den and num < den:
                return f"{sign}\\frac{{{whole * den + num}}}{{{den}}}"
    return s


def _has_percent(s: str) -> bool:
    return bool(_PERCENT_RE.search(s))


def _prepare(s: str) -> str:
    s = s.strip().replace("**", "")
    s = re.sub(r"\s*\bpercent\b", r"\\%", s)
    s = s.replace("{,}", "")
    return _mixed_to_improper(s)


def _exact_rational(expr: Any) -> Optional[Fraction]:
    """The exact value of a sympy number without floats (`1/factorial(2004)`, `2**-99`) as a
    Fraction; None for floats, symbols, sets, irrationals, or sizes too big to evaluate."""
    try:
        import sympy

        if not isinstance(expr, sympy.Basic) or not expr.is_number or expr.has(sympy.Float):
            return None
        for node in sympy.preorder_traversal(expr):  # refuse 10^(10^10)-sized evaluations
            if isinstance(node, sympy.Pow) and node.exp.is_Integer and abs(int(node.exp)) > 10_000:
                return None
            if isinstance(node, sympy.factorial) and node.args[0].is_Integer and int(node.args[0]) > 10_000:
                return None
        value = expr.doit()
        if value.is_Rational:
            return Fraction(int(value.p), int(value.q))
    except Exception:  # noqa: BLE001 - anything odd is "not an exact number"
        return None
    return None


def is_equiv(pred: Optional[str], gold: str, *, percent_equals_number: bool = True,
             timeout_s: int = 5) -> bool:
    """True if the predicted answer equals the gold answer mathematically (see the module doc).

    Args:
        pred: extracted answer (None or empty: False).
        gold: reference answer (plain text or LaTeX, without `$`).
        percent_equals_number: whether `28\\%` matches `28` (default True).
        timeout_s: Math-Verify's parse/verify timeout in seconds (0 disables; needed off the
            main thread).
    """
    if pred is None or not str(pred).strip() or not str(gold).strip():
        return False
    p, g = _prepare(str(pred)), _prepare(str(gold))
    if _has_percent(p) != _has_percent(g):
        if not percent_equals_number:
            return False
        p, g = _PERCENT_RE.sub("", p).strip(), _PERCENT_RE.sub("", g).strip()  # `28\%` is read as 28
    np_, ng = normalize_answer(p), normalize_answer(g)
    if np_ and np_ == ng:
        return True
    from math_verify import parse, verify  # sympy-heavy; imported on first use

    def _parse(s: str):
        out = parse(s if ("$" in s or "\\boxed" in s) else f"${s}$", parsing_timeout=timeout_s or None)
        return out or parse(f"\\boxed{{{s}}}", parsing_timeout=timeout_s or None)

    gp, pp = _parse(g), _parse(p)
    if not gp or not pp:
        return False
    if not verify(gp, pp, timeout_seconds=timeout_s or None):
        return False
    fg, fp = _exact_rational(gp[0]), _exact_rational(pp[0])
    if fg is not None and fp is not None:
        return fg == fp  # no numeric tolerance between exact rationals (1/2004! != 1/2006!)
    return True


def _score(pred: Optional[str], ground_truth: str, correct_score: float, incorrect_score: float,
           percent_equals_number: bool) -> dict[str, Any]:
    acc = is_equiv(pred, ground_truth, percent_equals_number=percent_equals_number)
    return {"score": float(correct_score if acc else incorrect_score), "acc": bool(acc), "pred": pred}


@REWARD_FNS.register("math_boxed")
def compute_score_boxed(response: str, ground_truth: str, *, correct_score: float = 1.0,
                        incorrect_score: float = -1.0, percent_equals_number: bool = True) -> dict[str, Any]:
    """MATH-style reward: the last `\\boxed{}` against the ground truth with `is_equiv`.
    Returns `{"score", "acc", "pred"}` (`pred`: the raw box content or None)."""
    return _score(last_boxed(response), ground_truth, correct_score, incorrect_score, percent_equals_number)


@REWARD_FNS.register("gsm8k")
def compute_score_gsm8k(response: str, ground_truth: str, *, correct_score: float = 1.0,
                        incorrect_score: float = -1.0, percent_equals_number: bool = True) -> dict[str, Any]:
    """GSM8K reward: the last `#### N` (or, failing that, the last box / `Answer:` line) against
    the ground truth (`#### N` in the gold is read the same way)."""
    pred = extract_gsm8k(response) or extract_final_answer(response, "auto")
    gold = extract_gsm8k(ground_truth) or ground_truth
    return _score(pred, gold, correct_score, incorrect_score, percent_equals_number)


@REWARD_FNS.register("math_auto")
def compute_score_auto(response: str, ground_truth: str, *, correct_score: float = 1.0,
                       incorrect_score: float = -1.0, percent_equals_number: bool = True) -> dict[str, Any]:
    """Benchmark reward for any prompt style: the last of `\\boxed{}` / `Answer:` / `####` in the
    response, compared with `is_equiv`."""
    return _score(extract_final_answer(response, "auto"), ground_truth, correct_score, incorrect_score,
                  percent_equals_number)


# data_source -> reward function (verl's `default_compute_score` routing, extended)
_SOURCE_ROUTES: tuple[tuple[str, str], ...] = (
    ("math_dapo", "dapo_math"),
    ("tiny_arith", "dapo_math"),
    ("gsm8k", "gsm8k"),
    ("lighteval/math", "math_boxed"),
    ("math-lighteval", "math_boxed"),
)


def verifier_for_source(data_source: str) -> str:
    """The reward function name for a row's `data_source`.

    `math_dapo*`, `tiny_arith` -> `dapo_math` (strict `Answer:` line, as in training);
    anything with `gsm8k` -> `gsm8k`; `lighteval/MATH` -> `math_boxed`; everything else
    (AIME, AMC, MATH-500, DeepMath, unknown) -> `math_auto` (last answer marker + Math-Verify).
    """
    src = (data_source or "").lower()
    for key, name in _SOURCE_ROUTES:
        if key in src:
            return name
    return "math_auto"
