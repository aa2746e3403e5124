"""avg@k, pass@k, maj@k, bootstrap confidence intervals and response-length statistics."""

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


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]], k: int) -> list[float]:
    """maj@k per problem: the share of the `n // k` disjoint chunks of k consecutive samples whose
    majority answer is correct (self-consistency, Wang et al. 2022, arXiv 2203.11171).

    Votes are cast by equivalence class: every sample the verifier judged correct votes for the
    gold answer (so `023`, `23` and `\\frac{1}{2}` / `0.5` are one vote each for the same value),
    and a wrong sample votes for its normalised answer string (two wrong answers that differ only
    in form count apart, which can only lower a wrong majority; a wrong answer never merges with
    a correct one). `None` (no answer) does not vote; a tie goes to the class that appears first in
    the chunk; a chunk without any answer counts as wrong.

    Args:
        answers: [P][n] normalised answers.
        correct: [P][n] verifier results, aligned with `answers`.
        k: samples a vote (1 <= k <= n).

    Returns:
        [P] floats in [0, 1].

    Raises:
        ValueError: k out of range, or ragged/misaligned inputs.
    """
    out = []
    for i, (ans, cor) in enumerate(zip(answers, correct, strict=True)):
        n = len(ans)
        if len(cor) != n:
            raise ValueError(f"maj_at_k: problem {i} has {n} answers but {len(cor)} correctness flags")
        if not 1 <= k <= n:
            raise ValueError(f"maj_at_k: k={k} must be in [1, n={n}] (problem {i})")
        chunks = n // k
        wins = 0
        for c in range(chunks):
            votes: dict[tuple, int] = {}
            for a, ok in zip(ans[c * k : (c + 1) * k], cor[c * k : (c + 1) * k]):
                if a is None:
                    continue
                key = (True,) if ok else (False, a)  # correct samples all vote for the gold answer
                votes[key] = votes.get(key, 0) + 1  # dicts keep first-seen order: ties go to the first
            if votes:
                best = max(votes, key=lambda key: votes[key])
                wins += best[0]
        out.append(wins / chunks)
    return out


def bootstrap_ci(per_problem: Sequence[float], *, num_resamples: int = 1000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of per-problem values (problems are
    resampled with replacement; Efron & Tibshirani 1993). Seeded, so reports repeat exactly.

    Returns:
        (low, high); (v, v) for a single problem.

    Raises:
        ValueError: no values, or confidence not in (0, 1).
    """
    import numpy as np

    x = np.asarray(per_problem, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci: no values")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Response-length statistics in tokens: mean, p50, p90, max, min, and `truncated` (the share
    that hit the length limit).

    Raises:
        ValueError: no lengths, or the two lists differ in length.
    """
    import numpy as np

    if not lengths:
        raise ValueError("length_stats: no responses")
    if len(lengths) != len(truncated):
        raise ValueError(f"length_stats: {len(lengths)} lengths but {len(truncated)} truncation flags")
    x = np.asarray(lengths, dtype=np.float64)
    return {"mean": float(x.mean()), "p50": float(np.median(x)), "p90": float(np.quantile(x, 0.9)),
            "min": float(x.min()), "max": float(x.max()), "truncated": float(np.mean(np.asarray(truncated, dtype=bool)))}
