"""Dynamic sampling on the tiny task: over-sampling with abort vs waiting for whole generation batches.

The rollout part of a DAPO step (draw prompts, sample ``n`` responses each, score, keep groups
whose accuracy varies, until ``train_batch_size`` groups are kept) on one real embedded server
holding the SFT'd tiny base model, with ``examples/tiny/dapo.yaml``'s sizes (16 groups of 8,
generation batches of 24 prompts, responses up to 64 tokens):

* ``whole``: the loop's default: generation batches of ``gen_batch_size`` prompts, each waited
  for in full, until enough groups are kept (``collect_groups``);
* ``abort``: ``rollout.over_sampling_batch_size`` prompts launched at once; as soon as enough
  finished groups are kept, everything still running is aborted (``/abort_request``) and dropped.

Both draw from the same seeded prompt stream and use the same collect_groups accounting. The
weights do not change between steps (the training part of a step is the same in both modes and is
left out). Writes ``benchmarks/results/dynamic_sampling_abort.json`` and prints a table.

    .venv/bin/python benchmarks/dynamic_sampling_abort.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY = REPO / "examples" / "tiny"


def run_mode(manager, rows, *, mode: str, steps: int, launch: int, train_batch_size: int, n: int, seed: int) -> dict:
    from megatron_rl.algorithms.dynamic_sampling import collect_groups
    from megatron_rl.data.dataset import PromptDataset

    dataset = PromptDataset(rows, seed=seed, shuffle=True)
    sampling = {"temperature": 1.0, "top_p": 1.0}

    def keep(g) -> bool:
        values = g.metric_values("acc")
        return len(values) >= 2 and max(values) > min(values)

    per_step = []
    for step in range(1, steps + 1):
        kept_so_far = [0]
        stats_acc = {"aborted": 0, "responses": 0}

        def generate_batch(b: int):
            batch_rows = dataset.next_batch(launch)
            if mode == "abort":
                groups, st = manager.generate_groups(batch_rows, n=n, sampling_params=sampling, step=step, gen_batch=b,
                                                     stop_after=train_batch_size - kept_so_far[0], keep_fn=keep)
                kept_so_far[0] += sum(keep(g) for g in groups)
                stats_acc["aborted"] += st["rollout/aborted"]
            else:
                groups, st = manager.generate_groups(batch_rows, n=n, sampling_params=sampling, step=step, gen_batch=b)
            stats_acc["responses"] += sum(len(g.samples) for g in groups)
            return groups

        t0 = time.perf_counter()
        kept, ds = collect_groups(generate_batch, train_batch_size=train_batch_size, max_num_gen_batches=8,
                                  ppo_mini_batch_size=8, keep_fn=keep)
        wall = time.perf_counter() - t0
        assert all(s.stop_reason != "abort" for g in kept for s in g.samples)
        per_step.append({"wall_s": wall, "kept_groups": len(kept), "gen_batches": ds["num_gen_batches"],
                         "finished_responses": stats_acc["responses"], "aborted_responses": stats_acc["aborted"]})
    walls = [s["wall_s"] for s in per_step]
    return {"mode": mode, "launch_prompts": launch, "steps": per_step, "mean_wall_s": statistics.mean(walls),
            "median_wall_s": statistics.median(walls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--train-batch-size", type=int, default=16)
    ap.add_argument("--gen-batch-size", type=int, default=24)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dynamic_sampling_abort.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import load_rows
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.rollout.manager import RolloutManager

    tok = AutoTokenizer.from_pretrained(TINY / "base_model")
    rows = load_rows(TINY / "data" / "train.parquet")
    (server,) = launch_servers("embedded", TINY / "base_model", 1, startup_timeout_s=300, random_seed=1)
    pool = RewardPool(1, 30.0)
    manager = RolloutManager([server.client(timeout_s=60, generate_timeout_s=600)], tok, pool, reward_fn="dapo_math",
                             max_prompt_length=32, max_response_length=64, seed=1,
                             overlong=(True, 16, 1.0), eos_token_ids=[tok.eos_token_id])
    results = []
    try:
        common = dict(steps=args.steps, train_batch_size=args.train_batch_size, n=args.n, seed=7)
        for mode, launch in (("whole", args.gen_batch_size), ("abort", args.gen_batch_size),
                             ("whole", args.gen_batch_size), ("abort", args.gen_batch_size)):
            results.append(run_mode(manager, rows, mode=mode, launch=launch, **common))
    finally:
        manager.close()
        pool.close()
        server.stop()
    by_mode = {m: [r for r in results if r["mode"] == m] for m in ("whole", "abort")}
    summary = {m: {"mean_wall_s": statistics.mean(s["wall_s"] for r in rs for s in r["steps"]),
                   "mean_gen_batches": statistics.mean(s["gen_batches"] for r in rs for s in r["steps"]),
                   "mean_finished_responses": statistics.mean(s["finished_responses"] for r in rs for s in r["steps"]),
                   "mean_aborted_responses": statistics.mean(s["aborted_responses"] for r in rs for s in r["steps"])}
               for m, rs in by_mode.items()}
    speedup = summary["whole"]["mean_wall_s"] / summary["abort"]["mean_wall_s"]
    print(f"dynamic-sampling rollout, {args.train_batch_size} groups x {args.n} kept per step, launches of "
          f"{args.gen_batch_size} prompts, {2 * args.steps} steps per mode (interleaved runs), load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<8} {'wall s/step':>12} {'gen batches':>12} {'finished resp':>14} {'aborted resp':>13}")
    for m, s in summary.items():
        print(f"{m:<8} {s['mean_wall_s']:>12.2f} {s['mean_gen_batches']:>12.2f} {s['mean_finished_responses']:>14.1f} "
              f"{s['mean_aborted_responses']:>13.1f}")
    print(f"whole / abort wall time: {speedup:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "speedup": speedup, "runs": results,
                               "load_avg_1m": os.getloadavg()[0]}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
