"""A prompt's responses as one vLLM completion with ``n`` (issue 30; ``rollout/vllm_group.py``):
which batches form a group, the body sent, the answer split back into per-response results in
entry order, aborts by any member's rid, a foreign answer refused; and the seeds the manager gives
a group (``partial.response_seeds``)."""

from __future__ import annotations

import threading

import httpx
import pytest

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.partial import derive_seed, response_seeds
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.rollout.vllm_group import parallel_group, split_group_answer

EOS = 151645


def _choice(index, token_ids, finish="stop"):
    tokens = [f"token_id:{t}" for t in token_ids]
    lps = [-0.5 - index] * len(token_ids)
    return {"index": index, "text": "", "finish_reason": finish, "stop_reason": None, "token_ids": list(token_ids),
            "prompt_logprobs": None, "prompt_token_ids": None,
            "logprobs": {"text_offset": [0] * len(tokens), "token_logprobs": lps, "tokens": tokens,
                         "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)]}}


def _answer(choices, completion_tokens=None):
    made = sum(len(c["token_ids"]) for c in choices) if completion_tokens is None else completion_tokens
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": made, "total_tokens": 3 + made}}


def test_a_group_is_one_prompt_same_params_consecutive_seeds():
    p = {"max_new_tokens": 8, "temperature": 1.0}
    ids = [[1, 2, 3]] * 3
    assert parallel_group(ids, [dict(p, sampling_seed=s) for s in (7, 8, 9)])
    assert parallel_group(ids, [dict(p)] * 3)  # no seeds at all
    assert not parallel_group(ids, [dict(p, sampling_seed=s) for s in (7, 9, 8)])  # not s, s+1, s+2
    assert not parallel_group(ids, [dict(p, sampling_seed=7), dict(p), dict(p, sampling_seed=9)])
    assert not parallel_group([[1, 2, 3], [1, 2, 4], [1, 2, 3]], [dict(p, sampling_seed=s) for s in (7, 8, 9)])
    assert not parallel_group(ids, [dict(p, sampling_seed=7), dict(p, sampling_seed=8, max_new_tokens=4),
                                    dict(p, sampling_seed=9)])  # a continuation's budget
    assert not parallel_group(ids[:1], [dict(p, sampling_seed=7)])  # one entry: a plain request


def test_response_seeds_consecutive_or_derived():
    assert response_seeds((0, 3, 1), 2, 4) == [derive_seed(0, 3, 1, 2, j) for j in range(4)]
    base = derive_seed(0, 3, 1, 2)
    assert response_seeds((0, 3, 1), 2, 4, consecutive=True) == [base, base + 1, base + 2, base + 3]


def test_split_checks_indices_and_usage():
    parts = split_group_answer(_answer([_choice(1, [5, EOS]), _choice(0, [4, 4, 4])]), 2, "w")
    assert [p["choices"][0]["token_ids"] for p in parts] == [[4, 4, 4], [5, EOS]]  # index order
    assert [p["usage"]["completion_tokens"] for p in parts] == [3, 2]
    with pytest.raises(ValueError, match=r"indices \[0, 2\], expected 0..1"):
        split_group_answer(_answer([_choice(0, [4]), _choice(2, [5])]), 2, "w")
    with pytest.raises(ValueError, match="usage.completion_tokens=9 is not the sum"):
        split_group_answer(_answer([_choice(0, [4]), _choice(1, [5])], completion_tokens=9), 2, "w")
    with pytest.raises(ValueError, match="expected 0..2"):
        split_group_answer(_answer([_choice(0, [4]), _choice(1, [5])]), 3, "w")


class _Fake:
    def __init__(self, answer):
        self.answer, self.bodies = answer, []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content) if request.content else {}
        self.bodies.append((request.url.path, body))
        if request.url.path == "/v1/completions":
            self.started.set()
            self.release.wait(5)
            return httpx.Response(200, json=self.answer(body))
        return httpx.Response(200, json={"status": "aborted"})


def _client(fake):
    return VLLMClient("http://vllm:8000", transport=httpx.MockTransport(fake), max_retries=0)


def test_group_goes_as_one_completion_with_n_and_comes_back_in_entry_order():
    fake = _Fake(lambda body: _answer([_choice(j, [10 + j, EOS]) for j in reversed(range(body.get("n", 1)))]))
    fake.release.set()
    p = {"max_new_tokens": 8, "temperature": 1.0}
    rids = ["s1-b0-p2-r0", "s1-b0-p2-r1", "s1-b0-p2-r2"]
    out = _client(fake).generate_batch([[1, 2, 3]] * 3, [dict(p, sampling_seed=40 + j) for j in range(3)], rids,
                                       eos_token_ids=[EOS])
    assert len(fake.bodies) == 1
    body = fake.bodies[0][1]
    assert body["n"] == 3 and body["seed"] == 40 and body["request_id"] == "s1-b0-p2-r0-n3"
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 8
    assert [r.rid for r in out] == rids
    assert [r.output_ids for r in out] == [[10, EOS], [11, EOS], [12, EOS]]
    assert [r.output_logprobs for r in out] == [[-0.5] * 2, [-1.5] * 2, [-2.5] * 2]
    assert [r.completion_tokens for r in out] == [2, 2, 2] and all(r.stop_reason == "eos" for r in out)


def test_not_a_group_goes_as_one_request_per_entry():
    fake = _Fake(lambda body: _answer([_choice(0, [body["seed"], EOS])]))
    fake.release.set()
    p = {"max_new_tokens": 8}
    out = _client(fake).generate_batch([[1, 2, 3]] * 2, [dict(p, sampling_seed=5), dict(p, sampling_seed=9)],
                                       ["a-r0", "a-r1"], eos_token_ids=[EOS])
    assert sorted(b["request_id"] for _, b in fake.bodies) == ["a-r0", "a-r1"]
    assert all("n" not in b for _, b in fake.bodies)
    assert [r.output_ids for r in out] == [[5, EOS], [9, EOS]]


def test_any_members_rid_prefix_aborts_the_group():
    fake = _Fake(lambda body: _answer([_choice(j, [7], "abort") for j in range(body["n"])]))
    c = _client(fake)
    p = {"max_new_tokens": 8}
    box = {}
    t = threading.Thread(target=lambda: box.update(out=c.generate_batch(
        [[1, 2]] * 2, [dict(p, sampling_seed=1), dict(p, sampling_seed=2)], ["s3-b0-p1-r0", "s3-b0-p1-r1"])))
    t.start()
    assert fake.started.wait(5)
    c.abort_request(rid="s3-b0-p1-r1")  # one member: the group's engine id, once
    assert fake.bodies[-1] == ("/abort_requests", {"request_ids": ["cmpl-s3-b0-p1-r0-n2-0"]})
    c.abort_request(rid="s3-")  # the batch prefix (what the manager sends): still one id
    assert fake.bodies[-1] == ("/abort_requests", {"request_ids": ["cmpl-s3-b0-p1-r0-n2-0"]})
    fake.release.set()
    t.join(5)
    assert [r.finish_type for r in box["out"]] == ["abort", "abort"]
    n = len(fake.bodies)
    c.abort_request(rid="s3-")  # nothing in flight any more: no call
    assert len(fake.bodies) == n


def test_a_group_answer_in_another_shape_is_refused():
    fake = _Fake(lambda body: _answer([_choice(0, [7, EOS])]))  # n=2 asked, one choice answered
    fake.release.set()
    with pytest.raises(RolloutServerError, match=r"expected 0..1 \(n=2\)"):
        _client(fake).generate_batch([[1]] * 2, [{"sampling_seed": 3}, {"sampling_seed": 4}], ["q-r0", "q-r1"])


def _manager_with(client, consecutive: bool, max_concurrency: int = 4):
    from megatron_rl.rollout.manager import RolloutManager

    return RolloutManager([client], None, None, reward_fn="dapo_math", max_prompt_length=64, max_response_length=8,
                          max_concurrency=max_concurrency, eos_token_ids=[EOS], consecutive_seeds=consecutive)


class _Counting:
    """Answers every completion (any n) after a short wait; records the bodies and the peak in flight."""

    def __init__(self):
        self.lock, self.now, self.peak, self.bodies = threading.Lock(), 0, 0, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json
        import time

        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.05)
        with self.lock:
            self.now -= 1
        return httpx.Response(200, json=_answer([_choice(j, [7, EOS]) for j in range(body.get("n", 1))]))


