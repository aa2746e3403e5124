"""avg@k and pass@k from per-sample correctness (stdlib only)."""

from __future__ import annotations

from math import comb
from typing import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k estimator of Chen et al. 2021 (Codex, arXiv 2107.03374):
    `1 - C(n-c, k) / C(n, k)` for n samples with c correct.

    Raises:
        ValueError: k > n or counts out of range.
    """
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass_at_k: num_correct {num_correct} not in [0, {num_samples}]")
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over all samples of all problems (avg@k, as in the DAPO paper's avg@32)."""
    total = sum(len(c) for c in correct)
    if total == 0:
        raise ValueError("avg_at_k: no samples")
    return sum(sum(map(bool, c)) for c in correct) / total


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems."""
    if not correct:
        raise ValueError("mean_pass_at_k: no problems")
    return sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / len(correct)
