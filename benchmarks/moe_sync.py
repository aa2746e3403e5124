"""Mixture-of-Experts weight sync (issue 29): the EP-gathered publish against a raw broadcast, the
export's peak memory, and the tiny MoE step split beside the dense tiny step.

Part ``sync`` (per model: ``tiny``, the shipped 8-expert top-2 `examples/tiny/moe_base_model` in
float32, and ``30b``, `examples/qwen3-30b-a3b/config.json` cut to 2 layers: hidden 2048, 32 / 4
heads of 128, 128 experts of 768, top-8, vocabulary 151936, untied, random bf16 weights):
three processes, as `sync_throughput.py` part big does for dense. Two gloo trainer ranks at
expert parallelism 2 (TP 1, 4 resp. 64 experts each; `initialize_parallel`, env RANK /
WORLD_SIZE as torchrun sets them) build the model with `models.builder`; rank 0, the publisher's
source, joins a private gloo group (`init_custom_process_group`, the weight sync's own) with a
plain receiver process. Then, collective over both trainer ranks:

1. the export alone: `iter_hf_weights(model, hf_config, ep_group=pgs.ep)` drained one tensor at a
   time (what the EP peer does in `WeightPublisher._take_part`); its peak RSS on each rank;
2. per ``weight_sync.load_format`` (``null``, the default: one broadcast per tensor, and
   ``flattened_bucket``), warm-up + N interleaved rounds of
   - the publish: rank 0 runs `iter_hf_weights(..., ep_group)` -> `buckets.wire_buckets` (the real
     sender's cast/bucket/flatten) and broadcasts bucket by bucket exactly as
     `WeightSyncSender.send` does (async broadcast of bucket k while bucket k+1 is gathered over
     EP and flattened), rank 1 iterates along (its EP gathers), the receiver receives;
   - the raw baseline: one `dist.broadcast` per bucket of the same sizes (a preallocated buffer)
     over the same group, rank 1 idle.
   Each round ends with a barrier of the sync group (inside the timing, both sides alike).
   GB/s = payload bytes / seconds; ratio = publish / raw (issue 29's target: >= 0.8), from the
   best round of each and from the medians.

No HTTP server is in the loop: the engine's load is the same for EP and dense models and is
measured by `sync_throughput.py`; this isolates what EP adds (the gathers) to the sender's path.

Memory, two measures on each trainer rank, for the export alone and for the publish:
- torch's allocator: the pass run once more (untimed) under torch.profiler with
  ``profile_memory``; the peak of the bytes torch allocated during the pass and still held
  (`_torch_peak_alloc`: exact, the model's parameters from before are not in it), plus the
  shard's parameter bytes;
- the resident set: ``VmHWM`` of /proc/self/status, reset before each measured pass by writing 5
  to /proc/self/clear_refs, minus the rank's RSS after its imports (Python, torch, megatron-core;
  before the model was built): so the shard, the allocator's retained memory, gloo's buffers and
  the export's working set; and its growth over the RSS just before the pass.
Target (issue 29): under 1.5 x the largest shard + the largest expert group. The shard is a
trainer rank's parameters (every EP rank holds the non-expert weights and 1/EP of each layer's
experts; the built model's parameter bytes, which `export_footprint` predicts). The expert group
is read two ways (both reported): one layer's experts, all E (gate, up, down), which
`iter_hf_weights` gathers and yields as one unit, and, stricter, one expert over the EP group
(EP experts' three tensors: what a single gather brings in).

Part ``split``: `megatron-rl train --config examples/tiny/moe-dapo.yaml` and
`--config examples/tiny/dapo.yaml` for a few RL steps each (no eval, no checkpoint; the runs go to
a temporary folder, deleted afterwards), then the median per-phase seconds of the steps after the
first (`timing/*` keys of metrics.jsonl, read with `step_time_split.py`'s helpers).

    .venv/bin/python benchmarks/moe_sync.py                       # both parts, ~3.5 min on 2 cores, ~20 GB RAM
    .venv/bin/python benchmarks/moe_sync.py --part sync --vocab-30b 32768   # a smaller machine
    .venv/bin/python benchmarks/moe_sync.py --part sync --models tiny
    .venv/bin/python benchmarks/moe_sync.py --part split --steps 6      # default 10 steps per recipe

Writes ``benchmarks/results/moe_sync.json`` (parts and models not run keep their entries) and
prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GB = 1e9
TINY_DIR = REPO / "examples" / "tiny" / "moe_base_model"
QWEN3_30B_CONFIG = REPO / "examples" / "qwen3-30b-a3b" / "config.json"
EP = 2


# --------------------------------------------------------------------------- pure functions
def synthetic_30b_config(num_layers: int = 2, vocab_size: int | None = None) -> dict:
    """Qwen3-30B-A3B's HF config (examples/qwen3-30b-a3b/config.json) cut to ``num_layers`` layers
    (and optionally to a smaller vocabulary)."""
    cfg = json.loads(QWEN3_30B_CONFIG.read_text())
    cfg["num_hidden_layers"] = num_layers
    cfg["max_window_layers"] = num_layers
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def export_footprint(hf_config: dict, *, itemsize: int, ep_size: int) -> dict:
    """Bytes of the HF tensors an export of ``hf_config`` yields and the issue's memory budget.

    Args:
        hf_config: an HF config (any architecture `models.hf_sharded.expected_hf_shapes` knows).
        itemsize: bytes per parameter (4 float32, 2 bf16).
        ep_size: expert-parallel size (the number of ranks the experts of a layer are split over).

    Returns:
        ``total_bytes`` (every HF tensor, what the engines receive), ``num_tensors``,
        ``expert_bytes`` (all experts of all layers), ``largest_tensor`` (name, bytes),
        ``largest_expert_group_bytes`` (one layer's experts, all of them: the unit the export
        gathers over EP and yields at once), ``largest_shard_bytes`` (one trainer rank: the
        non-expert weights plus 1/ep_size of the experts; vocabulary padding left out) and
        ``budget_bytes`` = 1.5 x largest shard + largest expert group.

    Raises:
        ValueError: ``ep_size`` does not divide a layer's experts, or a bad config.
    """
    from megatron_rl.models.hf_weights import expected_hf_shapes

    shapes = expected_hf_shapes(hf_config)
    per_layer_experts: dict[int, int] = {}
    experts_per_layer: dict[int, set] = {}
    total = 0
    largest = ("", 0)
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        total += nbytes
        if nbytes > largest[1]:
            largest = (name, nbytes)
        parts = name.split(".")
        if len(parts) > 5 and parts[3] == "mlp" and parts[4] == "experts":
            layer = int(parts[2])
            per_layer_experts[layer] = per_layer_experts.get(layer, 0) + nbytes
            experts_per_layer.setdefault(layer, set()).add(int(parts[5]))
    for layer, experts in experts_per_layer.items():
        if len(experts) % ep_size:
            raise ValueError(f"layer {layer}: {len(experts)} experts do not split over EP {ep_size}")
    expert_bytes = sum(per_layer_experts.values())
    shard = total - expert_bytes + expert_bytes // ep_size
    group = max(per_layer_experts.values(), default=0)
    one_expert = max((per_layer_experts[layer] // len(experts_per_layer[layer]) for layer in per_layer_experts),
                     default=0)
    return {"total_bytes": total, "num_tensors": len(shapes), "expert_bytes": expert_bytes,
            "largest_tensor": {"name": largest[0], "bytes": largest[1]}, "largest_expert_group_bytes": group,
            "largest_shard_bytes": shard, "budget_bytes": 1.5 * shard + group, "expert_bytes_one": one_expert,
            "ep_gather_bytes": ep_size * one_expert, "budget_strict_bytes": 1.5 * shard + ep_size * one_expert,
            "itemsize": itemsize, "ep_size": ep_size}


def broadcast_plan(metas: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_size_mib: float,
                   load_format: str | None) -> dict:
    """What the sender puts on the wire for tensors described by ``(name, dtype, shape)``, in order.

    Returns ``{"bucket_bytes": [flattened size of each bucket], "messages": [[nbytes, itemsize], ...]}``:
    one message per bucket with ``flattened_bucket``, one per tensor (in bucket order) with None.
    Buckets as `weight_sync.buckets.bucket_named_tensors` cuts them (alignment padding included).
    """
    from megatron_rl.weight_sync.buckets import BucketMeta, bucket_named_tensors

    named = [(n, torch.empty(shape, dtype=dt, device="meta")) for n, dt, shape in metas]
    buckets = list(bucket_named_tensors(iter(named), bucket_size_mib))
    sizes = [BucketMeta.of(b).nbytes for b in buckets]
    if load_format == "flattened_bucket":
        messages = [[s, 1] for s in sizes]
    elif load_format is None:
        messages = [[t.numel() * t.element_size(), t.element_size()] for b in buckets for _, t in b]
    else:
        raise ValueError(f"load_format must be 'flattened_bucket' or None, got {load_format!r}")
    return {"bucket_bytes": sizes, "messages": messages}


def gbps(nbytes: float, seconds: float) -> float:
    """Gigabytes (1e9) per second."""
    return nbytes / GB / seconds if seconds > 0 else float("inf")


def median_split(rows: list[dict], keys: dict[str, str]) -> dict[str, float | None]:
    """Median of each ``keys`` value (a metrics.jsonl key) over ``rows``; None where no row has it."""
    out: dict[str, float | None] = {}
    for label, key in keys.items():
        vals = [float(r[key]) for r in rows if key in r]
        out[label] = statistics.median(vals) if vals else None
    return out


# --------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); returns the RSS in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


def _torch_peak_alloc(fn) -> int:
    """Run ``fn()`` under torch.profiler with ``profile_memory``; return the peak of the bytes that torch's
    CPU allocator handed out during it and that were still live (allocations from before the
    profile, e.g. the model, are not counted; views are free). Memory outside torch's allocator
    (gloo's buffers, Python objects) is not seen: the RSS measurement covers it."""
    import logging

    from torch.profiler import ProfilerActivity, profile

    logging.getLogger("torch.profiler").setLevel(logging.ERROR)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory(prefix="moe-sync-prof-") as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    allocated = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(allocated, default=0)


# --------------------------------------------------------------------------- the processes
_DTYPE_BY_ITEMSIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}


