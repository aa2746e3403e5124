"""Benchmark: streaming checkpoint conversion of a Qwen2.5-32B-shaped model cut to 2 layers.

The model has Qwen2.5-32B's real sizes (hidden 5120, FFN 27648, vocabulary 152064, 40 query /
8 KV heads, QKV bias, untied embeddings; config from /work/shared/data/hf-configs/Qwen2.5-32B.json)
with `num_hidden_layers=2`: random bf16 weights (5.1 GB) written by huggingface_hub's
`save_torch_state_dict` with `max_shard_size="5GB"` (what transformers' `save_pretrained` uses).
Each stage runs in a child process of its own, so its peak memory is its own kernel high-water mark
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`: resident pages, file-backed mappings included):

1. generate the HF checkpoint;
2. HF -> megatron (`import_from_hf`);
3. megatron -> HF (`export_to_hf`);
4. compare the round trip with the original tensor by tensor (one tensor in memory at a time).

The issue's memory target is peak RSS < 1.5 x the largest HF shard + the model's largest tensor.
Throughput is HF tensor bytes / conversion wall time (the CLI's start-up, ~10 s of imports, is
reported apart). Files go under --work-dir (default: a fresh folder in /tmp) and are deleted at
the end unless --keep.

Usage: .venv/bin/python benchmarks/convert_32b_2layer.py [--out benchmarks/results/convert_32b_2layer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = Path("/work/shared/data/hf-configs/Qwen2.5-32B.json")
GB = 1e9


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def stage_generate(work: Path, config_path: Path) -> dict:
    """Random bf16 HF checkpoint in 5 GB shards; returns shard sizes and the largest tensor."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = json.loads(config_path.read_text())
    hf_config["num_hidden_layers"] = 2
    hf_config["max_window_layers"] = 2
    src = work / "hf"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(hf_config, indent=2))
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):  # names and shapes only
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, param in model.state_dict().items():
        state[name] = (torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    del model
    save_torch_state_dict(state, src, max_shard_size="5GB")
    shards = sorted(src.glob("*.safetensors"))
    largest = max(state.items(), key=lambda kv: kv[1].numel())
    return {
        "shards": {p.name: p.stat().st_size for p in shards},
        "total_tensor_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "largest_tensor": largest[0],
        "largest_tensor_bytes": largest[1].numel() * largest[1].element_size(),
        "num_tensors": len(state),
    }


def stage_convert(direction: str, src: Path, dst: Path) -> dict:
    """One conversion in this process; returns wall time and peak RSS (after imports and overall)."""
    from megatron_rl.checkpoint.convert import export_to_hf, import_from_hf

    import_rss = _peak_rss_bytes()
    started = time.perf_counter()
    if direction == "to-megatron":
        import_from_hf(src, dst, progress=True)
    else:
        export_to_hf(src, dst, progress=True)
    return {"wall_s": time.perf_counter() - started, "peak_rss_bytes": _peak_rss_bytes(),
            "peak_rss_after_imports_bytes": import_rss}


def stage_compare(original: Path, back: Path) -> dict:
    """Tensor-by-tensor equality (dtype, shape, bits) and the same shard layout."""
    import torch
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            return {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        out = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                out.update({n: f for n in h.keys()})
        return out

    a, b = files(original), files(back)
    mismatched = []
    for name in sorted(a):
        if name not in b:
            mismatched.append(name)
            continue
        with safe_open(str(a[name]), framework="pt") as ha, safe_open(str(b[name]), framework="pt") as hb:
            x, y = ha.get_tensor(name), hb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                mismatched.append(name)
    same_layout = {n: p.name for n, p in a.items()} == {n: p.name for n, p in b.items()}
    return {"bit_identical": not mismatched and a.keys() == b.keys(), "mismatched": mismatched[:10],
            "extra": sorted(set(b) - set(a))[:10], "same_shard_layout": same_layout}


def _child(stage: str, *args: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, *args]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"stage {stage} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/convert_32b_2layer.json"))
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--work-dir", default=None, help="where the checkpoints go (default: a new /tmp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.stage:  # a child: one stage, JSON on the last stdout line
        sys.stdout.flush()
        if opts.stage == "generate":
            result = stage_generate(Path(opts.args[0]), Path(opts.config))
        elif opts.stage == "compare":
            result = stage_compare(Path(opts.args[0]), Path(opts.args[1]))
        else:
            result = stage_convert(opts.stage, Path(opts.args[0]), Path(opts.args[1]))
        print(json.dumps(result))
        return

    work = Path(opts.work_dir) if opts.work_dir else Path(tempfile.mkdtemp(prefix="convert_32b_2layer_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        gen = _child("generate", str(work))
        print(f"generated {len(gen['shards'])} HF shard(s) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        runs = {}
        for direction, src, dst in (("to-megatron", work / "hf", work / "mcore"), ("to-hf", work / "mcore", work / "back")):
            t0 = time.perf_counter()
            runs[direction] = _child(direction, str(src), str(dst))
            runs[direction]["process_wall_s"] = time.perf_counter() - t0
        check = _child("compare", str(work / "hf"), str(work / "back"))
        mcore_bytes = sum(p.stat().st_size for p in (work / "mcore").glob("*.distcp"))
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)

    largest_shard = max(gen["shards"].values())
    budget = 1.5 * largest_shard + gen["largest_tensor_bytes"]
    data = gen["total_tensor_bytes"]
    result = {
        "model": "Qwen2.5-32B shapes, 2 layers, random bf16, untied, QKV bias",
        "hf_shards_bytes": gen["shards"],
        "hf_tensor_bytes": data,
        "megatron_checkpoint_bytes": mcore_bytes,
        "largest_tensor": gen["largest_tensor"],
        "largest_tensor_bytes": gen["largest_tensor_bytes"],
        "memory_budget_bytes": budget,
        "runs": {d: dict(r, gb_per_s=data / GB / r["wall_s"], within_budget=r["peak_rss_bytes"] < budget)
                 for d, r in runs.items()},
        "round_trip": check,
        "host": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
    }
    print(f"\nHF checkpoint: {data / GB:.2f} GB in {len(gen['shards'])} shard(s), largest shard "
          f"{largest_shard / GB:.2f} GB, largest tensor {gen['largest_tensor']} {gen['largest_tensor_bytes'] / GB:.2f} GB")
    print(f"memory budget (1.5 x largest shard + largest tensor): {budget / GB:.2f} GB\n")
    print(f"{'direction':<14}{'wall s':>9}{'GB/s':>8}{'peak RSS GB':>13}{'after imports GB':>18}{'in budget':>11}")
    for d, r in result["runs"].items():
        print(f"{d:<14}{r['wall_s']:>9.1f}{r['gb_per_s']:>8.2f}{r['peak_rss_bytes'] / GB:>13.2f}"
              f"{r['peak_rss_after_imports_bytes'] / GB:>18.2f}{str(r['within_budget']):>11}")
    print(f"\nHF -> megatron -> HF bit-identical: {check['bit_identical']} (same shard layout: {check['same_shard_layout']})")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
