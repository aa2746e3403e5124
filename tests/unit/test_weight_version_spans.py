"""Weight-version spans of a response (megatron_rl.rollout.live, GenerateResult parsing) and the
generation gate the rollout manager and the weight publisher share (ALGORITHMS.md section 8)."""

from __future__ import annotations

import threading

import pytest

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.client import GenerateResult, parse_weight_versions
from megatron_rl.rollout.live import (
    UNKNOWN_START,
    GenerationGate,
    concat_spans,
    fallback_spans,
    parse_version,
    spans_of,
    token_versions,
)
from megatron_rl.rollout.manager import Sample


def _answer(n: int, spans=None, version="3") -> dict:
    meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 2,
            "completion_tokens": n, "weight_version": version,
            "output_token_logprobs": [[-0.5, 7, None]] * n}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": [7] * n, "meta_info": meta}


def test_sglang_spans_are_parsed_and_checked():
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    res = GenerateResult.from_sglang(_answer(5, spans))
    assert res.weight_versions == (("2", 0), ("3", 3)) and res.weight_version == "3"
    assert GenerateResult.from_sglang(_answer(5)).weight_versions is None  # a server without spans
    assert parse_weight_versions([{"version": "1", "start": 0, "end": 0}], 0, "r") == (("1", 0),)
    for bad in ([{"version": "1", "start": 0, "end": 4}],  # does not cover the 5 tokens
                [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 5}],  # gap
                [{"version": "1", "start": 1, "end": 5}], [], [{"start": 0, "end": 5}]):
        with pytest.raises(RolloutServerError, match="weight_versions"):
            GenerateResult.from_sglang(_answer(5, bad))


def test_versions_and_the_fallback_for_servers_that_report_only_the_final_version():
    assert (parse_version("7"), parse_version("7+partial"), parse_version("default"), parse_version(None)) == \
        (7, 7, None, None)
    assert fallback_spans(None, None) == []
    assert fallback_spans(4, None) == fallback_spans(None, 4) == fallback_spans(4, 4) == [(4, 0)]
    assert fallback_spans(4, 5) == [(4, 0), (5, UNKNOWN_START)]
    # reported spans win; unparseable labels fall back (final label, else the published version)
    assert spans_of((("4", 0), ("5", 9)), "5", submitted=1, published=9) == [(4, 0), (5, 9)]
    assert spans_of(None, "5", submitted=4, published=9) == [(4, 0), (5, UNKNOWN_START)]
    assert spans_of((("default", 0),), "default", submitted=4, published=5) == [(4, 0), (5, UNKNOWN_START)]


def test_partial_rollout_parts_concatenate():
    assert concat_spans([(1, 0)], 10, [(2, 0)]) == [(1, 0), (2, 10)]
    assert concat_spans([(1, 0)], 10, [(1, 0), (2, 4)]) == [(1, 0), (2, 14)]  # one version merges
    assert concat_spans([(1, 0), (2, 6)], 10, [(3, 0), (4, UNKNOWN_START)]) == [(1, 0), (2, 6), (3, 10),
                                                                               (4, UNKNOWN_START)]
    # a continuation aborted before its first token leaves no trace once another follows
    assert concat_spans(concat_spans([(1, 0)], 16, [(2, 0)]), 16, [(3, 0)]) == [(1, 0), (3, 16)]
    assert token_versions([(1, 0), (2, 2)], 4) == [1, 1, 2, 2]
    assert token_versions([(1, 0), (2, UNKNOWN_START)], 3) == [1, 1, 1]  # unknown start: the older version
    assert token_versions([], 2) == [None, None]


def test_sample_oldest_and_newest_version():
    s = Sample("k", "u", [1], [2, 3, 4], [-1.0] * 3, "length", "x", weight_version_spans=[(3, 0), (5, 2)])
    assert (s.min_weight_version, s.max_weight_version) == (3, 5)
    assert Sample("k", "u", [1], [2], [-1.0], "eos", "x").min_weight_version is None


def test_gate_pause_epochs_stale_marks_and_waiting():
    gate = GenerationGate()
    assert gate.version is None and not gate.paused
    gate.set_version(3)
    gate.register("a", 1)
    gate.register("b", 2)
    gate.register("c", None)  # unknown version: never stale
    assert gate.take_stale(2) == ["a"] and gate.pop_stale("a") and not gate.pop_stale("a")
    gate.unregister("a")
    assert gate.inflight() == {"b": 2, "c": None}
    epoch = gate.begin_pause()
    assert epoch == gate.pause_epoch == 1 and gate.paused and not gate.wait_resumed(0.01)
    waiter = threading.Thread(target=gate.wait_resumed, args=(10.0,))
    waiter.start()
    gate.end_pause()
    waiter.join(5.0)
    assert not waiter.is_alive() and not gate.paused
