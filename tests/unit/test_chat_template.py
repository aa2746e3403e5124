"""Case B22: training tokens equal the chat-template rendering used for rollout; one BOS only."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.data.prompts import (
    end_of_turn_ids,
    prompt_response_sequence,
    render_conversation_with_mask,
    render_prompt_ids,
)
from shared_data import SHARED_DATA

QWEN_DIR = SHARED_DATA / "qwen2.5-tokenizer"
ROOT = Path(__file__).resolve().parents[2]

TOOL_CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2+2"}}}
TOOL_CALL_2 = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "3*3"}}}
MESSAGES = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What are 2+2 and 3*3?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL, TOOL_CALL_2]},
    {"role": "tool", "content": "4"},
    {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "They are 4 and 9.\nAnswer: 4, 9"},
]


@pytest.fixture(scope="module")
def qwen():
    if not QWEN_DIR.is_dir():
        pytest.skip(f"{QWEN_DIR} not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN_DIR))


def _plain(out):
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def test_qwen_prompt_ids_equal_template(qwen):
    msgs = MESSAGES[:2]
    ids = render_prompt_ids(qwen, msgs)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert ids == _plain(qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    assert qwen.decode(ids).endswith("<|im_start|>assistant\n")


def test_qwen_multi_turn_training_ids_and_mask(qwen):
    ids, mask = render_conversation_with_mask(qwen, MESSAGES)
    assert ids == _plain(qwen.apply_chat_template(MESSAGES, tokenize=True))
    text = qwen.decode(ids)
    # The two tool results are merged into ONE user turn by the real template (slime issue 2263).
    assert text.count("<|im_start|>user") == 2
    assert "</tool_response>\n<tool_response>" in text
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    assert im_end in end_of_turn_ids(qwen)
    spans, cur = [], None
    for i, m in enumerate(mask):
        if m and cur is None:
            cur = i
        if not m and cur is not None:
            spans.append((cur, i))
            cur = None
    assert cur is None
    assert len(spans) == 2
    first = qwen.decode(ids[spans[0][0]: spans[0][1]])
    second = qwen.decode(ids[spans[1][0]: spans[1][1]])
    assert first.startswith("<tool_call>\n") and first.count("<tool_call>") == 2
    assert first.endswith("</tool_call><|im_end|>")
    assert second == "They are 4 and 9.\nAnswer: 4, 9<|im_end|>"
    # The token before each span is the assistant header's newline; the one after is "\n".
    for s, e in spans:
        assert qwen.decode(ids[s - 3: s]) == "<|im_start|>assistant\n"
        assert ids[e - 1] == im_end
    assert qwen.decode(ids[spans[0][1]: spans[0][1] + 1]) == "\n"
    assert sum(mask) == (spans[0][1] - spans[0][0]) + (spans[1][1] - spans[1][0])


def test_prompt_plus_response_equals_template_render(qwen):
    msgs = MESSAGES[:2]
    response = "4 and 9\nAnswer: 4, 9"
    prompt_ids = render_prompt_ids(qwen, msgs)
    # What a server returns: the generated ids, ending with the end-of-turn token.
    response_ids = qwen.encode(response, add_special_tokens=False) + [qwen.convert_tokens_to_ids("<|im_end|>")]
    ids, mask = prompt_response_sequence(prompt_ids, response_ids)
    full = _plain(qwen.apply_chat_template(msgs + [{"role": "assistant", "content": response}], tokenize=True))
    assert ids == full[: len(ids)] and full[len(ids):] == qwen.encode("\n", add_special_tokens=False)
    assert mask == [False] * len(prompt_ids) + [True] * len(response_ids)
    ids2, mask2 = render_conversation_with_mask(qwen, msgs + [{"role": "assistant", "content": response}])
    assert ids2[: len(ids)] == ids and mask2[: len(ids)] == mask and mask2[len(ids):] == [False]


def test_prompt_response_sequence_by_hand():
    ids, mask = prompt_response_sequence([5, 6, 7], [8, 2])
    assert ids == [5, 6, 7, 8, 2]
    assert mask == [False, False, False, True, True]


# ------------------------------------------------------------------ BOS (SGLang PR 888, NeMo-RL 855)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llama_style():
    """A Llama-3-style tokenizer: BOS added by the post-processor AND by the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)


def test_llama3_style_template_gives_one_bos(llama_style):
    msgs = [{"role": "user", "content": "hi"}]
    # The bug: render to text, then tokenise with special tokens -> two BOS.
    text = llama_style.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert llama_style(text)["input_ids"][:2] == [0, 0]
    ids = render_prompt_ids(llama_style, msgs)
    assert ids[0] == 0 and ids.count(0) == 1
    assert llama_style.decode(ids) == text
    full, mask = render_conversation_with_mask(llama_style, msgs + [{"role": "assistant", "content": "ok"}])
    assert full.count(0) == 1
    assert llama_style.decode([t for t, m in zip(full, mask) if m]) == "ok<|eot_id|>"


def test_tiny_tokenizer_training_sequence():
    from megatron_rl.data.tiny_tokenizer import load_tiny_tokenizer

    tok = load_tiny_tokenizer(ROOT / "examples" / "tiny" / "data" / "tokenizer")
    msgs = [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "1+2=3\nAnswer: 3"}]
    ids, mask = render_conversation_with_mask(tok, msgs)
    prompt = render_prompt_ids(tok, msgs[:1])
    resp = tok.encode("1+2=3\nAnswer: 3", add_special_tokens=False) + [tok.eos_token_id]
    assert (ids[:-1], mask[:-1]) == prompt_response_sequence(prompt, resp)
    assert ids[-1] == 4 and mask[-1] is False  # the template's newline after <|im_end|>


def test_no_chat_template_raises():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab={"a": 0}, unk_token="a")))
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt_ids(tok, [{"role": "user", "content": "a"}])
