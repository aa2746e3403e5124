"""megatron-rl vs TRL's GRPOTrainer on the tiny task: RL steps/min, tokens/s, and accuracy in the same wall time.

One command, same CPU machine, one run of each, one after the other:

1. **megatron-rl**: `megatron-rl train --config examples/tiny/grpo.yaml` for `--steps` RL steps
   (16 prompts x 8 responses a step, 2 PPO updates, responses up to 64 tokens, lr 1e-4), no
   evaluation inside the run, final checkpoint saved. Its training wall time T is the sum of the
   per-step times (`timing/step_s` in metrics.jsonl: rollout, reward, log-probs, update and the
   weight sync to the rollout server; start-up and the checkpoint write are reported apart).
2. **TRL**: GRPOTrainer (installed in the benchmark's own virtual environment
   `benchmarks/.trl-venv`, made here on first use, with the project's torch and transformers
   versions) on the same base model (`examples/tiny/base_model`), data
   (`examples/tiny/data/train.jsonl`), group size, batch, lengths, sampling, optimizer and
   reward (the project's DAPO verifier); the settings map is in `benchmarks/trl_worker.py`. It
   trains until its summed step time reaches T (at an RL-step boundary), so both get the same
   training wall time; its RL step = one generation of 16 x 8 completions + 2 optimizer steps.
3. **Held-out accuracy**: `megatron-rl eval` (the embedded server, same seed, n, temperature 1.0,
   top_p 1.0, 64 new tokens) on `examples/tiny/data/test.jsonl` (296 problems) for the base
   model, megatron-rl's final checkpoint and TRL's final weights (a Hugging Face folder).

Prints a table and writes `benchmarks/results/trl_compare.json`. About 10-20 min on 2 lightly loaded CPU
cores with the defaults (more under load: the ratio is what to read). The first run also creates
the TRL environment (~5 GB, a few minutes from PyPI).

    .venv/bin/python benchmarks/trl_compare.py                  # 12 RL steps of megatron-rl, same time for TRL
    .venv/bin/python benchmarks/trl_compare.py --steps 80       # the recipe's full length
    .venv/bin/python benchmarks/trl_compare.py --skip-eval      # speed only

Both sides use torch's default thread count on the same cores; megatron-rl additionally runs its
rollout server as a second process (as in real use), TRL generates in its training process.
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
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny"
DEFAULT_VENV = REPO / "benchmarks" / ".trl-venv"
TRL_VERSION = "1.16.0"


def _find_python312() -> list[str]:
    """A Python 3.12 command for the TRL venv (the same rule as scripts/setup.sh)."""
    if os.environ.get("PYTHON"):
        return [os.environ["PYTHON"]]
    for cmd in (["python3.12"],):
        if shutil.which(cmd[0]) and subprocess.run(cmd + ["-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                                    capture_output=True).returncode == 0:
            return cmd
    if shutil.which("pyenv"):
        vers = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True).stdout.split()
        v312 = sorted((v for v in vers if v.startswith("3.12")), key=lambda v: [int(x) for x in v.split(".")])
        if v312:
            return ["env", f"PYENV_VERSION={v312[-1]}", "python3.12"]
    raise SystemExit("trl_compare: Python 3.12 not found for the TRL environment; set PYTHON=/path/to/python3.12")


def ensure_trl_venv(venv: Path, trl_version: str) -> Path:
    """Create `venv` with trl==trl_version and the project's torch/transformers versions (idempotent).

    Returns the venv's python. Raises SystemExit when pip fails (its output is shown).
    """
    import torch
    import transformers

    torch_v = torch.__version__.split("+")[0]
    pins = [f"torch=={torch_v}", f"transformers=={transformers.__version__}", f"trl=={trl_version}"]
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if py.exists() and stamp.exists() and stamp.read_text().split() == pins:
        return py
    if not py.exists():
        print(f"creating {venv} (TRL {trl_version}, {pins[0]}, {pins[1]}) ...", flush=True)
        subprocess.run(_find_python312() + ["-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"trl_compare: pip install {' '.join(pins)} into {venv} failed:\n{r.stdout}\n{r.stderr}")
    stamp.write_text(" ".join(pins))
    return py


def trl_settings(cfg) -> dict:
    """TRL GRPOConfig values equivalent to a megatron-rl config (`config.schema.Config`).

    One megatron-rl RL step = one TRL generation of train_batch_size x n completions, consumed by
    `steps_per_generation` = train_batch_size / ppo_mini_batch_size optimizer steps of
    ppo_mini_batch_size x n completions each (one micro-batch when ppo_micro_batch_size covers it).

    Raises:
        ValueError: a setting TRL's GRPOTrainer cannot mirror here (names the key).
    """
    a, d, r, o = cfg.actor, cfg.data, cfg.rollout, cfg.actor.optim
    unsupported = {
        "actor.loss_agg_mode": (a.loss_agg_mode, "seq-mean-token-mean"), "algorithm.adv_estimator":
        (cfg.algorithm.adv_estimator, "grpo"), "algorithm.filter_groups.enable": (cfg.algorithm.filter_groups.enable, False),
        "algorithm.daa.enable": (cfg.algorithm.daa.enable, False), "actor.use_kl_loss": (a.use_kl_loss, False),
        "actor.ppo_epochs": (a.ppo_epochs, 1), "actor.policy_loss": (a.policy_loss, "vanilla"),
        "reward.overlong_buffer.enable": (cfg.reward.overlong_buffer.enable, False),
        "actor.entropy_coeff": (a.entropy_coeff, 0.0), "actor.optim.lr_decay_style": (o.lr_decay_style, "constant"),
        "algorithm.norm_adv_by_std_in_grpo": (cfg.algorithm.norm_adv_by_std_in_grpo, True),
    }
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(f"{key}={value!r}: the TRL comparison mirrors only {key}={wanted!r}")
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError("data.train_batch_size must be a multiple of actor.ppo_mini_batch_size")
    updates = d.train_batch_size // a.ppo_mini_batch_size
    per_update = a.ppo_mini_batch_size * r.n
    if a.ppo_micro_batch_size < per_update:
        raise ValueError(f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size} < {per_update} sequences an update: "
                         "the comparison runs one micro-batch an update")
    return {"per_device_train_batch_size": per_update, "steps_per_generation": updates, "num_generations": r.n,
            "max_completion_length": d.max_response_length, "temperature": r.temperature, "top_p": r.top_p,
            "learning_rate": o.lr, "warmup_steps": o.lr_warmup_steps * updates, "weight_decay": o.weight_decay,
            "max_grad_norm": o.clip_grad, "epsilon": a.clip_ratio_low, "epsilon_high": a.clip_ratio_high,
            "adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2, "adam_epsilon": o.adam_eps}


def _load_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing/step_s" in r]


IDLE_LOAD_PER_CPU = 1.25
"""A run counts as idle when its load average never exceeded this many per CPU (2.5 on the 2-core
machine of issue 22): only such a run may write the docs' table (docs/benchmarks.md)."""


