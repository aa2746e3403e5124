"""Trains the tiny arithmetic base model (a small Qwen2) by SFT on worked solutions, then evaluates it.

The base model is deliberately imperfect so that RL has something to do: easy levels are
near-solved, hard levels are rarely right when sampled at temperature 1.0 but often right in
16 tries. This comes from (1) the task itself (more steps, two-digit additions) and (2) label
noise: a level-dependent fraction of the SFT solutions carry one wrong, consistently propagated
step (`tiny_task.perturb_solution`), so the model keeps the format but is unsure of the answer.

Deterministic for a given seed and thread count (fp32, CPU). Writes to --out:
model.safetensors, config.json, generation_config.json, the tokenizer files, eval_base.json.

    python tools/train_tiny_base.py --out examples/tiny/base_model
    python tools/train_tiny_base.py --arch qwen3_moe --out examples/tiny/moe_base_model

``--arch qwen3_moe`` makes the Mixture-of-Experts miniature (issue 29): Qwen3-MoE attention (q/k
norms, no bias), every layer an MoE block of ``--experts`` SwiGLU experts of width ``--moe-ffn``,
top-``--topk`` routing with renormalised gates (``norm_topk_prob``), no shared expert, untied head
(as Qwen3-30B-A3B). The router's load-balancing loss (``router_aux_loss_coef``) keeps the experts
in use during SFT.

Tool mode (issue 31): ``--tool-fraction '{"4": 0.35, "5": 0.35}'`` makes that share of a level's SFT
examples python-tool solutions in the ``"code"`` format (``megatron_rl/tools/formats.py``): the
program ``print(<expression>)``, the tool's ``output`` block (loss-masked: the environment writes it)
and ``Answer: N`` with the true value, tokenised as three separate parts like the multi-turn rollout
(``tool_response_ids``). ``--init-from examples/tiny/base_model`` continues a model instead of starting
fresh (use a lower ``--lr``). With a tool fraction the evaluation runs real tool calls through the
sandboxed ``python`` tool (``generate_with_tools``, ``evaluate_tools``) and reports the tool-call rate
and the accuracy of tool and text samples; ``--eval-only --init-from DIR`` evaluates a saved model.
See docs/MULTITURN.md "The tiny tool base model".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.data import tiny_task  # noqa: E402
from megatron_rl.data.prompts import render_prompt_ids  # noqa: E402
from megatron_rl.data.tiny_tokenizer import load_tiny_tokenizer, save_tiny_tokenizer  # noqa: E402
from megatron_rl.tools import formats  # noqa: E402
from megatron_rl.tools.parsing import parse_tool_calls, run_tool_calls  # noqa: E402

logger = logging.getLogger("train_tiny_base")

# SFT examples a level and the fraction of them with a wrong (perturbed) solution.
DEFAULT_COUNTS = {1: 4000, 2: 8000, 3: 8000, 4: 10000, 5: 10000}
DEFAULT_NOISE = {1: 0.1, 2: 0.3, 3: 0.45, 4: 0.6, 5: 0.7}


def model_config(vocab_size: int, eos_id: int, pad_id: int, args: argparse.Namespace):
    """The tiny Qwen2 config (GQA, qkv bias, tied embeddings), or with ``--arch qwen3_moe`` the tiny
    Qwen3-MoE one (see the module docstring)."""
    from transformers import Qwen2Config

    if args.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
            moe_intermediate_size=args.moe_ffn, num_experts=args.experts, num_experts_per_tok=args.topk,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
            router_aux_loss_coef=0.01, num_hidden_layers=args.layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=256, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, attention_dropout=0.0,
            attention_bias=False, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        )

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def true_value(expr: str) -> int:
    """The value of a tiny-task expression (digits, +, -, *), computed by Python, not read from a
    (possibly perturbed) worked solution. Raises ValueError for any other character."""
    if not expr or set(expr) - set("0123456789+-*"):
        raise ValueError(f"not a tiny-task expression: {expr!r}")
    return int(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - digits and + - * only (checked above)


def tool_response_ids(tokenizer, code: str, tool_message: str, final_text: str) -> tuple[list[int], list[int]]:
    """The token ids and loss mask of a one-call tool response, built from three separately encoded
    parts exactly as the multi-turn rollout builds it (never the joined text re-tokenised):

    - A (model): `formats.code_call_text(code)`, ending with `formats.CODE_STOP`;
    - T (tool):  `formats.code_response_text(tool_message)`, the environment's `output` block;
    - B (model): `final_text` then EOS.

    Returns (ids, mask), both of length len(A) + len(T) + len(B) + 1; mask is 1 on A, B and the EOS
    (trained) and 0 exactly on T's tokens (labels -100 in `collate`)."""
    a = tokenizer.encode(formats.code_call_text(code), add_special_tokens=False)
    t = tokenizer.encode(formats.code_response_text(tool_message), add_special_tokens=False)
    b = tokenizer.encode(final_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return a + t + b, [1] * len(a) + [0] * len(t) + [1] * len(b)


def tool_solution_ids(tokenizer, expr: str) -> tuple[list[int], list[int]]:
    """`tool_response_ids` of the tool solution of `expr`: the program `print(<expr>)`, the tool's
    message as the python tool returns it (print's stdout, its newline included), then `Answer: N`
    with N the true value."""
    value = true_value(expr)
    return tool_response_ids(tokenizer, f"print({expr})", f"{value}\n", f"Answer: {value}")


def _level_map(text: str) -> dict[int, float]:
    """JSON {level: number} -> {level: float} over all levels; missing levels (or empty text) get 0."""
    got = {int(k): float(v) for k, v in json.loads(text).items()} if text else {}
    return {lv: got.get(lv, 0.0) for lv in tiny_task.LEVELS}


def build_sft_examples(tokenizer, args, test_exprs: set[str]) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids incl. EOS, response loss mask) for the SFT set; test problems are excluded.

    A `--tool-fraction` share of a level's examples are tool solutions (`tool_solution_ids`, mask 0
    on the tool's output block); the others are worked text solutions, a `--noise` share of them
    perturbed. A level without a tool fraction draws exactly the examples (and random numbers) it
    drew before tool mode existed."""
    rng = random.Random(args.seed)
    counts = json.loads(args.counts) if args.counts else DEFAULT_COUNTS
    noise = json.loads(args.noise) if args.noise else DEFAULT_NOISE
    counts = {int(k): int(v) for k, v in counts.items()}
    noise = {int(k): float(v) for k, v in noise.items()}
    tool = _level_map(getattr(args, "tool_fraction", ""))
    out = []
    for level in tiny_task.LEVELS:
        n = 0
        while n < counts[level]:
            p = tiny_task.make_problem(level, rng)
            if p.expr in test_exprs:
                continue
            prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}])
            if tool[level] > 0 and rng.random() < tool[level]:
                resp, mask = tool_solution_ids(tokenizer, p.expr)
            else:
                text = tiny_task.perturb_solution(p, rng) if rng.random() < noise[level] else p.solution
                resp = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                mask = [1] * len(resp)
            out.append((prompt, resp, mask))
            n += 1
    rng.shuffle(out)
    return out


def collate(batch, pad_id: int):
    """Right-padded input_ids/attention_mask/labels [B, S]; labels -100 off the response.

    Items are (prompt ids, response ids) or (prompt ids, response ids, response mask); labels are
    also -100 where the mask is 0 (a tool's output)."""
    s = max(len(it[0]) + len(it[1]) for it in batch)
    ids = torch.full((len(batch), s), pad_id, dtype=torch.long)  # (B, S)
    att = torch.zeros((len(batch), s), dtype=torch.long)
    labels = torch.full((len(batch), s), -100, dtype=torch.long)
    for i, it in enumerate(batch):
        p, r = it[0], it[1]
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        att[i, :n] = 1
        lab = torch.tensor(r)
        if len(it) > 2:
            lab = lab.masked_fill(torch.tensor(it[2]) == 0, -100)
        labels[i, len(p) : n] = lab
    return ids, att, labels


def train(model, examples, args, pad_id: int) -> dict:
    """AdamW with linear warmup and cosine decay over `args.epochs` passes; returns stats."""
    g = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = len(examples) // args.batch_size
    total = steps_per_epoch * args.epochs
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, int(0.05 * total))

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    step = 0
    t0 = time.time()
    losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(examples), generator=g).tolist()
        for b in range(steps_per_epoch):
            batch = [examples[i] for i in order[b * args.batch_size : (b + 1) * args.batch_size]]
            ids, att, labels = collate(batch, pad_id)
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step % 50 == 0 or step == total:
                logger.info(
                    "step %d/%d epoch %d loss %.4f (%.1f s)",
                    step, total, epoch, sum(losses[-50:]) / len(losses[-50:]), time.time() - t0,
                )
    return {"steps": total, "train_time_s": round(time.time() - t0, 1), "final_loss": losses[-1]}


