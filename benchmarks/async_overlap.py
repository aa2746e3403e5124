"""Asynchronous training on the tiny DA3PO recipe: eta = 0 vs 1 vs 2, rollout server and trainer on one core each.

Issue 16's measurement. One invocation trains `examples/tiny/da3po.yaml` once per arm (arms
`trainer.max_staleness` = 0, 1, 1p, 1i, 2: `1p` is eta = 1 with `rollout.partial_rollout=true`, `1i` with
`rollout.pause_mode=in_place` (`ARM_SUFFIXES`); same seed, `--steps` RL steps each, no evaluation inside the
runs, final checkpoint saved) and reports for each arm:

* RL steps per minute and generated tokens per second over the training wall time (the sum of
  `timing/step_s` over every step: in async mode a step's time includes `timing/wait_rollout_s`,
  the time the trainer waited for the step's rollouts, so the first step carries the pipeline fill
  and a 20-step run amortises it; start-up and the checkpoint write are left out). `--skip-first N`
  leaves the first N steps out, which flatters eta > 0: step 2 then reaps what the fill generated;
* the speed-up over eta = 0 and its share of the **ideal overlap bound**
  `step_sync / max(rollout, train)`, computed from the eta = 0 run's own timings (means per step):
  rollout = `timing/generate_s` + `timing/reward_s` + `timing/filter_s` (the producer's phases),
  train = `timing/old_logprob_s` + `timing/update_s` + `timing/weight_sync_s` (the trainer's),
  step_sync = `timing/step_s`. With perfect overlap a step costs the longer of the two;
  `timing/advantage_s` and the metrics write stay on the trainer's critical path and are in
  step_sync only, so the bound is slightly optimistic;
* staleness (`train/staleness_mean`, `train/staleness_max`) and `rollout/resubmitted` (requests a
  live update aborted and generated again: the tiny recipe's `rollout.pause_mode: abort` without
  partial rollouts restarts them from scratch, under the newer version);
* held-out avg@8 of the final checkpoint (`megatron-rl eval` on examples/tiny/data/test.jsonl,
  `benchmarks/trl_compare.run_eval`) after the same number of steps.

**Core placement.** The machine's first core runs the rollout server, the second the trainer.
No config key sets a server's CPU affinity, so nothing in megatron_rl changes: the benchmark starts
the embedded server itself through the trainer's own launch code (`rollout.engine_set.EngineSet`,
the same flags and thread share as `megatron-rl train` gives it) from a thread pinned to core 0
(`os.sched_setaffinity`: the server process and its threads inherit it), and runs
`taskset -c 1 megatron-rl train ... rollout.server_urls=[URL]`; a fresh server per arm. With one
core each the two sides overlap only when the trainer trains while the server generates, which is
what eta > 0 is for. `--cpus SERVER,TRAINER` picks other cores.

The CPU used by processes outside the benchmark's own tree is sampled during each arm
(`trl_compare.LoadMonitor`'s foreign CPU; the 1-minute load average is recorded too, but the two
sides' own threads push it to 3-8 on 2 cores with nothing else running, so it cannot tell idle from
loaded); a result where other processes used more than `trl_compare.FOREIGN_IDLE_CPUS` CPUs on
average during an arm (`foreign_verdict`) is marked LOADED, and its numbers say little (the bound
assumes two otherwise idle cores).

    .venv/bin/python benchmarks/async_overlap.py             # 20 RL steps an arm + eval; ~25-40 min idle
    .venv/bin/python benchmarks/async_overlap.py --smoke     # 2 RL steps an arm, no eval (tests)

Prints a table and writes `benchmarks/results/async_overlap.json` (`--smoke`: `async_overlap_smoke.json`;
`--out` elsewhere). Target (issue 16):
eta = 1 reaches >= 85% of the ideal bound, with held-out avg@8 within 2 points of eta = 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from trl_compare import LoadMonitor, foreign_verdict, run_eval  # noqa: E402

RECIPE = REPO / "examples" / "tiny" / "da3po.yaml"
ROLLOUT_KEYS = ("timing/generate_s", "timing/reward_s", "timing/filter_s")
TRAIN_KEYS = ("timing/old_logprob_s", "timing/update_s", "timing/weight_sync_s")
ETAS = ("0", "1", "1p", "1i", "2")


ARM_SUFFIXES = {"p": ["rollout.partial_rollout=true"], "i": ["rollout.pause_mode=in_place"]}
"""Arm label suffixes and the overrides they add: `p` resumes a request aborted by a live update from
its prefix (`rollout.partial_rollout`), `i` keeps requests in flight through the update on the new
weights (`rollout.pause_mode: in_place`); a bare eta uses the recipe's `pause_mode: abort`, which
restarts aborted requests from scratch."""


def arm_eta(label) -> int:
    """`trainer.max_staleness` of an arm label: an integer with an optional suffix of `ARM_SUFFIXES`
    (`1`, `1p`, `1i`).

    Raises:
        ValueError: any other label.
    """
    text = str(label)
    core = text[:-1] if text[-1:] in ARM_SUFFIXES else text
    if not core.isdigit():
        raise ValueError(f"arm {text!r}: expected an integer eta with an optional suffix "
                         f"({', '.join(ARM_SUFFIXES)}), e.g. 1, 1p or 1i")
    return int(core)


def arm_overrides(label) -> list[str]:
    """The config overrides an arm label adds (`ARM_SUFFIXES`; none for a bare eta)."""
    return list(ARM_SUFFIXES.get(str(label)[-1:], []))


def step_rows(run_dir: Path) -> list[dict]:
    """The per-step rows (with `timing/step_s`) of `run_dir/metrics.jsonl`, in step order (a repeated
    step keeps its last row)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    by_step = {r["step"]: r for r in rows if "timing/step_s" in r}
    return [by_step[s] for s in sorted(by_step)]