def _busy_jiffies() -> Optional[int]:
    """Busy CPU time of the whole machine so far (/proc/stat's first line minus idle and iowait), in
    clock ticks; None without /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]) - fields[3] - fields[4]  # user..steal, less idle and iowait


def _tree_jiffies(root: int) -> int:
    """CPU time (utime + stime + cutime + cstime, clock ticks) of `root` and its live descendants
    (`megatron_rl.weight_sync.ipc.process_tree`): the children that exited and were waited for are in
    their parent's cutime/cstime."""
    from megatron_rl.weight_sync.ipc import process_tree

    total = 0
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        total += sum(int(x) for x in stat[stat.rindex(")") + 2:].split()[11:15])  # fields 14-17
    return total


class LoadMonitor:
    """Samples, every `period_s` seconds on a thread while in a `with` block, the 1-minute load
    average (`max`, `mean`, `values`; load-average units) and the **foreign CPU**: CPUs' worth of
    busy time spent by processes outside this process's own tree (this benchmark, the runs it
    started and their servers) over each interval (`foreign_max`, `foreign_mean`, in CPUs, from
    /proc/stat minus the tree's utime/stime; None without /proc). The load average counts this
    benchmark's own runnable threads too (a trainer and a server busy side by side read 3-8 on 2
    cores with nothing else running), so it cannot tell an idle machine from a loaded one; the
    foreign CPU can."""

    def __init__(self, period_s: float = 2.0) -> None:
        import threading

        self.period_s, self.values = period_s, [os.getloadavg()[0]]
        self.foreign: list[float] = []
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._cpu_sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu_sample(self) -> Optional[tuple[float, int, int]]:
        busy = _busy_jiffies()
        return None if busy is None else (time.monotonic(), busy, _tree_jiffies(os.getpid()))

    def _sample(self) -> None:
        self.values.append(os.getloadavg()[0])
        now = self._cpu_sample()
        if now is not None and self._last is not None and now[0] > self._last[0]:
            foreign = (now[1] - self._last[1]) - (now[2] - self._last[2])
            self.foreign.append(max(0.0, foreign / self._hz / (now[0] - self._last[0])))
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> "LoadMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def foreign_max(self) -> Optional[float]:
        return max(self.foreign) if self.foreign else None

    @property
    def foreign_mean(self) -> Optional[float]:
        return sum(self.foreign) / len(self.foreign) if self.foreign else None


