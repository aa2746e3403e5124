"""Prompt rendering and training sequences that match the chat template exactly (case B22).

Rollout prompt ids come from the tokenizer's own chat template, tokenised inside the template
call (`apply_chat_template(..., tokenize=True)`), never by rendering text and tokenising it again
with special tokens added: that path gives two BOS tokens for templates that start with
`{{ bos_token }}` (SGLang PR 888, NeMo-RL issue 855). Multi-turn training sequences are the full
template rendering, with the loss mask found from rendered prefixes, never by rendering each
message separately (slime issue 2263: consecutive tool messages merge into one user turn).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _as_id_list(out: Any) -> list[int]:
    """Plain list of ints from apply_chat_template's return (list, BatchEncoding, dict, tensor)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"expected one sequence from apply_chat_template, got {len(out)}")
        out = list(out[0])
    return [int(t) for t in out]


def _strip_double_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        logger.warning("chat template rendering started with two BOS tokens; dropping one")
        ids = ids[1:]
    return ids


def render_ids(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool,
               tools: Sequence[dict] | None = None) -> list[int]:
    """`apply_chat_template(messages, tokenize=True)` as a plain list of ints, with one BOS at most.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: chat messages ({"role", "content", ...}).
        add_generation_prompt: append the assistant header.
        tools: OpenAI function schemas passed to the template as `tools=` (Qwen2.5's template lists
            them in the system turn); None: no tools.
    Raises:
        ValueError: the tokenizer has no chat template, or the template returned several sequences.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template")
    kw = {} if tools is None else {"tools": [dict(t) for t in tools]}
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True, **kw
    )
    return _strip_double_bos(tokenizer, _as_id_list(out))


def render_prompt_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of the rollout prompt: the chat template with the generation prompt (and `tools`,
    the function schemas of a multi-turn run's `hermes` tools, when given).

    Exactly `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` as a
    `list[int]` (transformers 5 returns a BatchEncoding; handled). No second BOS is ever added.
    """
    return render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Ids that end an assistant turn: the EOS plus known end-of-turn specials in the vocabulary."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
    return ids


def prompt_response_sequence(
    prompt_ids: Sequence[int], response_ids: Sequence[int]
) -> tuple[list[int], list[bool]]:
    """Training sequence of one rollout: prompt ids + response ids, and its loss mask.

    `response_ids` are the generated ids as returned by the server (its EOS / end-of-turn
    token included when it finished). loss_mask: True (trained) on every response token,
    False on the prompt. Returns (input_ids [S], loss_mask [S]) with S = len(prompt) + len(response).
    """
    ids = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
    return ids, [False] * len(prompt_ids) + [True] * len(response_ids)


def render_conversation_with_mask(
    tokenizer: Any, messages: Sequence[Message]
) -> tuple[list[int], list[bool]]:
    """Multi-turn training sequence and loss mask, equal to the template's own rendering.

    input_ids are exactly `apply_chat_template(messages, tokenize=True)`. For each assistant
    message i, its span is the tokens after the rendering of messages[:i] with the generation
    prompt, up to and including the first end-of-turn token (`end_of_turn_ids`); those get
    loss_mask True, everything else (system, user, tool turns, headers, the newline after the
    end-of-turn token) False.

    Raises:
        ValueError: the template is not prefix-stable at an assistant turn (a rendered prefix is
            not a prefix of the full rendering), so spans cannot be located safely.
    """
    full = render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [False] * len(full)
    eot = end_of_turn_ids(tokenizer)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = render_ids(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        through = render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(prefix)] != prefix:
            raise ValueError(f"chat template is not prefix-stable before message {i}")
        start = len(prefix)
        if full[: len(through)] != through:
            raise ValueError(f"chat template is not prefix-stable after message {i}")
        end = len(through)
        for j in range(start, len(through)):
            if through[j] in eot:
                end = j + 1
                break
        for j in range(start, end):
            mask[j] = True
    return full, mask


def check_prompt_lengths(rows: Sequence[Any], tokenizer: Any, max_prompt_length: int, *, drop: bool,
                         what: str) -> list[Any]:
    """Render every row's prompt once at launch and compare with `max_prompt_length` (tokens), so
    an over-long prompt fails the run before step 1 instead of when it is first drawn.

    Args:
        rows: `PromptRow`s (their `origin` names file and line).
        drop: drop over-long rows with a warning (verl's `filter_overlong_prompts`) instead of failing.
        what: "data.train_files" or "data.val_files", for the messages.

    Returns:
        The rows that fit.

    Raises:
        ValueError: some prompt is too long and `drop` is False (names up to 5 rows and the count).
    """
    too_long = []
    kept = []
    for row in rows:
        n = len(render_prompt_ids(tokenizer, row.messages))
        if n > max_prompt_length:
            too_long.append((row, n))
        else:
            kept.append(row)
    if too_long:
        listed = "; ".join(f"{r.origin or r.prompt_key} ({n} tokens)" for r, n in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        msg = (f"{len(too_long)} of {len(rows)} prompts in {what} are longer than data.max_prompt_length "
               f"({max_prompt_length}): {listed}{more}")
        if not drop:
            raise ValueError(msg + ". Raise data.max_prompt_length or set data.filter_overlong_prompts=true")
        logger.warning("%s; dropped (data.filter_overlong_prompts)", msg)
    return kept
