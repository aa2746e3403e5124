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


def build_sft_examples(tokenizer, args, test_exprs: set[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids incl. EOS) for the SFT set; test problems are excluded."""
    rng = random.Random(args.seed)
    counts = json.loads(args.counts) if args.counts else DEFAULT_COUNTS
    noise = json.loads(args.noise) if args.noise else DEFAULT_NOISE
    counts = {int(k): int(v) for k, v in counts.items()}
    noise = {int(k): float(v) for k, v in noise.items()}
    out = []
    for level in tiny_task.LEVELS:
        n = 0
        while n < counts[level]:
            p = tiny_task.make_problem(level, rng)
            if p.expr in test_exprs:
                continue
            text = tiny_task.perturb_solution(p, rng) if rng.random() < noise[level] else p.solution
            prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}])
            resp = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            out.append((prompt, resp))
            n += 1
    rng.shuffle(out)
    return out


def collate(batch, pad_id: int):
    """Right-padded input_ids/attention_mask/labels [B, S]; labels -100 off the response."""
    seqs = [p + r for p, r in batch]
    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long)  # (B, S)
    att = torch.zeros((len(seqs), s), dtype=torch.long)
    labels = torch.full((len(seqs), s), -100, dtype=torch.long)
    for i, (p, r) in enumerate(batch):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        att[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(r)
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    save_tiny_tokenizer(out)
    tokenizer = load_tiny_tokenizer(out)
    _, test = tiny_task.build_splits(seed=args.task_seed)
    examples = build_sft_examples(tokenizer, args, {p.expr for p in test})
    logger.info("%d SFT examples", len(examples))

    cfg = model_config(128, tokenizer.eos_token_id, tokenizer.pad_token_id, args)
    model = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %d parameters", n_params)
    stats = train(model, examples, args, tokenizer.pad_token_id)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64,
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
    if not args.skip_eval:
        t0 = time.time()
        problems = test[: args.eval_limit] if args.eval_limit else test
        ev = evaluate(model, tokenizer, problems, n_samples=args.eval_samples, seed=args.seed)
        result["eval"] = ev
        result["eval_time_s"] = round(time.time() - t0, 1)
        print_table(ev, args.eval_samples)
    (out / "eval_base.json").write_text(json.dumps(result, indent=2) + "\n")
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