def _verdict(sides: dict, key: str, limit: float, missing: str, fmt: str, over_text: str,
             ok_text: str) -> tuple[bool, str]:
    """(idle, why): every side's `sides[name][key]` is known and <= `limit` (`fmt` formats values)."""
    worst = {name: side.get(key) for name, side in sides.items()}
    unknown = [n for n, v in worst.items() if v is None]
    if unknown:
        return False, f"no {missing} samples for {', '.join(unknown)}"
    over = {n: v for n, v in worst.items() if v > limit}
    if over:
        return False, over_text.format(", ".join(f"{v:{fmt}} ({n})" for n, v in over.items()))
    return True, ok_text.format(f"{max(worst.values()):{fmt}}")


def load_verdict(sides: dict, cpus: int) -> tuple[bool, str]:
    """(idle, why): whether every side's sampled load average stayed <= IDLE_LOAD_PER_CPU x `cpus`.
    A side without samples (an older `--reuse` side file) is not idle."""
    limit = IDLE_LOAD_PER_CPU * cpus
    return _verdict(sides, "loadavg_max", limit, "load", ".1f",
                    f"load average reached {{}} > {limit:.1f} ({IDLE_LOAD_PER_CPU} x {cpus} CPUs)",
                    f"load average <= {{}} (limit {limit:.1f})")


FOREIGN_IDLE_CPUS = 0.2
"""A side counts as run on an idle machine when processes outside the benchmark's own tree used at
most this many CPUs on average during it (`LoadMonitor.foreign_mean`)."""


def foreign_verdict(sides: dict) -> tuple[bool, str]:
    """(idle, why) from each side's `foreign_cpus_mean` (`LoadMonitor`): idle when every side's
    foreign CPU stayed <= FOREIGN_IDLE_CPUS on average. A side without the measure is not idle."""
    return _verdict(sides, "foreign_cpus_mean", FOREIGN_IDLE_CPUS, "foreign-CPU", ".2f",
                    f"other processes used more than {FOREIGN_IDLE_CPUS} CPUs on average: {{}}",
                    f"other processes used <= {{}} CPUs on average (limit {FOREIGN_IDLE_CPUS})")


