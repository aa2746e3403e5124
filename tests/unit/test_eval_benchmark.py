"""Benchmark loading and per-dataset summaries of `megatron-rl eval` (no generation here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.eval.benchmark import (
    BENCHMARKS, PACKAGE_DATA_DIR, EvalSettings, default_data_dir, ks_for, load_benchmark, summarise)
from megatron_rl.rewards.math_answer import verifier_for_source
from shared_data import BENCHMARK_DATA, SHARED_DATA

DATA = BENCHMARK_DATA


def test_ks_for():
    assert ks_for(1) == [1]
    assert ks_for(8) == [1, 2, 4, 8]
    assert ks_for(6) == [1, 2, 4, 6]


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


def test_benchmarks_ship_in_the_package_with_provenance(monkeypatch):
    """Every benchmark the eval knows by name is a package file, listed with its sha256 in
    PROVENANCE.md; setup.py ships them (package_data); without --data-dir or $MEGATRON_RL_DATA_DIR
    the eval reads them from the package, not from a checkout's sibling folder."""
    import hashlib

    monkeypatch.delenv("MEGATRON_RL_DATA_DIR", raising=False)
    assert default_data_dir() == PACKAGE_DATA_DIR == DATA.resolve()
    provenance = (PACKAGE_DATA_DIR / "PROVENANCE.md").read_text()
    total = 0
    for name, (fname, _) in BENCHMARKS.items():
        path = PACKAGE_DATA_DIR / fname
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"{digest}  {fname}" in provenance, fname
        total += path.stat().st_size
        assert load_benchmark(name)[1], name  # default data dir: the package
    assert total < 2 * 1024**2  # keep the package small (1.34 MiB today)
    setup_py = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert '"megatron_rl.eval.data": ["*.jsonl", "PROVENANCE.md"]' in setup_py and '"megatron_rl.eval.data"]' in setup_py
    if (SHARED_DATA / "aime24.jsonl").is_file():  # the copies are byte-identical to the shared folder
        for fname, _ in BENCHMARKS.values():
            assert (PACKAGE_DATA_DIR / fname).read_bytes() == (SHARED_DATA / fname).read_bytes(), fname


def test_data_dir_overrides_the_shipped_files(tmp_path, monkeypatch):
    (tmp_path / "aime24.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n')
    monkeypatch.setenv("MEGATRON_RL_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    assert len(load_benchmark("aime24")[1]) == 1
    monkeypatch.delenv("MEGATRON_RL_DATA_DIR")
    assert len(load_benchmark("aime24", tmp_path)[1]) == 1  # --data-dir
    assert len(load_benchmark("aime24")[1]) == 30


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
    # maj@4, problem 1: "5" and "05" are both verified correct, so one value with 2 votes; it ties
    # "4" (2 votes, wrong) and was seen first: right; problem 2: "8" (wrong)
    assert s["maj@4"]["value"] == 0.5
    assert s["format_valid"] == pytest.approx(7 / 8)
    assert s["response_length"]["mean"] == pytest.approx(45) and s["response_length"]["truncated"] == pytest.approx(1 / 8)
    assert recs[0]["num_correct"] == 2 and recs[0]["pass@2"] == pytest.approx(5 / 6)
    assert [r["acc"] for r in recs[0]["responses"]] == [True, False, False, True]


def test_same_stem_datasets_get_unique_names(tmp_path):
    """Two files named test.jsonl in two folders: both are reported (results.json and
    per_problem/<name>.jsonl are keyed by name), the second as test-2."""
    from megatron_rl.eval.benchmark import unique_names

    row = '{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}\n'
    for d, n in (("a", 3), ("b", 5)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "test.jsonl").write_text(row * n)
    got = unique_names([load_benchmark(str(tmp_path / d / "test.jsonl")) for d in ("a", "b", "a")])
    assert [(name, len(rows)) for name, rows in got] == [("test", 3), ("test-2", 5), ("test-3", 3)]


def test_empty_dataset_is_refused_naming_the_file(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"^{blank}: no problems in the file"):
        load_benchmark(str(blank))


@pytest.mark.parametrize("settings, words", [
    (EvalSettings(verifier="bogus"), "unknown verifier 'bogus'; known: "),
    (EvalSettings(max_problems=-1), "max_problems must be >= 0"),
])
def test_bad_settings_refused_before_any_server_starts(tmp_path, settings, words):
    from megatron_rl.eval.benchmark import run_eval

    with pytest.raises(ValueError, match=words):
        run_eval(datasets=["x.jsonl"], out_dir=tmp_path / "out", checkpoint=str(tmp_path / "no-model"),
                 settings=settings)
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_a_clear_error(tmp_path):
    from megatron_rl.eval.benchmark import run_eval

    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(ValueError, match=rf"^output folder {f}: cannot be created"):
        run_eval(datasets=["x.jsonl"], out_dir=f, checkpoint=str(tmp_path / "no-model"))


def test_level_labels_of_one_level_share_a_bucket():
    from megatron_rl.eval.evaluate import eval_metric_row, level_key

    assert [level_key(x) for x in (3, "3", 3.0, "Level 3", " level_3 ", None, "hard", 2.5)] == \
        ["3", "3", "3", "3", "3", None, "hard", "2.5"]
    assert eval_metric_row({"by_level": {"3": {"avg@2": 0.5}}}) == {"eval/level_3/avg@2": 0.5}
