"""Tests of the tiny arithmetic task, its tokenizer and the committed task files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_rl.data import tiny_task
from megatron_rl.data.dataset import load_rows
from megatron_rl.data.prompts import render_prompt_ids
from megatron_rl.data.tiny_tokenizer import (
    CHAT_TEMPLATE,
    load_tiny_tokenizer,
    save_tiny_tokenizer,
    tiny_vocab,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"


def test_worked_solution_by_hand():
    p = tiny_task.Problem(level=5, expr="3*7+9*3-12", steps=(), answer=36,
                          terms=((3, 7), (9, 3), (12,)), ops=("+", "-"))
    lines, acc = tiny_task._worked(list(p.terms), list(p.ops))
    assert lines == ["3*7=21", "9*3=27", "21+27=48", "48-12=36"]
    assert acc == 36
    # corrupting step 1 (9*3) by +2 propagates: 29, 50, 38
    lines, acc = tiny_task._worked(list(p.terms), list(p.ops), corrupt=(1, 2))
    assert lines == ["3*7=21", "9*3=29", "21+29=50", "50-12=38"]
    assert acc == 38


@pytest.mark.parametrize("level", tiny_task.LEVELS)
def test_problems_are_correct_and_short(level):
    rng = random.Random(level)
    tok = load_tiny_tokenizer(TINY / "data" / "tokenizer")
    for _ in range(200):
        p = tiny_task.make_problem(level, rng)
        assert p.level == level
        assert eval(p.expr) == p.answer >= 0  # the expression is plain Python arithmetic
        assert p.solution.splitlines()[-1] == f"Answer: {p.answer}"
        assert tiny_task.score_response(p.solution, str(p.answer)) == (True, True)
        assert len(tok.encode(p.solution, add_special_tokens=False)) + 1 <= 42  # incl. EOS
        wrong = tiny_task.perturb_solution(p, rng)
        fmt, ok = tiny_task.score_response(wrong, str(p.answer))
        assert fmt and not ok
        for line in wrong.splitlines()[:-1]:  # wrong solutions still chain their own values
            lhs, rhs = line.split("=")
            assert int(rhs) >= 0


def test_levels_have_the_documented_shapes():
    rng = random.Random(0)
    ops = {lv: {tiny_task.make_problem(lv, rng).expr.count("*") for _ in range(50)} for lv in tiny_task.LEVELS}
    assert ops == {1: {0}, 2: {0}, 3: {1}, 4: {2}, 5: {2}}
    assert len(tiny_task.make_problem(5, rng).steps) == 4
    with pytest.raises(ValueError, match="level"):
        tiny_task.make_problem(6, rng)


def test_score_response():
    assert tiny_task.score_response("1+1=2\nAnswer: 2", "2") == (True, True)
    assert tiny_task.score_response("Answer: 3\n1+1=2", "2") == (False, False)  # must be last
    assert tiny_task.score_response("Answer: 2\n1+1=2", "2") == (False, True)  # DAPO: last Answer line
    assert tiny_task.score_response("Answer: 02", "2") == (True, True)
    assert tiny_task.score_response("Answer: 5\nAnswer: 2\n", "2") == (True, True)
    assert tiny_task.score_response("", "2") == (False, False)
    assert tiny_task.score_response("Answer: two", "2") == (False, False)


def test_splits_are_fixed_disjoint_and_cover_all_levels():
    train, test = tiny_task.build_splits(seed=1234)
    train2, test2 = tiny_task.build_splits(seed=1234)
    assert [p.expr for p in train] == [p.expr for p in train2]
    assert [p.expr for p in test] == [p.expr for p in test2]
    assert not {p.expr for p in train} & {p.expr for p in test}
    assert len(train) == 940 and len(test) == 296 >= 256
    assert {p.level for p in test} == set(tiny_task.LEVELS)
    by_level = {lv: sum(p.level == lv for p in test) for lv in tiny_task.LEVELS}
    assert by_level == {1: 40, 2: 64, 3: 64, 4: 64, 5: 64}
    assert len({p.expr for p in train + test if p.level == 1}) == 80  # of the 81 possible
    assert len({p.expr for p in train}) == len(train)


def test_row_layout():
    p = tiny_task.make_problem(3, random.Random(1))
    row = tiny_task.problem_to_row(p, index=7, split="train")
    assert row == {
        "data_source": "tiny_arith",
        "prompt": [{"role": "user", "content": f"What is {p.expr}?"}],
        "ability": "arith",
        "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
        "extra_info": {"index": 7, "level": 3, "split": "train"},
    }


def test_committed_data_reproduces(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_task", ROOT / "tools" / "make_tiny_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_task(tmp_path, seed=1234)
    for name in ("train.jsonl", "test.jsonl", "tokenizer/tokenizer.json",
                 "tokenizer/tokenizer_config.json", "tokenizer/special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (TINY / "data" / name).read_bytes(), name
    jsonl = load_rows(TINY / "data" / "test.jsonl")
    parquet = load_rows(TINY / "data" / "test.parquet")
    assert jsonl == parquet
    assert jsonl[0].prompt_key == "test:0"


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_files_and_specials(tmp_path):
    written = save_tiny_tokenizer(tmp_path)
    assert sorted(Path(p).name for p in written) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    tok = load_tiny_tokenizer(tmp_path)
    assert len(tok) == len(tiny_vocab()) == 121 < 128
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.bos_token is None


def test_tokenizer_ids_by_hand(tmp_path):
    save_tiny_tokenizer(tmp_path)
    tok = load_tiny_tokenizer(tmp_path)
    # specials 0-2, tab 3, newline 4, chr(32..126) at 5..99, then merged words from 100.
    assert tok.encode("12+3", add_special_tokens=False) == [22, 23, 16, 24]
    assert tok.encode("Answer: 7", add_special_tokens=False) == [104, 31, 5, 28]
    assert tok.encode("\n", add_special_tokens=False) == [4]
    text = "What is 3*7+9*3-12?\n3*7=21\nAnswer: 36 (users: fine)"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_prompt_ids(tmp_path):
    save_tiny_tokenizer(tmp_path)
    tok = load_tiny_tokenizer(tmp_path)
    ids = render_prompt_ids(tok, [{"role": "user", "content": "What is 1+2?"}])
    # <|im_start|> user \n What ' is' ' ' 1 + 2 ? <|im_end|> \n <|im_start|> assistant \n
    assert ids == [1, 112, 4, 107, 109, 5, 22, 16, 23, 36, 2, 4, 1, 120, 4]
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_loads_the_same_next_to_a_qwen2_config(tmp_path):
    """transformers 5 rebuilds a qwen2 model folder's tokenizer as Qwen2Tokenizer from vocab and
    merges; the tiny tokenizer must survive that unchanged (a WordLevel one did not)."""
    from transformers import AutoTokenizer, Qwen2Config

    save_tiny_tokenizer(tmp_path / "tok")
    save_tiny_tokenizer(tmp_path / "model")
    Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path / "model")
    a = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    b = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    text = "What is 3*7+9*3-12?\n3*7=21\n\n21+27=48\nAnswer: 36 user assistant\t~"
    assert a.encode(text, add_special_tokens=False) == b.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "What is 1+2?"}]
    assert render_prompt_ids(a, msgs) == render_prompt_ids(b, msgs)
    assert (a.eos_token_id, a.pad_token_id) == (b.eos_token_id, b.pad_token_id) == (2, 0)


def test_base_model_folder_tokenizer_matches():
    from transformers import AutoTokenizer

    if not (TINY / "base_model" / "config.json").is_file():
        pytest.skip("base model not built")
    a = AutoTokenizer.from_pretrained(str(TINY / "base_model"))
    b = load_tiny_tokenizer(TINY / "data" / "tokenizer")
    assert a.get_vocab() == b.get_vocab()
    assert render_prompt_ids(a, [{"role": "user", "content": "What is 7*8+6*4?"}]) == render_prompt_ids(
        b, [{"role": "user", "content": "What is 7*8+6*4?"}])


# ---------------------------------------------------------------- tools/train_tiny_base.py


def _train_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny_base", ROOT / "tools" / "train_tiny_base.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sft_collate_masks_the_prompt():
    T = _train_tool()
    ids, att, labels = T.collate([([1, 5, 6], [7, 2]), ([1, 5], [8, 9, 2])], pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 2]]
    assert att.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, -100, 7, 2], [-100, -100, 8, 9, 2]]
    ids, att, labels = T.collate([([1], [7, 2]), ([1, 5, 6], [8, 9, 2])], pad_id=0)
    assert ids.tolist()[0] == [1, 7, 2, 0, 0, 0] and att.tolist()[0] == [1, 1, 1, 0, 0, 0]
    assert labels.tolist()[0] == [-100, 7, 2, -100, -100, -100]


def test_sft_and_eval_smoke(tmp_path):
    """A few SFT steps of a very small model, saved in HF format and evaluated (not tuned)."""
    T = _train_tool()
    out = tmp_path / "m"
    rc = T.main(["--out", str(out), "--hidden", "32", "--layers", "1", "--batch-size", "8",
                 "--counts", '{"1": 8, "2": 8, "3": 8, "4": 8, "5": 8}', "--eval-samples", "2",
                 "--eval-limit", "10", "--threads", "1"])
    assert rc == 0
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "eval_base.json"):
        assert (out / name).is_file(), name
    ev = json.loads((out / "eval_base.json").read_text())
    assert ev["sft"]["steps"] == 5 and ev["eval"]["all"]["n"] == 10
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] * 2 == cfg["num_attention_heads"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == 2


def test_sft_is_deterministic(tmp_path):
    T = _train_tool()
    args = ["--hidden", "32", "--layers", "1", "--batch-size", "8", "--skip-eval", "--threads", "2",
            "--counts", '{"1": 8, "2": 8, "3": 8, "4": 8, "5": 8}']
    assert T.main(["--out", str(tmp_path / "a"), *args]) == 0
    assert T.main(["--out", str(tmp_path / "b"), *args]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
