"""Where the time of one RL step goes: rollout, reward, filter, advantages, log-probs, update, weight sync.

Runs a short tiny recipe (default `examples/tiny/da3po.yaml`, the README's main job, for 10 RL steps,
no evaluation) or reads the `metrics.jsonl` of a run that already exists (`--run-dir`), then prints
the mean seconds and the share of the step of each phase, and writes
`benchmarks/results/step_time_split.json`.

    .venv/bin/python benchmarks/step_time_split.py                      # ~1-2 min on 2 idle CPU cores
    .venv/bin/python benchmarks/step_time_split.py --config examples/tiny/grpo.yaml --steps 20
    .venv/bin/python benchmarks/step_time_split.py --run-dir runs/tiny-da3po   # an existing run

Phases, from the per-step `timing/*` keys the trainer logs (`megatron_rl/trainer/loop.py`):

| phase | key | what |
|---|---|---|
| rollout | `timing/generate_s` | `/generate` on the rollout server(s), every generation batch of the step |
| reward | `timing/reward_s` | the verifier in the reward process pool |
| filter | `timing/filter_s` | dynamic sampling's group filter and the bookkeeping between generation batches |
| advantages | `timing/advantage_s` | advantages (+ DAA), the train batch, its broadcast to the other ranks |
| log-probs | `timing/old_logprob_s` | old (and reference) log-probs of the batch |
| update | `timing/update_s` | the PPO mini-batch updates (forward, backward, optimizer) |
| sync | `timing/weight_sync_s` | the broadcast of the new weights to the rollout servers |
| other | remainder | `timing/step_s` minus every timed phase (metrics, logging); runs from before `timing/filter_s` existed count their filter time here |

The extra generation batches that dynamic sampling draws are part of "rollout"
(`train/num_gen_batches` says how many a step took). Step 1 is left out of the means by default
(`--skip-first 1`): it pays one-off costs (first server batches, allocator warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PHASES: tuple[tuple[str, str | None], ...] = (
    ("rollout", "timing/generate_s"),
    ("reward", "timing/reward_s"),
    ("filter", "timing/filter_s"),
    ("advantages", "timing/advantage_s"),
    ("log-probs", "timing/old_logprob_s"),
    ("update", "timing/update_s"),
    ("sync", "timing/weight_sync_s"),
    ("other", None),
)
"""(phase name, metrics.jsonl key); None = the remainder of `timing/step_s`."""


def load_step_rows(run_dir: Path) -> list[dict]:
    """The per-step rows (those with `timing/step_s`) of `run_dir/metrics.jsonl`, in step order.

    Raises:
        FileNotFoundError: no metrics.jsonl in run_dir.
        ValueError: no row carries `timing/step_s`.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a megatron-rl run dir?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/step_s" in r]
    if not rows:
        raise ValueError(f"{path}: no row has timing/step_s (no RL step finished)")
    by_step = {r["step"]: r for r in rows}  # a resumed run may repeat a step: keep the last
    return [by_step[s] for s in sorted(by_step)]


def split(rows: list[dict]) -> dict:
    """Mean seconds and share of the step per phase over `rows` (each a metrics.jsonl step row).

    The "other" phase is `timing/step_s` minus the timed phases (clamped at 0). Returns
    `{"steps": n, "step_s": mean, "phases": {name: {"mean_s", "share", "median_s"}}, ...}`;
    shares are of the mean step time and add up to 1.
    """
    if not rows:
        raise ValueError("no steps to split")
    per_phase: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    for r in rows:
        timed = 0.0
        for name, key in PHASES:
            if key is not None:
                v = float(r.get(key, 0.0))
                per_phase[name].append(v)
                timed += v
        per_phase["other"].append(max(float(r["timing/step_s"]) - timed, 0.0))
    total = sum(statistics.mean(v) for v in per_phase.values())
    out = {name: {"mean_s": statistics.mean(v), "median_s": statistics.median(v),
                  "share": statistics.mean(v) / total if total else 0.0} for name, v in per_phase.items()}
    extra = {}
    for key in ("train/num_gen_batches", "perf/generated_tokens", "perf/generate_tokens_per_s",
                "perf/train_tokens_per_s", "response_length/mean"):
        vals = [float(r[key]) for r in rows if key in r]
        if vals:
            extra[key] = statistics.mean(vals)
    return {"steps": len(rows), "step_s": total, "step_s_measured": statistics.mean(float(r["timing/step_s"])
                                                                                     for r in rows),
            "phases": out, "means": extra}


