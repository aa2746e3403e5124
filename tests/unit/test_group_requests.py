"""One `/generate` per group (issue 22): the client's batch call and the manager's group path.

The client half runs against a mocked SGLang answer (httpx.MockTransport); the manager half against
a fake engine that records its calls and can abort entries the way a pause of the engines does.
The real server's side (shared prefill, a batch equal to the same requests alone) is in
tests/e2e/test_rollout_server.py.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.client import GenerateResult, RolloutClient
from megatron_rl.rollout.manager import RolloutManager


def _answer(rid, ids):
    return {"output_ids": ids, "meta_info": {
        "id": rid, "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 3,
        "completion_tokens": len(ids), "weight_version": "0",
        "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


def test_generate_batch_posts_sglangs_batch_body_and_keeps_entry_order():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json=[_answer(r, [10 + k, 2]) for k, r in enumerate(body["rid"])])

    c = RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5)
    sps = [{"max_new_tokens": 4, "sampling_seed": s} for s in (7, 8, 9)]
    out = c.generate_batch([[1, 2, 3]] * 3, sps, ["g-0", "g-1", "g-2"], eos_token_ids=[2])
    assert seen == [{"input_ids": [[1, 2, 3]] * 3, "sampling_params": sps, "rid": ["g-0", "g-1", "g-2"],
                     "return_logprob": True}]
    assert [r.rid for r in out] == ["g-0", "g-1", "g-2"]
    assert [r.output_ids for r in out] == [[10, 2], [11, 2], [12, 2]]
    assert all(r.stop_reason == "eos" and r.output_logprobs == [-0.5, -0.5] for r in out)
    with pytest.raises(ValueError, match="2 prompts, 1 sampling_params"):
        c.generate_batch([[1], [2]], sps[:1], ["a", "b"])
    with pytest.raises(ValueError, match="one response per entry"):
        c.generate_batch([[1]], [{"n": 2}], ["a"])


@pytest.mark.parametrize("answer, match", [
    (lambda rids: _answer(rids[0], [5]), "answered dict for a batch of 2"),
    (lambda rids: [_answer(rids[0], [5])], "answered list of 1 for a batch of 2"),
    (lambda rids: [_answer(r, [5]) for r in reversed(rids)], "do not follow the rids"),
])
def test_generate_batch_refuses_an_answer_that_is_not_the_batch(answer, match):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer(json.loads(request.content)["rid"]))

    c = RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5)
    with pytest.raises(RolloutServerError, match=match):
        c.generate_batch([[1], [1]], [{}, {}], ["x-0", "x-1"])


class FakeEngine:
    """Answers every entry with tokens [seed % 100, 2]; entries whose rid is in `abort_once` end
    aborted after 2 tokens ([7, 8]) the first time, as a pause of the engines does (the gate's
    pause begins before the answer and ends right after). Records every call's rids."""

    def __init__(self, batch: bool, abort_once=(), gate=None) -> None:
        self.supports_batch_generate = batch
        self.base_url = "fake://engine"
        self.calls: list[list[str]] = []
        self.bodies: list[list[tuple]] = []
        self.abort_once, self.gate = set(abort_once), gate
        self.lock = threading.Lock()

    def _one(self, ids, sp, rid) -> GenerateResult:
        if rid in self.abort_once:
            self.abort_once.discard(rid)
            return GenerateResult(rid=rid, output_ids=[7, 8], output_logprobs=[-1.0, -1.0], finish_type="abort",
                                  matched_stop=None, stop_reason="abort", prompt_tokens=len(ids),
                                  completion_tokens=2, weight_version="0", abort_message="Aborted")
        toks = [int(sp["sampling_seed"]) % 100, 2][: int(sp["max_new_tokens"])]
        return GenerateResult(rid=rid, output_ids=toks, output_logprobs=[-0.5] * len(toks), finish_type="stop",
                              matched_stop=2, stop_reason="eos", prompt_tokens=len(ids), completion_tokens=len(toks),
                              weight_version="0")

    def _answer(self, entries):
        with self.lock:
            self.calls.append([e[2] for e in entries])
            self.bodies.append([(list(e[0]), dict(e[1])) for e in entries])
            aborts = any(e[2] in self.abort_once for e in entries)
            if aborts and self.gate is not None:
                self.gate.begin_pause()
            out = [self._one(*e) for e in entries]
            if aborts and self.gate is not None:
                self.gate.end_pause()
            return out

    def generate(self, input_ids, sampling_params, rid, return_logprob=True, *, eos_token_ids=None, timeout_s=None):
        return self._answer([(input_ids, sampling_params, rid)])[0]

    def generate_batch(self, input_ids, sampling_params, rids, return_logprob=True, *, eos_token_ids=None,
                       timeout_s=None):
        return self._answer(list(zip(input_ids, sampling_params, rids)))


