"""Tests of verl-format loading, benchmark adapters and the resumable PromptDataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.data.dataset import (
    DAPO_PROMPT_TEMPLATE,
    DATASET_ADAPTERS,
    PromptDataset,
    PromptRow,
    load_rows,
    read_records,
)
from shared_data import SHARED_DATA, data_file

ROOT = Path(__file__).resolve().parents[2]
DATA = SHARED_DATA
needs_shared = pytest.mark.skipif(not DATA.is_dir(), reason="shared/data not present")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _verl(gt="7", idx=0):
    return {
        "data_source": "toy",
        "prompt": [{"role": "user", "content": f"q{idx}"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"index": idx},
    }


def test_adapter_names_are_pinned():
    assert DATASET_ADAPTERS.names() == ["aime", "amc", "gsm8k", "math500", "verl"]


def test_verl_row(tmp_path):
    path = _write_jsonl(tmp_path / "toy.jsonl", [_verl("7", 0), _verl("012", 1)])
    rows = load_rows(path)
    assert rows[0] == PromptRow(prompt_key="toy:0", messages=[{"role": "user", "content": "q0"}],
                                ground_truth="7", data_source="toy", extra_info={"index": 0})
    assert rows[1].ground_truth == "012" and rows[1].prompt_key == "toy:1"
    assert load_rows(path, name="mine")[1].prompt_key == "mine:1"


def test_jsonl_and_parquet_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_verl(str(i), i) for i in range(5)]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(tmp_path / "d.jsonl") == load_rows(tmp_path / "d.parquet")


def test_missing_ground_truth_names_file_row_and_key(tmp_path):
    bad = _verl()
    del bad["reward_model"]["ground_truth"]
    path = tmp_path / "bad.jsonl"
    # a blank line still counts as a line: the bad row is on line 3
    path.write_text(json.dumps(_verl()) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError) as e:
        load_rows(path)
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and "reward_model.ground_truth" in msg

    no_rm = _verl()
    del no_rm["reward_model"]
    _write_jsonl(path, [no_rm])
    with pytest.raises(ValueError, match=r"line 1: missing required key 'reward_model.ground_truth'"):
        load_rows(path)


def test_bad_files(tmp_path):
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        read_records(tmp_path / "x.csv")
    (tmp_path / "y.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="y.jsonl:2: invalid JSON"):
        read_records(tmp_path / "y.jsonl")
    with pytest.raises(KeyError, match="valid names: aime, amc, gsm8k, math500, verl"):
        load_rows(tmp_path / "y.jsonl", adapter="nope")
    row = _verl()
    row["prompt"] = "not a message list"
    _write_jsonl(tmp_path / "z.jsonl", [row])
    with pytest.raises(ValueError, match="line 1: prompt must be"):
        load_rows(tmp_path / "z.jsonl")


def test_adapters_by_hand(tmp_path):
    _write_jsonl(tmp_path / "aime.jsonl", [{"id": 60, "problem": "P?", "answer": "023"}])
    _write_jsonl(tmp_path / "amc.jsonl", [{"problem": "Q?", "answer": 27.0}, {"problem": "R", "answer": 2.5}])
    _write_jsonl(tmp_path / "gsm.jsonl", [{"question": "How many?", "answer": "3+4=<<3+4=7>>7\n#### 1,007"}])
    _write_jsonl(tmp_path / "m5.jsonl", [{"problem": "S", "answer": "\\frac{1}{2}", "level": 3}])
    aime = load_rows(tmp_path / "aime.jsonl", adapter="aime")[0]
    assert aime.ground_truth == "023"
    assert aime.messages == [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem="P?")}]
    assert aime.messages[0]["content"].startswith("Solve the following math problem step by step. The last")
    assert aime.messages[0]["content"].endswith('P?\n\nRemember to put your answer on its own line after "Answer:".')
    assert aime.extra_info == {"index": 0, "id": 60, "raw_problem": "P?"}
    assert aime.data_source == "aime" and aime.prompt_key == "aime:0"
    amc = load_rows(tmp_path / "amc.jsonl", adapter="amc")
    assert [r.ground_truth for r in amc] == ["27", "2.5"]
    assert load_rows(tmp_path / "gsm.jsonl", adapter="gsm8k")[0].ground_truth == "1007"
    m5 = load_rows(tmp_path / "m5.jsonl", adapter="math500")[0]
    assert m5.ground_truth == "\\frac{1}{2}" and m5.extra_info["level"] == 3
    _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "P"}])
    with pytest.raises(ValueError, match="line 1: missing required key 'answer'"):
        load_rows(tmp_path / "bad.jsonl", adapter="aime")
    _write_jsonl(tmp_path / "gbad.jsonl", [{"question": "Q", "answer": "7"}])
    with pytest.raises(ValueError, match="####"):
        load_rows(tmp_path / "gbad.jsonl", adapter="gsm8k")


@needs_shared
def test_shared_files_load():
    dapo = load_rows(DATA / "dapo_math_sample_answer_format.jsonl")
    assert len(dapo) == 80 and dapo[0].data_source == "math_dapo"
    assert all(r.ground_truth.lstrip("-").isdigit() for r in dapo)
    debug = load_rows(DATA / "dapo_math_17k_debug16_verl.jsonl")
    assert len(debug) == 16 and debug[0].ground_truth == "34"
    assert debug[0].messages[0]["content"].startswith("Solve the following math problem step by step.\n\n")


def test_benchmark_files_load():
    """The benchmark files shipped in the package (megatron_rl/eval/data): no shared folder needed."""
    aime = load_rows(data_file("aime24.jsonl"), adapter="aime")
    assert len(aime) == 30
    assert sorted(r.ground_truth for r in aime if r.ground_truth.startswith("0")) == [
        "023", "025", "033", "045", "055", "073", "080"]
    assert len(load_rows(data_file("aime25.jsonl"), adapter="aime")) == 30
    amc = load_rows(data_file("amc23.jsonl"), adapter="amc")
    assert amc[0].ground_truth == "27" and not any(r.ground_truth.endswith(".0") for r in amc)
    assert len(load_rows(data_file("math500.jsonl"), adapter="math500")) == 500
    gsm = load_rows(data_file("gsm8k_test.jsonl"), adapter="gsm8k")
    assert len(gsm) == 1319 and gsm[0].ground_truth == "18"  # Janet's ducks: (16-3-4)*2


# ---------------------------------------------------------------- PromptDataset


def _ds(n=5, seed=3, shuffle=True):
    rows = [PromptRow(prompt_key=f"t:{i}", messages=[], ground_truth=str(i), data_source="t") for i in range(n)]
    return PromptDataset(rows, seed=seed, shuffle=shuffle)


def _keys(rows):
    return [int(r.ground_truth) for r in rows]


def test_epochs_are_permutations_and_deterministic():
    a, b = _ds(), _ds()
    assert a.epoch_order(0) == b.epoch_order(0)
    assert sorted(a.epoch_order(0)) == [0, 1, 2, 3, 4]
    assert a.epoch_order(0) != a.epoch_order(1) or a.epoch_order(1) != a.epoch_order(2)
    assert _ds(seed=4).epoch_order(0) != a.epoch_order(0) or _ds(seed=5).epoch_order(0) != a.epoch_order(0)
    assert _ds(shuffle=False).epoch_order(7) == [0, 1, 2, 3, 4]


def test_next_batch_crosses_epochs_and_cursor():
    ds = _ds(shuffle=False)
    assert _keys(ds.next_batch(3)) == [0, 1, 2]
    assert ds.state_dict()["epoch"] == 0 and ds.state_dict()["position"] == 3
    assert _keys(ds.next_batch(3)) == [3, 4, 0]
    assert (ds.epoch, ds.position) == (1, 1)
    assert _keys(ds.next_batch(4)) == [1, 2, 3, 4]
    assert (ds.epoch, ds.position) == (2, 0)  # an epoch boundary resumes into the next epoch
    with pytest.raises(ValueError):
        ds.next_batch(0)


def test_exact_resume():
    ref = _ds(n=7)
    stream = [ref.next_batch(3) for _ in range(6)]
    a = _ds(n=7)
    for _ in range(4):
        a.next_batch(3)
    state = json.loads(json.dumps(a.state_dict()))
    b = _ds(n=7)
    b.load_state_dict(state)
    assert [_keys(b.next_batch(3)) for _ in range(2)] == [_keys(s) for s in stream[4:]]
    assert sorted(_keys(stream[0] + stream[1] + stream[2][:1])) == list(range(7))


def test_load_state_dict_checks():
    ds = _ds()
    with pytest.raises(ValueError, match="seed"):
        ds.load_state_dict({"epoch": 0, "position": 0, "seed": 99, "num_rows": 5})
    with pytest.raises(ValueError, match="num_rows"):
        ds.load_state_dict({"epoch": 0, "position": 0, "seed": 3, "num_rows": 6})
    with pytest.raises(ValueError, match="cursor"):
        ds.load_state_dict({"epoch": 0, "position": 5})
    with pytest.raises(ValueError):
        PromptDataset([])


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(extra_info=[1]), "line 1: extra_info must be an object"),
    (lambda r: r["reward_model"].update(ground_truth=""), "line 1: reward_model.ground_truth is empty"),
    (lambda r: r["reward_model"].update(ground_truth=["1", "2"]), "line 1: answer must be a number or string, got list"),
    (lambda r: r["prompt"][0].update(content=7), "line 1: prompt message content must be a string, got int"),
])
def test_malformed_rows_name_file_and_line(tmp_path, mutate, message):
    row = _verl()
    mutate(row)
    _write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=f"bad.jsonl: {message}"):
        load_rows(tmp_path / "bad.jsonl")


def test_non_utf8_line_is_named(tmp_path):
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8"):
        read_records(p)


def test_overlong_prompts_fail_at_launch_or_are_dropped(tmp_path, caplog):
    from transformers import AutoTokenizer

    from megatron_rl.data.prompts import check_prompt_lengths, render_prompt_ids

    tok = AutoTokenizer.from_pretrained(ROOT / "examples/tiny/data/tokenizer")
    rows = [_verl(), _verl(), _verl()]
    rows[2]["prompt"][0]["content"] = "1+1=" * 40
    _write_jsonl(tmp_path / "p.jsonl", rows)
    loaded = load_rows(tmp_path / "p.jsonl")
    limit = len(render_prompt_ids(tok, loaded[0].messages))
    with pytest.raises(ValueError, match=r"1 of 3 prompts in data.train_files are longer than data.max_prompt_length "
                                         rf"\({limit}\): .*p.jsonl: line 3 \(\d+ tokens\)"):
        check_prompt_lengths(loaded, tok, limit, drop=False, what="data.train_files")
    with caplog.at_level("WARNING"):
        kept = check_prompt_lengths(loaded, tok, limit, drop=True, what="data.train_files")
    assert kept == loaded[:2]
    assert "dropped" in caplog.text
