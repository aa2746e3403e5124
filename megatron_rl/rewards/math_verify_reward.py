"""Benchmark math reward backed by Hugging Face Math-Verify (`parse` / `verify`).

Registered as `math_verify`. The gold answer is wrapped in `$...$` unless it already carries
`$` or `\\boxed`, so plain numbers and bare LaTeX work. Math-Verify's timeouts use
`signal.alarm`, so call this only from a process's main thread (the reward pool's workers);
a parse/verify failure counts as incorrect (Math-Verify returns False / [] rather than raising).
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_rl.rewards.registry import REWARD_FNS

logger = logging.getLogger(__name__)


def _wrap_gold(ground_truth: str) -> str:
    g = ground_truth.strip()
    return g if ("$" in g or "\\boxed" in g) else f"${g}$"


@REWARD_FNS.register("math_verify")
def compute_score(
    response: str, ground_truth: str, *, correct_score: float = 1.0, incorrect_score: float = -1.0
) -> dict[str, Any]:
    """Score with Math-Verify. Returns `{"score", "acc", "pred"}` (`pred`: the string form of
    the last extracted prediction, or None)."""
    from math_verify import parse, verify  # heavy (sympy); imported in the worker on first use

    gold = parse(_wrap_gold(ground_truth))
    if not gold:
        gold = parse(f"\\boxed{{{ground_truth.strip()}}}")
    pred = parse(response)
    acc = bool(gold) and bool(pred) and bool(verify(gold, pred))
    pred_str = str(pred[-1]) if pred else None
    return {"score": float(correct_score if acc else incorrect_score), "acc": acc, "pred": pred_str}
