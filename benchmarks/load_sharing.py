"""Step time alone and beside a competing CPU-bound process (issue 21, "Fair behaviour under load").

Runs 10 steps of `examples/tiny/da3po.yaml` (evaluation shrunk: `eval.max_problems=32 eval.n=2`)
twice in one invocation: alone, then beside one competing process of 2 threads (torch matmuls with
`torch.set_num_threads(2)`, started and stopped here). Prints median step time, the generate /
update split (`timing/*` of metrics.jsonl, step 1 left out) and the step-0 evaluation time, and
writes `benchmarks/results/load_sharing.json` with the load average before each part.
Target: step time under that load <= 2.5x the step time alone.

    .venv/bin/python benchmarks/load_sharing.py                       # ~3-6 min on 2 cores
    .venv/bin/python benchmarks/load_sharing.py --env OMP_NUM_THREADS=2 --env OMP_WAIT_POLICY=ACTIVE  # the old sizing
    .venv/bin/python benchmarks/load_sharing.py rollout.enable_deterministic_inference=true --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMPETITOR = """
import torch
torch.set_num_threads(2)
a = torch.randn(384, 384)
while True:
    a = torch.tanh(a @ a)
"""


def _run(run_dir: Path, steps: int, max_problems: int, overrides: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "examples/tiny/da3po.yaml"),
           f"run_dir={run_dir}", f"trainer.total_training_steps={steps}", "trainer.progress_bar=false",
           f"eval.max_problems={max_problems}", "eval.n=2", "eval.after_train=false", "trainer.save_last=false",
           *overrides]
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"run failed (exit {code}); see {run_dir.parent / (run_dir.name + '.log')}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps_rows = [r for r in rows if "timing/step_s" in r and r["step"] > 1]
    eval0 = next((r["eval/wall_s"] for r in rows if r["step"] == 0 and "eval/wall_s" in r), None)

    def med(key):
        return statistics.median(r[key] for r in steps_rows)

    return {"step_s": med("timing/step_s"), "generate_s": med("timing/generate_s"),
            "update_s": med("timing/update_s"), "old_logprob_s": med("timing/old_logprob_s"),
            "eval0_s": eval0, "wall_s": wall, "steps": len(steps_rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of the recipe")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-problems", type=int, default=32)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the training runs")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/load_sharing.json"))
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(kv.split("=", 1) for kv in args.env)
    tmp = Path(tempfile.mkdtemp(prefix="load_sharing_"))
    parts = {}
    try:
        parts["alone"] = {"loadavg_before": os.getloadavg()}
        parts["alone"].update(_run(tmp / "alone", args.steps, args.max_problems, args.overrides, env))
        comp = subprocess.Popen([sys.executable, "-c", COMPETITOR])
        try:
            time.sleep(5)
            parts["beside"] = {"loadavg_before": os.getloadavg()}
            parts["beside"].update(_run(tmp / "beside", args.steps, args.max_problems, args.overrides, env))
        finally:
            comp.kill()
            comp.wait()
        parts["beside"]["loadavg_after"] = os.getloadavg()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = parts["beside"]["step_s"] / parts["alone"]["step_s"]
    print(f"{'part':8} {'load1 before':>12} {'step s':>7} {'generate s':>10} {'update s':>8} {'eval0 s':>8} {'wall s':>7}")
    for name, r in parts.items():
        print(f"{name:8} {r['loadavg_before'][0]:12.1f} {r['step_s']:7.2f} {r['generate_s']:10.2f} "
              f"{r['update_s']:8.2f} {r['eval0_s'] or 0:8.1f} {r['wall_s']:7.0f}")
    print(f"step time beside a 2-thread CPU job / alone: {ratio:.2f}x (target <= 2.5x)")
    out = {"overrides": args.overrides, "env": args.env, "steps": args.steps, "cpus": len(os.sched_getaffinity(0)),
           "parts": parts, "ratio_step": ratio}
    if parts["alone"]["eval0_s"] and parts["beside"]["eval0_s"]:
        out["ratio_eval0"] = parts["beside"]["eval0_s"] / parts["alone"]["eval0_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
