"""The tiny arithmetic task: a seeded, finite pool of graded arithmetic problems in verl rows.

Used by the miniature CPU reproduction of DAPO/DA3PO (examples/tiny). Every problem has a worked
solution: one line per intermediate step, then a final `Answer: N` line, so the DAPO verifier
(last `Answer:` line of the response) scores it.

Levels (operands are single digits drawn uniformly; numbers with 2-3 digits appear as
intermediate results; results are never negative):

| level | expression    | ranges                          | solution lines   | distinct |
|-------|---------------|---------------------------------|------------------|----------|
| 1     | a+b           | a, b in 1..9                    | 1 step + Answer  | 81       |
| 2     | a+b+c         | a, b, c in 1..9                 | 2 steps + Answer | 729      |
| 3     | a*b+c         | a, b in 2..9, c in 1..9         | 2 steps + Answer | 576      |
| 4     | a*b+c*d       | a, b, c, d in 2..9              | 3 steps + Answer | 4096     |
| 5     | a*b+c*d-e     | a, b, c, d in 2..9, e in 1..9   | 4 steps + Answer | ~36800   |

Difficulty grows with the number of steps and with the two-digit additions of levels 4 and 5
(products added together), which a tiny model learns last.

Example (level 4), prompt `What is 7*8+6*4?`, solution::

    7*8=56
    6*4=24
    56+24=80
    Answer: 80

Responses are at most 42 tokens (EOS included) with the tiny tokenizer (one token a character).
The train pool and the held-out eval set are disjoint by expression; both are fixed by a seed.
"""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATA_SOURCE = "tiny_arith"
ABILITY = "arith"
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5)
PROMPT_TEMPLATE = "What is {expr}?"

_ANSWER_LINE = re.compile(r"^Answer:\s*(-?\d+)\s*$")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One arithmetic problem with its worked solution.

    `steps` are the solution lines before the answer line, e.g. ("7*8=56", "56+3=59");
    `terms` the expression's terms, (n,) for a number and (a, b) for a*b; `ops` the + / -
    operators between terms (len(ops) == len(terms) - 1).
    """

    level: int
    expr: str
    steps: tuple[str, ...]
    answer: int
    terms: tuple[tuple[int, ...], ...]
    ops: tuple[str, ...]

    @property
    def prompt(self) -> str:
        """The user message text, e.g. 'What is 7*8+3?'."""
        return PROMPT_TEMPLATE.format(expr=self.expr)

    @property
    def solution(self) -> str:
        """The worked solution: the step lines, then 'Answer: N' (no trailing newline)."""
        return "\n".join((*self.steps, f"Answer: {self.answer}"))


Term = tuple[int, ...]
"""A term of an expression: (n,) for a number, (a, b) for the product a*b."""


def _worked(terms: list[Term], ops: list[str], corrupt: tuple[int, int] | None = None) -> tuple[list[str], int]:
    """Solution lines for `terms` joined by `ops` (+ or -), products first, then left to right.

    `corrupt` = (step index, offset) adds a nonzero offset to that step's result; later steps
    use the wrong value consistently (a negative result is reflected to stay >= 0).
    Returns (lines, final value).
    """
    lines: list[str] = []
    values: list[int] = []

    def emit(text: str, val: int) -> int:
        if corrupt is not None and corrupt[0] == len(lines):
            val = val + corrupt[1]
            if val < 0:
                val = val - 2 * corrupt[1]
        lines.append(f"{text}={val}")
        return val

    for t in terms:
        values.append(emit(f"{t[0]}*{t[1]}", t[0] * t[1]) if len(t) == 2 else t[0])
    acc = values[0]
    for op, v in zip(ops, values[1:]):
        acc = emit(f"{acc}{op}{v}", acc + v if op == "+" else acc - v)
    return lines, acc


def _expr(terms: list[Term], ops: list[str]) -> str:
    parts = ["*".join(map(str, t)) for t in terms]
    return parts[0] + "".join(op + p for op, p in zip(ops, parts[1:]))


def _draw_terms(level: int, rng: random.Random) -> tuple[list[Term], list[str]]:
    r = rng.randint
    if level == 1:
        return [(r(1, 9),), (r(1, 9),)], ["+"]
    if level == 2:
        return [(r(1, 9),), (r(1, 9),), (r(1, 9),)], ["+", "+"]
    if level == 3:
        return [(r(2, 9), r(2, 9)), (r(1, 9),)], ["+"]
    if level == 4:
        return [(r(2, 9), r(2, 9)), (r(2, 9), r(2, 9))], ["+"]
    if level == 5:
        while True:  # resample the rare negative results (2*2+2*2-9)
            terms = [(r(2, 9), r(2, 9)), (r(2, 9), r(2, 9)), (r(1, 9),)]
            if terms[0][0] * terms[0][1] + terms[1][0] * terms[1][1] >= terms[2][0]:
                return terms, ["+", "-"]
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def make_problem(level: int, rng: random.Random) -> Problem:
    """Draws one problem of `level` (1..5) from `rng`.

    Raises:
        ValueError: `level` is not in LEVELS.
    """
    terms, ops = _draw_terms(level, rng)
    steps, ans = _worked(terms, ops)
    return Problem(level=level, expr=_expr(terms, ops), steps=tuple(steps), answer=ans,
                   terms=tuple(terms), ops=tuple(ops))


_OFFSETS = (-3, -2, -1, 1, 2, 3, -10, 10)


def perturb_solution(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong worked solution: one step's result is off, and the error propagates.

    The step is uniform over the solution's steps; the offset is drawn from +-1, +-2, +-3, +-10.
    The text stays self-consistent (later steps use the wrong value) and its answer is wrong.
    Used as SFT noise so that the base model keeps the format but is unsure of hard answers.
    """
    corrupt = (rng.randrange(len(problem.steps)), rng.choice(_OFFSETS))
    lines, acc = _worked(list(problem.terms), list(problem.ops), corrupt)
    return "\n".join((*lines, f"Answer: {acc}"))