def _manager(engine, partial=False) -> RolloutManager:
    m = RolloutManager([engine], tokenizer=None, reward_pool=None, reward_fn="dapo_math", max_prompt_length=16,
                       max_response_length=6, seed=3, partial_rollout=partial, pause_timeout_s=5)
    m.gate.set_version(0)
    return m


def _params(n):
    return [{"max_new_tokens": 6, "sampling_seed": 100 + j} for j in range(n)]


def test_a_group_is_one_call_with_every_responses_rid_and_seed():
    eng = FakeEngine(batch=True)
    m = _manager(eng)
    futures = m._submit_row(2, 4, [5, 6, 7], _params(4), [f"s0-p2-r{j}" for j in range(4)])
    res = [f.result(timeout=10) for f in futures]
    assert eng.calls == [["s0-p2-r0", "s0-p2-r1", "s0-p2-r2", "s0-p2-r3"]]
    assert [b[1]["sampling_seed"] for b in eng.bodies[0]] == [100, 101, 102, 103]
    assert [r.output_ids for r in res] == [[0, 2], [1, 2], [2, 2], [3, 2]]
    assert [r.rid for r in res] == [f"s0-p2-r{j}" for j in range(4)]
    m.close()


def test_an_engine_without_batch_calls_gets_one_call_per_response():
    eng = FakeEngine(batch=False)
    m = _manager(eng)
    res = [f.result(timeout=10) for f in m._submit_row(0, 3, [5], _params(3), ["a", "b", "c"])]
    assert sorted(eng.calls) == [["a"], ["b"], ["c"]]
    assert [r.output_ids for r in res] == [[0, 2], [1, 2], [2, 2]]
    m.close()


@pytest.mark.parametrize("partial", [False, True], ids=["from_scratch", "partial_rollout"])
def test_entries_aborted_by_a_pause_are_resubmitted_together_and_alone(partial):
    """Entries 1 and 3 of a group of 4 are aborted by a pause: the next call carries exactly those
    two as `{rid}-a1` (one batch), with the prefix and the remaining budget under partial rollout;
    the other entries are answered once."""
    eng = FakeEngine(batch=True, abort_once={"g-1", "g-3"})
    m = _manager(eng, partial=partial)
    eng.gate = m.gate
    res = m.generate_batch_ids([([5, 6], p, f"g-{j}") for j, p in enumerate(_params(4))], key=0)
    assert eng.calls == [["g-0", "g-1", "g-2", "g-3"], ["g-1-a1", "g-3-a1"]]
    again = eng.bodies[1]
    if partial:
        assert [b[0] for b in again] == [[5, 6, 7, 8]] * 2  # prompt + the kept prefix
        assert [b[1]["max_new_tokens"] for b in again] == [4, 4]
        assert [r.output_ids for r in res] == [[0, 2], [7, 8] + [again[0][1]["sampling_seed"] % 100, 2], [2, 2],
                                               [7, 8] + [again[1][1]["sampling_seed"] % 100, 2]]
    else:
        assert [b[0] for b in again] == [[5, 6]] * 2 and [b[1]["sampling_seed"] for b in again] == [101, 103]
        assert [r.output_ids for r in res] == [[0, 2], [1, 2], [2, 2], [3, 2]]
    assert [r.resubmissions for r in res] == [0, 1, 0, 1]
    assert all(r.finish_type == "stop" for r in res)
    assert m.gate.inflight() == {}
    m.close()


def test_a_failed_group_call_fails_every_response_of_the_group():
    class Refusing(FakeEngine):
        def generate_batch(self, *a, **k):
            raise RolloutServerError("/generate answered 400", status_code=400)

    m = _manager(Refusing(batch=True))
    futures = m._submit_row(0, 3, [5], _params(3), ["a", "b", "c"])
    for f in futures:
        with pytest.raises(RolloutServerError, match="400"):
            f.result(timeout=10)
    m.close()