def _receiver(spec: dict) -> None:
    """The engine stand-in: rounds of (header n, n x [nbytes, itemsize], the n broadcasts, barrier)."""
    import torch.distributed as dist

    from megatron_rl.weight_sync.group import init_custom_process_group

    torch.set_num_threads(1)
    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=spec["sync_port"], world_size=2, rank=1,
                                   group_name="moe_sync_bench", timeout_s=900)
    buf = torch.empty(0, dtype=torch.uint8)
    rounds = 0
    while True:
        hdr = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(hdr, src=0, group=pg)
        n = int(hdr.item())
        if n == 0:
            break
        msgs = torch.empty(n, 2, dtype=torch.int64)
        dist.broadcast(msgs, src=0, group=pg)
        msgs = msgs.tolist()
        need = max(m[0] for m in msgs)
        if buf.numel() < need:
            buf = torch.empty(need, dtype=torch.uint8)
        for nbytes, itemsize in msgs:
            dist.broadcast(buf[:nbytes].view(_DTYPE_BY_ITEMSIZE[itemsize]), src=0, group=pg)
        dist.barrier(group=pg)
        rounds += 1
    print("RESULT " + json.dumps({"role": "receiver", "rounds": rounds, "peak_rss_bytes": _peak()}), flush=True)


def _announce(pg, messages: list[list[int]]) -> None:
    import torch.distributed as dist

    dist.broadcast(torch.tensor([len(messages)], dtype=torch.int64), src=0, group=pg)
    if messages:
        dist.broadcast(torch.tensor(messages, dtype=torch.int64), src=0, group=pg)


