"""Weight-sync throughput against a raw broadcast, and the time split of a sync.

Part 1 (``--part big``): a synthetic ~1 GB Qwen2 (random weights, float32) is served by a real
embedded server; the trainer (this process) pushes it with ``WeightSyncSender`` (HTTP session +
bucketed broadcast + the server's load), then a raw ``torch.distributed.broadcast`` of the same
bytes in the same bucket sizes goes from this process to a plain receiver process over a group
built the same way (``init_custom_process_group``, same backend, same loopback). Reported: GB/s of
each and the ratio (issue 5's target: >= 0.8), for both ``weight_sync.load_format`` values:
``flattened_bucket`` (the tensors of a bucket copied into one buffer) and null (one broadcast per
tensor, no copy on the trainer side).

Part 2 (``--part tiny``): the SFT'd tiny model in megatron-core (a world of one): the sync's time
split into producing the HF tensors (megatron -> HF names, TP gathers when TP > 1, cast,
flattening), broadcast, server load, and the HTTP control calls.

Writes ``benchmarks/results/sync_throughput.json`` and prints a table.

    .venv/bin/python benchmarks/sync_throughput.py            # both parts
    .venv/bin/python benchmarks/sync_throughput.py --part tiny
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.ports import find_free_port  # noqa: E402
from megatron_rl.weight_sync.buckets import MIB  # noqa: E402


def _raw_receiver(port: int, sizes: list[int], repeats: int, group_name: str) -> None:
    import torch.distributed as dist

    from megatron_rl.weight_sync.group import init_custom_process_group

    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=1,
                                   group_name=group_name, timeout_s=600)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(repeats):
        for b in bufs:
            dist.broadcast(b, src=0, group=pg)
    dist.barrier(group=pg)


def raw_broadcast_gbps(sizes: list[int], repeats: int) -> float:
    """GB/s (1e9 bytes) of plain broadcasts of buckets of ``sizes`` bytes to one receiver process."""
    import torch.distributed as dist

    from megatron_rl.weight_sync.group import destroy_custom_process_group, init_custom_process_group

    port = find_free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_raw_receiver, args=(port, sizes, repeats + 1, "raw_bench"))
    proc.start()
    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=port, world_size=2, rank=0,
                                   group_name="raw_bench", timeout_s=600)
    bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    for b in bufs:  # warm-up round
        dist.broadcast(b, src=0, group=pg)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for b in bufs:
            dist.broadcast(b, src=0, group=pg)
    elapsed = time.perf_counter() - t0
    dist.barrier(group=pg)
    proc.join(timeout=120)
    destroy_custom_process_group(pg)
    return sum(sizes) * repeats / 1e9 / elapsed


def part_big(bucket_mib: float, repeats: int, load_format: str | None = "flattened_bucket") -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.weight_sync.buckets import bucket_named_tensors
    from megatron_rl.weight_sync.sender import WeightSyncSender

    cfg = Qwen2Config(vocab_size=65536, hidden_size=2048, intermediate_size=5504, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                      max_position_embeddings=256, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    state = [(n, t.detach()) for n, t in model.state_dict().items() if n != "lm_head.weight"]  # tied
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    with tempfile.TemporaryDirectory(prefix="sync-bench-") as d:
        model.save_pretrained(d)
        del model
        (server,) = launch_servers("embedded", d, 1, startup_timeout_s=600,
                                   embedded_args=["--dtype", "float32", "--weight-sync-timeout-s", "600"])
    try:
        client = server.client(timeout_s=600)
        sender = WeightSyncSender([client], bucket_size_mib=bucket_mib, timeout_s=600, load_format=load_format)
        sender.init_group()
        sender.sync(iter(state), weight_version="warmup")
        runs = [sender.sync(iter(state), weight_version=str(i)) for i in range(repeats)]
        sender.close()
    finally:
        server.stop()
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in bucket_named_tensors(iter(state), bucket_mib)]
    raw = raw_broadcast_gbps(sizes, repeats)
    best = min(runs, key=lambda m: m["weight_sync/time_s"])
    sync_gbps = nbytes / 1e9 / best["weight_sync/time_s"]
    return {
        "model_bytes": nbytes, "bucket_size_mib": bucket_mib, "num_buckets": len(sizes), "load_format": load_format,
        "sync_time_s": best["weight_sync/time_s"], "sync_gb_per_s": sync_gbps, "raw_broadcast_gb_per_s": raw,
        "ratio": sync_gbps / raw,
        "split_s": {k.split("/")[1]: best[k] for k in ("weight_sync/bucket_prepare_time_s", "weight_sync/broadcast_time_s",
                                                        "weight_sync/load_time_s", "weight_sync/control_time_s")},
    }


def part_tiny(repeats: int) -> dict:
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.cpu_compat import enable_cpu_compat
    from megatron_rl.parallel.groups import world_of_one
    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.weight_sync.sender import WeightSyncSender

    tiny = REPO / "examples" / "tiny" / "base_model"
    hf_config = json.loads((tiny / "config.json").read_text())
    enable_cpu_compat()
    (server,) = launch_servers("embedded", tiny, 1, startup_timeout_s=300, embedded_args=["--dtype", "float32"])
    try:
        with world_of_one(backend="gloo", timeout_s=300, seed=0) as pgs:
            model = build_model(hf_config, build_transformer_config(hf_config))
            load_hf_weights(model, str(tiny), tp_rank=0, tp_size=1)
            sender = WeightSyncSender([server.client()], timeout_s=300)
            sender.init_group()
            sender.sync(iter_hf_weights(model, hf_config), weight_version="warmup")
            runs = [sender.sync(iter_hf_weights(model, hf_config), weight_version=str(i)) for i in range(repeats)]
            sender.close()
            del pgs
    finally:
        server.stop()
    keys = ("time_s", "bucket_prepare_time_s", "broadcast_time_s", "load_time_s", "control_time_s")
    med = {k: sorted(r[f"weight_sync/{k}"] for r in runs)[len(runs) // 2] for k in keys}
    return {"model_bytes": runs[0]["weight_sync/bytes"], "repeats": repeats, "median_s": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["big", "tiny", "both"], default="both")
    ap.add_argument("--bucket-size-mib", type=float, default=512.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load-format", choices=["flattened_bucket", "null", "both"], default="both",
                    help="weight_sync.load_format of the big part (null = one broadcast per tensor)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sync_throughput.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict = {"host": os.uname().nodename, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    if args.part in ("tiny", "both"):
        result["tiny"] = part_tiny(max(args.repeats, 5))
        t = result["tiny"]["median_s"]
        print(f"tiny model sync ({result['tiny']['model_bytes'] / 2**20:.1f} MiB), median of "
              f"{result['tiny']['repeats']} syncs:")
        print(f"  {'phase':<40} {'seconds':>9}")
        for k, label in (("bucket_prepare_time_s", "megatron -> HF tensors, cast, flatten"),
                         ("broadcast_time_s", "broadcast"), ("load_time_s", "server unflatten + load"),
                         ("control_time_s", "HTTP control calls"), ("time_s", "total")):
            print(f"  {label:<40} {t[k]:>9.4f}")
    if args.part in ("big", "both"):
        formats = {"flattened_bucket": ["flattened_bucket"], "null": [None], "both": ["flattened_bucket", None]}
        for fmt in formats[args.load_format]:
            key = "big" if fmt == "flattened_bucket" else "big_per_tensor"
            result[key] = b = part_big(args.bucket_size_mib, args.repeats, fmt)
            print(f"\n1 GB synthetic model ({b['model_bytes'] / 1e9:.2f} GB, {b['num_buckets']} buckets of "
                  f"<= {b['bucket_size_mib']:.0f} MiB), load_format {fmt or 'null (one broadcast per tensor)'}, "
                  f"best of {args.repeats}:")
            print(f"  {'':<28} {'GB/s':>8}")
            print(f"  {'WeightSyncSender.sync':<28} {b['sync_gb_per_s']:>8.3f}")
            print(f"  {'raw dist.broadcast':<28} {b['raw_broadcast_gb_per_s']:>8.3f}")
            print(f"  ratio {b['ratio']:.2f} (target >= 0.8); split: "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in b["split_s"].items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