def idle_verdict(sides: dict, cpus: int) -> tuple[bool, str]:
    """(idle, why): the load average stayed <= IDLE_LOAD_PER_CPU x `cpus` on every side
    (`load_verdict`), or, when it did not, the CPU used by processes outside the benchmark's own
    tree stayed <= FOREIGN_IDLE_CPUS on every side (`foreign_verdict`): the load average counts the
    run's own runnable threads (2 trainer ranks and 2 servers of `examples/tiny/grpo.yaml` read 2.3-2.7
    on 2 cores with nothing else running), the foreign CPU does not."""
    idle, why = load_verdict(sides, cpus)
    if idle:
        return idle, why
    idle_f, why_f = foreign_verdict(sides)
    return idle_f, f"{why}; {why_f}"


PHASES = ("timing/generate_s", "timing/reward_s", "timing/advantage_s", "timing/old_logprob_s", "timing/update_s",
          "timing/weight_sync_s")
BEFORE = REPO / "benchmarks" / "results" / "trl_compare_before_issue22.json"


def step_split(side: dict) -> dict:
    """Mean seconds per RL step of each phase of a megatron-rl side (`phase_s` holds the sums over
    its steps), plus the mean step and the step count; keys without the `timing/` prefix and `_s` suffix."""
    n = max(side["rl_steps"], 1)
    split = {k[len("timing/"):-len("_s")]: side["phase_s"].get(k, 0.0) / n for k in PHASES}
    split["step"] = side["train_s"] / n
    split["rl_steps"] = side["rl_steps"]   # the first step's warm-up weighs 1/rl_steps in these means
    return split


def split_before_and_after(mrl: dict, before: Path = BEFORE) -> dict:
    """The split of our step in this run next to the one recorded before issue 22's changes
    (`results/trl_compare_before_issue22.json`; left out when that file is missing)."""
    out = {"this run": step_split(mrl)}
    if before.exists():
        out[f"before issue 22 ({before.name})"] = step_split(json.loads(before.read_text())["megatron_rl"])
    return out


def table_allowed(result: dict, idle: bool, why: str) -> tuple[bool, str]:
    """Whether a run may write the docs' table (docs/benchmarks.md): an idle machine (`idle_verdict`), evaluations
    run (the table carries avg@n and pass@n) and >= 3 RL steps on both sides (fewer: the first
    step's warm-up dominates the rate). Returns (allowed, reason when not)."""
    if not idle:
        return False, f"not an idle machine ({why})"
    if result.get("skip_eval") or not result.get("eval"):
        return False, "--skip-eval: the table reports the held-out scores"
    steps = min(result["megatron_rl"]["rl_steps"], result["trl"]["rl_steps"])
    if steps < 3:
        return False, f"only {steps} RL step(s) on one side (need >= 3)"
    return True, ""


def readme_table(result: dict) -> str:
    """The comparison table of docs/benchmarks.md (markdown) from a result dict."""
    m, t, r = result["megatron_rl"], result["trl"], result["ratio_megatron_rl_over_trl"]
    rows = [("RL steps / min", f"{m['rl_steps_per_min']:.1f}", f"{t['rl_steps_per_min']:.1f}", f"{r['rl_steps_per_min']:.2f}x"),
            ("generated tokens / s", f"{m['generated_tokens_per_s']:.0f}", f"{t['generated_tokens_per_s']:.0f}",
             f"{r['generated_tokens_per_s']:.2f}x"),
            ("median step s", f"{m['median_step_s']:.2f}", f"{t['median_step_s']:.2f}", "")]
    n = result["eval_settings"]["n"]
    for key in (f"avg@{n}", f"pass@{n}"):
        if result["eval"]:
            rows.append((f"held-out {key}", f"{result['eval']['megatron-rl'][key]:.3f}", f"{result['eval']['trl'][key]:.3f}", ""))
    lines = ["| | megatron-rl | TRL | ratio |", "|---|---|---|---|"] + ["| " + " | ".join(x) + " |" for x in rows]
    return "\n".join(lines) + "\n"


def reused_steps(side: dict, steps: int | None, path: Path) -> int:
    """The step count of a reused megatron-rl side: `--steps` when given must match it (TRL's wall
    budget and step cap follow from it).

    Raises:
        SystemExit: `--steps` differs from the reused run's (names the file and both counts)."""
    if steps is not None and steps != side["rl_steps"]:
        raise SystemExit(f"{path}: the reused megatron-rl run has {side['rl_steps']} steps, not --steps {steps}; "
                         f"pass --steps {side['rl_steps']} (or none), or use another --work-dir")
    return side["rl_steps"]