def _send_like_sender(pg, named_tensors, *, load_format: str | None, bucket_size_mib: float) -> dict:
    """`WeightSyncSender.send` without the HTTP posts: the same `wire_buckets` pipeline and the same
    overlap (bucket k broadcast asynchronously while bucket k+1 is produced), then wait."""
    import torch.distributed as dist

    from megatron_rl.weight_sync.buckets import wire_buckets

    flatten = load_format == "flattened_bucket"
    prepare = wait = 0.0
    nbytes = nbuckets = ntensors = 0
    tp = time.perf_counter()
    buckets = wire_buckets(named_tensors, dtype=None, bucket_size_mib=bucket_size_mib, flatten=flatten)
    current = next(buckets, None)
    prepare += time.perf_counter() - tp
    while current is not None:
        flat, meta, is_last = current
        if flatten:
            works = [dist.broadcast(flat, src=0, group=pg, async_op=True)]
        else:
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in flat]
        tp = time.perf_counter()
        following = None if is_last else next(buckets)
        tw = time.perf_counter()
        prepare += tw - tp
        for w in works:
            w.wait()
        wait += time.perf_counter() - tw
        nbytes += flat.numel() if flatten else sum(t.numel() * t.element_size() for t in flat)
        nbuckets += 1
        ntensors += len(meta.names)
        current = following
        del flat, works
    return {"bytes": nbytes, "num_buckets": nbuckets, "num_tensors": ntensors, "prepare_s": prepare, "wait_s": wait}