@pytest.mark.parametrize("consecutive", [True, False], ids=["parallel_sampling", "per_response_seeds"])
def test_manager_groups_only_consecutive_seeds_and_keeps_its_concurrency(consecutive):
    """With consecutive seeds each prompt's 8 responses are one request with n=8; without, 8 requests,
    one task each, so `max_concurrency` (4) bounds what is in flight (a group path that fell back to
    8 threads per task had 4 x 8 in flight: breaker pass of issue 30)."""
    from megatron_rl.rollout.manager import request_id

    fake = _Counting()
    m = _manager_with(_client(fake), consecutive)
    futures = []
    for i in range(6):
        seeds = response_seeds((0, 1, 0), i, 8, consecutive=consecutive)
        params = [{"max_new_tokens": 8, "sampling_seed": s} for s in seeds]
        futures += m._submit_row(i, 8, [1, 2, 3], params, [request_id("s1-b0", i, j, 8) for j in range(8)])
    res = [f.result(timeout=30) for f in futures]
    assert [r.rid for r in res] == [request_id("s1-b0", i, j, 8) for i in range(6) for j in range(8)]
    if consecutive:
        assert len(fake.bodies) == 6 and all(b["n"] == 8 for b in fake.bodies)
    else:
        assert len(fake.bodies) == 48 and all("n" not in b for b in fake.bodies)
    assert fake.peak <= 4
    m.close()


def test_a_group_aborted_while_it_waits_in_the_pool_is_never_sent():
    """Over-sampling aborts the batch by its tag while later groups still wait for a pool thread: they
    end as aborts without a request (before, they were sent after the abort and ran to full length)."""
    fake = _Counting()
    m = _manager_with(_client(fake), True)
    m.abort("s2-b0-")
    params = [{"max_new_tokens": 8, "sampling_seed": 10 + j} for j in range(4)]
    res = [f.result(timeout=10) for f in m._submit_row(0, 4, [1, 2], params, [f"s2-b0-p0-r{j}" for j in range(4)])]
    assert fake.bodies == [] and all(r.finish_type == "abort" for r in res)
    assert "before it was sent" in res[0].abort_message
    m.close()