@torch.no_grad()
def evaluate(model, tokenizer, problems, *, n_samples: int, seed: int, max_new_tokens: int = 64,
             chunk: int = 32) -> dict:
    """Greedy accuracy, sampled pass@1 (mean over n_samples), pass@n and format rates by level.

    Args:
        problems: `tiny_task.Problem`s; prompts rendered with the chat template.
        n_samples: samples a problem (temperature 1.0, top_p 1.0, top_k off).
        seed: torch seed for sampling.
        max_new_tokens: response cap (tokens, EOS included).
        chunk: problems a `generate` call (batched, left padding).
    Returns:
        {level: {"greedy", "greedy_format", "pass1", "passn", "format", "truncated",
        "resp_tokens", "n"}} plus "all" (weighted by n). Rates are fractions in [0, 1];
        resp_tokens is the mean sampled response length in tokens (EOS included).
    """
    model.eval()
    torch.manual_seed(seed)
    per = {lv: {"n": 0, "greedy": 0.0, "greedy_format": 0.0, "pass1": 0.0, "passn": 0.0,
                "format": 0.0, "truncated": 0.0, "resp_tokens": 0.0} for lv in tiny_task.LEVELS}
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def gen(batch_prompts, **kw):
        s = max(len(p) for p in batch_prompts)
        ids = torch.tensor([[pad] * (s - len(p)) + p for p in batch_prompts])  # (B, S) left-padded
        att = (torch.arange(s)[None, :] >= torch.tensor([s - len(p) for p in batch_prompts])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **kw)
        res = []
        for row in out[:, s:].tolist():
            finished = eos in row
            row = row[: row.index(eos)] if finished else row
            res.append((tokenizer.decode(row), finished, len(row) + int(finished)))
        return res

    for c in range(0, len(problems), chunk):
        probs = problems[c : c + chunk]
        prompts = [render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in probs]
        greedy = gen(prompts, do_sample=False)
        sampled = gen(prompts, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                      num_return_sequences=n_samples)
        for i, p in enumerate(probs):
            d = per[p.level]
            d["n"] += 1
            fmt, ok = tiny_task.score_response(greedy[i][0], str(p.answer))
            d["greedy"] += ok
            d["greedy_format"] += fmt
            oks = []
            for text, finished, ntok in sampled[i * n_samples : (i + 1) * n_samples]:
                fmt, ok = tiny_task.score_response(text, str(p.answer))
                oks.append(ok)
                d["format"] += fmt / n_samples
                d["truncated"] += (not finished) / n_samples
                d["resp_tokens"] += ntok / n_samples
            d["pass1"] += sum(oks) / n_samples
            d["passn"] += any(oks)
    out = {}
    for lv, d in per.items():
        n = d.pop("n")
        if n:
            out[str(lv)] = {k: round(v / n, 4) for k, v in d.items()} | {"n": n}
    keys = ["greedy", "greedy_format", "pass1", "passn", "format", "truncated", "resp_tokens"]
    tot = sum(d["n"] for d in out.values())
    out["all"] = {k: round(sum(d[k] * d["n"] for d in out.values()) / tot, 4) for k in keys} | {"n": tot}
    return out


