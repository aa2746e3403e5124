"""The tiny task's tokenizer: a byte-level BPE over printable ASCII with a few word merges.

Built with the `tokenizers` library and saved as standard Hugging Face files
(tokenizer.json, tokenizer_config.json, special_tokens_map.json) that load with
`transformers.AutoTokenizer.from_pretrained`. It is built exactly like `Qwen2Tokenizer`
(same NFC normaliser, split regex, ByteLevel pre-tokenizer and decoder, BPE without unk), so it
loads identically as `TokenizersBackend` from a tokenizer-only folder and as `Qwen2Tokenizer`
from a model folder: transformers 5 rebuilds the tokenizer class of a `model_type: qwen2`
folder from vocab and merges, whatever tokenizer_class says (found the hard way: a WordLevel
tokenizer silently turned into a different one next to the model's config.json).

Conventions follow Qwen2.5-Instruct: `<|im_end|>` ends an assistant turn and is the EOS;
`<|endoftext|>` is the padding token; there is no BOS. Characters outside printable ASCII,
newline and tab are not in the vocabulary and are dropped by the BPE (the task never uses them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
"""Ids 0..2 in this order."""
WORDS: tuple[str, ...] = ("Answer", "What", " is", "user", "assistant")
"""Words that become one token through BPE merges (their prefixes become tokens too)."""

# Qwen2's pre-tokenizer regex (transformers/models/qwen2/tokenization_qwen2.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML without a default system prompt (Qwen2.5's layout). A generated assistant turn ends
with `<|im_end|>` (the EOS); the newline after it belongs to the template, not the response."""


def _byte_char(c: str) -> str:
    """GPT-2 byte-level symbol of an ASCII character (space -> 'Ġ', newline -> 'Ċ', tab -> 'ĉ')."""
    return _bytes_to_unicode()[ord(c)]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable unicode map, indexed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _merges() -> list[tuple[str, str]]:
    out = []
    for w in WORDS:
        sym = [_byte_char(c) for c in w]
        for i in range(1, len(sym)):
            out.append(("".join(sym[:i]), sym[i]))
    return out


def tiny_vocab() -> dict[str, int]:
    """Token -> id: 3 specials, 97 characters (tab, newline, printable ASCII), word merges."""
    chars = [_byte_char(c) for c in ["\t", "\n"] + [chr(c) for c in range(32, 127)]]
    merged = []
    for a, b in _merges():
        if a + b not in merged:
            merged.append(a + b)
    tokens = [*SPECIAL_TOKENS, *chars, *merged]
    assert len(set(tokens)) == len(tokens)
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizers_object():
    """The `tokenizers.Tokenizer`, built exactly as transformers' `Qwen2Tokenizer` builds one."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=_merges(), dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    """The tokenizer_config.json content (chat template inline, loadable by transformers 4 and 5)."""
    vocab = tiny_vocab()
    return {
        "added_tokens_decoder": {
            str(vocab[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "add_prefix_space": False,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": 256,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def save_tiny_tokenizer(out_dir: str | Path) -> list[str]:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out_dir`.

    The files are written directly (not through `save_pretrained`) so that the chat template
    sits inside tokenizer_config.json and the files are byte-identical across transformers
    versions. Returns the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    build_tokenizers_object().save(str(paths[0]), pretty=True)
    paths[1].write_text(json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")
    special = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
    }
    paths[2].write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    return [str(p) for p in paths]


def load_tiny_tokenizer(path: str | Path):
    """`AutoTokenizer.from_pretrained(path)` for a directory written by `save_tiny_tokenizer`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