def _mean(rows: list[dict], keys: tuple[str, ...]) -> float:
    return statistics.mean(sum(float(r.get(k) or 0.0) for k in keys) for r in rows)


def overlap_bound(rows: list[dict]) -> dict:
    """The ideal overlap bound of a synchronous (eta = 0) run from its step rows: mean `step_s`,
    mean rollout (generate + reward + filter) and train (old log-probs + update + weight sync)
    seconds a step, and `bound` = step_s / max(rollout, train).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no step rows for the overlap bound")
    step, rollout, train = _mean(rows, ("timing/step_s",)), _mean(rows, ROLLOUT_KEYS), _mean(rows, TRAIN_KEYS)
    return {"step_sync_s": step, "rollout_s": rollout, "train_s": train,
            "bound": step / max(rollout, train, 1e-9), "steps": len(rows)}


def arm_summary(rows: list[dict]) -> dict:
    """RL steps/min, generated tokens/s (over the summed `timing/step_s`), mean step seconds, mean
    wait for rollouts and the staleness (mean of the per-step means, max of the maxima) of one arm."""
    if not rows:
        raise ValueError("no step rows")
    wall = max(sum(float(r["timing/step_s"]) for r in rows), 1e-9)
    return {"steps": len(rows), "train_s": wall, "rl_steps_per_min": 60.0 * len(rows) / wall,
            "generated_tokens_per_s": sum(float(r.get("perf/generated_tokens") or 0) for r in rows) / wall,
            "mean_step_s": wall / len(rows), "wait_rollout_s": _mean(rows, ("timing/wait_rollout_s",)),
            "rollout_s": _mean(rows, ROLLOUT_KEYS), "train_phase_s": _mean(rows, TRAIN_KEYS),
            "resubmitted": sum(int(r.get("rollout/resubmitted") or 0) for r in rows),
            "staleness_mean": statistics.mean(float(r.get("train/staleness_mean") or 0.0) for r in rows),
            "staleness_max": max(float(r.get("train/staleness_max") or 0.0) for r in rows)}


def compare(arms: dict[int, list[dict]], skip_first: int = 0) -> dict:
    """Per-arm summaries from `{eta: step rows}`, with `speedup` over eta = 0 and `share_of_bound`
    (speed-up / the eta = 0 run's `overlap_bound`). The first `skip_first` steps of every arm are
    left out when at least one step remains (default none: in async mode step 1 fills the pipeline
    and the next steps profit from it, so only the whole run compares fairly)."""
    used = {eta: (rows[skip_first:] if len(rows) > skip_first else rows) for eta, rows in arms.items()}
    zero = next((k for k in used if str(k) == "0"), None)
    if zero is None:
        raise ValueError("compare needs the eta = 0 arm (labelled 0): the bound comes from its timings")
    bound = overlap_bound(used[zero])
    out = {eta: arm_summary(rows) for eta, rows in sorted(used.items(), key=lambda kv: (arm_eta(kv[0]), str(kv[0])))}
    base = out[zero]["rl_steps_per_min"]
    for s in out.values():
        s["speedup"] = s["rl_steps_per_min"] / base
        s["share_of_bound"] = s["speedup"] / bound["bound"]
    return {"bound": bound, "arms": out,
            "skipped_first_steps": max(0, min(skip_first, min(len(r) for r in arms.values()) - 1))}


def format_table(result: dict) -> str:
    """The comparison as a Markdown table, titled with the bound and the load verdict."""
    b, n = result["bound"], result.get("eval_n", 8)
    lines = [f"ideal overlap bound (eta = 0 timings): step {b['step_sync_s']:.2f} s / "
             f"max(rollout {b['rollout_s']:.2f} s, "
             f"train {b['train_s']:.2f} s) = {b['bound']:.2f}x"
             + ("" if result.get("idle", True) else f"   ** LOADED MACHINE: {result.get('load_verdict', '')} **"),
             f"| eta | steps | step s | RL steps/min | gen tok/s | wait s | speed-up | % of bound | staleness mean/max "
             f"| resubmitted | avg@{n} | other CPUs |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for eta, s in result["arms"].items():
        ev = (result.get("eval") or {}).get(str(eta))
        acc = f"{ev[f'avg@{n}']:.3f}" if ev else "-"
        load = s.get("foreign_cpus_mean")
        lines.append(f"| {eta} | {s['steps']} | {s['mean_step_s']:.2f} | {s['rl_steps_per_min']:.2f} | "
                     f"{s['generated_tokens_per_s']:.0f} | {s['wait_rollout_s']:.2f} | {s['speedup']:.2f}x | "
                     f"{100 * s['share_of_bound']:.0f}% | {s['staleness_mean']:.2f}/{s['staleness_max']:.0f} | "
                     f"{s['resubmitted']} | {acc} | "
                     f"{'-' if load is None else f'{load:.2f}'} |")
    return "\n".join(lines)


def run_arm(label: str, work: Path, steps: int, seed: int, cpus: tuple[int, int], log) -> tuple[list[dict], dict]:
    """Train the recipe with `trainer.max_staleness` = the arm's eta (`arm_eta(label)`, plus the
    label's `arm_overrides`) for `steps` steps, the server pinned to
    `cpus[0]` and the trainer to `cpus[1]`; returns (step rows, {wall, load}).

    Raises:
        SystemExit: the trainer failed (names its log).
    """
    from megatron_rl.config import load_config
    from megatron_rl.rollout.engine_set import EngineSet

    eta = arm_eta(label)
    run_dir = work / f"eta{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run_dir={run_dir}", f"trainer.total_training_steps={steps}", "trainer.save_interval=0",
                 "trainer.save_last=true", "trainer.progress_bar=false", "trainer.tensorboard=false",
                 f"trainer.seed={seed}", "eval.before_train=false", "eval.after_train=false",
                 f"trainer.max_staleness={eta}"] + arm_overrides(label)
    cfg = load_config(RECIPE, overrides)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})  # the launch thread and the server inherit core cpus[0]
    try:
        engines = EngineSet(cfg)
    finally:
        os.sched_setaffinity(0, mine)
    try:
        engines.connect()
        url = [p.base_url for p in engines.processes]
        server_cpus = sorted(os.sched_getaffinity(engines.processes[0].process.pid))  # recorded: the pinning held
        cli = Path(sys.executable).parent / "megatron-rl"
        cmd = ["taskset", "-c", str(cpus[1]), str(cli), "train", "--config", str(RECIPE), *overrides,
               f"rollout.server_urls=[{url[0]}]"]
        t0 = time.perf_counter()
        with open(work / f"eta{label}.log", "w") as fh, LoadMonitor() as load:
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        wall = time.perf_counter() - t0
    finally:
        engines.stop()
    if r.returncode:
        raise SystemExit(f"arm {label}: megatron-rl train failed (exit {r.returncode}); log: {work / f'eta{label}.log'}")
    rows = step_rows(run_dir)
    log(f"arm {label}: {len(rows)} steps, {sum(x['timing/step_s'] for x in rows):.1f} s of steps, {wall:.1f} s in all, "
        f"load max {load.max:.1f}, other processes {load.foreign_mean or 0:.2f} CPUs on average")
    return rows, {"process_wall_s": wall, "loadavg_max": load.max, "loadavg_mean": load.mean,
                  "foreign_cpus_mean": load.foreign_mean, "foreign_cpus_max": load.foreign_max,
                  "checkpoint": str(run_dir), "server_affinity": server_cpus}


def main() -> None:
    """Run the three arms (and the evaluations), print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="RL steps per arm")
    ap.add_argument("--smoke", action="store_true", help="2 RL steps per arm, no evaluation (tests)")
    ap.add_argument("--skip-eval", action="store_true", help="no held-out evaluation")
    ap.add_argument("--etas", default=",".join(map(str, ETAS)), help="the arms: eta values with an optional suffix, p = rollout.partial_rollout=true, i = "
                         "rollout.pause_mode=in_place (0 must be one: the bound's source)")
    ap.add_argument("--cpus", default="0,1", help="SERVER_CPU,TRAINER_CPU")
    ap.add_argument("--skip-first", type=int, default=0,
                    help="leave the first N steps of each arm out (flatters eta > 0)")
    ap.add_argument("--reuse", action="store_true",
                    help="summarise the arms already in --work-dir (their eta*.side.json) instead of training again")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-n", type=int, default=8)
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a new folder under the temp dir")
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/async_overlap.json (--smoke: async_overlap_smoke.json)")
    args = ap.parse_args()
    steps = 2 if args.smoke else args.steps
    out = args.out or REPO / "benchmarks" / "results" / f"async_overlap{'_smoke' if args.smoke else ''}.json"
    etas = list(dict.fromkeys(x.strip() for x in args.etas.split(",") if x.strip()))
    try:
        sorted_etas = sorted(etas, key=lambda x: (arm_eta(x), x))
    except ValueError as e:
        ap.error(f"--etas: {e}")
    etas = sorted_etas
    cpus = tuple(int(x) for x in args.cpus.split(","))
    if "0" not in etas or len(cpus) != 2:
        ap.error("--etas must include 0 and --cpus must name two cores")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megatron-rl-async-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # subprocess.run / EngineSet.stop clean up

    def log(msg: str) -> None:
        print(f"[async_overlap {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"work dir {work}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {steps} steps an arm")
    arms, sides = {}, {}
    for eta in etas:
        side_file = work / f"eta{eta}.side.json"
        if args.reuse and side_file.is_file():
            arms[eta], sides[eta] = step_rows(work / f"eta{eta}"), json.loads(side_file.read_text())
            log(f"eta {eta}: reused {work / f'eta{eta}'}")
            continue
        arms[eta], sides[eta] = run_arm(eta, work, steps, args.seed, cpus, log)
        side_file.write_text(json.dumps(sides[eta]))
    result = compare(arms, args.skip_first)
    for eta, side in sides.items():
        result["arms"][eta].update(side)
    idle, why = foreign_verdict({f"eta{e}": s for e, s in sides.items()})
    result.update(benchmark="async_overlap", recipe=os.path.relpath(RECIPE, REPO), steps=steps, smoke=args.smoke,
                  cpus={"server": cpus[0], "trainer": cpus[1]}, cpu_count=os.cpu_count(), idle=idle,
                  load_verdict=why, eval_n=args.eval_n, eval={})
    if not (args.smoke or args.skip_eval):
        for eta in etas:
            ck = sides[eta]["checkpoint"]
            result["eval"][str(eta)] = run_eval(ck, work / f"eval-eta{eta}", args.eval_n, args.seed, log,
                                                reuse=args.reuse)
    result["arms"] = {str(k): v for k, v in result["arms"].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