def print_table(ev: dict, n_samples: int) -> None:
    print(f"{'level':>5} {'n':>4} {'greedy':>7} {'pass@1':>7} {f'pass@{n_samples}':>8} {'format':>7} "
          f"{'trunc':>6} {'tokens':>6}")
    for k, d in ev.items():
        print(f"{k:>5} {d['n']:>4} {d['greedy']:>7.3f} {d['pass1']:>7.3f} {d['passn']:>8.3f} "
              f"{d['format']:>7.3f} {d['truncated']:>6.3f} {d['resp_tokens']:>6.1f}")


def _cut_at_stop(tokenizer, row: list[int], stop: str) -> int | None:
    """Number of tokens of `row` up to and including the first point where its text contains `stop`
    (None when it never does)."""
    if stop not in tokenizer.decode(row):
        return None
    for k in range(1, len(row) + 1):
        if stop in tokenizer.decode(row[:k]):
            return k
    return None  # unreachable: the full row contains stop


@torch.no_grad()
def generate_with_tools(model, tokenizer, prompts: list[list[int]], tools: dict, *, do_sample: bool,
                        max_response_tokens: int = 96, max_calls: int = 2) -> list[dict]:
    """Generates one response a prompt, running its `"code"`-format tool calls for real.

    Each round generates (batched, left padding) until EOS, `formats.CODE_STOP` or the response
    budget; a round that stops on CODE_STOP is parsed with `parse_tool_calls(fmt="code")`, its call
    run with `tools` (e.g. {"python": PythonTool()}), and the tool part
    `formats.code_result_text(result)` is encoded on its own and appended (as the multi-turn rollout
    does); then the next round continues. At most `max_calls` calls are run a sample: a further call,
    or a round that stops on CODE_STOP without a parsable call, ends the sample unfinished.

    Args:
        prompts: prompt token ids (chat template applied), one a sample.
        do_sample: temperature 1.0, top_p 1.0, top_k off when True; greedy otherwise (the caller seeds torch).
        max_response_tokens: budget of the whole response in tokens (model and tool tokens, EOS included).
    Returns:
        A dict a prompt: "ids" (response token ids, EOS included when finished), "mask" (1 on the
        model's tokens, 0 on the tool's), "text" (decoded, EOS dropped), "calls" (tool calls run),
        "finished" (ended with EOS), "tool_errors" (calls that returned ok=False).
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    states = [{"prompt": p, "ids": [], "mask": [], "calls": 0, "finished": False, "done": False,
               "tool_errors": 0} for p in prompts]
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
    while True:
        active = [st for st in states if not st["done"]]
        if not active:
            break
        seqs = [st["prompt"] + st["ids"] for st in active]
        s = max(len(x) for x in seqs)
        ids = torch.tensor([[pad] * (s - len(x)) + x for x in seqs])  # (B, S) left-padded
        att = (torch.arange(s)[None, :] >= torch.tensor([s - len(x) for x in seqs])[:, None]).long()
        budget = max(max_response_tokens - len(st["ids"]) for st in active)
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=budget, eos_token_id=eos,
                             pad_token_id=pad, stop_strings=[formats.CODE_STOP], tokenizer=tokenizer, **kw)
        pending = []  # (state, call)
        for st, row in zip(active, out[:, s:].tolist()):
            row = row[: max_response_tokens - len(st["ids"])]
            k_eos = row.index(eos) + 1 if eos in row else None
            k_stop = _cut_at_stop(tokenizer, row[: (k_eos or len(row))], formats.CODE_STOP)
            if k_stop is not None:
                row = row[:k_stop]
            elif k_eos is not None:
                row = row[:k_eos]
                st["finished"] = True
            st["ids"] += row
            st["mask"] += [1] * len(row)
            st["done"] = True  # unless a call continues it below
            if k_stop is None:
                continue
            calls = parse_tool_calls(tokenizer.decode(row), fmt="code")
            if calls and st["calls"] < max_calls and len(st["ids"]) < max_response_tokens:
                pending.append((st, calls[0]))
        results = run_tool_calls([c for _, c in pending], tools, max_workers=4)
        for (st, _), res in zip(pending, results):
            part = tokenizer.encode(formats.code_result_text(res), add_special_tokens=False)
            part = part[: max_response_tokens - len(st["ids"])]
            st["ids"] += part
            st["mask"] += [0] * len(part)
            st["calls"] += 1
            st["tool_errors"] += int(not res.ok)
            st["done"] = len(st["ids"]) >= max_response_tokens
    for st in states:
        body = st["ids"][:-1] if st["finished"] else st["ids"]
        st["text"] = tokenizer.decode(body)
        for key in ("prompt", "done"):
            st.pop(key)
    return states


@torch.no_grad()
def evaluate_tools(model, tokenizer, problems, *, n_samples: int, seed: int, max_response_tokens: int = 96,
                   max_calls: int = 2, chunk: int = 32) -> dict:
    """`evaluate`'s numbers with real tool calls (`generate_with_tools`, the sandboxed `python` tool),
    plus how the tool is used, by level.

    Returns {level: {...}} plus "all" (weighted by problems; the tool/text accuracies by samples):
    "greedy", "greedy_tool" (greedy response called the tool), "pass1", "passn", "format",
    "truncated", "resp_tokens" (mean sampled response length in tokens, tool tokens and EOS
    included), "model_tokens" (the model's tokens only), "tool_rate" (fraction of samples with a
    call), "calls" (mean calls a sample), "tool_errors" (calls that failed, a sample), "acc_tool" /
    "acc_text" (accuracy of the samples with / without a call; null when there are none),
    "n_tool" / "n_text" (their sample counts), "n" (problems).
    """
    from megatron_rl.tools.python_sandbox import PythonTool

    model.eval()
    torch.manual_seed(seed)
    keys = ["greedy", "greedy_tool", "pass1", "passn", "format", "truncated", "resp_tokens", "model_tokens",
            "tool_rate", "calls", "tool_errors"]
    per = {lv: dict.fromkeys(keys, 0.0) | {"n": 0, "ok_tool": 0, "ok_text": 0, "n_tool": 0, "n_text": 0}
           for lv in tiny_task.LEVELS}
    tool = PythonTool(pool_size=2, max_concurrency=4)
    try:
        for c in range(0, len(problems), chunk):
            probs = problems[c : c + chunk]
            prompts = [render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in probs]
            gen = dict(tools={"python": tool}, max_response_tokens=max_response_tokens, max_calls=max_calls)
            greedy = generate_with_tools(model, tokenizer, prompts, do_sample=False, **gen)
            sampled = generate_with_tools(model, tokenizer, [q for q in prompts for _ in range(n_samples)],
                                          do_sample=True, **gen)
            for i, p in enumerate(probs):
                d = per[p.level]
                d["n"] += 1
                d["greedy"] += tiny_task.score_response(greedy[i]["text"], str(p.answer))[1]
                d["greedy_tool"] += greedy[i]["calls"] > 0
                oks = []
                for r in sampled[i * n_samples : (i + 1) * n_samples]:
                    fmt, ok = tiny_task.score_response(r["text"], str(p.answer))
                    oks.append(ok)
                    used = r["calls"] > 0
                    d["ok_tool" if used else "ok_text"] += ok
                    d["n_tool" if used else "n_text"] += 1
                    for key, v in (("format", fmt), ("truncated", not r["finished"]), ("resp_tokens", len(r["ids"])),
                                   ("model_tokens", sum(r["mask"])), ("tool_rate", used), ("calls", r["calls"]),
                                   ("tool_errors", r["tool_errors"])):
                        d[key] += v / n_samples
                d["pass1"] += sum(oks) / n_samples
                d["passn"] += any(oks)
    finally:
        tool.close()
    out = {}
    for lv, d in per.items():
        n = d["n"]
        if n:
            out[str(lv)] = {k: round(d[k] / n, 4) for k in keys} | _tool_text_acc(d) | {"n": n}
    tot = sum(d["n"] for d in out.values())
    agg = {k: round(sum(d[k] * d["n"] for d in out.values()) / tot, 4) for k in keys}
    sums = {k: sum(per[lv][k] for lv in per) for k in ("ok_tool", "ok_text", "n_tool", "n_text")}
    out["all"] = agg | _tool_text_acc(sums) | {"n": tot}
    return out


def _tool_text_acc(d: dict) -> dict:
    """acc_tool / acc_text (None without samples) and n_tool / n_text from summed counts."""
    return {"acc_tool": round(d["ok_tool"] / d["n_tool"], 4) if d["n_tool"] else None,
            "acc_text": round(d["ok_text"] / d["n_text"], 4) if d["n_text"] else None,
            "n_tool": d["n_tool"], "n_text": d["n_text"]}


def print_tool_table(ev: dict, n_samples: int) -> None:
    """Prints `evaluate_tools`' result as a table, a row a level."""
    print(f"{'level':>5} {'n':>4} {'greedy':>7} {'g_tool':>6} {'pass@1':>7} {f'pass@{n_samples}':>8} {'tool%':>6} "
          f"{'acc_tool':>8} {'acc_text':>8} {'format':>7} {'trunc':>6} {'tokens':>6}")
    fmt = lambda v: f"{v:>8.3f}" if v is not None else f"{'-':>8}"  # noqa: E731
    for k, d in ev.items():
        print(f"{k:>5} {d['n']:>4} {d['greedy']:>7.3f} {d['greedy_tool']:>6.3f} {d['pass1']:>7.3f} "
              f"{d['passn']:>8.3f} {d['tool_rate']:>6.3f} {fmt(d['acc_tool'])} {fmt(d['acc_text'])} "
              f"{d['format']:>7.3f} {d['truncated']:>6.3f} {d['resp_tokens']:>6.1f}")