def _build(spec: dict, pgs):
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    hf_config = spec["hf_config"]
    tf = build_transformer_config(hf_config, expert_model_parallel_size=EP, params_dtype=dtype)
    if spec["model"] == "tiny":
        model = build_model(hf_config, tf)
        load_hf_weights(model, str(TINY_DIR))
    else:
        tf.perform_initialization = False  # random weights below: megatron's CPU init of 1.3B params is slow
        model = build_model(hf_config, tf)
        gen = torch.Generator().manual_seed(1000 + pgs.rank)  # each EP rank's experts differ
        with torch.no_grad():
            for p in model.parameters():  # every page touched: the shard is resident, as in training
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def _worker(spec: dict) -> None:
    """One trainer rank (env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); prints ``RESULT {json}``."""
    import torch.distributed as dist

    from megatron_rl.models import builder, hf_config as _hfc  # noqa: F401 - imported before the baseline RSS
    from megatron_rl.models.hf_weights import iter_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.weight_sync import buckets  # noqa: F401
    from megatron_rl.weight_sync.group import destroy_custom_process_group, init_custom_process_group

    torch.set_num_threads(1)
    pgs = initialize_parallel(expert_model_parallel_size=EP, backend="gloo", timeout_s=900, seed=0)
    assert pgs.ep_size == EP and dist.get_world_size(pgs.ep) == EP, pgs
    rss_imports = _reset_peak()  # the process's fixed cost (Python, torch, megatron-core): left out of the peaks
    t0 = time.perf_counter()
    model = _build(spec, pgs)
    build_s = time.perf_counter() - t0
    hf_config = spec["hf_config"]
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rank = pgs.rank
    out: dict = {"role": f"trainer{rank}", "rank": rank, "ep_rank": pgs.ep_rank, "build_s": build_s,
                 "shard_param_bytes": shard_bytes, "rss_after_imports_bytes": rss_imports}

    def export(**kw):
        with torch.no_grad():
            yield from iter_hf_weights(model, hf_config, ep_group=pgs.ep, **kw)

    # 1. the export alone, drained tensor by tensor; rank 0 records what it yielded
    dist.barrier()
    before = _reset_peak()
    metas = []
    t0 = time.perf_counter()
    for name, t in export():
        metas.append((name, t.dtype, tuple(t.shape)))
        del t
    out["export_only"] = {"time_s": time.perf_counter() - t0, "rss_before_bytes": before, "peak_rss_bytes": _peak(),
                          "num_tensors": len(metas), "bytes": sum(_numel(s) * d.itemsize for _, d, s in metas)}
    if rank == 0:  # the whole model in every global expert, once
        experts = {n.split(".")[5] for n, _, _ in metas if ".mlp.experts." in n}
        out["export_only"]["experts_per_layer"] = len(experts)
    dist.barrier()

    def drain() -> None:
        for _ in export():
            pass

    out["export_only"]["torch_peak_alloc_bytes"] = _torch_peak_alloc(drain)  # the same pass, torch's count
    dist.barrier()

    pg = init_custom_process_group(backend="gloo", host="127.0.0.1", port=spec["sync_port"], world_size=2, rank=0,
                                   group_name="moe_sync_bench", timeout_s=900) if rank == 0 else None
    out["formats"] = {}
    for fmt in spec["formats"]:
        load_format = None if fmt == "null" else fmt
        plan = broadcast_plan(metas, spec["bucket_size_mib"], load_format) if rank == 0 else None
        raw_msgs = [[s, 1] for s in plan["bucket_bytes"]] if rank == 0 else None
        raw_buf = (torch.randint(0, 255, (max(plan["bucket_bytes"]),), dtype=torch.uint8) if rank == 0 else None)
        res = {"publish_s": [], "raw_s": [], "publish_peak_rss_bytes": [], "publish_rss_before_bytes": [],
               "peer_peak_rss_bytes": [], "prepare_s": [], "wait_s": []}
        for i in range(spec["repeats"] + 1):  # round 0 is the warm-up
            order = ("raw", "publish") if i % 2 == 0 else ("publish", "raw")  # interleaved, alternating
            for kind in order:
                dist.barrier()
                if kind == "raw":
                    if rank == 0:
                        _announce(pg, raw_msgs)
                        t0 = time.perf_counter()
                        for s in plan["bucket_bytes"]:
                            dist.broadcast(raw_buf[:s], src=0, group=pg)
                        dist.barrier(group=pg)
                        if i:
                            res["raw_s"].append(time.perf_counter() - t0)
                    continue
                if rank == 0:
                    _announce(pg, plan["messages"])
                before = _reset_peak()
                t0 = time.perf_counter()
                if rank == 0:
                    stats = _send_like_sender(pg, export(), load_format=load_format,
                                              bucket_size_mib=spec["bucket_size_mib"])
                    dist.barrier(group=pg)
                else:
                    for _ in export():  # the EP peer: its gathers (WeightPublisher._take_part)
                        pass
                elapsed = time.perf_counter() - t0
                peak = _peak()
                if not i:
                    continue
                if rank == 0:
                    res["publish_s"].append(elapsed)
                    res["publish_peak_rss_bytes"].append(peak)
                    res["publish_rss_before_bytes"].append(before)
                    res["prepare_s"].append(stats["prepare_s"])
                    res["wait_s"].append(stats["wait_s"])
                    res.update(bytes=stats["bytes"], num_buckets=stats["num_buckets"],
                               num_tensors=stats["num_tensors"], messages=len(plan["messages"]),
                               bucket_bytes=plan["bucket_bytes"])
                    assert stats["bytes"] == sum(m[0] for m in plan["messages"]), (stats, len(plan["messages"]))
                else:
                    res["peer_peak_rss_bytes"].append(peak)
        # one more publish, untimed, under the profiler: torch's allocations of the source and of the peer
        dist.barrier()
        if rank == 0:
            _announce(pg, plan["messages"])

            def publish_once() -> None:
                _send_like_sender(pg, export(), load_format=load_format, bucket_size_mib=spec["bucket_size_mib"])
                dist.barrier(group=pg)

            res["publish_torch_peak_alloc_bytes"] = _torch_peak_alloc(publish_once)
        else:
            res["peer_torch_peak_alloc_bytes"] = _torch_peak_alloc(drain)
        del raw_buf
        out["formats"][fmt] = res
    if rank == 0:
        _announce(pg, [])  # the receiver stops
        destroy_custom_process_group(pg)
    dist.barrier()
    destroy_parallel()
    print("RESULT " + json.dumps(out), flush=True)


