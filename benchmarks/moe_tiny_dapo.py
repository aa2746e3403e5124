"""Routing replay on the tiny Mixture-of-Experts DAPO recipe: replay on, off, and on at eta = 1.

Issue 29's end-to-end measurement. One invocation trains `examples/tiny/moe-dapo.yaml` (tiny Qwen3-MoE,
8 experts, top-2; DAPO with dynamic sampling) once per arm, same seed, `--steps` RL steps each, with the
recipe's held-out evaluation before and after (avg@8, pass@8, greedy accuracy on
examples/tiny/data/test.jsonl):

* `replay`   - `actor.router_replay=true` (R3, arXiv 2510.11370), synchronous;
* `no_replay` - `actor.router_replay=false rollout.return_routed_experts=true`: the trainer's routers
  choose by themselves, the engines still return their routing, so `train/router_mismatch` measures
  how often the trainer would route differently from the engine;
* `replay_eta1` - replay with `trainer.max_staleness=1`: the routing of a sample comes from weights one
  step older than the trainer's.

`train/router_mismatch` (ALGORITHMS.md 9) is measured in the old-log-prob pass of every step: the share
of valid (token, layer) pairs whose top-k set under the trainer's own router scores differs from the
engine's. The tiny model runs in fp32 on the same CPU kernels in the engine and the trainer, so at
eta = 0 the two see the same weights and the metric is expected to be 0 (a nonzero value there is a
bug in the replay's token order or the weight sync); at eta = 1 it is the drift of one update.

    .venv/bin/python benchmarks/moe_tiny_dapo.py                  # 3 arms x 80 steps; ~15 min on 2 cores
    .venv/bin/python benchmarks/moe_tiny_dapo.py --arms replay --steps 5 --out /tmp/x.json
    .venv/bin/python benchmarks/moe_tiny_dapo.py --from-runs replay=runs/a no_replay=runs/b  # summarise only

Prints a Markdown table and writes `benchmarks/results/moe_tiny_dapo.json` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "tiny" / "moe-dapo.yaml"
ARMS = {
    "replay": ["actor.router_replay=true"],
    "no_replay": ["actor.router_replay=false", "rollout.return_routed_experts=true"],
    "replay_eta1": ["actor.router_replay=true", "trainer.max_staleness=1"],
}
"""Arm name -> the overrides it adds to the recipe."""
EVAL_KEYS = ("avg@8", "pass@8", "greedy_acc")


def summarise_run(run_dir: Path) -> dict:
    """One finished run's row: steps, wall seconds, eval before/after (`EVAL_KEYS`), and the router
    mismatch over its steps (mean, max, last, and per step).

    Raises:
        FileNotFoundError: `run_dir` has no summary.json or metrics.jsonl (the run did not finish).
        ValueError: no step of the run reported `train/router_mismatch`.
    """
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    by_step = {r["step"]: r for r in rows if "train/router_mismatch" in r}
    if not by_step:
        raise ValueError(f"{run_dir}/metrics.jsonl: no step reports train/router_mismatch (was routing returned?)")
    mm = [float(by_step[s]["train/router_mismatch"]) for s in sorted(by_step)]
    cfg = summary.get("config", {})
    return {
        "run_dir": str(run_dir), "steps": summary.get("steps"), "wall_s": summary.get("wall_s"),
        "router_replay": cfg.get("actor", {}).get("router_replay"),
        "max_staleness": cfg.get("trainer", {}).get("max_staleness"),
        "eval_before": {k: summary["eval_before"].get(k) for k in EVAL_KEYS},
        "eval_after": {k: summary["eval_after"].get(k) for k in EVAL_KEYS},
        "router_mismatch": {"mean": statistics.mean(mm), "max": max(mm), "last": mm[-1], "steps": len(mm),
                            "per_step": mm},
    }


def format_table(arms: dict[str, dict]) -> str:
    """The arms as a Markdown table: avg@8 / pass@8 / greedy before -> after, mismatch, wall."""
    lines = ["| arm | steps | avg@8 | pass@8 | greedy | train/router_mismatch mean (max) | wall s |",
             "|---|---|---|---|---|---|---|"]
    for name, a in arms.items():
        b, e, m = a["eval_before"], a["eval_after"], a["router_mismatch"]
        cells = [f"{b[k]:.3f} -> {e[k]:.3f}" for k in EVAL_KEYS]
        lines.append(f"| {name} | {a['steps']} | {' | '.join(cells)} | {m['mean']:.4f} ({m['max']:.4f}) | "
                     f"{a['wall_s']:.0f} |")
    return "\n".join(lines)


def run_arm(name: str, work: Path, steps: int) -> Path:
    """Train the recipe with the arm's overrides into `work/name`; returns the run folder.

    Raises:
        SystemExit: the trainer failed (names its log).
    """
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log = work / f"{name}.log"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(RECIPE), f"run_dir={run_dir}",
           f"trainer.total_training_steps={steps}", "trainer.progress_bar=false", "trainer.save_last=false",
           *ARMS[name]]
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"arm {name}: megatron-rl train exited {rc}; see {log}")
    print(f"arm {name}: {steps} steps in {time.monotonic() - t0:.0f} s", flush=True)
    return run_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--work", type=Path, default=None, help="run folders (default: a fresh temporary folder)")
    p.add_argument("--from-runs", nargs="+", default=None, metavar="ARM=DIR",
                   help="summarise finished runs instead of training")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "moe_tiny_dapo.json")
    args = p.parse_args(argv)
    if args.from_runs:
        dirs = {}
        for item in args.from_runs:
            name, sep, path = item.partition("=")
            if not sep or name not in ARMS:
                p.error(f"--from-runs {item!r}: expected ARM=DIR with ARM one of {', '.join(ARMS)}")
            dirs[name] = Path(path)
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="moe_tiny_dapo_"))
        work.mkdir(parents=True, exist_ok=True)
        dirs = {name: run_arm(name, work, args.steps) for name in args.arms}
    arms = {name: summarise_run(d) for name, d in dirs.items()}
    table = format_table(arms)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"recipe": str(RECIPE.relative_to(REPO)), "arms": arms, "table": table},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
