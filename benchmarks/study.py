"""Miniature reproduction study: does DA3PO beat DAPO and GRPO on the tiny task at equal generated tokens?

One command runs every training run one after another (the machine has 2 cores), then writes
`<out>/study.json` and PNG plots under `<out>/plots/` and prints a table:

* GRPO, DAPO and DA3PO (`examples/tiny/{grpo,dapo,da3po}.yaml`) with every seed of `--seeds`
  (default 3 seeds; the seed is `trainer.seed`, which seeds the rollout sampling, the prompt
  order and torch);
* one seed each of: DAPO without dynamic sampling (`algorithm.filter_groups.enable=false`,
  `data.gen_batch_size` = `data.train_batch_size` so that no generated group is thrown away), and
  the DAA variants of docs/ALGORITHMS.md section 4.2-4.3 (`algorithm.daa.difficulty` group /
  posterior / history x `algorithm.daa.factor` balanced / power; DA3PO itself is the recipe's
  default, the paper's rule as reported: `factor: constant`, lambda 2, `difficulty: group`).

Every run starts from the same base model (`examples/tiny/base_model`) and trains on the same
finite prompt pool: `--pool-size` rows of `examples/tiny/data/train.jsonl`, stratified by
difficulty level (first rows of each level in file order), so that prompts recur across epochs
and the `history` difficulty estimator sees earlier groups of the same prompt. Held-out accuracy
is the trainer's own evaluation (`eval.*`) on `examples/tiny/data/test.jsonl`.

Token budget: `trainer.max_generated_tokens` = the budget, with a step cap the run will not reach;
the trainer stops after the first step whose running total of generated tokens
(`perf/total_generated_tokens`) reaches the budget, exactly as after its last step (final
evaluation `eval_after`, `summary.json`). A run thus ends at or above the budget, by less than
its last step's tokens; the exact count of every run is in the JSON. The step-0 (base model)
evaluation is the same for every run (same weights, same `eval.seed`), so only the first run
launched does it (`eval.before_train`) and every curve starts from it.

Resumable: a run dir with `summary.json` is done and skipped; one stopped with a checkpoint
(SIGTERM to the study stops the run in flight that way) resumes from it with the same command (the
trainer only finishes if its budget was reached); one without a checkpoint starts over.

    .venv/bin/python benchmarks/study.py                 # the full study (< 2 h on 2 CPU cores)
    .venv/bin/python benchmarks/study.py --quick         # CI: 1 seed x 3 algorithms, 2 steps each
    .venv/bin/python benchmarks/study.py --analyze-only  # recompute study.json and the plots

See docs/reproduction.md for the design, the time budget and the measured results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ROOT / "examples" / "tiny"
TRAIN_JSONL = TINY / "data" / "train.jsonl"
MAIN_ALGORITHMS = ("grpo", "dapo", "da3po")
MEAN_RESPONSE_TOKENS = 24
"""Mean response length of the base model at temperature 1.0 (23.7 tokens at step 1 of the tiny
recipes); only used to place the periodic evaluations before a run has measured anything."""
STOP_RULE = "trainer.max_generated_tokens = budget: the run ends after the first step s with T_s >= budget"
DS_GEN_BATCHES = 1.3
"""Expected generation batches a dynamic-sampling step (same use as MEAN_RESPONSE_TOKENS)."""


@dataclass
class RunSpec:
    """One training run of the study.

    Attributes:
        name: run folder name under `<out>/runs/` (e.g. `dapo_s2`).
        label: what is compared: runs of one label are seeds of one configuration.
        recipe: `examples/tiny/<recipe>.yaml`.
        seed: `trainer.seed`.
        overrides: the label's own `key=value` overrides (on top of the study's common ones).
    """

    name: str
    label: str
    recipe: str
    seed: int
    overrides: list[str] = field(default_factory=list)


ABLATIONS: list[tuple[str, str, list[str]]] = [
    ("dapo_no_ds", "dapo", ["algorithm.filter_groups.enable=false", "data.gen_batch_size=16"]),
    *[(f"da3po_{d}_{f}", "da3po", [f"algorithm.daa.difficulty={d}", f"algorithm.daa.factor={f}"])
      for d in ("group", "posterior", "history") for f in ("balanced", "power")],  # DA3PO itself: constant + group
]
"""(label, recipe, overrides) of the one-seed variants."""


def build_plan(seeds: list[int], *, quick: bool, only: Optional[list[str]] = None) -> list[RunSpec]:
    """The runs in launch order: seed by seed of the three algorithms first (so a study cut short
    still has balanced main results), then the one-seed ablations (first seed). `--quick`: the
    three algorithms at the first seed only. `only`: names or labels to keep."""
    plan = [RunSpec(f"{a}_s{s}", a, a, s) for s in (seeds[:1] if quick else seeds) for a in MAIN_ALGORITHMS]
    if not quick:
        plan += [RunSpec(f"{label}_s{seeds[0]}", label, recipe, seeds[0], list(ov)) for label, recipe, ov in ABLATIONS]
    if only:
        wanted = set(only)
        unknown = wanted - {r.name for r in plan} - {r.label for r in plan}
        if unknown:
            raise SystemExit(f"study: --only {sorted(unknown)}: no such run or label; runs are "
                             f"{', '.join(r.name for r in plan)}")
        plan = [r for r in plan if r.name in wanted or r.label in wanted]
    return plan


# ---------------------------------------------------------------------------------------------
# the prompt pool


def make_pool(size: int, out: Path, src: Path = TRAIN_JSONL, *, write: bool = True,
              by_level: Optional[dict] = None) -> dict:
    """Write `size` rows of `src` to `out`, stratified by `extra_info.level` (largest-remainder
    allocation in proportion to the level counts, first rows of each level in file order; row
    order kept). `size` 0 or >= the file's rows = all of them. `by_level` ({level: rows}, study v2)
    takes that many first rows of each level instead (`size` is then ignored). Rows keep their
    content, so a prompt's key (`<file>:<row>`) is stable across runs of the study.

    Returns:
        {"path", "size", "source", "by_level": {level: rows}}.

    Raises:
        ValueError: `src` has rows without a level while a subset is asked for, or fewer rows of a
            level than `by_level` asks for.
    """
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()]
    rows = [json.loads(ln) for ln in lines]
    levels = [str((r.get("extra_info") or {}).get("level")) for r in rows]
    if not by_level and (size <= 0 or size >= len(rows)):
        keep = list(range(len(rows)))
    else:
        if "None" in levels:
            raise ValueError(f"{src}: rows without extra_info.level; cannot stratify a pool of {size}")
        counts: dict[str, int] = {}
        for lv in levels:
            counts[lv] = counts.get(lv, 0) + 1
        if by_level:
            alloc = {str(lv): int(c) for lv, c in by_level.items()}
            short = {lv: c for lv, c in alloc.items() if c > counts.get(lv, 0)}
            if short:
                raise ValueError(f"{src}: pool asks for {short} rows of levels that have only "
                                 f"{ {lv: counts.get(lv, 0) for lv in short} }")
        else:
            quota = {lv: size * c / len(rows) for lv, c in counts.items()}
            alloc = {lv: int(q) for lv, q in quota.items()}
            for lv in sorted(quota, key=lambda k: (-(quota[k] - alloc[k]), k))[: size - sum(alloc.values())]:
                alloc[lv] += 1
        taken: dict[str, int] = {}
        keep = []
        for i, lv in enumerate(levels):
            if taken.get(lv, 0) < alloc.get(lv, 0):
                taken[lv] = taken.get(lv, 0) + 1
                keep.append(i)
    text = "".join(lines[i] + "\n" for i in keep)
    if write and (not out.is_file() or out.read_text() != text):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    got: dict[str, int] = {}
    for i in keep:
        got[levels[i]] = got.get(levels[i], 0) + 1
    return {"path": str(out), "size": len(keep), "source": str(src.relative_to(ROOT)),
            "by_level": dict(sorted(got.items()))}


# ---------------------------------------------------------------------------------------------
# running one training run under the token budget


def read_rows(path: Path) -> list[dict]:
    """The complete JSON lines of a metrics.jsonl (a line cut by a crash is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def latest_checkpoint_step(run_dir: Path) -> Optional[int]:
    """The step named by `checkpoints/latest_checkpointed_iteration.txt`, or None."""
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(marker.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class Runner:
    """Launches `megatron-rl train` for one `RunSpec` under the token budget (`trainer.max_generated_tokens`)."""

    def __init__(self, args: argparse.Namespace, pool_path: Path) -> None:
        self.args = args
        self.pool_path = pool_path
        self.child: Optional[subprocess.Popen] = None

    def common_overrides(self, spec: RunSpec, run_dir: Path, *, steps: int, before_train: bool) -> list[str]:
        a = self.args
        return [
            f"run_dir={run_dir}", f"trainer.seed={spec.seed}", f"trainer.total_training_steps={steps}",
            f"trainer.max_generated_tokens={a.budget_tokens}",
            "trainer.save_interval=0", "trainer.keep_last_n_checkpoints=1", "trainer.progress_bar=false",
            "trainer.tensorboard=false", f"data.train_files=[{self.pool_path}]",
            f"eval.n={a.eval_n}", f"eval.max_problems={a.eval_problems}",
            f"eval.interval={self.eval_interval(spec)}", f"eval.before_train={str(before_train).lower()}",
            *spec.overrides,
        ]

    def resolved(self, spec: RunSpec):
        from megatron_rl.config import load_config

        return load_config(TINY / f"{spec.recipe}.yaml", spec.overrides)

    def eval_interval(self, spec: RunSpec) -> int:
        """Steps between periodic evaluations: `--evals-per-run` evaluations spread evenly over
        the budget, from the expected tokens of a step (MEAN_RESPONSE_TOKENS, DS_GEN_BATCHES)."""
        if self.args.evals_per_run == 0:
            return 0
        cfg = self.resolved(spec)
        if cfg.algorithm.filter_groups.enable:
            prompts = (cfg.data.gen_batch_size or cfg.data.train_batch_size) * DS_GEN_BATCHES
        else:
            prompts = cfg.data.train_batch_size
        per_step = prompts * cfg.rollout.n * MEAN_RESPONSE_TOKENS
        return max(1, round(self.args.budget_tokens / (self.args.evals_per_run + 1) / per_step))

    def step_cap(self, spec: RunSpec) -> int:
        """A step count the budget stop always comes before: every response at least 4 tokens."""
        cfg = self.resolved(spec)
        return max(4, math.ceil(self.args.budget_tokens / (cfg.data.train_batch_size * cfg.rollout.n * 4)) + 2)

    def launch(self, spec: RunSpec, overrides: list[str], log_path: Path) -> tuple[int, float]:
        """Run the trainer to its end (its token budget). Returns (exit code, wall seconds)."""
        cmd = [self.args.python, "-m", "megatron_rl.cli", "train", "--config", str(TINY / f"{spec.recipe}.yaml"),
               *overrides]
        t0 = time.perf_counter()
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            # on an exception (the study interrupted) the child stays in self.child for main() to stop
            self.child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            code = self.child.wait()
            self.child = None
        return code, time.perf_counter() - t0

    def run(self, spec: RunSpec, run_dir: Path, *, before_train: bool) -> dict:
        """Bring one run to its `summary.json` (skipped when it is there already).

        Returns:
            the run's study state (`study_run.json`): phases (train, or resume from a checkpoint)
            with exit codes and wall times, status "done" or "failed".
        """
        state_path = run_dir / "study_run.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {"phases": []}
        if (run_dir / "summary.json").is_file():
            return state
        failures = 0
        while not (run_dir / "summary.json").is_file():
            if failures >= 2:
                state["status"] = "failed"
                break
            ckpt = latest_checkpoint_step(run_dir)
            if ckpt is None and run_dir.exists():   # nothing to resume from: start over
                shutil.rmtree(run_dir)
                state = {"phases": [], "restarts": state.get("restarts", -1) + 1}
            phase, steps = "train" if ckpt is None else "resume", self.step_cap(spec)
            run_dir.mkdir(parents=True, exist_ok=True)
            overrides = self.common_overrides(spec, run_dir, steps=steps, before_train=before_train)
            print(f"[study] {spec.name}: {phase} (trainer.max_generated_tokens={self.args.budget_tokens})", flush=True)
            code, wall = self.launch(spec, overrides, run_dir / "study_stdout.log")
            state["phases"].append({"phase": phase, "returncode": code, "wall_s": round(wall, 2),
                                    "total_training_steps": steps})
            state_path.write_text(json.dumps(state, indent=1))
            if code != 0:
                failures += 1
                print(f"[study] {spec.name}: {phase} exited with {code}; see {run_dir}/train.log "
                      f"and {run_dir}/study_stdout.log", flush=True)
        else:
            state["status"] = "done"
            if not self.args.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        state_path.write_text(json.dumps(state, indent=1))
        return state


# ---------------------------------------------------------------------------------------------
# analysis


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear interpolation of the points (xs ascending) at x, clamped to the ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            if xs[i] == xs[i - 1]:
                return ys[i]
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


def first_crossing(xs: list[float], ys: list[float], target: float) -> Optional[float]:
    """The x at which the piecewise-linear curve (xs, ys) first reaches `target`, or None."""
    for i, y in enumerate(ys):
        if y >= target:
            if i == 0:
                return xs[0]
            return xs[i - 1] + (target - ys[i - 1]) / (y - ys[i - 1]) * (xs[i] - xs[i - 1])
    return None


def stats(values: list[Optional[float]]) -> dict:
    """{"n", "mean", "std" (sample, None below 2 values), "min", "max", "values"} over the
    non-None values; mean/min/max None when there are none."""
    vals = [v for v in values if v is not None]
    return {
        "n": len(vals),
        "mean": statistics.fmean(vals) if vals else None,
        "std": statistics.stdev(vals) if len(vals) >= 2 else None,
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
        "values": values,
    }


def eval_point(row_or_summary: dict, n: int, *, from_summary: bool) -> dict:
    """One held-out evaluation: avg@n, pass@n, greedy accuracy, format share, and the same per
    difficulty level. From a metrics.jsonl eval row (`eval/...`, `eval/level_L/...`) or from a
    summary.json evaluation (`by_level` with `num_problems`)."""
    keys = {"avg": f"avg@{n}", "pass": f"pass@{n}", "greedy": "greedy_acc", "format_valid": "format_valid"}
    if from_summary:
        ev = row_or_summary
        point = {k: ev.get(v) for k, v in keys.items()}
        point["levels"] = {lv: {k: rec.get(v) for k, v in keys.items()} | {"num_problems": rec.get("num_problems")}
                           for lv, rec in (ev.get("by_level") or {}).items()}
        point["num_problems"] = ev.get("num_problems")
        return point
    r = row_or_summary
    point = {k: r.get(f"eval/{v}") for k, v in keys.items()}
    levels: dict[str, dict] = {}
    for key, value in r.items():
        if key.startswith("eval/level_"):
            lv, _, metric = key[len("eval/level_"):].partition("/")
            for k, v in keys.items():
                if metric == v:
                    levels.setdefault(lv, {})[k] = value
    point["levels"] = dict(sorted(levels.items()))
    return point


def hard_share(point: dict, level_sizes: dict[str, int], hard_levels: list[str]) -> dict:
    """Over the held-out problems of `hard_levels`: share solved by at least one of n samples
    (pass@n), mean sample accuracy (avg@n) and greedy accuracy, weighted by problems per level."""
    out = {}
    for k in ("pass", "avg", "greedy"):
        num = den = 0.0
        for lv in hard_levels:
            rec = point["levels"].get(lv)
            if rec is None or rec.get(k) is None or not level_sizes.get(lv):
                continue
            num += rec[k] * level_sizes[lv]
            den += level_sizes[lv]
        out[k] = num / den if den else None
    return out


def run_record(spec: RunSpec, run_dir: Path, state: dict, base: Optional[dict], args) -> dict:
    """Everything the study reports about one finished run (status "missing" without summary.json)."""
    rec: dict = {"name": spec.name, "label": spec.label, "recipe": f"examples/tiny/{spec.recipe}.yaml",
                 "seed": spec.seed, "overrides": spec.overrides, "run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        rec["status"] = state.get("status", "missing")
        return rec
    summary = json.loads(summary_path.read_text())
    cfg = summary["config"]
    n = cfg["eval"]["n"]
    rows = read_rows(run_dir / "metrics.jsonl")
    train = sorted((r for r in rows if "perf/generated_tokens" in r), key=lambda r: r["step"])
    cum = {0: 0, **{r["step"]: r["perf/total_generated_tokens"] for r in train}}
    evals: dict[int, dict] = {}
    for r in rows:
        if f"eval/avg@{n}" in r:
            evals[r["step"]] = r  # the last row of a step wins (the final evaluation)
    final = eval_point(summary["eval_after"], n, from_summary=True)
    level_sizes = {lv: v["num_problems"] for lv, v in final["levels"].items()}
    curve = []
    if 0 not in evals and base is not None:
        curve.append({"step": 0, "tokens": 0, **base["point"], "from_run": base["from_run"]})
    for step in sorted(evals):
        curve.append({"step": step, "tokens": cum.get(step), **eval_point(evals[step], n, from_summary=False)})
    for p in curve:
        p["hard"] = hard_share(p, level_sizes, args.hard_levels)
    steps = summary["steps"]
    final.update({"step": steps, "tokens": summary["total_generated_tokens"]})
    final["hard"] = hard_share(final, level_sizes, args.hard_levels)
    xs_steps = [p["step"] for p in curve]
    xs_tokens = [p["tokens"] for p in curve]
    ys = [p["avg"] for p in curve]
    gb = cfg["data"]["gen_batch_size"] or cfg["data"]["train_batch_size"]
    drawn = sum(r.get("train/num_gen_batches", 1) * gb for r in train)
    pool_size = sum(1 for _ in open(cfg["data"]["train_files"][0]))
    phases = state.get("phases", [])
    rec.update({
        "status": "done",
        "steps": steps,
        "total_generated_tokens": summary["total_generated_tokens"],
        "tokens_from_metrics": sum(r["perf/generated_tokens"] for r in train),
        "budget_tokens": args.budget_tokens,
        "stop": {"stopped_by_budget": summary["total_generated_tokens"] >= args.budget_tokens, "rule": STOP_RULE},
        "eval_interval": cfg["eval"]["interval"],
        "final": final,
        "curve": curve,
        "steps_to_target": first_crossing(xs_steps, ys, args.target_acc) if curve else None,
        "tokens_to_target": first_crossing(xs_tokens, ys, args.target_acc) if curve else None,
        "train": {
            "mean_num_gen_batches": statistics.fmean(r.get("train/num_gen_batches", 1) for r in train)
            if train else None,
            "mean_response_length": statistics.fmean(r["response_length/mean"] for r in train) if train else None,
            "mean_train_acc": statistics.fmean(r["train/acc"] for r in train) if train else None,
            "daa_amplified_frac_mean": statistics.fmean(r.get("train/daa_amplified_frac", 0.0) for r in train)
            if train else None,
            "prompts_drawn": drawn,
            "epochs_of_pool": drawn / pool_size if pool_size else None,
        },
        "wall_s": round(sum(p["wall_s"] for p in phases), 1) if phases else None,
        "trainer_wall_s": summary.get("wall_s"),
        "phases": phases,
    })
    return rec


def aggregate(records: list[dict], args) -> dict:
    """Per label: mean / std / min / max across seeds of the final and to-target numbers, and
    mean +- std curves of held-out avg@n (overall and per level) on common token and step grids
    (each seed's curve interpolated linearly between its evaluations, up to the shortest seed)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r.get("status") == "done":
            groups.setdefault(r["label"], []).append(r)
    out = {}
    for label, runs in groups.items():
        levels = sorted({lv for r in runs for lv in r["final"]["levels"]}, key=_level_key)
        g = {
            "runs": [r["name"] for r in runs],
            "seeds": [r["seed"] for r in runs],
            "final_avg": stats([r["final"]["avg"] for r in runs]),
            "final_pass": stats([r["final"]["pass"] for r in runs]),
            "final_greedy": stats([r["final"]["greedy"] for r in runs]),
            "final_hard_pass": stats([r["final"]["hard"]["pass"] for r in runs]),
            "final_hard_avg": stats([r["final"]["hard"]["avg"] for r in runs]),
            "final_avg_by_level": {lv: stats([r["final"]["levels"].get(lv, {}).get("avg") for r in runs])
                                   for lv in levels},
            "gain_avg": stats([r["final"]["avg"] - r["curve"][0]["avg"] if r["curve"] and r["curve"][0]["step"] == 0
                               else None for r in runs]),
            "steps": stats([r["steps"] for r in runs]),
            "tokens": stats([r["total_generated_tokens"] for r in runs]),
            "steps_to_target": stats([r["steps_to_target"] for r in runs]),
            "tokens_to_target": stats([r["tokens_to_target"] for r in runs]),
            "reached_target": sum(r["steps_to_target"] is not None for r in runs),
            "wall_s": stats([r["wall_s"] for r in runs]),
            "mean_num_gen_batches": stats([r["train"]["mean_num_gen_batches"] for r in runs]),
            "epochs_of_pool": stats([r["train"]["epochs_of_pool"] for r in runs]),
        }
        curves = {}
        for name, axis, npts in (("tokens", "tokens", 21), ("steps", "step", None)):
            usable = [r for r in runs if len(r["curve"]) >= 1]
            if not usable:
                continue
            end = min(r["curve"][-1][axis] if r["curve"][-1][axis] is not None else 0 for r in usable)
            end = min(end, min(r["final"][axis] for r in usable))
            if npts:
                grid = [end * i / (npts - 1) for i in range(npts)]
            else:
                grid = sorted({p[axis] for r in usable for p in r["curve"] if p[axis] <= end})
            per_key = {"avg": lambda p: p["avg"]}
            for lv in levels:
                per_key[f"level_{lv}"] = lambda p, lv=lv: p["levels"].get(lv, {}).get("avg")
            c = {"x": grid}
            for key, get in per_key.items():
                series = []
                for r in usable:
                    pts = [(p[axis], get(p)) for p in r["curve"] if get(p) is not None and p[axis] is not None]
                    if pts:
                        series.append([_interp([x for x, _ in pts], [y for _, y in pts], x) for x in grid])
                c[key] = {"mean": [statistics.fmean(col) for col in zip(*series)] if series else [],
                          "std": [statistics.stdev(col) if len(col) >= 2 else 0.0 for col in zip(*series)]}
            curves[name] = c
        g["curves"] = curves
        out[label] = g
    return out


def _level_key(lv: str):
    try:
        return (0, float(lv), lv)
    except ValueError:
        return (1, 0.0, lv)


def compare(groups: dict, a: str, b: str, metric: str) -> Optional[dict]:
    """`a` minus `b` on the mean of `metric` across seeds, with the standard error of that
    difference (sqrt(s_a^2/n_a + s_b^2/n_b); None when either side has fewer than 2 seeds)."""
    if a not in groups or b not in groups:
        return None
    sa, sb = groups[a][metric], groups[b][metric]
    if sa["mean"] is None or sb["mean"] is None:
        return None
    se = None
    if sa["std"] is not None and sb["std"] is not None:
        se = math.sqrt(sa["std"] ** 2 / sa["n"] + sb["std"] ** 2 / sb["n"])
    diff = sa["mean"] - sb["mean"]
    verdict = "n/a (one seed)" if se is None else (
        "larger than 2 standard errors" if se > 0 and abs(diff) > 2 * se else "within 2 standard errors (noise)")
    return {"a": a, "b": b, "metric": metric, "diff": diff, "se": se, "n_a": sa["n"], "n_b": sb["n"],
            "verdict": verdict}


# ---------------------------------------------------------------------------------------------
# plots and table

COLORS = {"grpo": "tab:blue", "dapo": "tab:orange", "da3po": "tab:green", "dapo_no_ds": "tab:red"}


def make_plots(records: list[dict], groups: dict, out_dir: Path, n: int) -> list[str]:
    """PNG files under `out_dir`: held-out avg@n vs generated tokens and vs steps (main labels:
    mean +- std across seeds, faint lines per seed), per difficulty level vs tokens, ablations vs
    tokens, and final numbers per label. Returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    main = [lb for lb in MAIN_ALGORITHMS if lb in groups]
    others = [lb for lb in groups if lb not in MAIN_ALGORITHMS]
    cmap = plt.get_cmap("tab10")

    def color(label: str, i: int = 0):
        return COLORS.get(label, cmap((i + 4) % 10))

    def band(ax, label, axis, key, i=0):
        c = groups[label]["curves"].get(axis)
        if not c or not c.get(key, {}).get("mean"):
            return
        m, s = c[key]["mean"], c[key]["std"]
        nseeds = groups[label]["final_avg"]["n"]
        ax.plot(c["x"], m, color=color(label, i), label=f"{label} (n={nseeds})")
        if nseeds >= 2:
            ax.fill_between(c["x"], [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)],
                            color=color(label, i), alpha=0.2)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (axis, key) in zip(axes, (("tokens", "tokens"), ("steps", "step"))):
        for label in main:
            for r in records:
                if r.get("status") == "done" and r["label"] == label:
                    ax.plot([p[key] for p in r["curve"]], [p["avg"] for p in r["curve"]], color=color(label),
                            alpha=0.3, lw=0.8, marker=".")
            band(ax, label, axis, "avg")
        ax.set_xlabel("generated tokens" if axis == "tokens" else "RL steps")
        ax.set_ylabel(f"held-out avg@{n}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Held-out accuracy: mean +- std across seeds (faint: each seed)")
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=110)
    plt.close(fig)
    written.append("accuracy.png")

    levels = sorted({lv for g in groups.values() for lv in g["final_avg_by_level"]}, key=_level_key)
    if levels and main:
        fig, axes = plt.subplots(1, len(levels), figsize=(3.2 * len(levels), 3.6), sharey=False)
        for ax, lv in zip(axes if len(levels) > 1 else [axes], levels):
            for label in main:
                band(ax, label, "tokens", f"level_{lv}")
            ax.set_title(f"level {lv}")
            ax.set_xlabel("generated tokens")
            ax.grid(alpha=0.3)
        axes_list = axes if len(levels) > 1 else [axes]
        axes_list[0].set_ylabel(f"held-out avg@{n}")
        axes_list[0].legend(fontsize=8)
        fig.suptitle("Held-out accuracy per difficulty level (mean +- std across seeds)")
        fig.tight_layout()
        fig.savefig(out_dir / "accuracy_by_level.png", dpi=110)
        plt.close(fig)
        written.append("accuracy_by_level.png")

    if others:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, label in enumerate(["dapo", "da3po"] + others):
            if label in groups:
                band(ax, label, "tokens", "avg", i)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel(f"held-out avg@{n}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Ablations (one seed each) against DAPO and DA3PO")
        fig.tight_layout()
        fig.savefig(out_dir / "ablations.png", dpi=110)
        plt.close(fig)
        written.append("ablations.png")

    labels = main + others
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(labels) * 2), 4.2))
    for ax, (metric, title) in zip(axes, (("final_avg", f"final held-out avg@{n}"),
                                          ("final_hard_pass", f"hard problems solved (pass@{n})"))):
        means = [groups[lb][metric]["mean"] or 0.0 for lb in labels]
        errs = [groups[lb][metric]["std"] or 0.0 for lb in labels]
        ax.bar(range(len(labels)), means, yerr=errs, color=[color(lb, i) for i, lb in enumerate(labels)], capsize=4)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("At the token budget (error bars: std across seeds)")
    fig.tight_layout()
    fig.savefig(out_dir / "final.png", dpi=110)
    plt.close(fig)
    written.append("final.png")
    return written


