"""examples/tiny/tool_base_model: the tiny base model SFT'd to sometimes call the python tool
(tools/train_tiny_base.py --tool-fraction). Its greedy tool round, run with the real sandboxed tool by
`generate_with_tools`, is token for token the SFT's three-part tool solution; its recorded eval shows
what RL starts from (a minority of hard-level samples call the tool, and those are mostly right)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "tiny" / "tool_base_model"

pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="tool base model not built")


def _train_tool():
    spec = importlib.util.spec_from_file_location("train_tiny_base_tbm", ROOT / "tools" / "train_tiny_base.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_greedy_tool_round_matches_the_sft_tokens():
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.data.prompts import render_prompt_ids
    from megatron_rl.data.tiny_tokenizer import load_tiny_tokenizer
    from megatron_rl.tools.python_sandbox import PythonTool

    T = _train_tool()
    torch.set_num_threads(1)
    tok = load_tiny_tokenizer(MODEL)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "What is 7*2+8*7?"}])  # a held-out level-4 problem
    tool = PythonTool(pool_size=1)
    try:
        (r,) = T.generate_with_tools(model, tok, [prompt], {"python": tool}, do_sample=False)
    finally:
        tool.close()
    assert r["text"] == "```python\nprint(7*2+8*7)\n```\n```output\n70\n\n```\nAnswer: 70"
    assert r["calls"] == 1 and r["finished"] and r["tool_errors"] == 0
    ids, mask = T.tool_solution_ids(tok, "7*2+8*7")
    assert r["ids"] == ids and r["mask"] == mask  # what the rollout appends is what SFT trained on


def test_recorded_eval_calls_the_tool_sometimes_and_tool_samples_are_right_more():
    ev = json.loads((MODEL / "eval_base.json").read_text())
    assert ev["eval_mode"] == "tools" and ev["args"]["init_from"] == "examples/tiny/base_model"
    for lv in ("4", "5"):
        d = ev["eval"][lv]
        assert 0.2 <= d["tool_rate"] <= 0.4, (lv, d["tool_rate"])
        assert d["acc_tool"] >= 0.9 and d["acc_text"] <= 0.3, (lv, d)
    for lv in ("1", "2", "3"):
        assert ev["eval"][lv]["tool_rate"] == 0.0
