"""The `"code"` tool format's texts (megatron_rl/tools/formats.py) against the parser and
`format_tool_response`, and the three-part tokenisation of a tool solution in tools/train_tiny_base.py
(the SFT data the tiny tool base model learns from)."""

import importlib.util
from pathlib import Path

import pytest

from megatron_rl.tools.base import ToolResult
from megatron_rl.tools.formats import CODE_STOP, code_call_text, code_response_text, code_result_text
from megatron_rl.tools.parsing import format_tool_response, parse_tool_calls

ROOT = Path(__file__).resolve().parents[2]


def _train_tool():
    spec = importlib.util.spec_from_file_location("train_tiny_base_fmt", ROOT / "tools" / "train_tiny_base.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_call_text_is_the_fenced_program_and_ends_with_the_stop():
    text = code_call_text("print(7*8+6*4-3)")
    assert text == "```python\nprint(7*8+6*4-3)\n```\n"
    assert text.endswith(CODE_STOP) and CODE_STOP == "\n```\n"
    calls = parse_tool_calls(text, fmt="code")
    assert len(calls) == 1 and calls[0].name == "python"
    assert calls[0].arguments == {"code": "print(7*8+6*4-3)\n"}


@pytest.mark.parametrize("result", [
    ToolResult(ok=True, output="77\n"),  # the python tool's output of print(77): stdout, newline kept
    ToolResult(ok=True, output="77"),
    ToolResult(ok=True, output=""),
    ToolResult(ok=False, error="NameError: name 'x' is not defined"),
    ToolResult(ok=False, output="1\n", error="timed out"),
])
def test_response_text_equals_format_tool_response(result):
    want = format_tool_response(result, fmt="code") + "\n"
    assert code_response_text(result.to_message()) == want
    assert code_result_text(result) == want


def test_response_text_of_print_output_keeps_the_newline():
    # to_message strips nothing: the block shows print's newline, then the fence
    assert code_result_text(ToolResult(ok=True, output="77\n")) == "```output\n77\n\n```\n"
    assert code_response_text("77") == "```output\n77\n```\n"


@pytest.fixture(scope="module")
def tokenizer():
    from megatron_rl.data.tiny_tokenizer import load_tiny_tokenizer

    return load_tiny_tokenizer(ROOT / "examples" / "tiny" / "base_model")


def test_tool_solution_three_parts(tokenizer):
    T = _train_tool()
    ids, mask = T.tool_solution_ids(tokenizer, "7*8+6*4-3")
    a = "```python\nprint(7*8+6*4-3)\n```\n"
    t = "```output\n77\n\n```\n"
    b = "Answer: 77"
    # hand-counted: the tiny tokenizer is one token a character except the merged word "Answer"
    assert len(tokenizer.encode(a, add_special_tokens=False)) == 31
    assert len(tokenizer.encode(t, add_special_tokens=False)) == 18
    assert len(tokenizer.encode(b, add_special_tokens=False)) == 5
    assert len(ids) == len(mask) == 31 + 18 + 5 + 1
    assert mask == [1] * 31 + [0] * 18 + [1] * 6
    assert ids[-1] == tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids[:31]) == a
    assert tokenizer.decode(ids[31:49]) == t
    assert tokenizer.decode(ids[49:]) == b + "<|im_end|>"
    assert tokenizer.decode(ids) == a + t + b + "<|im_end|>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m == 0]) == t


def test_tool_solution_collates_with_the_tool_part_masked(tokenizer):
    T = _train_tool()
    ids, mask = T.tool_solution_ids(tokenizer, "9*9+9*9-1")
    prompt = [1, 5, 6]
    inp, att, labels = T.collate([(prompt, ids, mask), ([1], [7, 2])], pad_id=0)
    row = labels[0].tolist()
    assert row[:3] == [-100] * 3
    assert [x for x in row[3:]] == [i if m else -100 for i, m in zip(ids, mask)]
    assert inp[0].tolist() == prompt + ids and att[0].tolist() == [1] * (3 + len(ids))
    assert labels[1].tolist()[:3] == [-100, 7, 2]
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m == 0]) == "```output\n161\n\n```\n"


def test_true_value_is_pythons():
    T = _train_tool()
    assert T.true_value("7*8+6*4-3") == 77 and T.true_value("2+3+4") == 9
    with pytest.raises(ValueError):
        T.true_value("__import__('os')")


def test_tool_fraction_mixes_tool_solutions_only_where_asked(tokenizer):
    import argparse

    T = _train_tool()
    args = argparse.Namespace(seed=0, counts='{"1": 20, "2": 0, "3": 0, "4": 200, "5": 0}',
                              noise='{"1": 0, "2": 0, "3": 0, "4": 0, "5": 0}', tool_fraction='{"4": 0.5}')
    ex = T.build_sft_examples(tokenizer, args, set())
    tool = [e for e in ex if 0 in e[2]]
    text = [e for e in ex if 0 not in e[2]]
    assert 60 <= len(tool) <= 140 and len(ex) == 220
    for p, r, m in tool:  # every tool example prints the prompt's expression and answers its true value
        expr = tokenizer.decode(p).split("What is ")[1].split("?")[0]
        assert tokenizer.decode(r) == (code_call_text(f"print({expr})") + code_response_text(f"{eval(expr)}\n")
                                       + f"Answer: {eval(expr)}<|im_end|>")
    assert all("```" not in tokenizer.decode(r) for _, r, _ in text)
    # a level without a tool fraction draws the same examples as before tool mode existed
    args0 = argparse.Namespace(seed=0, counts=args.counts, noise=args.noise, tool_fraction="")
    plain = T.build_sft_examples(tokenizer, args0, set())
    assert all(0 not in m for _, _, m in plain)