def _fmt(s: dict, digits: int = 3) -> str:
    if s["mean"] is None:
        return "-"
    if s["std"] is None:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} +- {s['std']:.{digits}f}"


def print_table(groups: dict, n: int) -> None:
    head = ["label", "seeds", f"final avg@{n}", "gain", f"hard pass@{n}", "steps", "tokens", "steps->target",
            "wall s"]
    rows = [head]
    for label, g in groups.items():
        rows.append([label, str(g["final_avg"]["n"]), _fmt(g["final_avg"]), _fmt(g["gain_avg"]),
                     _fmt(g["final_hard_pass"]), _fmt(g["steps"], 1), _fmt(g["tokens"], 0),
                     f"{_fmt(g['steps_to_target'], 1)} ({g['reached_target']}/{g['final_avg']['n']})",
                     _fmt(g["wall_s"], 0)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI mode: one seed of grpo/dapo/da3po, a 6000-token budget (2 steps), a small eval")
    p.add_argument("--out", type=Path, help="study folder (default runs/study, runs/study-quick with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="trainer.seed values (default 1 2 3)")
    p.add_argument("--budget-tokens", type=int, help="generated response tokens a run (default 250000; quick 6000)")
    p.add_argument("--pool-size", type=int,
                   help="training prompts, stratified by level (default 320; quick 64; 0 = all 940)")
    p.add_argument("--eval-n", type=int, help="eval.n: samples a held-out problem (default 4; quick 2)")
    p.add_argument("--eval-problems", type=int, help="eval.max_problems (default 0 = all 296; quick 32)")
    p.add_argument("--evals-per-run", type=int, help="periodic evaluations spread over the budget (default 3; quick 1)")
    p.add_argument("--target-acc", type=float, default=0.40,
                   help="held-out avg@n for steps/tokens-to-target (default 0.40)")
    p.add_argument("--hard-levels", nargs="+", default=["4", "5"],
                   help="difficulty levels counted as hard (default 4 5)")
    p.add_argument("--only", nargs="+", help="run only these run names or labels (e.g. grpo dapo_s2)")
    p.add_argument("--analyze-only", action="store_true", help="launch nothing; recompute study.json and the plots")
    p.add_argument("--dry-run", action="store_true", help="print the plan and each run's overrides, launch nothing")
    p.add_argument("--results", type=Path,
                   help="also copy study.json here (default benchmarks/results/study.json for the full study)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's checkpoint")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs megatron-rl (default: this one)")
    args = p.parse_args(argv)
    defaults = ({"budget_tokens": 6000, "pool_size": 64, "eval_n": 2, "eval_problems": 32, "evals_per_run": 1}
                if args.quick else
                {"budget_tokens": 250000, "pool_size": 320, "eval_n": 4, "eval_problems": 0, "evals_per_run": 3})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = ROOT / ("runs/study-quick" if args.quick else "runs/study")
    if args.results is None and not args.quick:
        args.results = ROOT / "benchmarks" / "results" / "study.json"
    if args.budget_tokens <= 0:
        p.error(f"--budget-tokens: {args.budget_tokens} must be > 0")
    if args.eval_n <= 0 or args.eval_problems < 0 or args.evals_per_run < 0:
        p.error("--eval-n must be > 0, --eval-problems and --evals-per-run >= 0")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds: {args.seeds} repeats a seed")
    args.out = args.out.resolve()
    return args


def base_eval_of(plan: list[RunSpec], runs_dir: Path) -> Optional[dict]:
    """The step-0 evaluation (the base model) from the first run dir that has one."""
    for spec in plan:
        rows = read_rows(runs_dir / spec.name / "metrics.jsonl")
        for r in rows:
            if r["step"] == 0 and any(k.startswith("eval/avg@") for k in r):
                n = next(int(k.split("@")[1]) for k in r if k.startswith("eval/avg@"))
                return {"from_run": spec.name, "point": eval_point(r, n, from_summary=False)}
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    plan = build_plan(args.seeds, quick=args.quick, only=args.only)
    runs_dir = args.out / "runs"
    pool = make_pool(args.pool_size, args.out / "pool.jsonl", write=not args.dry_run)
    runner = Runner(args, Path(pool["path"]))
    t0 = time.perf_counter()
    print(f"[study] {len(plan)} runs, budget {args.budget_tokens} generated tokens each, pool {pool['size']} "
          f"prompts {pool['by_level']}, eval n={args.eval_n} on {args.eval_problems or 'all'} problems; out {args.out}",
          flush=True)
    if args.dry_run:
        for spec in plan:
            ov = runner.common_overrides(spec, runs_dir / spec.name, steps=runner.step_cap(spec), before_train=False)
            print(f"{spec.name}: examples/tiny/{spec.recipe}.yaml {' '.join(ov)}")
        return 0
    states = {}
    interrupted = False
    if not args.analyze_only:
        def stop(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        try:
            for spec in plan:
                run_dir = runs_dir / spec.name
                before = base_eval_of(plan, runs_dir) is None
                t_run = time.perf_counter()
                states[spec.name] = runner.run(spec, run_dir, before_train=before)
                print(f"[study] {spec.name}: {states[spec.name].get('status', 'done')} "
                      f"({time.perf_counter() - t_run:.0f} s; study {time.perf_counter() - t0:.0f} s)", flush=True)
        except KeyboardInterrupt:
            interrupted = True
            if runner.child is not None and runner.child.poll() is None:
                print("[study] interrupted: stopping the run in flight (it checkpoints; rerun to resume)", flush=True)
                runner.child.send_signal(signal.SIGTERM)
                try:
                    runner.child.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    runner.child.kill()
    for spec in plan:
        path = runs_dir / spec.name / "study_run.json"
        if spec.name not in states:
            states[spec.name] = json.loads(path.read_text()) if path.is_file() else {}
    base = base_eval_of(plan, runs_dir)
    records = [run_record(spec, runs_dir / spec.name, states[spec.name], base, args) for spec in plan]
    groups = aggregate(records, args)
    comparisons = [c for c in (compare(groups, a, b, m)
                               for a, b in (("da3po", "dapo"), ("dapo", "grpo"), ("da3po", "grpo"))
                               for m in ("final_avg", "final_hard_pass", "steps_to_target", "tokens_to_target"))
                   if c is not None]
    result = {
        "study": {
            "mode": "quick" if args.quick else "full",
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "budget_tokens": args.budget_tokens,
            "seeds": args.seeds,
            "pool": pool,
            "eval": {"n": args.eval_n, "max_problems": args.eval_problems, "evals_per_run": args.evals_per_run,
                     "data": "examples/tiny/data/test.jsonl"},
            "target_acc": args.target_acc,
            "hard_levels": args.hard_levels,
            "stop_rule": STOP_RULE,
            "wall_s_this_invocation": round(time.perf_counter() - t0, 1),
            "wall_s_runs": round(sum(r.get("wall_s") or 0 for r in records), 1),
            "cpus": os.cpu_count(),
            "loadavg_at_end": list(os.getloadavg()),
            "interrupted": interrupted,
        },
        "base_eval": base,
        "runs": {r["name"]: r for r in records},
        "groups": groups,
        "comparisons": comparisons,
        "failed": [r["name"] for r in records if r.get("status") != "done"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plots = make_plots(records, groups, args.out / "plots", args.eval_n) if groups else []
    result["plots"] = [str(args.out / "plots" / p) for p in plots]
    text = json.dumps(result, indent=1, default=str)
    (args.out / "study.json").write_text(text)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)
    print()
    print_table(groups, args.eval_n)
    for c in comparisons:
        if c["metric"] == "final_avg":
            se = "-" if c["se"] is None else f"{c['se']:.3f}"
            print(f"{c['a']} - {c['b']} final avg@{args.eval_n}: {c['diff']:+.3f} (se {se}): {c['verdict']}")
    print(f"\n[study] {args.out / 'study.json'}; plots in {args.out / 'plots'}; "
          f"runs {result['study']['wall_s_runs']:.0f} s")
    if result["failed"]:
        print(f"[study] not finished: {', '.join(result['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