def run_eval(model, tokenizer, problems, args, use_tools: bool) -> tuple[dict, float]:
    """Runs `evaluate_tools` (use_tools) or `evaluate` on `problems`, prints the table; returns
    (the result, its wall time in seconds)."""
    t0 = time.time()
    if use_tools:
        ev = evaluate_tools(model, tokenizer, problems, n_samples=args.eval_samples, seed=args.seed,
                            max_response_tokens=args.max_response_tokens)
        print_tool_table(ev, args.eval_samples)
    else:
        ev = evaluate(model, tokenizer, problems, n_samples=args.eval_samples, seed=args.seed)
        print_table(ev, args.eval_samples)
    return ev, round(time.time() - t0, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="examples/tiny/base_model")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3_moe"])
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts a layer")
    ap.add_argument("--topk", type=int, default=2, help="qwen3_moe: experts a token")
    ap.add_argument("--moe-ffn", type=int, default=128, help="qwen3_moe: one expert's FFN width")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=1234, help="seed of tiny_task.build_splits")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--counts", default="", help='JSON {level: n examples}')
    ap.add_argument("--noise", default="", help='JSON {level: wrong-solution fraction}')
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--eval-limit", type=int, default=0, help="evaluate the first N test problems (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--tool-fraction", default="",
                    help='JSON {level: fraction of the SFT examples that are python-tool solutions}')
    ap.add_argument("--init-from", default="", help="model folder to continue SFT from (else a fresh model)")
    ap.add_argument("--eval-tools", default="auto", choices=["auto", "on", "off"],
                    help="evaluate with real tool calls (auto: when --tool-fraction is given)")
    ap.add_argument("--max-response-tokens", type=int, default=96,
                    help="tool-mode eval: response budget in tokens (model and tool tokens)")
    ap.add_argument("--eval-only", action="store_true",
                    help="evaluate the --init-from model and print the table; no training, nothing written")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    use_tools = args.eval_tools == "on" or (args.eval_tools == "auto" and bool(args.tool_fraction))
    _, test = tiny_task.build_splits(seed=args.task_seed)
    problems = test[: args.eval_limit] if args.eval_limit else test
    if args.eval_only:
        if not args.init_from:
            ap.error("--eval-only needs --init-from")
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        run_eval(model, load_tiny_tokenizer(args.init_from), problems, args, use_tools)
        return 0
    out = Path(args.out)
    save_tiny_tokenizer(out)
    tokenizer = load_tiny_tokenizer(out)
    examples = build_sft_examples(tokenizer, args, {p.expr for p in test})
    logger.info("%d SFT examples", len(examples))

    if args.init_from:
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if model.config.vocab_size != 128 or model.config.eos_token_id != tokenizer.eos_token_id:
            raise ValueError(f"--init-from {args.init_from}: not a tiny-task model (vocab_size "
                             f"{model.config.vocab_size}, eos {model.config.eos_token_id})")
    else:
        cfg = model_config(128, tokenizer.eos_token_id, tokenizer.pad_token_id, args)
        model = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters", n_params)
    stats = train(model, examples, args, tokenizer.pad_token_id)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=args.max_response_tokens if use_tools else 64,
    )
    if args.arch == "qwen3_moe":
        model.config.output_router_logits = False  # the aux loss was for SFT; RL sets its own (trainer.moe_*)
        model.config.router_aux_loss_coef = 0.0
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the file is committed
    save_tiny_tokenizer(out)  # save_pretrained must not leave a different tokenizer behind
    import transformers

    result = {
        "n_params": n_params,
        "sft": stats,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "eval_note": "pass@1 = mean correctness of the samples (temperature 1.0, top_p 1.0, "
                     "top_k off) = expected avg@k; pass@n = any of the n samples correct; "
                     "format = last line is 'Answer: N'; greedy = greedy decoding accuracy",
    }
    if use_tools:
        result["eval_note"] += (
            f"; eval_mode tools: responses generated with real python-tool calls (format 'code', "
            f"at most 2 calls, {args.max_response_tokens} response tokens incl. the tool's); tool_rate = "
            "fraction of samples that called the tool; acc_tool / acc_text = accuracy of the samples "
            "with / without a call; greedy_tool = the greedy response called it")
    if not args.skip_eval:
        ev, secs = run_eval(model, tokenizer, problems, args, use_tools)
        result |= {"eval_mode": "tools" if use_tools else "text", "eval": ev, "eval_time_s": secs}
    (out / "eval_base.json").write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
