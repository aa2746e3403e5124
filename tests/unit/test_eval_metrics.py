import pytest

from megatron_rl.eval.metrics import avg_at_k, mean_pass_at_k, pass_at_k


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the plain accuracy c/n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # n-c < k -> certain
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0


def test_avg_and_mean_pass():
    correct = [[True, False, False, False], [True, True, True, True]]
    assert avg_at_k(correct) == pytest.approx(5 / 8)
    # problem 1: pass@2 = 0.5 (above), problem 2: 1.0
    assert mean_pass_at_k(correct, 2) == pytest.approx(0.75)


def test_errors():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        avg_at_k([])


def test_pass_at_k_matches_unbiased_formula_by_enumeration():
    """pass@k equals the probability that a random k-subset of the n samples holds a correct one,
    counted by enumerating every subset (Chen et al. 2021's unbiased estimator)."""
    from itertools import combinations
    from math import comb

    for n, c, k in [(5, 2, 2), (6, 1, 3), (8, 3, 4), (4, 0, 2), (7, 7, 3), (10, 4, 1)]:
        flags = [True] * c + [False] * (n - c)
        hits = sum(any(flags[i] for i in s) for s in combinations(range(n), k))
        assert pass_at_k(n, c, k) == pytest.approx(hits / comb(n, k))
    # hand values: n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; n=6, c=1, k=3: 1 - C(5,3)/C(6,3) = 1 - 10/20
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(6, 1, 3) == pytest.approx(0.5)


def test_maj_at_k_hand_cases():
    from megatron_rl.eval.metrics import maj_at_k

    # 4 samples, k=4: "5" twice (right), "6" once, None once -> majority "5" right
    answers = [["5", "6", None, "5"], ["6", "6", "5", "5"], [None, None, None, None]]
    correct = [[True, False, False, True], [False, False, True, True], [False] * 4]
    # problem 2 ties 2-2: the first-seen answer ("6", wrong) wins; problem 3: no answer -> wrong
    assert maj_at_k(answers, correct, 4) == [1.0, 0.0, 0.0]
    # k=2: chunks of 2. p1: ("5","6") tie -> "5" right; (None,"5") -> "5" right. p2: ("6","6") wrong, ("5","5") right
    assert maj_at_k(answers, correct, 2) == [1.0, 0.5, 0.0]
    # k=1 is plain accuracy
    assert maj_at_k(answers, correct, 1) == [0.5, 0.5, 0.0]
    with pytest.raises(ValueError):
        maj_at_k(answers, correct, 5)


def test_maj_at_k_votes_by_value_not_by_spelling():
    """Correct samples vote for one value whatever their spelling; a wrong answer never merges with a
    correct one that normalises to the same string (the tester's cases)."""
    from megatron_rl.eval.metrics import maj_at_k

    # gold 023: 023 and 23 are one value (2 votes) against 24 (2 votes); the correct class comes first
    assert maj_at_k([["023", "24", "23", "24"]], [[True, False, True, False]], 4) == [1.0]
    # gold 1/2: three spellings of 1/2 (3 votes) beat 3 (2 votes)
    assert maj_at_k([["\\frac{1}{2}", "0.5", "1/2", "3", "3"]], [[True, True, True, False, False]], 5) == [1.0]
    # gold 5/4: two wrong 11/4 and a correct "1 1/4" normalised to the same string: the wrong one wins
    assert maj_at_k([["11/4", "11/4", "11/4"]], [[False, False, True]], 3) == [0.0]


def test_bootstrap_ci_and_length_stats():
    from megatron_rl.eval.metrics import bootstrap_ci, length_stats

    lo, hi = bootstrap_ci([0.0, 1.0] * 50, num_resamples=2000, seed=1)
    # mean 0.5, standard error sqrt(0.25/100) = 0.05 -> 95% interval about 0.5 +- 0.098
    assert 0.38 < lo < 0.44 and 0.56 < hi < 0.62
    assert bootstrap_ci([0.3]) == (pytest.approx(0.3), pytest.approx(0.3))
    assert bootstrap_ci([0.0, 1.0] * 50, seed=1) == bootstrap_ci([0.0, 1.0] * 50, seed=1)  # seeded
    s = length_stats([10, 20, 30, 40], [False, False, False, True])
    assert s["mean"] == 25 and s["p50"] == 25 and s["max"] == 40 and s["min"] == 10 and s["truncated"] == 0.25
    with pytest.raises(ValueError):
        length_stats([], [])
