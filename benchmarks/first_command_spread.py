"""The README's first command, run several times: how far its before -> after numbers move between runs.

The embedded server batches requests as they arrive, so two runs of the same command (same seed)
can sample a different token wherever batching moved a logit across a near-tie, and the numbers a
newcomer reads at the end differ from the README's. Deterministic inference
(`rollout.enable_deterministic_inference=true`: every request in a batch of its own) would make
them repeat, but it multiplies the server's generation work about 10x (measured in
benchmarks/README.md, "First command: spread between runs"), so the recipes leave it off and the
README states the spread measured here next to each number instead.

Runs `megatron-rl train --config examples/tiny/da3po.yaml` (the README's first command, nothing
changed but `run_dir` and the progress bar) `--runs` times, one after the other, and after each run
adds its `summary.json` numbers (before and after: avg@8, pass@8, greedy accuracy, format-valid
share, per level; steps, wall time, load average) to `benchmarks/results/first_command_spread.json`.
A run already in that file is skipped, so the command resumes after an interruption; `--commit`
git-commits the file after each run (long measurements span sessions). The table gives each
metric's mean, sample SD and range over the runs.

    .venv/bin/python benchmarks/first_command_spread.py --runs 5 --commit     # ~6.5 min a run at idle
    .venv/bin/python benchmarks/first_command_spread.py --table-only         # the table from the file
    # the other recipes over seeds (run i gets trainer.seed=i): greedy vs avg@8 after training
    .venv/bin/python benchmarks/first_command_spread.py --recipe examples/tiny/grpo.yaml --vary-seed --runs 3 \
        --out benchmarks/results/recipe_seeds_grpo.json --commit
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
RECIPE = REPO / "examples" / "tiny" / "da3po.yaml"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "first_command_spread.json"
METRICS = ("avg@8", "pass@8", "greedy_acc", "format_valid")


def _flat(ev: dict) -> dict:
    """The numbers of one `eval_before` / `eval_after` entry: overall metrics and avg@8 per level.

    Raises:
        KeyError: the summary lacks a metric (names it).
    """
    out = {}
    for m in METRICS:
        if m not in ev:
            raise KeyError(f"summary.json evaluation has no {m!r} (keys: {sorted(ev)})")
        out[m] = float(ev[m])
    for level, row in sorted((ev.get("by_level") or {}).items()):
        for m in ("avg@8", "greedy_acc"):
            if m in row:
                out[f"level {level} {m}"] = float(row[m])
    return out


def run_once(index: int, work: Path, python: str, recipe: Path = RECIPE, seed: int | None = None) -> dict:
    """One run of `recipe` (the first command's by default) in `work/run{index}`, with
    `trainer.seed=seed` when given; its numbers.

    Raises:
        SystemExit: the run failed (names its log).
    """
    run_dir = work / f"run{index}"
    log = work / f"run{index}.log"
    shutil.rmtree(run_dir, ignore_errors=True)  # a folder left by an interrupted run: start it over, not resume
    cmd = [python, "-m", "megatron_rl.cli", "train", "--config", str(recipe), f"run_dir={run_dir}",
           "trainer.progress_bar=false", *([f"trainer.seed={seed}"] if seed is not None else [])]
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        code = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"run {index} failed (exit {code}); see {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run": index, "seed": seed, "steps": summary["steps"], "wall_s": wall, "train_wall_s": summary.get("wall_s"),
            "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "before": _flat(summary["eval_before"]), "after": _flat(summary["eval_after"]),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(runs: list[dict]) -> str:
    """Markdown table: metric, then mean, SD and min-max over the runs, before and after."""
    lines = ["| metric | before: mean (SD) [min, max] | after: mean (SD) [min, max] | change: mean (SD) |",
             "|---|---|---|---|"]
    keys = [k for k in runs[0]["after"] if all(k in r["after"] and k in r["before"] for r in runs)]

    def cell(vals):
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.mean(vals):.3f} ({sd:.3f}) [{min(vals):.3f}, {max(vals):.3f}]"

    for k in keys:
        b = [r["before"][k] for r in runs]
        a = [r["after"][k] for r in runs]
        d = [y - x for x, y in zip(b, a)]
        sd = statistics.stdev(d) if len(d) > 1 else 0.0
        lines.append(f"| {k} | {cell(b)} | {cell(a)} | {statistics.mean(d):+.3f} ({sd:.3f}) |")
    walls = [r["wall_s"] for r in runs]
    lines.append(f"\n{len(runs)} runs; wall {min(walls) / 60:.1f}-{max(walls) / 60:.1f} min a run; load average "
                 f"(1 min) at the starts {', '.join(f'{r['loadavg_before'][0]:.1f}' for r in runs)}")
    return "\n".join(lines)


def _commit(path: Path, message: str, tries: int = 5) -> None:
    """`git add` + `git commit` of `path`, retried while another git process holds the index lock;
    any other git failure is printed at once (the file stays written)."""
    for attempt in range(tries):
        for cmd in (["git", "add", str(path)], ["git", "commit", "-q", "-m", message, "--", str(path)]):
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if out.returncode != 0:
                break
        else:
            return
        if "index.lock" not in out.stderr or attempt == tries - 1:
            print(f"warning: could not commit {path} ({' '.join(cmd[:2])}: {out.stderr.strip()[:300]}); "
                  "it is written, commit it by hand", flush=True)
            return
        time.sleep(2.0 * (attempt + 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs in all (those already in --out count)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work", type=Path, help="run folders and logs (default: runs/<name of --out>)")
    p.add_argument("--commit", action="store_true", help="git-commit --out after each run")
    p.add_argument("--table-only", action="store_true", help="print the table from --out; run nothing")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--recipe", type=Path, default=RECIPE, help="recipe to run (default: the first command's)")
    p.add_argument("--vary-seed", action="store_true", help="run i gets trainer.seed=i (default: the recipe's seed)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.work = (args.work or REPO / "runs" / args.out.stem).resolve()
    recipe = (args.recipe if args.recipe.is_absolute() else REPO / args.recipe).resolve()
    if not recipe.is_file():
        p.error(f"--recipe {args.recipe}: no such file")
    name = str(recipe.relative_to(REPO)) if recipe.is_relative_to(REPO) else str(recipe)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"recipe": name, "vary_seed": args.vary_seed,
                                                                        "runs": []}
    if not args.table_only and data["runs"]:  # runs of one setting only in a file
        if data.get("recipe") != name:
            p.error(f"{args.out} holds runs of {data.get('recipe')}, not {name}: pass another --out")
        if bool(data.get("vary_seed", False)) != args.vary_seed:
            p.error(f"{args.out} holds runs {'with' if data.get('vary_seed') else 'without'} --vary-seed: "
                    "pass the same setting or another --out")
    if not args.table_only:
        args.work.mkdir(parents=True, exist_ok=True)
        done = {r["run"] for r in data["runs"]}
        for index in range(1, args.runs + 1):
            if index in done:
                continue
            print(f"run {index}/{args.runs} ...", flush=True)
            data["runs"].append(run_once(index, args.work, args.python, recipe, index if args.vary_seed else None))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(data, indent=1) + "\n")
            if args.commit:
                _commit(args.out, f"{args.out.stem}: run {index}")
    if not data["runs"]:
        print(f"no runs in {args.out}")
        return 1
    print(table(data["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