def run_megatron(work: Path, steps: int, seed: int, responses_per_step: int, log) -> dict:
    """Train the grpo recipe for `steps` RL steps; returns per-step timings and tokens (also saved
    as `work/megatron-rl.side.json` for `--reuse`)."""
    run_dir = work / "megatron-rl"
    shutil.rmtree(run_dir, ignore_errors=True)
    cli = Path(sys.executable).parent / "megatron-rl"
    cmd = [str(cli), "train", "--config", str(TINY / "grpo.yaml"), f"run_dir={run_dir}",
           f"trainer.total_training_steps={steps}", "trainer.save_interval=0", "trainer.save_last=true",
           "trainer.progress_bar=false", "trainer.tensorboard=false", f"trainer.seed={seed}",
           "eval.before_train=false", "eval.after_train=false"]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(work / "megatron-rl.log", "w") as fh, LoadMonitor() as load:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"megatron-rl train failed (exit {r.returncode}); log: {work / 'megatron-rl.log'}")
    side = summarise_megatron_run(run_dir, wall, load0, os.getloadavg()[0], responses_per_step)
    side.update(loadavg_max=load.max, loadavg_mean=load.mean, foreign_cpus_mean=load.foreign_mean,
                foreign_cpus_max=load.foreign_max)
    (work / "megatron-rl.side.json").write_text(json.dumps(side, indent=2))
    log(f"megatron-rl: {side['rl_steps']} steps, {side['train_s']:.1f} s of steps, {wall:.1f} s in all")
    return side


def summarise_megatron_run(run_dir: Path, process_wall_s: float, load0, load1, responses_per_step: int = 128) -> dict:
    """Per-step timings, tokens and train accuracy of a finished megatron-rl run dir."""
    m = _load_metrics(run_dir)
    step_s = [x["timing/step_s"] for x in m]
    phases = {k: sum(x.get(k, 0.0) for x in m) for k in PHASES}
    return {
        "rl_steps": len(m), "train_s": sum(step_s), "process_wall_s": process_wall_s,
        "overhead_s": process_wall_s - sum(step_s), "step_s": step_s,
        "generated_tokens": sum(x["perf/generated_tokens"] for x in m),
        "responses": len(m) * responses_per_step, "train_acc": [x.get("train/acc") for x in m],
        "phase_s": phases, "checkpoint": str(run_dir), "loadavg_start": load0, "loadavg_end": load1,
    }


def run_trl(py: Path, work: Path, budget_s: float, max_rl_steps: int, seed: int, grpo: dict, log) -> dict:
    """TRL GRPOTrainer for the same wall budget with the settings `grpo` (`trl_settings`)."""
    out = work / "trl"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "repo": str(REPO), "seed": seed, "out_dir": str(out), "train_file": str(TINY / "data" / "train.jsonl"),
        "model": str(TINY / "base_model"), "budget_s": budget_s, "max_rl_steps": max_rl_steps,
        "grpo": grpo,
    }
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    with open(work / "trl.log", "w") as fh, LoadMonitor() as load:
        r = subprocess.run([str(py), str(REPO / "benchmarks" / "trl_worker.py"), str(out / "spec.json")],
                           stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"TRL run failed (exit {r.returncode}); log: {work / 'trl.log'}")
    side = summarise_trl_run(out, wall, load0, os.getloadavg()[0])
    side.update(loadavg_max=load.max, loadavg_mean=load.mean, foreign_cpus_mean=load.foreign_mean,
                foreign_cpus_max=load.foreign_max)
    (work / "trl.side.json").write_text(json.dumps(side, indent=2))
    log(f"TRL: {side['rl_steps']} steps, {side['train_s']:.1f} s of steps, {wall:.1f} s in all")
    return side