def _collect(procs: list[tuple[str, subprocess.Popen]], timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    outputs, failed = {}, False
    for role, proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for _, other in procs:
                other.kill()
            text, _ = proc.communicate()
            failed = True
        outputs[role] = text
        failed = failed or proc.returncode != 0
    if failed:
        raise RuntimeError("moe_sync processes failed:\n" + "\n===== next\n".join(
            f"[{r}]\n{o[-6000:]}" for r, o in outputs.items()))
    results = {}
    for role, text in outputs.items():
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"no RESULT from {role}:\n{text[-6000:]}")
        results[role] = json.loads(lines[-1][len("RESULT "):])
    return results


def part_sync(model: str, *, repeats: int, bucket_size_mib: float, formats: list[str], dtype: str,
              vocab_size: int | None, timeout_s: float) -> dict:
    from megatron_rl.ports import find_free_port

    if model == "tiny":
        hf_config = json.loads((TINY_DIR / "config.json").read_text())
    else:
        hf_config = synthetic_30b_config(2, vocab_size)
    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    foot = export_footprint(hf_config, itemsize=itemsize, ep_size=EP)
    spec = {"model": model, "hf_config": hf_config, "dtype": dtype, "bucket_size_mib": bucket_size_mib,
            "formats": formats, "repeats": repeats, "sync_port": find_free_port()}
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    master = find_free_port()
    env0 = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [("receiver", subprocess.Popen([sys.executable, __file__, "--receiver", json.dumps(spec)], env=env0,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))]
    for rank in range(EP):
        env = dict(env0, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(EP), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(master))
        procs.append((f"trainer{rank}", subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                         text=True)))
    res = _collect(procs, timeout_s)
    r0, r1 = res["trainer0"], res["trainer1"]
    assert r0["export_only"]["bytes"] == foot["total_bytes"], (r0["export_only"]["bytes"], foot["total_bytes"])
    shard = max(r0["shard_param_bytes"], r1["shard_param_bytes"])  # measured (vocabulary padding included)
    budget = 1.5 * shard + foot["largest_expert_group_bytes"]
    budget_strict = 1.5 * shard + foot["ep_gather_bytes"]
    fmts = {}
    for fmt, f in r0["formats"].items():
        best_pub, best_raw = min(f["publish_s"]), min(f["raw_s"])
        med_pub, med_raw = statistics.median(f["publish_s"]), statistics.median(f["raw_s"])
        fmts[fmt] = {
            "bytes": f["bytes"], "num_buckets": f["num_buckets"], "num_tensors": f["num_tensors"],
            "broadcasts": f["messages"], "bucket_bytes": f["bucket_bytes"],
            "publish_s": f["publish_s"], "raw_s": f["raw_s"],
            "publish_gb_per_s": {"best": gbps(f["bytes"], best_pub), "median": gbps(f["bytes"], med_pub)},
            "raw_gb_per_s": {"best": gbps(sum(f["bucket_bytes"]), best_raw),
                             "median": gbps(sum(f["bucket_bytes"]), med_raw)},
            "ratio": {"best": gbps(f["bytes"], best_pub) / gbps(sum(f["bucket_bytes"]), best_raw),
                      "median": gbps(f["bytes"], med_pub) / gbps(sum(f["bucket_bytes"]), med_raw)},
            "split_median_s": {"prepare (EP gathers, clone/cat, flatten)": statistics.median(f["prepare_s"]),
                               "wait for the wire": statistics.median(f["wait_s"])},
            "publish_peak_rss_bytes": {"source": max(f["publish_peak_rss_bytes"]),
                                       "peer": max(r1["formats"][fmt]["peer_peak_rss_bytes"])},
            "publish_growth_bytes": {"source": max(a - b for a, b in zip(f["publish_peak_rss_bytes"],
                                                                        f["publish_rss_before_bytes"]))},
            "publish_torch_peak_alloc_bytes": {"source": f["publish_torch_peak_alloc_bytes"],
                                               "peer": r1["formats"][fmt]["peer_torch_peak_alloc_bytes"]},
        }
    exp0, exp1 = r0["export_only"], r1["export_only"]
    base = {"source": r0["rss_after_imports_bytes"], "peer": r1["rss_after_imports_bytes"]}
    # the export's memory: peak RSS over the process's fixed cost (imports), the model shard included
    peak_export = max(exp0["peak_rss_bytes"] - base["source"], exp1["peak_rss_bytes"] - base["peer"])
    peak_publish = max(v["publish_peak_rss_bytes"][k] - base[k] for v in fmts.values() for k in base)
    return {
        "model": model, "dtype": dtype, "hf_config": {k: hf_config.get(k) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
            "moe_intermediate_size", "num_experts_per_tok", "vocab_size", "tie_word_embeddings")} | {
            "num_experts": hf_config.get("num_experts", hf_config.get("num_local_experts"))},
        "ep_size": EP, "bucket_size_mib": bucket_size_mib, "repeats": repeats, "footprint": foot,
        "shard_param_bytes": {"rank0": r0["shard_param_bytes"], "rank1": r1["shard_param_bytes"]},
        "build_s": max(r0["build_s"], r1["build_s"]),
        "memory": {
            "measure": "VmHWM (/proc/self/status) of each trainer rank, reset via /proc/self/clear_refs before "
                       "the pass; "
                       "peak_rss_bytes = that peak minus the rank's RSS after imports (before the model was built), "
                       "so the shard, the allocator's leftovers and the export's working set; growth_bytes = the peak "
                       "minus the RSS just before the pass",
            "largest_shard_bytes": shard, "largest_expert_group_bytes": foot["largest_expert_group_bytes"],
            "budget_bytes": budget, "ep_gather_bytes": foot["ep_gather_bytes"], "budget_strict_bytes": budget_strict,
            "rss_after_imports_bytes": max(r0["rss_after_imports_bytes"],
                                                                   r1["rss_after_imports_bytes"]),
            "export_only": {"source": exp0, "peer": exp1, "peak_rss_bytes": peak_export,
                            "growth_bytes": max(exp0["peak_rss_bytes"] - exp0["rss_before_bytes"],
                                                exp1["peak_rss_bytes"] - exp1["rss_before_bytes"]),
                            "within_budget": peak_export < budget},
            "publish": {"peak_rss_bytes": peak_publish, "within_budget": peak_publish < budget,
                        "growth_bytes": max(v["publish_growth_bytes"]["source"] for v in fmts.values())},
            # torch's allocator: the shard (parameters) + the peak of the export's own live allocations
            "torch_alloc": {
                "export_peak_bytes": max(exp0["torch_peak_alloc_bytes"], exp1["torch_peak_alloc_bytes"]),
                "publish_peak_bytes": {fmt: v["publish_torch_peak_alloc_bytes"] for fmt, v in fmts.items()},
                "shard_plus_export_bytes": shard + max(exp0["torch_peak_alloc_bytes"], exp1["torch_peak_alloc_bytes"]),
                "shard_plus_publish_bytes": shard + max(max(v["publish_torch_peak_alloc_bytes"].values())
                                                        for v in fmts.values()),
            },
            "receiver_peak_rss_bytes": res["receiver"]["peak_rss_bytes"],
        },
        "formats": fmts, "load_avg_start": list(load_start), "load_avg_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t_start,
    }


