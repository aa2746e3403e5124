"""The RL layer's overhead: the trainer's update of one step's batch against plain megatron-core.

For the same model (same DDP wrapper and optimizer) and the same tokens, one RL step's update is
timed against a plain forward/backward + optimizer step:

- RL update (what `run_training` does in step 6): `PolicyTrainer.compute_logprobs` (the old
  log-prob recompute, forward only) then `PolicyTrainer.update` (per mini-batch: forward,
  vocab-parallel log-probs and entropy, the clipped policy loss with its global normaliser,
  backward through megatron-core's schedule, optimizer step, metric reductions).
- Plain: per mini-batch, megatron-core's schedule over the same micro-batches with GPTModel's
  own per-token cross-entropy (`labels=`, masked sum / token count), then the optimizer step.

- RL with `actor.old_logprob_source: rollout` (ALGORITHMS.md 8): `PolicyTrainer.update` alone, the
  old log-probs taken from the engine instead of recomputed (here the trainer's own numbers, as an
  engine with matching numerics would send them).

The ratio RL / plain is the price of the RL layer; a bare lower bound is ~1.33 (one extra
forward pass for the recompute on top of a forward + backward). `update / plain` isolates the
loss layer (no recompute). TP=2 runs as two gloo processes (one thread each, like TP=1's one
process), rank 0 reports. Each configuration runs `--warmup` untimed repetitions, then RL and
plain alternate `--repeats` times. The table reports the fastest repetition of each (the least
disturbed by other jobs on a shared machine; the recompute and update columns are those of the
fastest RL repetition); the JSON also keeps every repetition and the medians. The last column is
the CPU time of rank 0's process (medians), which other jobs on the machine disturb far less than
wall time (it leaves out time spent waiting in TP collectives).

Batches: prompts of 16-32 tokens and responses of 8-64 tokens, random token ids (seed 0). Models:
`tiny` = the tiny DA3PO recipe's base model (examples/tiny/base_model, 1M parameters, its
weights) on that recipe's step (16 prompts x 8 responses = 128 sequences, mini-batches of 64 =
`ppo_mini_batch_size` 8 x `rollout.n` 8, micro-batches of 64); `small` = a random Qwen2 (hidden
256, 4 layers, FFN 1024, 8/4 heads, vocabulary 4096, untied; megatron-core's initialisation,
6M parameters) on 32 sequences in 2 mini-batches of 16 (micro-batches of 16), where the matmuls
rather than Python dominate.

    .venv/bin/python benchmarks/rl_overhead.py                       # tiny and small, TP=1 and TP=2 (~7 min)
    .venv/bin/python benchmarks/rl_overhead.py --models tiny --tp 1  # one configuration

Writes `benchmarks/results/rl_overhead.json` (or `--out`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_MODEL = REPO / "examples" / "tiny" / "base_model"
SMALL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "use_sliding_window": False, "attention_dropout": 0.0,
}
PRESETS = {"tiny": {"sequences": 128, "mini_batch_sequences": 64, "micro_batch_size": 64},
           "small": {"sequences": 32, "mini_batch_sequences": 16, "micro_batch_size": 16}}
"""Batch shape per model (sequences, sequences per optimizer step, sequences per micro-batch)."""


def _batch(vocab: int, n: int, seed: int = 0):
    """n (prompt, response) pairs of random ids: prompts 16-32 tokens, responses 8-64."""
    import torch

    from megatron_rl.trainer.batch import build_train_batch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(16, 33, (n,), generator=g).tolist()
    rlen = torch.randint(8, 65, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p in plen]
    responses = [torch.randint(1, vocab, (r,), generator=g).tolist() for r in rlen]
    adv = (torch.randn(n, generator=g)).tolist()
    return build_train_batch(prompts, responses, advantages=adv, rollout_logprobs=[[-1.0] * r for r in rlen],
                             trained=[True] * n, pad_id=0)


def worker() -> None:
    """One rank: build the model at TP = WORLD_SIZE, time RL and plain updates, rank 0 prints JSON."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.config.schema import ActorConfig
    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_model_spec, build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.policy import PolicyTrainer

    args = json.loads(os.environ["BENCH_ARGS"])
    tp = int(os.environ["WORLD_SIZE"])
    g = initialize_parallel(tensor_model_parallel_size=tp, backend="gloo", timeout_s=600, seed=1234)
    assert g.tp_size == tp and dist.get_world_size(g.tp) == tp, g
    if args["model"] == "tiny":
        hf_config = json.loads((TINY_MODEL / "config.json").read_text())
    else:
        hf_config = dict(SMALL_CONFIG)
    tf_config = build_transformer_config(hf_config, tensor_model_parallel_size=tp)
    model = build_model(hf_config, tf_config)
    if args["model"] == "tiny":
        load_hf_weights(model, str(TINY_MODEL), tp_rank=g.tp_rank, tp_size=tp)
    vocab = build_model_spec(hf_config, tensor_model_parallel_size=tp).vocab_size
    n_params = sum(p.numel() for p in model.parameters()) * tp  # (replicated norms counted tp times: approx)
    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-5, weight_decay=0.0, clip_grad=1.0)
    loss = ActorConfig(
        loss_agg_mode="token-mean", loss_scale_factor=None,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, kl_loss_type="k3",
    )
    mbs, mini = args["micro_batch_size"], args["mini_batch_sequences"]
    trainer = PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=vocab, micro_batch_size=mbs,
                            actor=loss, tp_group=g.tp if tp > 1 else None)
    batch = _batch(vocab, args["sequences"])

    def rl_update() -> tuple[float, float, float]:
        """(recompute wall s, update wall s, CPU s of this process for both)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        batch.old_logprobs = trainer.compute_logprobs(batch, mini_batch_sequences=mini)
        t1 = time.perf_counter()
        trainer.update(batch, mini_batch_sequences=mini)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, time.process_time() - c0

    def plain_loss(mb, output):  # GPTModel's per-token cross entropy [B, S], masked mean (per-token path)
        mask = mb.loss_mask.float()
        return (output * mask).sum(), mask.sum().to(torch.int), {}

    def plain_update() -> tuple[float, float]:
        """(wall s, CPU s of this process)."""
        def forward_step(data_iterator, m):
            mb = next(data_iterator)
            return m(mb.input_ids, mb.position_ids, None, labels=mb.labels), lambda out: plain_loss(mb, out)

        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for start in range(0, len(batch), mini):
            mini_batch = batch.slice(start, min(start + mini, len(batch)))
            for m in tm.model:
                m.zero_grad_buffer()
            tm.optimizer.zero_grad()
            mb_list = list(mini_batch.micro_batches(mbs))
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mb_list), model=tm.model,
                num_microbatches=len(mb_list), seq_length=batch.input_ids.shape[1], micro_batch_size=mbs,
                forward_only=False)
            ok, _, _ = tm.optimizer.step()
            if ok:
                tm.scheduler.step(increment=1)
        return time.perf_counter() - t0, time.process_time() - c0

    engine_logprobs = trainer.compute_logprobs(batch, mini_batch_sequences=mini)

    def rollout_update() -> tuple[float, float]:
        """`actor.old_logprob_source: rollout`: no recompute, the old log-probs are the engine's (here
        the trainer's own numbers, as an engine whose numerics match would send). (wall s, CPU s)."""
        dist.barrier()
        batch.old_logprobs = engine_logprobs
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.update(batch, mini_batch_sequences=mini)
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(args["warmup"]):
        rl_update()
        rollout_update()
        plain_update()
    rec, upd, plain, rl_cpu, plain_cpu, ro, ro_cpu = [], [], [], [], [], [], []
    for _ in range(args["repeats"]):
        a, b, c = rl_update()
        rec.append(a)
        upd.append(b)
        rl_cpu.append(c)
        w, c = rollout_update()
        ro.append(w)
        ro_cpu.append(c)
        w, c = plain_update()
        plain.append(w)
        plain_cpu.append(c)
    if g.rank == 0:
        med = statistics.median
        rl = [a + b for a, b in zip(rec, upd)]
        best = rl.index(min(rl))
        print("RESULT " + json.dumps({
            "model": args["model"], "tp": tp, "parameters": n_params, "sequences": len(batch),
            "padded_width": int(batch.input_ids.shape[1]), "trained_tokens": int(batch.loss_mask.sum()),
            "optimizer_steps": -(-len(batch) // mini), "micro_batch_size": mbs,
            "rl_update_s": rl[best], "recompute_s": rec[best], "update_s": upd[best], "plain_s": min(plain),
            "ratio": rl[best] / min(plain), "update_over_plain": upd[best] / min(plain),
            "median_rl_update_s": med(rl), "median_plain_s": med(plain), "median_ratio": med(rl) / med(plain),
            "rl_cpu_s": med(rl_cpu), "plain_cpu_s": med(plain_cpu), "cpu_ratio": med(rl_cpu) / med(plain_cpu),
            "rollout_source_s": min(ro), "rollout_source_ratio": min(ro) / min(plain),
            "rollout_source_cpu_s": med(ro_cpu), "rollout_source_cpu_ratio": med(ro_cpu) / med(plain_cpu),
            "rl_cpu_all_s": rl_cpu, "plain_cpu_all_s": plain_cpu, "rollout_source_all_s": ro,
            "rollout_source_cpu_all_s": ro_cpu,
            "recompute_all_s": rec, "update_all_s": upd, "rl_update_all_s": rl, "plain_all_s": plain,
        }), flush=True)
    destroy_parallel()


def run_config(model: str, tp: int, args) -> dict:
    """Launch `tp` gloo ranks of `worker` and return rank 0's result."""
    from megatron_rl.ports import find_free_port

    port = find_free_port()
    bench = {"model": model, "warmup": args.warmup, "repeats": args.repeats, **PRESETS[model]}
    for key in PRESETS[model]:
        if getattr(args, key) is not None:
            bench[key] = getattr(args, key)
    procs = []
    for rank in range(tp):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads), BENCH_ARGS=json.dumps(bench),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{model} TP={tp} failed:\n" + "\n=====\n".join(o[-4000:] for o in outs))
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--sequences", type=int, help="sequences in the step's batch (default: the model's PRESETS)")
    ap.add_argument("--mini-batch-sequences", type=int, help="sequences per optimizer step")
    ap.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rl_overhead.json"))
    args = ap.parse_args()
    rows = []
    for model in args.models:
        for tp in args.tp:
            rows.append(run_config(model, tp, args))
            r = rows[-1]
            print(f"  done {model} TP={tp}: RL {r['rl_update_s']:.3f} s, plain {r['plain_s']:.3f} s", flush=True)
    header = ("model", "TP", "params", "seqs x S", "recompute s", "update s", "RL update s", "plain fwd/bwd+opt s",
              "RL / plain", "update / plain", "RL / plain (medians)", "RL / plain (CPU s, rank 0)",
              "rollout log-probs / plain", "rollout log-probs / plain (CPU s)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['model']} | {r['tp']} | {r['parameters'] / 1e6:.2f}M | {r['sequences']} x {r['padded_width']} | "
              f"{r['recompute_s']:.3f} | {r['update_s']:.3f} | {r['rl_update_s']:.3f} | {r['plain_s']:.3f} | "
              f"{r['ratio']:.2f} | {r['update_over_plain']:.2f} | {r['median_ratio']:.2f} | "
              f"{r['rl_cpu_s']:.2f} / {r['plain_cpu_s']:.2f} = {r['cpu_ratio']:.2f} | "
              f"{r['rollout_source_ratio']:.2f} | "
              f"{r['rollout_source_cpu_s']:.2f} / {r['plain_cpu_s']:.2f} = {r['rollout_source_cpu_ratio']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    out.write_text(json.dumps({"settings": vars(args), "load_average_at_end": load, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
