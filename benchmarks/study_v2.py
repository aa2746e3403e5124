"""Study v2 (issue 19 item 3): does DA3PO with the paper's rule beat DAPO on hard prompts at equal generated tokens?

The design below was fixed before any v2 run; docs/reproduction.md "Study v2: design" gives the
numbers behind each choice.

* **Pool** where hard prompts recur: the first 32 / 64 / 64 rows of levels 3 / 4 / 5 of
  examples/tiny/data/train.jsonl (160 prompts; base model avg@8 0.32 / 0.098 / 0.057 on those
  levels), drawn ~10 times each in a run.
* **G = rollout.n = 16** (the paper's); 8 prompts x 16 responses trained a step (128 sequences,
  as the recipes' 16 x 8) in 2 optimizer updates (`actor.ppo_mini_batch_size=4`); the
  dynamic-sampling arms draw generation batches of 12 prompts (the recipes' 1.5x over-draw).
* **Arms**, every one with the same seeds (paired: `trainer.seed` alone sets the prompt order of
  every epoch, each response's sampling seed (seed, step, generation batch, prompt, response) and
  the server's seed, so two arms at one seed draw the same prompts and sample the same step-1
  rollouts): `grpo`, `dapo`, `da3po` (the paper's rule as reported: `factor: constant`, lambda
  `amplification` 2, `hard_threshold` 0.5, `difficulty: group`, pinned), `da3po_balanced_history`
  (this project's `factor: balanced` + `difficulty: history`).
* **Budget** 800,000 generated tokens a run (`trainer.max_generated_tokens`): ~100 steps of the
  dynamic-sampling arms, ~200 of GRPO.
* **Evaluation at fixed token counts**: `eval.token_interval` = budget / 5 evaluates after the
  first step whose running total reaches 160k, 320k, 480k, 640k tokens, and the final evaluation
  follows the step that reaches 800k; the base model (once per study) is the point at 0.

PRIMARY METRIC (fixed before the runs): held-out levels 4-5 avg@16 = mean correctness of 16
samples (temperature 1.0, `eval.seed` 1234) on each of the 128 level-4/5 problems of
examples/tiny/data/test.jsonl, taken (a) at the budget (final value) and (b) as the area under
its curve over the 6 token checkpoints 0, 160k, ..., 800k (trapezoid over the nominal token
counts, divided by the budget: the mean accuracy over the run). The primary comparison is the
paired difference DA3PO - DAPO over seeds with its paired-t 95% interval; the others (DA3PO -
GRPO, DAPO - GRPO, the balanced + history variant against both DAPO and DA3PO) are reported the
same way. Secondary: overall avg@4, pass@4 and greedy accuracy on all 296 held-out problems after
the budget (one evaluation of the final checkpoint), levels 4-5 pass@16 and greedy accuracy,
per-level avg@16.

Seeds: a pilot of 2 seeds (`--pilot`) measures the paired seed-to-seed spread: the residual SD
sigma of the additive arm + seed model over the complete seed blocks (df = (arms - 1)(seeds - 1)),
sd_d = sqrt(2) sigma the SD of a paired difference; the seeds needed to tell a 3-point difference
from noise (two-sided alpha 0.05, power 0.8) are the smallest n with
n >= ((t_{0.975, n-1} + t_{0.8, n-1}) sd_d / 0.03)^2 (`--analyze-only` prints it, with the normal
approximation ((1.96 + 0.84) sd_d / 0.03)^2); then `--seeds 1 2 ... n` adds the missing runs,
at most what ~6 hours of machine time allow.

Long study across sessions: each finished run writes `benchmarks/results/study_v2/<run>.json`
(small: the evaluation points, secondary evaluation, training stats, overrides, wall time); a
run whose file exists is skipped, so the study resumes on any machine from what is committed
(`--commit` commits each file as it is written). SIGTERM (or Ctrl-C) stops the run in flight
after its current step with a checkpoint; the same command resumes it. Progress and an ETA go to
`<out>/study_v2.log`. `--analyze-only` recomputes everything (paired differences with 95%
intervals, seed count, plots) from the result files alone.

    .venv/bin/python benchmarks/study_v2.py --dry-run            # the plan, overrides, time estimate
    nohup nice -n 10 .venv/bin/python benchmarks/study_v2.py --pilot --commit > runs/study_v2.out 2>&1 &
    .venv/bin/python benchmarks/study_v2.py --seeds 1 2 3 4 5 6  # add seeds (done runs are skipped)
    .venv/bin/python benchmarks/study_v2.py --analyze-only       # analysis JSON, plots, table
    .venv/bin/python benchmarks/study_v2.py --quick              # pipeline check (tests/e2e/test_study_v2_quick.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study import (ROOT, TINY, TRAIN_JSONL, RunSpec, _fmt, eval_point, latest_checkpoint_step,  # noqa: E402
                   make_pool, read_rows, stats)

TEST_JSONL = TINY / "data" / "test.jsonl"
BASE_EVAL = TINY / "base_model" / "eval_base.json"

GRPO_AS_RUN = ["actor.old_logprob_source=recompute", "actor.sequence_packing=false", "rollout.num_servers=1",
               "trainer.nproc_per_node=1", "trainer.attention_backend=auto", "trainer.transformer_impl=auto",
               "weight_sync.load_format=null"]
"""examples/tiny/grpo.yaml as the study ran it: issue 22 (after the study) gave the recipe 2 servers, 2
trainer ranks, the engine's log-probs, sequence packing, SDPA attention and one-bucket syncs for speed;
a run added to the study keeps the settings its committed runs had."""

ARMS: list[tuple[str, str, list[str]]] = [
    ("grpo", "grpo", GRPO_AS_RUN),
    ("dapo", "dapo", ["data.gen_batch_size=12"]),
    ("da3po", "da3po", ["data.gen_batch_size=12", "algorithm.daa.factor=constant", "algorithm.daa.amplification=2.0",
                        "algorithm.daa.hard_threshold=0.5", "algorithm.daa.difficulty=group"]),
    ("da3po_balanced_history", "da3po", ["data.gen_batch_size=12", "algorithm.daa.factor=balanced",
                                         "algorithm.daa.difficulty=history"]),
]
"""(arm, recipe, the arm's own overrides). Every arm also gets `common_overrides`."""
ARM_NAMES = [a for a, _, _ in ARMS]
PAIRS = [("da3po", "dapo"), ("da3po_balanced_history", "dapo"), ("da3po", "da3po_balanced_history"),
         ("dapo", "grpo"), ("da3po", "grpo")]
"""Paired comparisons (a - b); the first is the primary one."""
PRIMARY = ("final_hard_avg", "auc_hard_avg")
SECONDARY = ("final_overall_avg", "final_overall_pass", "final_overall_greedy", "final_hard_pass",
             "final_hard_greedy", "final_level4_avg", "final_level5_avg")
PILOT_SEEDS = [1, 2]
DELTA, ALPHA, POWER = 0.03, 0.05, 0.8
STUDY_HOURS = 6.0
"""Machine time for the whole study (pilot included): caps the seed count."""

FULL = {"pool": {"3": 32, "4": 64, "5": 64}, "G": 16, "train_batch_size": 8, "gen_batch_size": 12,
        "ppo_mini_batch_size": 4, "budget_tokens": 800_000, "eval_points": 5,
        "hard_eval": {"levels": ["4", "5"], "n": 16, "max_problems": 0},
        "overall_eval": {"n": 4, "max_problems": 0}, "save_interval": 20}
"""The design (see the module docstring); `settings` of every result file."""
QUICK = {**FULL, "pool": {"3": 8, "4": 8, "5": 8}, "budget_tokens": 6000, "eval_points": 2,
         "hard_eval": {"levels": ["4", "5"], "n": 2, "max_problems": 16},
         "overall_eval": {"n": 2, "max_problems": 16}, "save_interval": 0}
"""`--quick`: the pipeline on a 24-prompt pool, 1-2 steps a run, small evaluations."""

IDLE = {"start_s": 15.0, "train_s_per_token": {"grpo": 0.80e-3, "ds": 0.65e-3}, "eval_s_per_token": 0.55e-3,
        "checkpoint_s": 1.0}
"""Idle 2-core machine, from study v1 (docs/reproduction.md "Study v2: design", time budget):
a trainer start; seconds of a training step per generated token (GRPO trains on every response,
dynamic sampling drops some); an evaluation per generated token; a checkpoint."""


# ---------------------------------------------------------------------------------------------
# the plan


def settings_for(quick: bool, budget_tokens: Optional[int] = None) -> dict:
    s = json.loads(json.dumps(QUICK if quick else FULL))
    if budget_tokens:
        s["budget_tokens"] = budget_tokens
    s["token_interval"] = s["budget_tokens"] // s["eval_points"]
    if s["token_interval"] * s["eval_points"] != s["budget_tokens"]:
        raise SystemExit(f"study_v2: the budget {s['budget_tokens']} must be a multiple of {s['eval_points']}")
    return s


def build_plan(seeds: list[int], only: Optional[list[str]] = None) -> list[RunSpec]:
    """Seed by seed, every arm (a study cut short still has complete pairs). `only`: names or arms."""
    plan = [RunSpec(f"{arm}_s{s}", arm, recipe, s, list(ov)) for s in seeds for arm, recipe, ov in ARMS]
    if only:
        unknown = set(only) - {r.name for r in plan} - set(ARM_NAMES)
        if unknown:
            raise SystemExit(f"study_v2: --only {sorted(unknown)}: no such run or arm; runs are "
                             f"{', '.join(r.name for r in plan)}")
        plan = [r for r in plan if r.name in only or r.label in only]
    return plan


def base_level_stats() -> dict:
    """Per level of the held-out set: the base model's mean sample accuracy and response tokens
    (examples/tiny/base_model/eval_base.json, avg@8 at temperature 1.0)."""
    ev = json.loads(BASE_EVAL.read_text())["eval"]
    return {lv: {"pass1": r["pass1"], "resp_tokens": r["resp_tokens"], "n": r["n"]}
            for lv, r in ev.items() if lv != "all"}


def expectations(st: dict) -> dict:
    """What the design implies, from the base model's per-level numbers: the pool's base success,
    its mean response length, steps per arm (dynamic sampling at 1.0-1.6 generation batches a step),
    visits of each prompt, and the share of groups with mixed outcomes (homogeneous per-level success)."""
    lv = base_level_stats()
    pool, g = st["pool"], st["G"]
    size = sum(pool.values())
    mean_len = sum(c * lv[k]["resp_tokens"] for k, c in pool.items()) / size
    p = sum(c * lv[k]["pass1"] for k, c in pool.items()) / size
    mixed = sum(c * (1 - (1 - lv[k]["pass1"]) ** g - lv[k]["pass1"] ** g) for k, c in pool.items()) / size
    per_prompt = g * mean_len
    draws = st["budget_tokens"] / per_prompt
    return {
        "pool_size": size, "pool_base_success": p, "pool_mean_response_tokens": mean_len,
        "mixed_group_share_upper": mixed, "prompts_drawn": draws, "visits_per_prompt": draws / size,
        "grpo_steps": st["budget_tokens"] / (st["train_batch_size"] * per_prompt),
        "ds_steps": [st["budget_tokens"] / (b * st["gen_batch_size"] * per_prompt) for b in (1.6, 1.0)],
    }


def eval_tokens(st: dict, which: str) -> float:
    """Generated tokens of one evaluation (n samples + greedy a problem) at the base model's lengths."""
    lv = base_level_stats()
    if which == "hard":
        counts = {k: lv[k]["n"] for k in st["hard_eval"]["levels"]}
        n, cap = st["hard_eval"]["n"], st["hard_eval"]["max_problems"]
    else:
        counts = {k: r["n"] for k, r in lv.items()}
        n, cap = st["overall_eval"]["n"], st["overall_eval"]["max_problems"]
    total = sum(counts.values())
    frac = min(1.0, cap / total) if cap else 1.0
    return frac * sum(c * (n + 1) * lv[k]["resp_tokens"] for k, c in counts.items())


def estimate_run_s(arm: str, st: dict) -> float:
    """Idle-machine wall time of one run: start, training, the evaluations at the token points, the
    secondary evaluation (its own start), checkpoints."""
    kind = "grpo" if arm == "grpo" else "ds"
    e = IDLE["eval_s_per_token"]
    steps = expectations(st)["grpo_steps" if kind == "grpo" else "ds_steps"]
    steps = steps if isinstance(steps, float) else sum(steps) / 2
    ckpts = steps / st["save_interval"] if st["save_interval"] else 1
    return (2 * IDLE["start_s"] + st["budget_tokens"] * IDLE["train_s_per_token"][kind]
            + st["eval_points"] * eval_tokens(st, "hard") * e + eval_tokens(st, "overall") * e
            + ckpts * IDLE["checkpoint_s"])


def estimate_base_s(st: dict) -> float:
    e = IDLE["eval_s_per_token"]
    return 2 * (IDLE["start_s"] + 5.0) + (eval_tokens(st, "hard") + eval_tokens(st, "overall")) * e


# ---------------------------------------------------------------------------------------------
# running


class Log:
    """Timestamped lines to stdout and to `<out>/study_v2.log`."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} [study_v2] {msg}"
        print(line, flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """The trainer gets SIGTERM (checkpoint, exit) if the study process dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _atomic_write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class Study:
    """Runs the plan: the base model's evaluations once, then each run to its result file."""

    def __init__(self, args: argparse.Namespace, st: dict, log: Log) -> None:
        self.args, self.st, self.log = args, st, log
        self.out = args.out
        self.runs_dir = self.out / "runs"
        self.pool_path = self.out / "pool.jsonl"
        self.val_path = self.out / "val_hard.jsonl"
        self.child: Optional[subprocess.Popen] = None
        self.done_walls: list[tuple[float, float]] = []   # (measured, estimated) of runs finished here

    # -- overrides

    def step_cap(self) -> int:
        """A step count the budget always comes before (every response at least 4 tokens)."""
        return self.st["budget_tokens"] // (self.st["train_batch_size"] * self.st["G"] * 4) + 2

    def shared(self, seed: int, run_dir: Path) -> list[str]:
        st = self.st
        return [f"run_dir={run_dir}", f"trainer.seed={seed}", "trainer.progress_bar=false", "trainer.tensorboard=false",
                "trainer.keep_last_n_checkpoints=1", f"data.train_files=[{self.pool_path}]",
                f"rollout.n={st['G']}", f"data.train_batch_size={st['train_batch_size']}",
                f"actor.ppo_mini_batch_size={st['ppo_mini_batch_size']}", "eval.interval=0"]

    def train_overrides(self, spec: RunSpec, run_dir: Path) -> list[str]:
        st = self.st
        return [*self.shared(spec.seed, run_dir), f"trainer.total_training_steps={self.step_cap()}",
                f"trainer.max_generated_tokens={st['budget_tokens']}", f"trainer.save_interval={st['save_interval']}",
                f"data.val_files=[{self.val_path}]", f"eval.n={st['hard_eval']['n']}",
                f"eval.max_problems={st['hard_eval']['max_problems']}", f"eval.token_interval={st['token_interval']}",
                "eval.before_train=false", "eval.after_train=true", *spec.overrides]

    def overall_overrides(self, spec: RunSpec, run_dir: Path) -> list[str]:
        """The secondary evaluation: resume the final checkpoint (copied to `run_dir`) at its spent
        budget, so no step runs, and evaluate all held-out problems."""
        st = self.st
        return [*self.shared(spec.seed, run_dir), f"trainer.total_training_steps={self.step_cap()}",
                f"trainer.max_generated_tokens={st['budget_tokens']}", "trainer.save_interval=0",
                f"data.val_files=[{TEST_JSONL}]", f"eval.n={st['overall_eval']['n']}",
                f"eval.max_problems={st['overall_eval']['max_problems']}", "eval.token_interval=0",
                "eval.before_train=false", "eval.after_train=true", *spec.overrides]

    def base_overrides(self, which: str, run_dir: Path) -> list[str]:
        """The base model's evaluation (`eval_before` of a one-step run that saves nothing)."""
        ev = self.st["hard_eval" if which == "hard" else "overall_eval"]
        val = self.val_path if which == "hard" else TEST_JSONL
        return [*self.shared(PILOT_SEEDS[0], run_dir), *GRPO_AS_RUN, "trainer.total_training_steps=1", "trainer.save_last=false",
                "trainer.save_interval=0", f"data.val_files=[{val}]", f"eval.n={ev['n']}",
                f"eval.max_problems={ev['max_problems']}", "eval.before_train=true", "eval.after_train=false"]

    # -- processes

    def launch(self, recipe: str, overrides: list[str], log_path: Path,
               watch: Optional[Callable[[], None]] = None) -> tuple[int, float]:
        """Run the trainer to its end; `watch` is called every `--poll-s` seconds meanwhile."""
        cmd = [self.args.python, "-m", "megatron_rl.cli", "train", "--config", str(TINY / f"{recipe}.yaml"), *overrides]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        t0 = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            # own session: a Ctrl-C reaches the study only, which stops the trainer with SIGTERM
            self.child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, preexec_fn=_die_with_parent)
            while True:
                try:
                    code = self.child.wait(timeout=self.args.poll_s)
                    break
                except subprocess.TimeoutExpired:
                    if watch is not None:
                        watch()
            self.child = None
        return code, time.perf_counter() - t0

    def stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.log("stopping the trainer in flight (SIGTERM: it checkpoints after its step; rerun to resume)")
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout=900)
            except subprocess.TimeoutExpired:
                self.child.kill()

    def phase(self, name: str, recipe: str, run_dir: Path, overrides: list[str], state: dict, *,
              resumable: bool, state_path: Optional[Path] = None, needs_checkpoint: bool = False,
              watch: Optional[Callable[[], None]] = None) -> bool:
        """Bring `run_dir` to its summary.json (two tries). A run dir without a checkpoint starts
        over (`resumable` False: always); `needs_checkpoint`: fail instead (the secondary evaluation
        must never train). Each attempt is recorded in `state` (and `state_path`)."""
        failures = 0
        while not (run_dir / "summary.json").is_file():
            if failures >= 2:
                return False
            if needs_checkpoint and latest_checkpoint_step(run_dir) is None:
                self.log(f"{name}: no checkpoint in {run_dir}: cannot evaluate the final weights")
                return False
            if run_dir.exists() and (not resumable or latest_checkpoint_step(run_dir) is None):
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            self.log(f"{name}: start ({run_dir.name})")
            phases = state.setdefault("phases", [])
            phases.append({"phase": run_dir.name, "returncode": None, "wall_s": None})
            code, wall = self.launch(recipe, overrides, run_dir / "study_stdout.log", watch)
            phases[-1].update({"returncode": code, "wall_s": round(wall, 1)})
            if state_path is not None:
                state_path.write_text(json.dumps(state, indent=1))
            if code != 0:
                failures += 1
                self.log(f"{name}: {run_dir.name} exited with {code}; see {run_dir}/train.log and study_stdout.log")
        return True

    # -- the base model

    def run_base(self) -> Optional[dict]:
        path = self.args.results_dir / "base.json"
        if path.is_file():
            return json.loads(path.read_text())
        state: dict = {}
        base = {"settings": self.st, "kind": "base"}
        t0 = time.perf_counter()
        for which, n in (("hard", self.st["hard_eval"]["n"]), ("overall", self.st["overall_eval"]["n"])):
            run_dir = self.runs_dir / f"base_{which}"
            overrides = self.base_overrides(which, run_dir)
            if not self.phase(f"base {which}", "grpo", run_dir, overrides, state, resumable=False):
                return None
            summary = json.loads((run_dir / "summary.json").read_text())
            base[which] = eval_point(summary["eval_before"], n, from_summary=True)
        base.update({"wall_s": round(time.perf_counter() - t0, 1), "phases": state["phases"]})
        _atomic_write(path, base)
        self.log(f"base model: levels 4-5 avg@{self.st['hard_eval']['n']} {base['hard']['avg']:.4f}, "
                 f"overall avg@{self.st['overall_eval']['n']} {base['overall']['avg']:.4f} -> {path}")
        self.commit(f"study v2: base model evaluation ({path.name})")
        return base

    # -- one run

    def run(self, spec: RunSpec, eta: Callable[[float], str]) -> Optional[dict]:
        path = self.args.results_dir / f"{spec.name}.json"
        if path.is_file():
            return json.loads(path.read_text())
        run_dir = self.runs_dir / spec.name
        state_path = run_dir / "study_run.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        t0 = time.perf_counter()

        def watch() -> None:
            rows = [r for r in read_rows(run_dir / "metrics.jsonl") if "perf/total_generated_tokens" in r]
            if rows:
                frac = min(1.0, rows[-1]["perf/total_generated_tokens"] / self.st["budget_tokens"])
                self.log(f"{spec.name}: step {rows[-1]['step']}, {rows[-1]['perf/total_generated_tokens']:,} tokens "
                         f"({100 * frac:.0f} %), {(time.perf_counter() - t0) / 60:.1f} min; {eta(frac)}")

        ok = self.phase(spec.name, spec.recipe, run_dir, self.train_overrides(spec, run_dir), state, resumable=True,
                        state_path=state_path, watch=watch)
        overall_dir = run_dir / "overall"
        if ok and not (overall_dir / "summary.json").is_file():
            if latest_checkpoint_step(overall_dir) is None and latest_checkpoint_step(run_dir) is not None:
                shutil.rmtree(overall_dir, ignore_errors=True)
                shutil.copytree(run_dir / "checkpoints", overall_dir / "checkpoints")
            ok = self.phase(spec.name, spec.recipe, overall_dir, self.overall_overrides(spec, overall_dir), state,
                            resumable=True, state_path=state_path, needs_checkpoint=True)
        state["status"] = "done" if ok else "failed"
        run_dir.mkdir(parents=True, exist_ok=True)
        state_path.write_text(json.dumps(state, indent=1))
        if not ok:
            return None
        record = build_record(spec, run_dir, state, self.st, [*self.train_overrides(spec, run_dir)])
        _atomic_write(path, record)
        self.log(f"{spec.name}: done in {record['wall_s']['total'] / 60:.1f} min: levels 4-5 avg@"
                 f"{self.st['hard_eval']['n']} {record['curve'][-1]['avg']:.4f}, overall avg@"
                 f"{self.st['overall_eval']['n']} {record['overall']['avg']:.4f}, {record['steps']} steps -> {path}")
        self.commit(f"study v2: {spec.name} ({path.name})")
        if not self.args.keep_checkpoints:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            shutil.rmtree(overall_dir / "checkpoints", ignore_errors=True)
        return record

    def commit(self, message: str) -> None:
        if not self.args.commit:
            return
        d = str(self.args.results_dir)
        try:
            subprocess.run(["git", "add", "--", d], cwd=ROOT, check=True, capture_output=True, timeout=120)
            subprocess.run(["git", "commit", "-q", "-m", message, "--", d], cwd=ROOT, check=True, capture_output=True,
                           timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            err = getattr(e, "stderr", b"") or b""
            self.log(f"git commit failed ({e}: {err.decode(errors='replace').strip()[:200]}); the result files are "
                     f"on disk in {d}: commit them by hand")


def _sanitize(overrides: list[str], out: Path) -> list[str]:
    """Overrides with this machine's paths replaced by $OUT / $ROOT."""
    return [o.replace(str(out), "$OUT").replace(str(ROOT), "$ROOT") for o in overrides]


def _last_by_step(rows: list[dict], key: str) -> dict[int, dict]:
    return {r["step"]: r for r in rows if key in r}


def build_record(spec: RunSpec, run_dir: Path, state: dict, st: dict, overrides: list[str]) -> dict:
    """The result file of one finished run (`run_dir/summary.json` and `run_dir/overall/summary.json`
    present): the evaluation at each token checkpoint k * token_interval (the one after the first
    step whose running total reaches it; the last is the final evaluation), the secondary evaluation,
    training stats, wall times."""
    summary = json.loads((run_dir / "summary.json").read_text())
    overall = json.loads((run_dir / "overall" / "summary.json").read_text())
    n_hard, n_all = st["hard_eval"]["n"], st["overall_eval"]["n"]
    rows = read_rows(run_dir / "metrics.jsonl")
    train = _last_by_step(rows, "perf/total_generated_tokens")
    evals = _last_by_step(rows, f"eval/avg@{n_hard}")
    steps = sorted(train)
    last = summary["steps"]
    curve = []
    for k in range(1, st["eval_points"] + 1):
        target = k * st["token_interval"]
        s = next((s for s in steps if train[s]["perf/total_generated_tokens"] >= target), None)
        if s is None:
            raise ValueError(f"{run_dir}: no step reached {target} tokens")
        if s == last:
            point = eval_point(summary["eval_after"], n_hard, from_summary=True)
        elif s in evals:
            point = eval_point(evals[s], n_hard, from_summary=False)
        else:
            raise ValueError(f"{run_dir}: step {s} reached {target} tokens but has no evaluation")
        curve.append({"k": k, "nominal_tokens": target, "step": s, "tokens": train[s]["perf/total_generated_tokens"],
                      **point})
    tr = [train[s] for s in steps]
    gen_batch = next((int(o.split("=")[1]) for o in overrides if o.startswith("data.gen_batch_size=")),
                     st["train_batch_size"])
    drawn = sum(r.get("train/num_gen_batches", 1) * gen_batch for r in tr)
    step_s = sum(r.get("timing/step_s", 0.0) for r in tr)
    eval_s = sum(r.get("eval/wall_s", 0.0) for r in rows if f"eval/avg@{n_hard}" in r)
    phases = state.get("phases", [])
    mean = (lambda key: statistics.fmean(r.get(key, 0.0) for r in tr) if tr else None)
    return {
        "kind": "run", "name": spec.name, "arm": spec.label, "seed": spec.seed,
        "recipe": f"examples/tiny/{spec.recipe}.yaml", "overrides": _sanitize(overrides, run_dir.parents[1]),
        "settings": st, "status": "done",
        "steps": last, "total_generated_tokens": summary["total_generated_tokens"],
        "curve": curve,
        "overall": eval_point(overall["eval_after"], n_all, from_summary=True),
        "train": {
            "mean_num_gen_batches": mean("train/num_gen_batches"),
            "mean_response_length": mean("response_length/mean"),
            "mean_train_acc": mean("train/acc"),
            "train_acc_first10": statistics.fmean(r["train/acc"] for r in tr[:10]) if tr else None,
            "train_acc_last10": statistics.fmean(r["train/acc"] for r in tr[-10:]) if tr else None,
            "solve_none_share": (sum(r.get("train/solve_none", 0) for r in tr)
                                 / max(1, sum(r.get("train/generated_groups", 0) for r in tr))),
            "daa_amplified_frac_mean": mean("train/daa_amplified_frac"),
            "daa_factor_mean": mean("train/daa_factor_mean"),
            "prompts_drawn": drawn,
            "visits_per_prompt": drawn / sum(st["pool"].values()),
            "step1_token_checksum": train[steps[0]].get("rollout/token_checksum") if steps and steps[0] == 1 else None,
            "step1_generated_tokens": train[1]["perf/generated_tokens"] if 1 in train else None,
        },
        "wall_s": {"total": round(sum(p["wall_s"] for p in phases), 1), "steps": round(step_s, 1),
                   "evals": round(eval_s, 1), "trainer": summary.get("wall_s")},
        "s_per_token": step_s / summary["total_generated_tokens"] if summary["total_generated_tokens"] else None,
        "phases": phases,
        "host": {"cpus": os.cpu_count(), "loadavg_at_end": list(os.getloadavg())},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---------------------------------------------------------------------------------------------
# statistics (standard library only)


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer df >= 1 (closed forms, Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    theta = math.atan2(abs(t), math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        total = term = 0.0
        if df > 1:
            total = term = math.cos(theta)
            for k in range(1, (df - 3) // 2 + 1):
                term *= c2 * (2 * k) / (2 * k + 1)
                total += term
        a = 2 / math.pi * (theta + s * total)
    else:
        total = term = 1.0
        for k in range(1, (df - 2) // 2 + 1):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + 0.5 * a if t >= 0 else 0.5 - 0.5 * a


def t_ppf(p: float, df: int) -> float:
    """The p quantile of Student's t with integer df (bisection on `t_cdf`)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_ppf(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def z_ppf(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def auc(xs: list[float], ys: list[float]) -> float:
    """Trapezoid area under (xs, ys) divided by the x range: the curve's mean value."""
    area = sum((ys[i] + ys[i + 1]) / 2 * (xs[i + 1] - xs[i]) for i in range(len(xs) - 1))
    return area / (xs[-1] - xs[0])


def paired(a: dict[int, float], b: dict[int, float], alpha: float = ALPHA) -> dict:
    """a - b over the seeds both have: mean, sample SD, standard error, paired-t (1 - alpha)
    interval, t statistic and two-sided p value (None below 2 seeds)."""
    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds]
    out = {"n": len(d), "seeds": seeds, "diffs": d, "mean": statistics.fmean(d) if d else None,
           "sd": None, "se": None, "ci95": None, "t": None, "p": None, "verdict": "no pairs" if not d else "one pair"}
    if len(d) >= 2:
        sd = statistics.stdev(d)
        se = sd / math.sqrt(len(d))
        half = t_ppf(1 - alpha / 2, len(d) - 1) * se
        out.update({"sd": sd, "se": se, "ci95": [out["mean"] - half, out["mean"] + half]})
        if se > 0:
            out["t"] = out["mean"] / se
            out["p"] = 2 * (1 - t_cdf(abs(out["t"]), len(d) - 1))
        excl = out["ci95"][0] > 0 or out["ci95"][1] < 0
        out["verdict"] = "95% interval excludes 0" if excl else "95% interval includes 0 (not told from noise)"
    return out


def residual_sd(table: dict[str, dict[int, float]], arms: list[str]) -> dict:
    """The residual SD of the additive model y[arm, seed] = mu_arm + b_seed + e over the seeds
    every arm has (complete blocks), df = (arms - 1)(seeds - 1); sd_diff = sqrt(2) sigma is the SD of
    a paired difference between two arms."""
    arms = [a for a in arms if a in table]
    seeds = sorted(set.intersection(*(set(table[a]) for a in arms))) if arms else []
    df = (len(arms) - 1) * (len(seeds) - 1)
    out = {"arms": arms, "seeds": seeds, "df": df, "sigma": None, "sd_diff": None}
    if df < 1:
        return out
    y = {(a, s): table[a][s] for a in arms for s in seeds}
    grand = statistics.fmean(y.values())
    arm_mean = {a: statistics.fmean(y[a, s] for s in seeds) for a in arms}
    seed_mean = {s: statistics.fmean(y[a, s] for a in arms) for s in seeds}
    ss = sum((y[a, s] - arm_mean[a] - seed_mean[s] + grand) ** 2 for a in arms for s in seeds)
    out["sigma"] = math.sqrt(ss / df)
    out["sd_diff"] = math.sqrt(2) * out["sigma"]
    return out


def seeds_needed(sd_diff: float, delta: float = DELTA, alpha: float = ALPHA, power: float = POWER) -> dict:
    """Seeds (pairs) for a paired t-test to detect `delta` (two-sided alpha, power): the smallest
    n >= 2 with n >= ((t_{1-alpha/2, n-1} + t_{power, n-1}) sd_diff / delta)^2, and the normal
    approximation ceil(((z_{1-alpha/2} + z_power) sd_diff / delta)^2)."""
    normal = max(2, math.ceil(((z_ppf(1 - alpha / 2) + z_ppf(power)) * sd_diff / delta) ** 2))
    n = 2
    while n < 10_000 and n < ((t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * sd_diff / delta) ** 2:
        n += 1
    return {"t": n, "normal": normal}


def mde(sd_diff: float, n: int, alpha: float = ALPHA, power: float = POWER) -> Optional[float]:
    """The smallest paired difference n seeds detect (two-sided alpha, power), paired t."""
    if n < 2:
        return None
    return (t_ppf(1 - alpha / 2, n - 1) + t_ppf(power, n - 1)) * sd_diff / math.sqrt(n)


# ---------------------------------------------------------------------------------------------
# analysis


def load_results(results_dir: Path) -> tuple[Optional[dict], list[dict]]:
    base, runs = None, []
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("kind") == "base":
            base = data
        elif data.get("kind") == "run" and data.get("status") == "done":
            runs.append(data)
    return base, runs


def run_metrics(rec: dict, base: dict) -> dict:
    """The primary and secondary numbers of one run (curve points at the nominal token counts)."""
    xs = [0] + [p["nominal_tokens"] for p in rec["curve"]]

    def level(p: dict, lv: str) -> Optional[float]:
        return (p.get("levels") or {}).get(lv, {}).get("avg")

    ys = [base["hard"]["avg"]] + [p["avg"] for p in rec["curve"]]
    fin, ov = rec["curve"][-1], rec["overall"]
    m = {"final_hard_avg": fin["avg"], "auc_hard_avg": auc(xs, ys),
         "final_overall_avg": ov["avg"], "final_overall_pass": ov["pass"], "final_overall_greedy": ov["greedy"],
         "final_hard_pass": fin["pass"], "final_hard_greedy": fin["greedy"],
         "final_level4_avg": level(fin, "4"), "final_level5_avg": level(fin, "5"),
         "steps": rec["steps"], "total_generated_tokens": rec["total_generated_tokens"],
         "overshoot_tokens": statistics.fmean(p["tokens"] - p["nominal_tokens"] for p in rec["curve"]),
         "wall_s": rec["wall_s"]["total"], "s_per_token": rec.get("s_per_token")}
    m["curve"] = {"x": xs, "y": ys, "tokens": [0] + [p["tokens"] for p in rec["curve"]],
                  "level4": [level(base["hard"], "4")] + [level(p, "4") for p in rec["curve"]],
                  "level5": [level(base["hard"], "5")] + [level(p, "5") for p in rec["curve"]]}
    return m


def analyze(results_dir: Path, *, plots_dir: Optional[Path] = None, study_hours: float = STUDY_HOURS,
            delta: float = DELTA) -> dict:
    """Everything from the result files alone: per-run metrics, per-arm statistics, paired
    differences with 95% intervals, the seed count, the pairing check, plots."""
    base, recs = load_results(results_dir)
    out: dict = {"results_dir": str(results_dir), "primary": list(PRIMARY), "delta": delta, "alpha": ALPHA,
                 "power": POWER}
    if base is None:
        out["error"] = f"no base.json in {results_dir}"
        return out
    st = base["settings"]
    used = [r for r in recs if r["settings"] == st]
    out["excluded"] = [r["name"] for r in recs if r["settings"] != st]
    out["settings"] = st
    out["base"] = {"hard": base["hard"], "overall": base["overall"]}
    runs = {r["name"]: {"arm": r["arm"], "seed": r["seed"], **run_metrics(r, base), "train": r["train"]} for r in used}
    out["runs"] = runs
    table = {m: {} for m in (*PRIMARY, *SECONDARY, "steps", "wall_s")}
    for r in runs.values():
        for m in table:
            if r[m] is not None:
                table[m].setdefault(r["arm"], {})[r["seed"]] = r[m]
    out["arms"] = {arm: {m: stats(list(table[m].get(arm, {}).values())) for m in table}
                   | {"seeds": sorted(table[PRIMARY[0]].get(arm, {}))} for arm in ARM_NAMES if arm in table[PRIMARY[0]]}
    out["comparisons"] = [{"a": a, "b": b, "metric": m, "primary": (a, b) == PAIRS[0] and m in PRIMARY,
                           **paired(table[m].get(a, {}), table[m].get(b, {}))}
                          for a, b in PAIRS for m in (*PRIMARY, *SECONDARY)]
    # the seed count, from the paired spread of the primary metrics
    est = {a: estimate_run_s(a, st) for a in ARM_NAMES}
    measured = {a: statistics.fmean(table["wall_s"][a].values()) for a in ARM_NAMES if table["wall_s"].get(a)}
    per_seed = sum(measured.get(a, est[a]) for a in ARM_NAMES)   # an arm not run yet: its idle estimate
    affordable = int((study_hours * 3600 - estimate_base_s(st)) // per_seed)
    sc = {"per_seed_wall_s": per_seed, "per_seed_wall_s_idle_estimate": sum(est.values()),
          "wall_s_measured": measured, "seeds_affordable": affordable, "study_hours": study_hours}
    for m in PRIMARY:
        rs = residual_sd(table[m], ARM_NAMES)
        if rs["sd_diff"] is not None:
            need = seeds_needed(rs["sd_diff"], delta)
            n_now = len(rs["seeds"])
            rs.update({"n_needed": need["t"], "n_needed_normal": need["normal"],
                       "mde_now": mde(rs["sd_diff"], n_now),
                       "mde_at_affordable": mde(rs["sd_diff"], max(2, affordable))})
        sc[m] = rs
    needs = [sc[m]["n_needed"] for m in PRIMARY if sc[m].get("n_needed")]
    if needs:
        sc["recommended_seeds"] = max(2, min(max(needs), affordable))
        sc["enough_within_budget"] = max(needs) <= affordable
        sc["next_command"] = ("benchmarks/study_v2.py --seeds "
                              + " ".join(str(s) for s in range(1, sc["recommended_seeds"] + 1)))
    out["seed_count"] = sc
    # pairing: the dynamic-sampling arms at one seed sample identical step-1 rollouts
    pairing = {}
    for seed in sorted({r["seed"] for r in runs.values()}):
        cs = {r["arm"]: r["train"]["step1_token_checksum"] for r in runs.values()
              if r["seed"] == seed and r["arm"] != "grpo"}
        pairing[str(seed)] = {"step1_token_checksum": cs, "identical": len(set(map(str, cs.values()))) <= 1}
    out["pairing"] = pairing
    if plots_dir is not None and runs:
        out["plots"] = make_plots(out, plots_dir)
    return out


COLORS = {"grpo": "tab:blue", "dapo": "tab:orange", "da3po": "tab:green", "da3po_balanced_history": "tab:purple"}


def make_plots(an: dict, out_dir: Path) -> list[str]:
    """curves.png (levels 4-5 avg@n against tokens: per arm mean +- SD at the token points, each
    seed faint at its real token counts), paired.png (paired differences with 95% intervals),
    secondary.png (final secondary numbers per arm, SD error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out_dir.mkdir(parents=True, exist_ok=True)
    n = an["settings"]["hard_eval"]["n"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, title in zip(axes, ("y", "level4", "level5"), ("levels 4-5", "level 4", "level 5")):
        for arm in an["arms"]:
            seeds = [r for r in an["runs"].values() if r["arm"] == arm]
            for r in seeds:
                ax.plot(r["curve"]["tokens"], r["curve"][key], color=COLORS.get(arm), alpha=0.25, lw=0.8)
            cols = list(zip(*[r["curve"][key] for r in seeds]))
            mean = [statistics.fmean(c) for c in cols]
            sd = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in cols]
            x = seeds[0]["curve"]["x"]
            ax.plot(x, mean, color=COLORS.get(arm), marker="o", label=f"{arm} (n={len(seeds)})")
            ax.fill_between(x, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=COLORS.get(arm), alpha=0.15)
        ax.set_title(f"held-out {title} avg@{n}")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)

    comps = [c for c in an["comparisons"] if c["metric"] in PRIMARY and c["ci95"] is not None]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(4, len(comps)) + 1))
    for i, c in enumerate(comps):
        ax.errorbar(c["mean"], i, xerr=[[c["mean"] - c["ci95"][0]], [c["ci95"][1] - c["mean"]]], fmt="o",
                    color="tab:red" if c["primary"] else "black", capsize=3)
    ax.set_yticks(range(len(comps)), [f"{c['a']} - {c['b']}: {c['metric']} (n={c['n']})" for c in comps], fontsize=8)
    for x, style in ((0, "-"), (an["delta"], ":"), (-an["delta"], ":")):
        ax.axvline(x, color="grey", ls=style, lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("paired difference (95% interval, paired t)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out_dir / "paired.png", dpi=110)
    plt.close(fig)

    mets = ("final_overall_avg", "final_overall_pass", "final_overall_greedy", "final_hard_pass", "final_hard_greedy")
    arms = list(an["arms"])
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.8 / max(1, len(arms))
    for j, arm in enumerate(arms):
        means = [an["arms"][arm][m]["mean"] or 0.0 for m in mets]
        errs = [an["arms"][arm][m]["std"] or 0.0 for m in mets]
        ax.bar([i + j * w for i in range(len(mets))], means, w, yerr=errs, color=COLORS.get(arm), label=arm, capsize=2)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(mets))], [m.replace("final_", "") for m in mets], fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("secondary metrics at the budget (error bars: SD across seeds)")
    fig.tight_layout()
    fig.savefig(out_dir / "secondary.png", dpi=110)
    plt.close(fig)
    return ["curves.png", "paired.png", "secondary.png"]


def print_report(an: dict) -> None:
    if "error" in an:
        print(f"[study_v2] {an['error']}")
        return
    n = an["settings"]["hard_eval"]["n"]
    rows = [["arm", "seeds", f"final L4-5 avg@{n}", "AUC", "overall avg", "greedy", "steps", "wall s"]]
    for arm, g in an["arms"].items():
        rows.append([arm, str(len(g["seeds"])), _fmt(g["final_hard_avg"], 4), _fmt(g["auc_hard_avg"], 4),
                     _fmt(g["final_overall_avg"]), _fmt(g["final_overall_greedy"]), _fmt(g["steps"], 0),
                     _fmt(g["wall_s"], 0)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print()
    for c in an["comparisons"]:
        if c["metric"] in PRIMARY and c["mean"] is not None:
            ci = "" if c["ci95"] is None else f" [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"
            print(f"{'*' if c['primary'] else ' '} {c['a']} - {c['b']} {c['metric']}: {c['mean']:+.4f}{ci} "
                  f"(n={c['n']}): {c['verdict']}")
    sc = an.get("seed_count", {})
    for m in PRIMARY:
        r = sc.get(m) or {}
        if r.get("sd_diff") is not None:
            print(f"{m}: sigma {r['sigma']:.4f} (df {r['df']}), paired SD {r['sd_diff']:.4f}: {r['n_needed']} seeds "
                  f"for a {an['delta']:.2f} difference (normal approx. {r['n_needed_normal']}); detectable now "
                  f"{r['mde_now']:.4f}, at {sc['seeds_affordable']} seeds {r['mde_at_affordable']:.4f}")
    if "recommended_seeds" in sc:
        print(f"seeds affordable in {sc['study_hours']:.0f} h: {sc['seeds_affordable']}; next: {sc['next_command']}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pilot", action="store_true", help=f"the pilot: seeds {PILOT_SEEDS}")
    p.add_argument("--seeds", type=int, nargs="+",
                   help=f"trainer.seed values (default {PILOT_SEEDS}); done runs are skipped")
    p.add_argument("--quick", action="store_true", help="pipeline check: seed 1, 1-2 steps a run, small evaluations")
    p.add_argument("--only", nargs="+", help="only these runs or arms (e.g. dapo da3po_s2)")
    p.add_argument("--budget-tokens", type=int, help="generated tokens a run (default 800000; quick 6000)")
    p.add_argument("--out", type=Path, help="run folders, pool, log (default runs/study_v2, quick runs/study_v2-quick)")
    p.add_argument("--results-dir", type=Path,
                   help="result files (default benchmarks/results/study_v2; quick <out>/results)")
    p.add_argument("--analysis-out", type=Path,
                   help="analysis JSON (default benchmarks/results/study_v2_analysis.json; quick <out>/analysis.json)")
    p.add_argument("--plots-dir", type=Path, help="plots (default docs/study_v2; quick <out>/plots)")
    p.add_argument("--analyze-only", action="store_true", help="launch nothing; the analysis from the result files")
    p.add_argument("--dry-run", action="store_true", help="print the plan, overrides and time estimate; write nothing")
    p.add_argument("--commit", action="store_true", help="git-commit the result files as each is written")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's checkpoints")
    p.add_argument("--poll-s", type=float, default=120.0, help="seconds between progress lines (default 120)")
    p.add_argument("--python", default=sys.executable, help="interpreter of the trainer (default: this one)")
    args = p.parse_args(argv)
    if args.pilot and args.seeds:
        p.error("--pilot is --seeds 1 2: give one of them")
    args.seeds = [1] if args.quick and not args.seeds else (args.seeds or list(PILOT_SEEDS))
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds {args.seeds} repeats a seed")
    q = args.quick
    args.out = (args.out or ROOT / ("runs/study_v2-quick" if q else "runs/study_v2")).resolve()
    results = ROOT / "benchmarks" / "results"
    args.results_dir = (args.results_dir or (args.out / "results" if q else results / "study_v2")).resolve()
    args.analysis_out = args.analysis_out or (args.out / "analysis.json" if q else results / "study_v2_analysis.json")
    args.plots_dir = args.plots_dir or (args.out / "plots" if q else ROOT / "docs/study_v2")
    return args


def _lock(path: Path) -> None:
    """One study process per --out: refuse when the lock's process still runs."""
    if path.is_file():
        try:
            pid = int(path.read_text().strip())
            os.kill(pid, 0)
            if "study_v2" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                raise SystemExit(f"study_v2: another study runs on {path.parent} (pid {pid}); stop it first")
        except (ValueError, ProcessLookupError, PermissionError, FileNotFoundError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.analyze_only:
        an = analyze(args.results_dir, plots_dir=args.plots_dir)
        _atomic_write(Path(args.analysis_out), an)
        print_report(an)
        print(f"[study_v2] analysis {args.analysis_out}; plots in {args.plots_dir}")
        return 0 if "error" not in an else 1
    st = settings_for(args.quick, args.budget_tokens)
    plan = build_plan(args.seeds, args.only)
    exp = expectations(st)
    est = {a: estimate_run_s(a, st) for a in ARM_NAMES}
    todo = [s for s in plan if not (args.results_dir / f"{s.name}.json").is_file()]
    base_todo = not (args.results_dir / "base.json").is_file()
    total_est = sum(est[s.label] for s in todo) + (estimate_base_s(st) if base_todo else 0)
    log = Log(None if args.dry_run else args.out / "study_v2.log")
    log(f"{len(plan)} runs ({len(todo)} to do{', base model first' if base_todo else ''}), seeds {args.seeds}; budget "
        f"{st['budget_tokens']:,} tokens, evaluations every {st['token_interval']:,}; pool {st['pool']} "
        f"(base success {exp['pool_base_success']:.3f}, ~{exp['visits_per_prompt']:.1f} visits a prompt); "
        f"idle estimate {total_est / 3600:.2f} h ({', '.join(f'{a} {s / 60:.1f} min' for a, s in est.items())})")
    study = Study(args, st, log)
    if args.dry_run:
        from megatron_rl.config import load_config

        print(json.dumps({"settings": st, "expectations": exp}, indent=1))
        for spec in plan:
            ov = study.train_overrides(spec, study.runs_dir / spec.name)
            cfg = load_config(TINY / f"{spec.recipe}.yaml", ov)  # validates the overrides
            d = cfg.algorithm.daa
            print(f"{spec.name}: examples/tiny/{spec.recipe}.yaml {' '.join(ov)}")
            print(f"    G={cfg.rollout.n} batch={cfg.data.train_batch_size} gen_batch={cfg.data.gen_batch_size} "
                  f"dynamic_sampling={cfg.algorithm.filter_groups.enable} "
                  f"daa={d.enable and f'{d.factor}/{d.difficulty}'} "
                  f"seed={cfg.trainer.seed} eval.token_interval={cfg.eval.token_interval}")
        return 0
    _lock(args.out / "study_v2.lock")
    make_pool(0, study.pool_path, TRAIN_JSONL, by_level=st["pool"])
    make_pool(0, study.val_path, TEST_JSONL, by_level={lv: 64 for lv in st["hard_eval"]["levels"]})
    t0 = time.perf_counter()
    left = list(todo)

    def eta(frac_of_current: float = 0.0) -> str:
        ratio = statistics.median(m / e for m, e in study.done_walls) if study.done_walls else 1.0
        rest = sum(est[s.label] for s in left) - (est[left[0].label] * frac_of_current if left else 0)
        secs = rest * ratio
        return (f"study ETA {time.strftime('%H:%M', time.localtime(time.time() + secs))} ({secs / 3600:.1f} h left, "
                f"{len(left)} runs; measured/idle-estimate ratio {ratio:.2f})")

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    failed, interrupted = [], False
    try:
        if study.run_base() is None:
            failed.append("base")
        for spec in plan:
            if (args.results_dir / f"{spec.name}.json").is_file():
                continue
            t_run = time.perf_counter()
            rec = study.run(spec, eta)
            left.remove(spec)
            if rec is None:
                failed.append(spec.name)
                continue
            study.done_walls.append((time.perf_counter() - t_run, est[spec.label]))
            log(eta())
    except KeyboardInterrupt:
        interrupted = True
        study.stop_child()
        log("interrupted: rerun the same command to resume")
    finally:
        (args.out / "study_v2.lock").unlink(missing_ok=True)
    an = analyze(args.results_dir, plots_dir=args.plots_dir)
    _atomic_write(Path(args.analysis_out), an)
    print_report(an)
    log(f"this invocation {(time.perf_counter() - t0) / 3600:.2f} h; analysis {args.analysis_out}; "
        f"plots {args.plots_dir}"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 75 if interrupted else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