def score_response(response: str, ground_truth: str) -> tuple[bool, bool]:
    """Scores a response: (format_valid, correct).

    `correct` follows the DAPO verifier: the integer on the last line that starts with
    `Answer:` equals int(ground_truth). `format_valid` is stricter: the last non-empty line is
    `Answer: N` with an integer N (what the tiny base model is trained to end with).
    """
    lines = [ln.strip() for ln in response.strip().split("\n") if ln.strip()]
    answers = [m for m in map(_ANSWER_LINE.match, lines) if m is not None]
    correct = bool(answers) and int(answers[-1].group(1)) == int(ground_truth)
    valid = bool(lines) and _ANSWER_LINE.match(lines[-1]) is not None
    return valid, correct


def problem_to_row(problem: Problem, *, index: int, split: str) -> dict[str, Any]:
    """The verl-format row of one problem (`data_source`, `prompt`, `ability`, `reward_model`, `extra_info`)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": str(problem.answer), "style": "rule"},
        "extra_info": {"index": index, "level": problem.level, "split": split},
    }


def _draw_unique(
    level: int, n: int, rng: random.Random, exclude: set[str], max_tries: int = 100_000
) -> list[Problem]:
    out: list[Problem] = []
    for _ in range(max_tries):
        if len(out) == n:
            return out
        p = make_problem(level, rng)
        if p.expr in exclude:
            continue
        exclude.add(p.expr)
        out.append(p)
    raise ValueError(f"could not draw {n} distinct level-{level} problems")


TEST_COUNTS: dict[int, int] = {1: 40, 2: 64, 3: 64, 4: 64, 5: 64}
"""Held-out problems a level (296 in all). Level 1 has only 81 distinct problems."""
TRAIN_COUNTS: dict[int, int] = {1: 40, 2: 200, 3: 200, 4: 250, 5: 250}
"""RL train-pool prompts a level (940 in all); prompts recur across epochs."""


def build_splits(
    *,
    seed: int = 1234,
    train_counts: dict[int, int] | None = None,
    test_counts: dict[int, int] | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """The fixed RL train pool and held-out test set, disjoint by expression; both shuffled.

    The test set is drawn first (so it does not depend on the train counts), level by level.
    Defaults: `TRAIN_COUNTS`, `TEST_COUNTS`.

    Raises:
        ValueError: a level does not have enough distinct problems for the counts.
    """
    train_counts = TRAIN_COUNTS if train_counts is None else train_counts
    test_counts = TEST_COUNTS if test_counts is None else test_counts
    rng = random.Random(seed)
    seen: set[str] = set()
    test = [p for lv in LEVELS for p in _draw_unique(lv, test_counts[lv], rng, seen)]
    train = [p for lv in LEVELS for p in _draw_unique(lv, train_counts[lv], rng, seen)]
    # Shuffled so that any prefix of either split mixes the levels.
    random.Random(seed + 1).shuffle(train)
    random.Random(seed + 2).shuffle(test)
    return train, test


def write_rows(rows: list[dict[str, Any]], path_stem: Path) -> None:
    """Writes rows to `<path_stem>.jsonl` and `<path_stem>.parquet`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path_stem.parent.mkdir(parents=True, exist_ok=True)
    with open(path_stem.with_suffix(".jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), path_stem.with_suffix(".parquet"))