def format_table(result: dict) -> str:
    """The split as a Markdown table (phase, mean s, share)."""
    lines = ["| phase | mean s | share |", "|---|---|---|"]
    for name, p in result["phases"].items():
        lines.append(f"| {name} | {p['mean_s']:.2f} | {100 * p['share']:.1f}% |")
    lines.append(f"| **step** | **{result['step_s']:.2f}** | 100% |")
    return "\n".join(lines)


def run_recipe(config: str, steps: int, run_dir: Path, overrides: list[str]) -> float:
    """Train `config` for `steps` RL steps into run_dir (no eval, no checkpoint); returns wall seconds."""
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists (an earlier run?): remove it or pass another --work-dir; "
                         "nothing is deleted here")
    cli = Path(sys.executable).parent / "megatron-rl"
    cmd = [str(cli), "train", "--config", config, f"run_dir={run_dir}", f"trainer.total_training_steps={steps}",
           "trainer.save_interval=0", "trainer.save_last=false", "trainer.progress_bar=false",
           "eval.before_train=false", "eval.after_train=false", *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log = run_dir.parent / (run_dir.name + ".log")
    with open(log, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if r.returncode:
        raise SystemExit(f"megatron-rl train failed (exit {r.returncode}); log: {log}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, help="read this run's metrics.jsonl instead of running a recipe")
    ap.add_argument("--config", default=str(REPO / "examples" / "tiny" / "da3po.yaml"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-first", type=int, default=1, help="leave the first N steps out of the means")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="folder for the recipe run (default: a new folder under the system temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_time_split.json")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for the recipe run")
    args = ap.parse_args()

    wall = None
    load0 = os.getloadavg()[0]
    if args.run_dir is None:
        if args.steps <= args.skip_first:
            ap.error(f"--steps {args.steps} leaves no step after --skip-first {args.skip_first}")
        import signal
        import tempfile

        work = args.work_dir or Path(tempfile.mkdtemp(prefix="megatron-rl-step-split-"))
        run_dir = work / Path(args.config).stem
        print(f"run: {run_dir} (log {run_dir}.log)", flush=True)
        # SIGTERM ends this script through SystemExit, so subprocess.run kills the trainer it started
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        wall = run_recipe(args.config, args.steps, run_dir, args.overrides)
        source = {"config": os.path.relpath(args.config, REPO), "steps": args.steps, "overrides": args.overrides,
                  "process_wall_s": wall}
    else:
        run_dir = args.run_dir
        source = {"run_dir": str(run_dir)}
    rows = load_step_rows(run_dir)
    used = rows[args.skip_first:] if len(rows) > args.skip_first else rows
    result = split(used)
    result.update({"benchmark": "step_time_split", "source": source, "skipped_first_steps": len(rows) - len(used),
                   "loadavg_start": load0, "loadavg_end": os.getloadavg()[0], "cpu_count": os.cpu_count()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{source.get('config') or source.get('run_dir')}: mean of {result['steps']} RL steps "
          f"(after skipping {result['skipped_first_steps']}), load average {load0:.1f}-{result['loadavg_end']:.1f}")
    print(format_table(result))
    m = result["means"]
    if m:
        print(" ".join(f"{k}={v:.1f}" for k, v in m.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
