"""What one RL step's generation costs on the embedded server: batched vs deterministic inference.

Starts the embedded server (`python -m megatron_rl.engine`) on the tiny base model with one thread
(what `megatron-rl train` gives it on 2 cores, `parallel/threads.py`) and sends the tiny recipes'
step through `RolloutManager.generate`, as the trainer does: 16 training prompts x 8 responses, up
to 64 new tokens, temperature 1.0, `--repeats` steps on successive prompts. Per step it records the
wall time, the server process's CPU time (/proc/<pid>/stat: user + system), this process's CPU time
(the client side: HTTP, JSON, prompt rendering) and the generated tokens. Modes:

- `batched`: the default, continuous batching of the requests as they arrive;
- `deterministic`: `--enable-deterministic-inference` (`rollout.enable_deterministic_inference`),
  every request in a batch of its own, so a run repeats bit for bit.

The first step of each mode is a warm-up and left out; the table gives the sums over the other
steps (wall, CPU, tokens) and the CPU per token from those sums, so every column describes the
same steps. Server CPU time is the figure to read on a shared machine (other jobs stretch wall
time, not CPU time).
`--profile DIR` also records the server with py-spy (raw collapsed stacks, `pip install py-spy`).

    .venv/bin/python benchmarks/generation_cost.py                  # both modes, 4 steps each (~1.5 min)
    .venv/bin/python benchmarks/generation_cost.py --modes batched --profile runs/gen-profile

Prints a table and writes `benchmarks/results/generation_cost.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = REPO / "examples" / "tiny" / "base_model"
TRAIN = REPO / "examples" / "tiny" / "data" / "train.parquet"
MODES = {"batched": [], "deterministic": ["--enable-deterministic-inference"]}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(mode: str, repeats: int, prompts: int, n: int, max_new_tokens: int, profile: Path | None) -> dict:
    """`repeats` steps of generation in `mode`; per-step rows and medians (warm-up step left out)."""
    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import load_rows
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.launcher import launch_rollout_server
    from megatron_rl.rollout.manager import RolloutManager

    rows = load_rows(TRAIN)[: prompts * repeats]
    tok = AutoTokenizer.from_pretrained(MODEL)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    log = (profile or Path(os.environ.get("TMPDIR", "/tmp"))) / f"generation_cost_{mode}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    steps = []
    with launch_rollout_server(MODEL, extra_args=["--max-batch-size", "256", *MODES[mode]], env=env,
                               log_path=log, startup_timeout_s=180) as server, RewardPool(1, 30) as pool:
        client = server.client(generate_timeout_s=1800)
        pid = server.process.pid
        manager = RolloutManager([client], tok, pool, reward_fn="dapo_math", max_prompt_length=1 << 20,
                                 max_response_length=max_new_tokens, eos_token_ids=[tok.eos_token_id])
        spy = None
        try:
            for k in range(repeats):
                if k == 1 and profile is not None:
                    spy = subprocess.Popen([_py_spy(), "record", "--nonblocking", "--format", "raw", "-r", "200",
                                            "-o", str(profile / f"server_{mode}.txt"), "-p", str(pid)])
                    time.sleep(1.0)
                c0, p0, t0 = process_cpu_s(pid), time.process_time(), time.perf_counter()
                res = manager.generate(rows[k * prompts:(k + 1) * prompts], n=n,
                                       sampling_params={"temperature": 1.0, "top_p": 1.0}, tag=f"s{k}", seed_parts=(1, k))
                steps.append({"wall_s": time.perf_counter() - t0, "server_cpu_s": process_cpu_s(pid) - c0,
                              "client_cpu_s": time.process_time() - p0,
                              "tokens": sum(len(r.output_ids) for group in res for r in group)})
                print(f"  {mode} step {k}: " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}"
                                                       for key, v in steps[-1].items()), flush=True)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait()
            manager.close()
            client.close()
    timed = steps[1:]
    total = {key: sum(s[key] for s in timed) for key in ("wall_s", "server_cpu_s", "client_cpu_s", "tokens")}
    total["steps"] = len(timed)
    total["server_cpu_ms_per_token"] = 1000 * total["server_cpu_s"] / max(total["tokens"], 1)
    return {"steps": steps, "total": total}


def _py_spy() -> str:
    """py-spy next to this interpreter (the venv's), else on PATH.

    Raises:
        SystemExit: not installed (before any server starts).
    """
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.is_file() else shutil.which("py-spy")
    if not found:
        raise SystemExit("--profile needs py-spy (.venv/bin/pip install py-spy)")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=4, help="steps per mode, the first a warm-up")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile", type=Path, help="py-spy raw stacks of the server (steps 2..) into this folder")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "generation_cost.json")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be >= 2 (the first step of each mode is a warm-up)")
    if args.profile is not None:
        _py_spy()
    load0 = os.getloadavg()
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "loadavg_before": load0, "modes": {}}
    for mode in args.modes:
        result["modes"][mode] = measure(mode, args.repeats, args.prompts, args.n, args.max_new_tokens, args.profile)
    result["loadavg_after"] = os.getloadavg()
    print(f"\nsums over steps 2..{args.repeats} of each mode:")
    print(f"| mode | wall s | server CPU s | client CPU s | tokens | server CPU ms / token |\n|---|---|---|---|---|---|")
    for mode, r in result["modes"].items():
        m = r["total"]
        print(f"| {mode} | {m['wall_s']:.2f} | {m['server_cpu_s']:.2f} | {m['client_cpu_s']:.2f} | {m['tokens']:.0f} | "
              f"{m['server_cpu_ms_per_token']:.3f} |")
    if {"batched", "deterministic"} <= set(result["modes"]):
        b, d = result["modes"]["batched"]["total"], result["modes"]["deterministic"]["total"]
        result["deterministic_over_batched"] = {"wall": d["wall_s"] / b["wall_s"],
                                                "server_cpu": d["server_cpu_s"] / b["server_cpu_s"]}
        print(f"deterministic / batched: wall {result['deterministic_over_batched']['wall']:.1f}x, server CPU "
              f"{result['deterministic_over_batched']['server_cpu']:.1f}x")
    print(f"load average (1 min) before {load0[0]:.1f}, after {result['loadavg_after'][0]:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