def test_a_malformed_batch_answer_is_raised_at_once_not_resent():
    """Breaker finding: an answer out of order (or of the wrong length) is an answer, not a lost
    request: status 200 on the error, so the manager raises it at once instead of resending the
    group 2 x servers + 2 times and reporting "no answer"."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            calls.append(1)
            rids = json.loads(request.content)["rid"]
            return httpx.Response(200, json=[_answer(r, [5]) for r in reversed(rids)])
        return httpx.Response(200, json={})

    c = RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5)
    with pytest.raises(RolloutServerError, match="do not follow the rids") as info:
        c.generate_batch([[1], [1]], [{}, {}], ["x-0", "x-1"])
    assert info.value.status_code == 200
    m = RolloutManager([c], tokenizer=None, reward_pool=None, reward_fn="dapo_math", max_prompt_length=16,
                       max_response_length=6)
    calls.clear()
    with pytest.raises(RolloutServerError, match="do not follow the rids"):
        m.generate_batch_ids([([1], {"max_new_tokens": 2}, "g-0"), ([1], {"max_new_tokens": 2}, "g-1")])
    assert calls == [1]
    m.close()


def test_an_eos_iterable_is_read_for_every_entry():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[_answer(r, [5, 2]) for r in json.loads(request.content)["rid"]])

    c = RolloutClient("http://mock", transport=httpx.MockTransport(handler), timeout_s=5)
    out = c.generate_batch([[1]] * 3, [{"stop_token_ids": [2]}] * 3, ["a", "b", "c"], eos_token_ids=iter([2]))
    assert [r.stop_reason for r in out] == ["eos"] * 3


def test_an_own_abort_during_the_pause_drops_the_resubmission():
    """Breaker finding: the over-sampling abort (`RolloutManager.abort` by rid prefix) lands while
    the engines are paused; the entry aborted by the pause is not sent again afterwards."""
    eng = FakeEngine(batch=True, abort_once={"s0-b0-p0-r1"})
    m = _manager(eng)
    eng.gate = m.gate
    original = eng._one

    def one(ids, sp, rid):
        res = original(ids, sp, rid)
        if res.finish_type == "abort":
            with m._own_lock:  # what `abort` records first, before its /abort_request
                m._own_aborts.add("s0-b0-")
        return res

    eng._one = one
    res = m.generate_batch_ids([([5], p, f"s0-b0-p0-r{j}") for j, p in enumerate(_params(3))])
    assert eng.calls == [["s0-b0-p0-r0", "s0-b0-p0-r1", "s0-b0-p0-r2"]]
    assert [r.finish_type for r in res] == ["stop", "abort", "stop"]
    m.close()


def test_the_default_batch_call_is_one_generate_per_entry_side_by_side():
    """`RolloutEngine.generate_batch` for engines without a batch call (vLLM's API): K `generate`
    calls running at the same time, results in entry order, the first failure raised."""
    from megatron_rl.rollout.engine import RolloutEngine

    class OneAtATime(RolloutEngine):
        def __init__(self) -> None:
            self.started, self.lock, self.all_in = [], threading.Lock(), threading.Event()

        def generate(self, input_ids, sampling_params, rid, return_logprob=True, *, eos_token_ids=None,
                     timeout_s=None):
            with self.lock:
                self.started.append(rid)
                if len(self.started) == 3:
                    self.all_in.set()
            assert self.all_in.wait(5), "the calls were not concurrent"
            if rid == "bad":
                raise RolloutServerError("/v1/completions answered 400", status_code=400)
            return FakeEngine(batch=False)._one(input_ids, sampling_params, rid)

    OneAtATime.__abstractmethods__ = frozenset()  # only generate matters here
    eng = OneAtATime()
    assert eng.supports_batch_generate is False
    out = eng.generate_batch([[1], [2], [3]], _params(3), ["a", "b", "c"])
    assert [r.rid for r in out] == ["a", "b", "c"] and [r.output_ids for r in out] == [[0, 2], [1, 2], [2, 2]]
    eng = OneAtATime()
    with pytest.raises(RolloutServerError, match="400"):
        eng.generate_batch([[1], [2], [3]], _params(3), ["a", "bad", "c"])
    with pytest.raises(ValueError, match="2 prompts, 1 sampling_params"):
        eng.generate_batch([[1], [2]], _params(1), ["a", "b"])
