"""Reward functions (DAPO `Answer:` rule, Math-Verify) and the reward process pool."""

import time

import pytest

from megatron_rl.rewards.math_dapo import compute_score, extract_answer, normalize_answer
from megatron_rl.rewards.pool import RewardPool
from megatron_rl.rewards.registry import REWARD_FNS


# spawn-safe, module-level test rewards (passed to the pool, never registered globally)
def _slow_reward(response, ground_truth, **kw):
    time.sleep(float(response))
    return {"score": 1.0, "acc": True, "pred": response}


def _raising_reward(response, ground_truth, **kw):
    raise RuntimeError("verifier exploded")


def test_dapo_last_answer_line_only():
    r = compute_score("Answer: 5\nlet me recheck\nAnswer: 7\nthat's it", "7")
    assert r == {"score": 1.0, "acc": True, "pred": "7"}
    assert compute_score("Answer: 7\nno wait\nAnswer: 5", "7")["acc"] is False
    assert compute_score("The answer is 7", "7") == {"score": -1.0, "acc": False, "pred": None}
    assert extract_answer("final answer:  42  ") == "42"


def test_dapo_integers_compare_numerically_and_scores_configurable():
    assert compute_score("Answer: 012", "12")["acc"]
    assert compute_score("Answer: $1,000$", "1000")["acc"]
    assert not compute_score("Answer: 13", "12")["acc"]
    assert compute_score("Answer: 13", "12", correct_score=1.0, incorrect_score=0.0)["score"] == 0.0
    assert compute_score("Answer: \\boxed{\\frac{1}{2}}", "\\frac12")["acc"]
    assert compute_score("Final Answer: **73**", "73")["acc"]


def test_normalize_keeps_latex_commands():
    assert normalize_answer("\\tan x") == "\\tan x"  # B19: unchanged, not `\\tanx`
    assert normalize_answer("\\infty") == "\\infty"
    assert normalize_answer("12 ft") == "12"
    assert normalize_answer("5\\text{ cm}") == "5"
    assert normalize_answer("\\left(1,2\\right)") == normalize_answer("(1,2)")


def test_math_verify_reward():
    fn = REWARD_FNS.get("math_verify")
    assert fn("so the result is $\\boxed{\\frac{1}{2}}$", "0.5")["acc"]
    assert fn("the answer is \\boxed{12}", "12")["acc"]  # plain-number gold
    r = fn("the answer is \\boxed{13}", "12")
    assert r["acc"] is False and r["score"] == -1.0


def test_pool_results_in_order_with_failures_and_timeout():
    with RewardPool(2, timeout_s=1.5, reward_fns={"slow": _slow_reward, "boom": _raising_reward}) as pool:
        t0 = time.monotonic()
        out = pool.map(
            [
                ("dapo_math", "Answer: 3", "3"),
                ("slow", "60", ""),  # hangs far beyond the timeout
                ("boom", "x", "y"),
                ("dapo_math", "Answer: 4", "3", {"incorrect_score": 0.0}),
                ("no_such_reward", "x", "y"),
                ("slow", "0.01", ""),
            ]
        )
        elapsed = time.monotonic() - t0
        assert elapsed < 20
        assert out[0] == {"score": 1.0, "acc": True, "pred": "3", "failed": False}
        assert out[1]["failed"] and out[1]["score"] == 0.0 and not out[1]["acc"] and "timeout" in out[1]["error"]
        assert out[2]["failed"] and "verifier exploded" in out[2]["error"]
        assert out[3] == {"score": 0.0, "acc": False, "pred": "4", "failed": False}
        assert out[4]["failed"] and "no_such_reward" in out[4]["error"]
        assert out[5]["failed"] is False and out[5]["acc"]
        assert pool.num_replaced == 1
        # the replaced worker serves the next call
        assert pool.map([("slow", "0", "")] * 3) == [{"score": 1.0, "acc": True, "pred": "0", "failed": False}] * 3
    with pytest.raises(RuntimeError):
        pool.map([("dapo_math", "Answer: 1", "1")])


def test_pool_argument_validation():
    with pytest.raises(ValueError):
        RewardPool(0, timeout_s=1.0)
    with pytest.raises(ValueError):
        RewardPool(1, timeout_s=0)


def test_pool_map_from_two_threads_keeps_each_callers_results():
    # asynchronous training scores the producer's groups and an evaluation's answers at once; the
    # shared workers used to hand one caller's results to the other (None entries, a TypeError)
    import threading

    with RewardPool(2, timeout_s=10.0) as pool:
        out = {}

        def score(name, answers, truth):
            out[name] = [pool.map([("dapo_math", f"Answer: {a}", truth) for a in answers]) for _ in range(5)]

        a = threading.Thread(target=score, args=("a", [3, 4, 3, 3, 5, 3], "3"))
        b = threading.Thread(target=score, args=("b", [7, 7, 1], "7"))
        a.start()
        b.start()
        a.join(60)
        b.join(60)
        assert all([r["acc"] for r in res] == [True, False, True, True, False, True] for res in out["a"])
        assert all([r["acc"] for r in res] == [True, True, False] for res in out["b"])
