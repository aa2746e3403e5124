"""Cost per call of the python tool's sandbox (issue 31): warm pool, cold start, concurrent throughput.

What is timed is `ProcessSandbox.run("print(2 + 3)")` as the rollout would call it: take a worker,
send the program, read its output, wait for its exit, kill its group, delete its folder.
- warm: a pool of 4 started workers; a pause of 0.3 s between calls lets the pool refill, so each
  call finds a ready worker (the result's `warm` flag is checked);
- back-to-back: the same pool without pauses (calls may catch a worker still starting);
- cold: `pool_size: 0`, every call starts its worker (interpreter start-up, namespaces, Landlock);
- concurrent: `run_many` of 64 trivial programs, 8 at a time, pool of 8: calls per second.
Targets (issue 31): median <= 50 ms warm, <= 300 ms cold. Writes `benchmarks/results/tool_sandbox.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig

OUT = Path(__file__).resolve().parent / "results" / "tool_sandbox.json"
TRIVIAL = "print(2 + 3)"


def _stats(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in samples_s)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 1), "min_ms": round(ms[0], 1)}


def _timed(sb: ProcessSandbox, n: int, pause_s: float) -> tuple[list[float], int]:
    times, warm = [], 0
    for _ in range(n):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        r = sb.run(TRIVIAL)
        times.append(time.perf_counter() - t0)
        assert r.ok and r.stdout == "5\n", (r.error, r.stderr)
        warm += bool(r.layers.get("warm"))
    return times, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls per sequential case")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = {}
    with ProcessSandbox(SandboxConfig(pool_size=4)) as sb:
        layers = sb.layers
        _timed(sb, 3, 0.3)  # first calls pay imports on the trainer side
        t, warm = _timed(sb, args.calls, 0.3)
        rows["warm"] = {**_stats(t), "warm_share": warm / len(t)}
        t, warm = _timed(sb, args.calls, 0.0)
        rows["back_to_back"] = {**_stats(t), "warm_share": warm / len(t)}
    with ProcessSandbox(SandboxConfig(pool_size=0)) as sb:
        _timed(sb, 1, 0.0)  # takes the worker started by the constructor's check
        t, warm = _timed(sb, args.calls // 2, 0.0)
        rows["cold"] = {**_stats(t), "warm_share": warm / len(t)}
    with ProcessSandbox(SandboxConfig(pool_size=8, max_concurrency=8)) as sb:
        time.sleep(1.0)
        t0 = time.perf_counter()
        results = sb.run_many([TRIVIAL] * 64)
        wall = time.perf_counter() - t0
        assert all(r.ok for r in results)
        rows["concurrent"] = {"n": 64, "concurrency": 8, "wall_s": round(wall, 2), "calls_per_s": round(64 / wall, 1)}
    out = {"program": TRIVIAL, "layers": layers, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
           "targets_ms": {"warm_median": 50, "cold_median": 300}, "results": rows}
    print(f"layers: {layers}  (cpus {out['cpus']}, load average {out['load_avg_1m']:.2f})")
    print(f"{'case':<14}{'n':>4}{'median ms':>11}{'p90 ms':>9}{'min ms':>9}{'warm':>7}")
    for name in ("warm", "back_to_back", "cold"):
        r = rows[name]
        print(f"{name:<14}{r['n']:>4}{r['median_ms']:>11}{r['p90_ms']:>9}{r['min_ms']:>9}{r['warm_share']:>7.0%}")
    c = rows["concurrent"]
    print(f"concurrent: {c['n']} calls, {c['concurrency']} at a time: {c['wall_s']} s, {c['calls_per_s']} calls/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
