"""The tiny tool recipe against the text-only one: accuracy by level, tool use, the tool's cost.

Issue 31's end-to-end measurement. One invocation trains three arms, same seed, `--steps` RL steps each,
with the recipes' held-out evaluation before and after (avg@8, pass@8, greedy on
examples/tiny/data/test.jsonl, also by level):

* `text` - `examples/tiny/dapo.yaml`: the tiny DAPO recipe on `base_model` (one completion a sample);
* `text_control` - the same text-only recipe on `text_control_model`: base_model with the tool model's
  continued SFT minus the tool examples (`tools/train_tiny_base.py` without `--tool-fraction`), so
  that `tool` and `text_control` start from the same amount of SFT (the continued SFT alone sharpens
  the text answers too);
* `tool` - `examples/tiny/tool-dapo.yaml`: the same DAPO recipe on `tool_base_model` (base_model SFT'd
  further to call the sandboxed python tool sometimes), every sample an episode of turns.

For the tool arm it also reports, from `metrics.jsonl` (docs/MULTITURN.md): tool calls per trained sample
and the share of samples with a call (first and last steps), the sandbox's cost per call (seconds in
tools / calls, wall clock of a turn's calls), the share of an episode's time spent in tools
(`timing/tool_s / timing/episode_s`), the tool time against the step's generation time, and the
most tool runs of different samples in progress at once (`rollout/tool_concurrency_max`: > 1 means
the calls of different samples overlapped instead of waiting on each other).

    .venv/bin/python benchmarks/tool_tiny_dapo.py                     # 3 arms x 80 steps; ~25-40 min on 2 cores
    .venv/bin/python benchmarks/tool_tiny_dapo.py --arms tool --steps 3 --out /tmp/x.json
    .venv/bin/python benchmarks/tool_tiny_dapo.py --from-runs text=runs/a tool=runs/b   # summarise only

Prints a Markdown table and writes `benchmarks/results/tool_tiny_dapo.json` (`--out` elsewhere).
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
RECIPES = {"text": REPO / "examples" / "tiny" / "dapo.yaml", "text_control": REPO / "examples" / "tiny" / "dapo.yaml",
           "tool": REPO / "examples" / "tiny" / "tool-dapo.yaml"}
OVERRIDES = {"text_control": ["model.path=examples/tiny/text_control_model"]}
"""Arm -> overrides added to its recipe."""
EVAL_KEYS = ("avg@8", "pass@8", "greedy_acc")


def _eval_row(ev: dict) -> dict:
    """avg@8 / pass@8 / greedy (and the tool-use rate when the run had tools), overall and by level."""
    row = {k: ev.get(k) for k in EVAL_KEYS + ("tool_use_rate",) if ev.get(k) is not None}
    row["by_level"] = {lv: {k: v for k, v in rec.items() if k in EVAL_KEYS + ("tool_use_rate",)}
                       for lv, rec in (ev.get("by_level") or {}).items()}
    return row


def _tool_stats(rows: list[dict]) -> dict:
    """The tool numbers over a run's step rows (see the module docstring); {} without tool calls."""
    steps = [r for r in rows if "train/tool_calls_per_sample" in r]
    if not steps:
        return {}
    tool_s = sum(r.get("timing/tool_s", 0.0) for r in steps)
    calls = sum(r.get("rollout/tool_calls", 0) for r in steps)
    ep_s = sum(r.get("timing/episode_s", 0.0) for r in steps)
    gen_s = sum(r.get("timing/generate_s", 0.0) for r in steps)
    k = max(1, min(5, len(steps) // 4))
    first, last = steps[:k], steps[-k:]
    return {
        "steps": len(steps),
        "tool_calls_per_sample": {"first_steps": statistics.mean(r["train/tool_calls_per_sample"] for r in first),
                                  "last_steps": statistics.mean(r["train/tool_calls_per_sample"] for r in last),
                                  "steps_averaged": k},
        "tool_use_rate": {"first_steps": statistics.mean(r["train/tool_use_rate"] for r in first),
                          "last_steps": statistics.mean(r["train/tool_use_rate"] for r in last)},
        "tool_errors_per_sample": statistics.mean(r.get("train/tool_errors_per_sample", 0.0) for r in steps),
        "calls": calls,
        "seconds_per_call": tool_s / calls if calls else None,
        "tool_share_of_episode_time": tool_s / ep_s if ep_s else None,
        "tool_s_per_generate_s": tool_s / gen_s if gen_s else None,
        "tool_concurrency_max": max(r.get("rollout/tool_concurrency_max", 0) for r in steps),
        "step_s_mean": statistics.mean(r.get("timing/step_s", 0.0) for r in steps if "timing/step_s" in r)
        if any("timing/step_s" in r for r in steps) else None,
    }


def summarise_run(run_dir: Path) -> dict:
    """One finished run: steps, wall seconds, eval before/after (`_eval_row`), tool numbers.

    Raises:
        FileNotFoundError: `run_dir` has no summary.json or metrics.jsonl (the run did not finish).
    """
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"run_dir": str(run_dir), "steps": summary.get("steps"), "wall_s": summary.get("wall_s"),
            "model": summary.get("config", {}).get("model", {}).get("path"),
            "eval_before": _eval_row(summary["eval_before"]), "eval_after": _eval_row(summary["eval_after"]),
            "tools": _tool_stats(rows)}


def format_table(arms: dict[str, dict]) -> str:
    """Per arm and level: avg@8 before -> after (tool-use rate before -> after for the tool arm)."""
    levels = sorted({lv for a in arms.values() for lv in a["eval_before"]["by_level"]}, key=str)
    lines = ["| arm | level | avg@8 | pass@8 | greedy | tool use |", "|---|---|---|---|---|---|"]
    for name, a in arms.items():
        for lv in [*levels, "all"]:
            b = a["eval_before"] if lv == "all" else a["eval_before"]["by_level"].get(lv, {})
            e = a["eval_after"] if lv == "all" else a["eval_after"]["by_level"].get(lv, {})
            cells = [f"{b[k]:.3f} -> {e[k]:.3f}" if b.get(k) is not None and e.get(k) is not None else "-"
                     for k in (*EVAL_KEYS, "tool_use_rate")]
            lines.append(f"| {name} | {lv} | {' | '.join(cells)} |")
    return "\n".join(lines)


def run_arm(name: str, work: Path, steps: int) -> Path:
    """Train the arm's recipe into `work/name`; returns the run folder.

    Raises:
        SystemExit: the trainer failed (names its log).
    """
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    log = work / f"{name}.log"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(RECIPES[name]), f"run_dir={run_dir}",
           f"trainer.total_training_steps={steps}", "trainer.progress_bar=false", "trainer.save_last=false",
           *OVERRIDES.get(name, [])]
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"arm {name}: megatron-rl train exited {rc}; see {log}")
    print(f"arm {name}: {steps} steps in {time.monotonic() - t0:.0f} s", flush=True)
    return run_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--work", type=Path, default=None, help="run folders (default: a fresh temporary folder)")
    p.add_argument("--from-runs", nargs="+", default=None, metavar="ARM=DIR",
                   help="summarise finished runs instead of training")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tool_tiny_dapo.json")
    args = p.parse_args(argv)
    if args.from_runs:
        dirs = {}
        for item in args.from_runs:
            name, sep, path = item.partition("=")
            if not sep or name not in RECIPES:
                p.error(f"--from-runs {item!r}: expected ARM=DIR with ARM one of {', '.join(RECIPES)}")
            dirs[name] = Path(path)
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="tool_tiny_dapo_"))
        work.mkdir(parents=True, exist_ok=True)
        dirs = {name: run_arm(name, work, args.steps) for name in args.arms}
    arms = {name: summarise_run(d) for name, d in dirs.items()}
    table = format_table(arms)
    print(table)
    for name, a in arms.items():
        if a["tools"]:
            print(f"{name}: tools {json.dumps(a['tools'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"recipes": {k: str(v.relative_to(REPO)) for k, v in RECIPES.items()},
                                    "load_average": os.getloadavg(), "arms": arms, "table": table}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
