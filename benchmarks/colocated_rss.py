"""Peak resident memory of the tiny CI run, colocated vs disaggregated (issue 17's "Measure").

Runs `megatron-rl train` on examples/tiny/ci.yaml (3 steps, deterministic, no evaluation) twice,
with `rollout.colocate` false and true, sampling every 0.1 s the RSS of the whole process tree
(trainer + rollout server + reward workers) from /proc; reports the peak of the sum and the
peak of each process kind. On CPU the trainer's offload is a no-op, so the difference comes from
the engine releasing its weights while the trainer trains (the tiny model's weights are small).

    .venv/bin/python benchmarks/colocated_rss.py    # ~5 min on 2 loaded cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = open(f"/proc/{e}/stat", "rb").read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(e))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _rss(pid: int) -> tuple[str, int]:
    try:
        rss = int(open(f"/proc/{pid}/statm").read().split()[1]) * PAGE
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return "", 0
    kind = "server" if "megatron_rl.engine" in cmd else "trainer" if "megatron_rl.cli" in cmd else "other"
    return kind, rss


def run(colocate: bool, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "examples/tiny/ci.yaml"),
           f"run_dir={run_dir}", "trainer.total_training_steps=3", "trainer.progress_bar=false",
           "eval.before_train=false", "eval.after_train=false", "rollout.enable_deterministic_inference=true",
           f"rollout.colocate={str(colocate).lower()}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_sum, peak = 0, {}
    while proc.poll() is None:
        by_kind: dict[str, int] = {}
        for pid in _tree(proc.pid):
            kind, rss = _rss(pid)
            if kind:
                by_kind[kind] = by_kind.get(kind, 0) + rss
        peak_sum = max(peak_sum, sum(by_kind.values()))
        for k, v in by_kind.items():
            peak[k] = max(peak.get(k, 0), v)
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): see {run_dir}/train.log")
    return {"peak_total_gib": peak_sum / 2**30, **{f"peak_{k}_gib": v / 2**30 for k, v in peak.items()}}


def main() -> None:
    out: dict = {"load_avg_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="coloc-rss-") as d:
        for colocate in (False, True):
            out["colocated" if colocate else "disaggregated"] = run(colocate, Path(d) / str(colocate))
    out["load_avg_1m_end"] = os.getloadavg()[0]
    path = REPO / "benchmarks" / "results" / "colocated_rss.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    for k in ("disaggregated", "colocated"):
        print(k, {a: round(b, 3) for a, b in out[k].items()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