def summarise_trl_run(out: Path, process_wall_s: float, load0, load1) -> dict:
    """Per-RL-step timings, completion tokens and train accuracy of a finished TRL worker run."""
    res = json.loads((out / "result.json").read_text())
    steps = res["rl_steps"]
    step_s = [s["step_s"] for s in steps]
    return {
        "rl_steps": len(steps), "train_s": sum(step_s), "process_wall_s": process_wall_s,
        "overhead_s": process_wall_s - sum(step_s), "step_s": step_s,
        "generated_tokens": sum(s["completion_tokens"] for s in steps),
        "responses": sum(s["completions"] for s in steps), "train_acc": [s["acc"] for s in steps],
        "checkpoint": res["final_model"], "versions": res["versions"], "torch_threads": res["torch_threads"],
        "loadavg_start": load0, "loadavg_end": load1,
    }


def checkpoint_stamp(checkpoint: str) -> list:
    """(relative path, size, mtime in ns) of every file under a checkpoint folder, sorted: what
    `--reuse` compares before taking an earlier evaluation of the same path."""
    root = Path(checkpoint)
    return sorted([str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
                  for f in root.rglob("*") if f.is_file())


def run_eval(checkpoint: str, out: Path, n: int, seed: int, log, reuse: bool = False) -> dict:
    """`megatron-rl eval` on the held-out set; returns avg@n, pass@n, format share, wall seconds.

    With `reuse`, an `out/results.json` of the same checkpoint (path and files: `checkpoint_stamp`),
    n and seed is read instead: a side trained again into the same folder is evaluated again."""
    stamp = checkpoint_stamp(checkpoint)
    if reuse and (out / "eval.side.json").exists():
        side = json.loads((out / "eval.side.json").read_text())
        if (side.get("checkpoint") == checkpoint and side.get("stamp") == stamp and side.get("n") == n
                and side.get("seed") == seed):
            log(f"eval {checkpoint}: reused {out}")
            return side["result"]
    cli = Path(sys.executable).parent / "megatron-rl"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(cli), "eval", "--checkpoint", checkpoint, "--data", str(TINY / "data" / "test.jsonl"),
           "--n", str(n), "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", "64",
           "--seed", str(seed), "--out", str(out)]
    t0 = time.perf_counter()
    with open(str(out) + ".log", "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if r.returncode:
        raise SystemExit(f"megatron-rl eval failed (exit {r.returncode}); log: {out}.log")
    out_d = read_eval_results(out / "results.json", n)
    out_d["wall_s"] = time.perf_counter() - t0
    (out / "eval.side.json").write_text(json.dumps({"checkpoint": checkpoint, "stamp": stamp, "n": n, "seed": seed,
                                                    "result": out_d}))
    log(f"eval {checkpoint}: avg@{n} {out_d[f'avg@{n}']:.3f}")
    return out_d


def read_eval_results(path: Path, n: int) -> dict:
    """avg@n (with its CI), pass@n, format-valid share and problem count of the one dataset in a
    `megatron-rl eval` results.json (`{"settings": ..., "datasets": {name: summary}}`).

    Raises:
        ValueError: the file holds no dataset with avg@n.
    """
    res = json.loads(Path(path).read_text())
    ds = next((v for v in res.get("datasets", {}).values() if isinstance(v, dict) and f"avg@{n}" in v), None)
    if ds is None:
        raise ValueError(f"{path}: no dataset with avg@{n} under 'datasets'")
    return {f"avg@{n}": ds[f"avg@{n}"]["value"], f"avg@{n}_ci": ds[f"avg@{n}"]["ci"],
            f"pass@{n}": ds[f"pass@{n}"]["value"], "format_valid": ds["format_valid"],
            "num_problems": ds["num_problems"]}


def summarise(side: dict) -> dict:
    """RL steps/min and generated tokens/s over the training wall time."""
    t = max(side["train_s"], 1e-9)
    return {"rl_steps_per_min": 60.0 * side["rl_steps"] / t, "generated_tokens_per_s": side["generated_tokens"] / t,
            "responses_per_s": side["responses"] / t,
            "median_step_s": statistics.median(side["step_s"]) if side["step_s"] else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="megatron-rl RL steps (sets the shared wall budget) [12; with --reuse: the reused run's]")
    ap.add_argument("--trl-max-steps", type=int, default=0,
                    help="cap on TRL's RL steps (default 10 x --steps; the wall budget usually stops it first)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-n", type=int, default=8, help="samples per held-out problem (avg@n)")
    ap.add_argument("--skip-eval", action="store_true", help="speed only, no held-out evaluation")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the TRL environment (created if missing)")
    ap.add_argument("--trl-version", default=TRL_VERSION)
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="folder for both runs and their evaluations (default: a new folder under the system temp "
                         "dir); an existing run in it is reused with --reuse, otherwise refused, never deleted")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the finished runs and evaluations already in --work-dir (re-evaluate, re-tabulate)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "trl_compare.json")
    ap.add_argument("--table", type=Path, default=REPO / "benchmarks" / "results" / "trl_compare_table.md",
                    help="the markdown table for docs/benchmarks.md, written only when the load average stayed <= "
                         f"{IDLE_LOAD_PER_CPU} per CPU during both runs, or other processes used <= "
                         f"{FOREIGN_IDLE_CPUS} CPUs on average (idle_verdict)")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    import signal
    import tempfile

    if args.reuse and args.work_dir is None:
        ap.error("--reuse needs the --work-dir of the earlier invocation")
    if args.work_dir is None:
        args.work_dir = Path(tempfile.mkdtemp(prefix="megatron-rl-trl-compare-"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        taken = [p for p in (args.work_dir / "megatron-rl", args.work_dir / "trl") if p.exists()]
        if taken:
            ap.error(f"{', '.join(map(str, taken))} exist (an earlier comparison): pass --reuse to use them, or "
                     "another --work-dir; nothing is deleted")
    log(f"work dir: {args.work_dir} (runs, logs and evaluations)")
    # SIGTERM ends this script through SystemExit, so subprocess.run kills the run it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_all = time.perf_counter()
    py = ensure_trl_venv(args.venv, args.trl_version)
    log(f"TRL environment: {py}")
    log(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    from megatron_rl.config.loader import load_config

    cfg = load_config(str(TINY / "grpo.yaml"))
    grpo = trl_settings(cfg)
    w = args.work_dir
    if args.reuse and (w / "megatron-rl.side.json").exists():
        mrl = json.loads((w / "megatron-rl.side.json").read_text())
        args.steps = reused_steps(mrl, args.steps, w / "megatron-rl.side.json")
        log(f"megatron-rl: reused {w / 'megatron-rl.side.json'} ({args.steps} steps)")
    else:
        args.steps = args.steps or 12
        mrl = run_megatron(w, args.steps, args.seed, cfg.data.train_batch_size * cfg.rollout.n, log)
    if args.reuse and (w / "trl.side.json").exists():
        trl = json.loads((w / "trl.side.json").read_text())
        log(f"TRL: reused {w / 'trl.side.json'}")
    else:
        trl = run_trl(py, w, mrl["train_s"], args.trl_max_steps or 10 * args.steps, args.seed, grpo, log)
    evals = {}
    if not args.skip_eval:
        for key, ckpt in (("base", str(TINY / "base_model")), ("megatron-rl", mrl["checkpoint"]), ("trl", trl["checkpoint"])):
            evals[key] = run_eval(ckpt, w / f"eval-{key}", args.eval_n, args.seed, log, reuse=args.reuse)
    sm, st = summarise(mrl), summarise(trl)
    ratio = {k: sm[k] / st[k] if st[k] else float("inf")
             for k in ("rl_steps_per_min", "generated_tokens_per_s", "responses_per_s")}
    result = {
        "benchmark": "trl_compare", "recipe": "examples/tiny/grpo.yaml", "seed": args.seed, "steps": args.steps,
        "setup": {"prompts_per_step": cfg.data.train_batch_size, "group_size": cfg.rollout.n,
                  "trl_grpo_config": grpo, "loss": "seq-mean-token-mean (TRL loss_type=grpo)", "kl": 0.0,
                  "dtype": "float32", "device": "cpu", "cpu_count": os.cpu_count()},
        "megatron_rl": {**mrl, **sm}, "trl": {**trl, **st}, "ratio_megatron_rl_over_trl": ratio,
        "megatron_rl_step_split_s": split_before_and_after(mrl),
        "eval": evals, "eval_settings": {"data": "examples/tiny/data/test.jsonl", "n": args.eval_n,
                                         "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64, "seed": args.seed},
        "skip_eval": args.skip_eval,
        "warnings": [],
        "total_wall_s": time.perf_counter() - t_all,
    }
    if min(mrl["rl_steps"], trl["rl_steps"]) < 3:
        result["warnings"].append(
            f"only {min(mrl['rl_steps'], trl['rl_steps'])} RL step(s) on one side: the first step's warm-up "
            "dominates the rate, so the ratio is not representative; use --steps 12 (the default) or more")
    idle, why = idle_verdict({"megatron-rl": mrl, "trl": trl}, os.cpu_count() or 1)
    result["idle"], result["load_verdict"] = idle, why
    if not idle:
        result["warnings"].append(f"not an idle machine ({why}): the docs table was not written; the JSON "
                                  "still records this run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table_ok, table_why = table_allowed(result, idle, why)
    if table_ok and args.table is not None:
        args.table.write_text(readme_table(result))
        log(f"docs table ({why}): {args.table}")
    elif args.table is not None:
        log(f"docs table not written: {table_why}")

    n = args.eval_n
    print()
    print(f"{'':22s} {'megatron-rl':>12s} {'TRL ' + trl.get('versions', {}).get('trl', ''):>12s} "
          f"{'ratio (megatron-rl / TRL)':>7s}")
    print(f"{'RL steps':22s} {mrl['rl_steps']:12d} {trl['rl_steps']:12d}")
    print(f"{'training wall s':22s} {mrl['train_s']:12.1f} {trl['train_s']:12.1f}")
    print(f"{'RL steps / min':22s} {sm['rl_steps_per_min']:12.2f} {st['rl_steps_per_min']:12.2f} "
          f"{ratio['rl_steps_per_min']:7.2f}")
    print(f"{'generated tokens / s':22s} {sm['generated_tokens_per_s']:12.1f} {st['generated_tokens_per_s']:12.1f} "
          f"{ratio['generated_tokens_per_s']:7.2f}")
    print(f"{'median step s':22s} {sm['median_step_s']:12.2f} {st['median_step_s']:12.2f}")
    print(f"{'start-up etc. s':22s} {mrl['overhead_s']:12.1f} {trl['overhead_s']:12.1f}")
    if evals:
        print(f"{'held-out avg@%d' % n:22s} {evals['megatron-rl'][f'avg@{n}']:12.3f} {evals['trl'][f'avg@{n}']:12.3f}"
              f"   (base {evals['base'][f'avg@{n}']:.3f})")
        print(f"{'held-out pass@%d' % n:22s} {evals['megatron-rl'][f'pass@{n}']:12.3f} {evals['trl'][f'pass@{n}']:12.3f}"
              f"   (base {evals['base'][f'pass@{n}']:.3f})")
    def la(side):
        a, b = side.get("loadavg_start"), side.get("loadavg_end")
        return "?" if a is None or b is None else f"{a:.1f}-{b:.1f}"

    print(f"load average: {la(mrl)} (megatron-rl), {la(trl)} (TRL); wrote {args.out}")
    print("megatron-rl's mean step, s: " + "; ".join(
        f"{label}: " + ", ".join(f"{k} {v:.3f}" if k != "rl_steps" else f"over {v} steps" for k, v in split.items())
        for label, split in result["megatron_rl_step_split_s"].items()))
    for w_ in result["warnings"]:
        print(f"WARNING: {w_}")


if __name__ == "__main__":
    main()
