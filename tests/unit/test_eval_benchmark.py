"""Benchmark loading and per-dataset summaries of `megatron-rl eval` (no generation here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.eval.benchmark import EvalSettings, ks_for, load_benchmark, summarise
from megatron_rl.rewards.math_answer import verifier_for_source

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_ks_for():
    assert ks_for(1) == [1]
    assert ks_for(8) == [1, 2, 4, 8]
    assert ks_for(6) == [1, 2, 4, 6]


@pytest.mark.skipif(not DATA.is_dir(), reason="shared/data not present")
def test_benchmarks_load_with_their_answer_formats():
    """Every benchmark loads; zero-padded AIME answers are kept, AMC floats become integers,
    GSM8K golds are the number after `####`; routing gives each a verifier."""
    sizes = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "gsm8k": 1319}
    for name, size in sizes.items():
        got, rows = load_benchmark(name, DATA)
        assert got == name and len(rows) == size
    _, aime = load_benchmark("aime24", DATA)
    assert "023" in {r.ground_truth for r in aime}
    _, amc = load_benchmark("amc23", DATA)
    assert amc[0].ground_truth == "27"
    _, gsm = load_benchmark("gsm8k", DATA)
    assert gsm[0].ground_truth == "18" and verifier_for_source(gsm[0].data_source) == "gsm8k"
    assert verifier_for_source(aime[0].data_source) == "math_auto"


def test_unknown_benchmark_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark(str(tmp_path / "nope.jsonl"))


def test_summarise_hand_case():
    """Two problems x 4 samples: avg, pass@k, maj@k and lengths by hand."""
    from megatron_rl.data.dataset import PromptRow

    rows = [PromptRow(prompt_key=f"t:{i}", messages=[{"role": "user", "content": "q"}], ground_truth=g,
                      data_source="x") for i, g in enumerate(["5", "7"])]
    rewards = [
        [{"acc": True, "pred": "5"}, {"acc": False, "pred": "4"}, {"acc": False, "pred": "4"}, {"acc": True, "pred": "05"}],
        [{"acc": False, "pred": None}, {"acc": False, "pred": "8"}, {"acc": False, "pred": "9"}, {"acc": False, "pred": "8"}],
    ]
    texts = [["r"] * 4, ["r"] * 4]
    lengths = [[10, 20, 30, 40], [50, 60, 70, 80]]
    stops = [["eos"] * 4, ["eos", "eos", "eos", "length"]]
    s, recs = summarise("t", rows, texts, rewards, lengths, stops, EvalSettings(n=4), ["math_auto"] * 2)
    assert s["avg@4"]["value"] == pytest.approx(2 / 8)
    # problem 1: c=2 of 4: pass@2 = 1 - C(2,2)/C(4,2) = 5/6; problem 2: 0
    assert s["pass@2"]["value"] == pytest.approx(5 / 12)
    assert s["pass@4"]["value"] == pytest.approx(0.5)
    # maj@4, problem 1: votes are normalised strings, so "5" and "05" are separate votes and
    # "4" (2 votes, wrong) wins; problem 2: "8" (wrong)
    assert s["maj@4"]["value"] == 0.0
    assert s["format_valid"] == pytest.approx(7 / 8)
    assert s["response_length"]["mean"] == pytest.approx(45) and s["response_length"]["truncated"] == pytest.approx(1 / 8)
    assert recs[0]["num_correct"] == 2 and recs[0]["pass@2"] == pytest.approx(5 / 6)
    assert [r["acc"] for r in recs[0]["responses"]] == [True, False, False, True]