# --------------------------------------------------------------------------- part split
SPLIT_KEYS = {"generation": "timing/generate_s", "reward": "timing/reward_s", "old log-prob": "timing/old_logprob_s",
              "update": "timing/update_s", "weight sync": "timing/weight_sync_s", "step": "timing/step_s"}
RECIPES = {"moe": "examples/tiny/moe-dapo.yaml", "dense": "examples/tiny/dapo.yaml"}


def part_split(steps: int, skip_first: int) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_time_split import load_step_rows, run_recipe

    work = Path(tempfile.mkdtemp(prefix="moe-sync-split-"))
    out: dict = {"steps": steps, "skip_first": skip_first, "recipes": {}}
    try:
        for key, config in RECIPES.items():
            load0 = os.getloadavg()[0]
            run_dir = work / key
            wall = run_recipe(str(REPO / config), steps, run_dir, [])
            rows = load_step_rows(run_dir)
            used = rows[skip_first:] if len(rows) > skip_first else rows
            extra = median_split(used, {"weight_sync_bytes": "weight_sync/bytes",
                                        "num_gen_batches": "train/num_gen_batches",
                                        "generated_tokens": "perf/generated_tokens",
                                        "router_mismatch": "train/router_mismatch"})
            out["recipes"][key] = {"config": config, "steps_used": len(used), "process_wall_s": wall,
                                   "median_s": median_split(used, SPLIT_KEYS), "median_other": extra,
                                   "load_avg_start": load0, "load_avg_end": os.getloadavg()[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- tables
def format_sync_table(models: dict) -> str:
    lines = ["| model | dtype | load_format | payload GB | broadcasts | publish GB/s (best / median) | "
             "raw GB/s (best / median) | ratio (best / median) |", "|---|---|---|---|---|---|---|---|"]
    for key, m in models.items():
        for fmt, f in m["formats"].items():
            lines.append(f"| {key} | {m['dtype']} | {fmt} | {f['bytes'] / GB:.4f} | {f['broadcasts']} | "
                         f"{f['publish_gb_per_s']['best']:.3f} / {f['publish_gb_per_s']['median']:.3f} | "
                         f"{f['raw_gb_per_s']['best']:.3f} / {f['raw_gb_per_s']['median']:.3f} | "
                         f"{f['ratio']['best']:.2f} / {f['ratio']['median']:.2f} |")
    return "\n".join(lines)


def format_memory_table(models: dict) -> str:
    """Two measures: torch's allocator (the shard + the pass's own peak live allocations: exact, the
    model and the export only) and the resident set (peak over the RSS after imports: everything).
    Budgets: 1.5 x shard + one layer's experts, and (strict) + one expert over the EP group."""
    lines = ["| model | shard GB | layer's experts GB | budget GB (strict) | shard + export allocs GB | "
             "shard + publish allocs GB (null / flattened) | export RSS GB (growth) | publish RSS GB (growth) | "
             "allocs within budget (strict) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, m in models.items():
        mem = m["memory"]
        ta = mem["torch_alloc"]
        shard = mem["largest_shard_bytes"]
        pub = {fmt: shard + max(v.values()) for fmt, v in ta["publish_peak_bytes"].items()}
        worst = max(ta["shard_plus_export_bytes"], *pub.values())
        lines.append(f"| {key} | {shard / GB:.4f} | {mem['largest_expert_group_bytes'] / GB:.4f} | "
                     f"{mem['budget_bytes'] / GB:.4f} ({mem['budget_strict_bytes'] / GB:.4f}) | "
                     f"{ta['shard_plus_export_bytes'] / GB:.4f} | "
                     + " / ".join(f"{pub[f] / GB:.4f}" for f in ("null", "flattened_bucket") if f in pub) + " | "
                     f"{mem['export_only']['peak_rss_bytes'] / GB:.3f} "
                     f"(+{mem['export_only']['growth_bytes'] / GB:.3f}) | "
                     f"{mem['publish']['peak_rss_bytes'] / GB:.3f} (+{mem['publish']['growth_bytes'] / GB:.3f}) | "
                     f"export {ta['shard_plus_export_bytes'] < mem['budget_bytes']} "
                     f"({ta['shard_plus_export_bytes'] < mem['budget_strict_bytes']}), publish "
                     f"{worst < mem['budget_bytes']} ({worst < mem['budget_strict_bytes']}) |")
    return "\n".join(lines)


def format_split_table(split: dict) -> str:
    rec = split["recipes"]
    keys = list(rec)
    lines = ["| phase (median s) | " + " | ".join(f"{k} ({rec[k]['config']})" for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for label in SPLIT_KEYS:
        cells = []
        for k in keys:
            v = rec[k]["median_s"][label]
            cells.append("-" if v is None else f"{v:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["sync", "split", "all"], default="all")
    ap.add_argument("--models", default="tiny,30b", help="comma-separated: tiny, 30b")
    ap.add_argument("--formats", default="null,flattened_bucket", help="weight_sync.load_format values: null, "
                    "flattened_bucket")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-size-mib", type=float, default=512.0, help="weight_sync.bucket_size_mib (default 512)")
    ap.add_argument("--dtype-30b", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--vocab-30b", type=int, default=None, help="shrink the 30B-shaped model's vocabulary")
    ap.add_argument("--steps", type=int, default=10, help="RL steps per recipe in part split")
    ap.add_argument("--skip-first", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe_sync.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--receiver", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    if args.receiver:
        _receiver(json.loads(args.receiver))
        return
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if out.is_file() else {}
    result.update({"benchmark": "moe_sync", "host": os.uname().nodename, "cpus": os.cpu_count(),
                   "torch": torch.__version__})
    if args.part in ("sync", "all"):
        models = result.setdefault("sync", {})
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            if model not in ("tiny", "30b"):
                ap.error(f"unknown model {model!r}")
            dtype = "float32" if model == "tiny" else args.dtype_30b
            print(f"sync: {model} ({dtype}), load average {os.getloadavg()[0]:.2f} ...", flush=True)
            models[model] = part_sync(model, repeats=args.repeats, bucket_size_mib=args.bucket_size_mib,
                                      formats=[f.strip() for f in args.formats.split(",")], dtype=dtype,
                                      vocab_size=args.vocab_30b if model == "30b" else None, timeout_s=args.timeout_s)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
    if args.part in ("split", "all"):
        print(f"split: {args.steps} steps of each tiny recipe, load average {os.getloadavg()[0]:.2f} ...", flush=True)
        result["split"] = part_split(args.steps, args.skip_first)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    if result.get("sync"):
        print(f"\nEP{EP} publish (iter_hf_weights over the EP group -> wire_buckets -> gloo broadcast) vs raw "
              "broadcast of the same bytes (target >= 0.8):")
        print(format_sync_table(result["sync"]))
        print("\nexport peak memory (target: < 1.5 x largest shard + largest expert group):")
        print(format_memory_table(result["sync"]))
    if result.get("split"):
        print(f"\nstep split, median of steps {result['split']['skip_first'] + 1}..{result['split']['steps']}:")
        print(format_split_table(result["split"]))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
