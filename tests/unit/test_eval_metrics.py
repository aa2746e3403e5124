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
