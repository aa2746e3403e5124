"""`rollout/token_checksum` (trainer.loop.token_checksum): hand-computed values, position
sensitivity, and exactness as a float64 metric."""

from megatron_rl.trainer.step_metrics import CHECKSUM_PRIME as _CHECKSUM_PRIME, token_checksum


def test_hand_computed():
    assert token_checksum([]) == 0
    assert token_checksum([5]) == 6
    assert token_checksum([1, 2]) == 2 * 1_000_003 + 3 == 2_000_009
    assert token_checksum([2, 1]) == 3 * 1_000_003 + 2 == 3_000_011  # order matters
    # reduced modulo 2^31 - 1 at every token
    want = ((1_000_001 * 1_000_003 + 1_000_001) * 1_000_003 + 1_000_001) % _CHECKSUM_PRIME
    assert token_checksum([10**6] * 3) == want


def test_step_sum_is_float_exact():
    worst = (_CHECKSUM_PRIME - 1) * 2  # a running sum before its reduction
    assert worst < 2**53 and float(worst) == worst
