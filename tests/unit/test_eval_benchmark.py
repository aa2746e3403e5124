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


def _two_rows():
    from megatron_rl.data.dataset import PromptRow

    return [PromptRow(prompt_key=f"t:{i}", messages=[{"role": "user", "content": "q"}], ground_truth=g,
                      data_source="x") for i, g in enumerate(["5", "7"])]


def test_summarise_tool_metrics_hand_case():
    """`megatron-rl eval --tool-config`: 2 problems x 3 samples with episode stats; calls
    [[2, 0, 1], [0, 0, 3]]: 6 calls / 6 samples = 1.0 a sample; 3 of 6 samples used a tool = 0.5;
    every response records its `tool_calls` (a sample without episode stats counts 0)."""
    from megatron_rl.eval.benchmark import format_row, format_table

    rows = _two_rows()
    rewards = [[{"acc": True, "pred": "5"}] * 3, [{"acc": False, "pred": "1"}] * 3]
    episodes = [[{"tool_calls": 2, "turns": 3}, {"tool_calls": 0, "turns": 1}, {"tool_calls": 1, "turns": 2}],
                [{"tool_calls": 0, "turns": 1}, None, {"tool_calls": 3, "turns": 3}]]
    s, recs = summarise("t", rows, [["r"] * 3] * 2, rewards, [[1] * 3] * 2, [["eos"] * 3] * 2, EvalSettings(n=3),
                        ["math_auto"] * 2, episodes)
    assert s["tool_calls_per_sample"] == pytest.approx(1.0)
    assert s["tool_use_rate"] == pytest.approx(0.5)
    assert [r["tool_calls"] for r in recs[0]["responses"]] == [2, 0, 1]
    assert [r["tool_calls"] for r in recs[1]["responses"]] == [0, 0, 3]
    assert format_row("t", s).split()[-2:] == ["1.00", "0.500"]
    table = format_table({"settings": {}, "datasets": {"t": s}})
    assert table.splitlines()[0].split()[-2:] == ["calls", "tools"]


def test_summarise_without_episodes_has_no_tool_metrics():
    """Single-turn (no episodes, or only None stats): no tool keys anywhere, table unchanged."""
    from megatron_rl.eval.benchmark import format_table

    rows = _two_rows()
    rewards = [[{"acc": True, "pred": "5"}] * 2, [{"acc": False, "pred": "1"}] * 2]
    args = ("t", rows, [["r"] * 2] * 2, rewards, [[1] * 2] * 2, [["eos"] * 2] * 2, EvalSettings(n=2), ["m"] * 2)
    for episodes in (None, [[None, None], [None, None]]):
        s, recs = summarise(*args, episodes)
        assert "tool_use_rate" not in s and "tool_calls_per_sample" not in s
        assert all("tool_calls" not in r for rec in recs for r in rec["responses"])
        assert "tools" not in format_table({"settings": {}, "datasets": {"t": s}})


def test_tool_settings_recorded_for_results_json():
    from megatron_rl.config.multi_turn import MultiTurnConfig
    from megatron_rl.eval.benchmark import tool_settings

    assert tool_settings(None) == {"tool_config": None, "tool_format": None, "max_assistant_turns": None}
    mt = MultiTurnConfig(enable=True, tool_config_path="examples/tools/tiny_python_tool.yaml", format="code",
                         max_assistant_turns=3)
    assert tool_settings(mt) == {"tool_config": "examples/tools/tiny_python_tool.yaml", "tool_format": "code",
                                 "max_assistant_turns": 3}


def _run_dir(tmp_path, enable=True):
    run = tmp_path / "runs" / "tiny-tool-dapo"
    it = run / "checkpoints" / "iter_0000080"
    (it / "model_optim").mkdir(parents=True)
    cfg = (f"rollout:\n  multi_turn:\n    enable: {str(enable).lower()}\n    format: code\n"
           "    max_assistant_turns: 3\n    tool_config_path: /x/examples/tools/tiny_python_tool.yaml\n")
    (run / "config.yaml").write_text(cfg)
    return run, it


@pytest.mark.parametrize("where", ["run", "checkpoints", "iter", "model_optim"])
def test_warns_when_a_tool_trained_run_is_evaluated_without_tools(tmp_path, caplog, where):
    """A run trained with rollout.multi_turn.enable, evaluated without --tool-config: a WARNING that
    names the run's tool config and says to pass --tool-config (the evaluation itself is unchanged)."""
    import logging

    from megatron_rl.eval.benchmark import warn_if_trained_with_tools

    run, it = _run_dir(tmp_path)
    if where != "run":  # the iteration folder holds its own copy of config.yaml
        (it / "config.yaml").write_text((run / "config.yaml").read_text())
    path = {"run": run, "checkpoints": run / "checkpoints", "iter": it, "model_optim": it / "model_optim"}[where]
    caplog.set_level(logging.WARNING, logger="megatron_rl.eval.benchmark")
    msg = warn_if_trained_with_tools(path)
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert rec.getMessage() == msg
    assert "trained with tools" in msg and "--tool-config /x/examples/tools/tiny_python_tool.yaml" in msg
    assert "rollout.multi_turn.enable: true" in msg and "max_assistant_turns 3" in msg


def test_no_warning_for_a_run_without_tools_or_without_config(tmp_path, caplog):
    import logging

    from megatron_rl.eval.benchmark import warn_if_trained_with_tools

    caplog.set_level(logging.WARNING)
    run, it = _run_dir(tmp_path, enable=False)
    assert warn_if_trained_with_tools(run) is None and warn_if_trained_with_tools(it) is None
    assert warn_if_trained_with_tools(tmp_path / "elsewhere") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_evaluate_datasets_writes_tool_metrics_settings_and_per_response_calls(tmp_path):
    """`evaluate_datasets` with a fake manager whose results carry episode stats: results.json has
    the dataset's tool metrics and the tool settings, per_problem/<name>.jsonl every response's calls."""
    import json
    from types import SimpleNamespace

    from megatron_rl.eval.benchmark import evaluate_datasets

    calls = [[1, 0], [2, 2]]

    class Manager:
        def generate(self, rows, n, **kw):
            return [[SimpleNamespace(output_ids=[1, 2], response_mask=None, stop_reason="eos",
                                     episode={"tool_calls": c}) for c in calls[i]] for i in range(len(rows))]

    class Pool:
        def map(self, items):
            return [{"acc": False, "pred": "1"} for _ in items]

    settings = EvalSettings(n=2, bootstrap_resamples=10)
    settings.extra.update({"tool_config": "tools.yaml", "tool_format": "code", "max_assistant_turns": 3})
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "Answer: 1")
    res = evaluate_datasets(Manager(), Pool(), tok, [("t", _two_rows())], settings, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["settings"]["tool_config"] == "tools.yaml" and on_disk["settings"]["max_assistant_turns"] == 3
    d = on_disk["datasets"]["t"]
    assert d["tool_use_rate"] == res["datasets"]["t"]["tool_use_rate"]
    assert d["tool_calls_per_sample"] == pytest.approx(5 / 4) and d["tool_use_rate"] == pytest.approx(3 / 4)
    lines = [json.loads(x) for x in (tmp_path / "per_problem" / "t.jsonl").read_text().splitlines()]
    assert [[r["tool_calls"] for r in rec["responses"]] for rec in lines] == calls
