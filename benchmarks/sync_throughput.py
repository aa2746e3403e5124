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

Part 3 (``--part pp``): the trainer's ``WeightPublisher`` end to end, at PP=1 (one trainer
process) and PP=2 (two gloo trainer processes, spawned as torchrun would: RANK, WORLD_SIZE,
MASTER_ADDR/PORT), on a synthetic ~0.41 GB untied Qwen2 (hidden 1024, 4 layers, vocabulary 32768,
float32) served by one real embedded server. Every rank builds its stage's megatron-core model from
the HF checkpoint (plus a per-layout constant, so that each layout's sync changes the server's
weights), holds a publisher built as ``trainer.setup.build_run`` builds it (``_sender_factory``,
a ``ServerFleet`` of one client on the controller), and calls ``publish(version)``: one warm-up
(it creates the groups), then N timed publishes, each after a barrier. Reported per layout: the
controller's ``weight_sync/time_s`` (best, median) and GB/s, against a raw ``dist.broadcast`` of
the same bytes in the same buckets (each stage's buckets; best of two runs, interleaved); after the last publish a few tensors of
each stage are read back from the server (``/get_weights_by_name``, first rows) and compared with
the HF checkpoint plus that layout's constant, and the server's ``weight_version`` must be the last
published one.

Part 4 (``--part colocated``, issue 17): the same ~1 GB model handed over by shared-memory handles
(``ColocatedWeightSender``, ``/update_weights_from_tensor``) against a plain in-process copy of
the same bytes (target >= 0.5x) and the broadcast path of part 1 (read from the results file).

Writes ``benchmarks/results/sync_throughput.json`` (parts not run keep their entries; top-level
``load_avg_1m`` is that of the last big / tiny run, part pp records its own) and prints a table.

    .venv/bin/python benchmarks/sync_throughput.py            # parts big and tiny
    .venv/bin/python benchmarks/sync_throughput.py --part tiny
    .venv/bin/python benchmarks/sync_throughput.py --part pp  # ~3-5 min on 2 loaded cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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


def part_colocated(bucket_mib: float, repeats: int) -> dict:
    """Colocated transport (issue 17): the same ~1 GB synthetic model handed to a real embedded
    server by shared-memory handles (`ColocatedWeightSender`: session, one reused shared bucket,
    `/update_weights_from_tensor` flattened_bucket, the server's copy into its parameters), against
    a plain in-process copy of the same bytes in the same buckets (the physical bound here: the
    hand-over copies twice, into the bucket and out of it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rl.rollout.launcher import launch_servers
    from megatron_rl.weight_sync.buckets import bucket_named_tensors
    from megatron_rl.weight_sync.colocated import ColocatedWeightSender

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
        (server,) = launch_servers("embedded", d, 1, startup_timeout_s=600, embedded_args=["--dtype", "float32"])
    times: dict[str, list[float]] = {"named": [], "fresh": [], "kept": [], "kept_one_buffer": []}
    try:
        client = server.client(timeout_s=600)
        for mode in times:  # named: load_format null, handles to the tensors' own storages (moved into shared
            # memory by the warm-up update), the engine's copy the only one (what runs use);
            # flattened_bucket: fresh: new shared buffers per update; kept: reused across updates;
            # kept_one_buffer: reused, without the double buffering (packing and the engine's copy in turn)
            sender = ColocatedWeightSender([client], bucket_size_mib=bucket_mib, timeout_s=600,
                                           keep_buffer=mode != "fresh", buffers=1 if mode == "kept_one_buffer" else 2,
                                           load_format=None if mode == "named" else "flattened_bucket")
            sender.init_group()
            for i in range(repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                sender.begin_update()
                sender.send(iter(state), weight_version=f"{mode}{i}")
                sender.finish_update(f"{mode}{i}")
                times[mode].append(time.perf_counter() - t0)
            sender.close()
    finally:
        server.stop()
    buckets = list(bucket_named_tensors(iter(state), bucket_mib))
    dst = torch.empty(max(sum(t.numel() for _, t in b) for b in buckets) * 4, dtype=torch.uint8)
    copies = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for b in buckets:
            off = 0
            for _, t in b:
                n = t.numel() * t.element_size()
                dst[off:off + n].view(t.dtype).copy_(t.reshape(-1))
                off += n
        copies.append(time.perf_counter() - t0)
    best, kept, copy = min(times["fresh"][1:]), min(times["kept"][1:]), min(copies[1:])
    named = min(times["named"][1:])
    one = min(times["kept_one_buffer"][1:])
    big = {}
    out = REPO / "benchmarks" / "results" / "sync_throughput.json"
    if out.is_file():
        big = json.loads(out.read_text()).get("big", {})
    return {"model_bytes": nbytes, "bucket_size_mib": bucket_mib, "num_buckets": len(buckets), "repeats": repeats,
            "handover_time_s": named, "handover_gb_per_s": nbytes / 1e9 / named, "copy_time_s": copy,
            "copy_gb_per_s": nbytes / 1e9 / copy, "ratio_to_copy": copy / named,
            "bucket_time_s": best, "bucket_gb_per_s": nbytes / 1e9 / best, "bucket_ratio_to_copy": copy / best,
            "kept_buffer_time_s": kept, "kept_buffer_gb_per_s": nbytes / 1e9 / kept, "kept_ratio_to_copy": copy / kept,
            "kept_one_buffer_time_s": one, "kept_one_buffer_ratio_to_copy": copy / one,
            "broadcast_gb_per_s": big.get("sync_gb_per_s"), "all_times_s": times, "load_avg_1m": os.getloadavg()[0]}


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


# --------------------------------------------------------------------------- part pp
# The synthetic model of part pp: untied (the last stage sends lm_head, as the 7B+ Qwen2.5 do),
# so the two stages of PP=2 carry about the same bytes.
PP_MODEL = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
                max_position_embeddings=256, torch_dtype="float32")
# per-layout constant added to every trainer weight, so that each layout's publishes change what
# the server holds (the check after the last publish would pass on stale weights otherwise)
PP_DELTA = {1: 0.25, 2: 0.5}
# tensors read back after a layout's last publish: stage 0's and (at PP=2) stage 1's
PP_CHECK = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.k_proj.bias",
            "model.layers.3.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight")


def _pp_worker(spec: dict) -> None:
    """One trainer rank of part pp (env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); prints
    ``RESULT {json}``: the controller's metrics of every timed publish, each stage source's bucket sizes."""
    import logging

    import torch.distributed as dist

    from megatron_rl.config.schema import WeightSyncConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.rollout import launcher  # noqa: F401 - registers the engine backends (the controller
    # gets them from EngineSet; a later stage's source needs them too, for _sender_factory's ENGINE_BACKENDS.get)
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.fleet import ServerFleet
    from megatron_rl.trainer.setup import _sender_factory
    from megatron_rl.weight_sync.buckets import bucket_named_tensors
    from megatron_rl.weight_sync.publisher import WeightPublisher

    torch.set_num_threads(1)
    warnings_seen: list[str] = []

    class _Keep(logging.Handler):  # a retry or a re-created group would spoil the timing: count them
        def emit(self, record: logging.LogRecord) -> None:
            warnings_seen.append(record.getMessage())

    logging.basicConfig(level=logging.WARNING, format=f"[rank{os.environ['RANK']}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_rl").addHandler(_Keep(level=logging.WARNING))

    pp = spec["pp"]
    pgs = initialize_parallel(pipeline_model_parallel_size=pp, backend="gloo", timeout_s=600, seed=0)
    hf_config = json.loads((Path(spec["model_dir"]) / "config.json").read_text())
    tf_config = build_transformer_config(hf_config, pipeline_model_parallel_size=pp)
    t0 = time.perf_counter()
    model = build_model(hf_config, tf_config, pre_process=pgs.is_pipeline_first_stage,
                        post_process=pgs.is_pipeline_last_stage)
    load_hf_weights(model, spec["model_dir"], tp_rank=pgs.tp_rank, tp_size=pgs.tp_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(spec["delta"])
    build_s = time.perf_counter() - t0
    sizes = [sum(t.numel() * t.element_size() for _, t in b)
             for b in bucket_named_tensors(iter_hf_weights(model, hf_config), spec["bucket_size_mib"])]

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(backend="embedded", api_key=None, admin_api_key=None, timeout_s=600.0),
        weight_sync=WeightSyncConfig(bucket_size_mib=spec["bucket_size_mib"], timeout_s=600.0,
                                     load_format=spec["load_format"]))
    fleet = ServerFleet([RolloutClient(spec["url"], timeout_s=600.0)], None) if pgs.rank == 0 else None
    publisher = WeightPublisher(model, hf_config, pgs, sender_factory=_sender_factory(cfg, None), fleet=fleet)
    runs, walls = [], []
    version = spec["first_version"]
    try:
        for i in range(spec["repeats"] + 1):  # the first one (group creation) is the warm-up
            if pgs.world_size > 1:
                dist.barrier()
            tw = time.perf_counter()
            metrics = publisher.publish(version)
            wall = time.perf_counter() - tw
            if i > 0 and pgs.rank == 0:
                runs.append(metrics)
                walls.append(wall)
            version += 1
    finally:
        publisher.close()
        if fleet is not None:
            for c in fleet.clients:
                c.close()
    sources = publisher.sources
    destroy_parallel()
    print("RESULT " + json.dumps({
        "rank": pgs.rank, "pp_rank": pgs.pp_rank, "is_source": publisher.is_source, "sources": sources,
        "bucket_sizes": sizes if publisher.is_source else [], "last_version": version - 1,
        "runs": runs, "publish_wall_s": walls, "build_s": build_s, "warnings": warnings_seen}), flush=True)


def _run_pp_layout(pp: int, spec: dict, timeout_s: float) -> list[dict]:
    """Start ``pp`` trainer ranks (one stage each) and return their RESULT dicts, by rank."""
    port = find_free_port()
    procs = []
    for rank in range(pp):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(pp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--pp-worker", json.dumps({**spec, "pp": pp})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs, failed = [], False
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
            failed = True
        outputs.append(out)
        failed = failed or proc.returncode != 0
    if failed:
        raise RuntimeError(f"PP={pp} trainer ranks failed:\n" + "\n===== next rank\n".join(o[-8000:] for o in outputs))
    results = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"no RESULT line from a PP={pp} rank:\n{out[-8000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def _check_server(client, model_dir: str, delta: float, version: int, rows: int = 4) -> dict:
    """After a layout's last publish: the first ``rows`` rows of PP_CHECK on the server equal the HF
    checkpoint + ``delta``; the server's weight version is ``version``. Raises AssertionError."""
    from safetensors import safe_open

    got_version = client.weight_version()
    assert got_version == str(version), f"server weight_version {got_version!r}, expected {version}"
    errs = {}
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        for name in PP_CHECK:
            want = f.get_tensor(name)[:rows].float() + delta
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=rows), dtype=torch.float32)
            assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (name, float((got - want).abs().max()))
            errs[name] = float((got - want).abs().max())
    return {"weight_version": got_version, "tensors_checked": len(errs), "rows_each": rows,
            "max_abs_err": max(errs.values())}


def part_pp(bucket_mib: float, repeats: int, load_format: str | None) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rl.rollout.launcher import launch_servers

    load_start = os.getloadavg()
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**PP_MODEL)).eval()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    layouts: dict = {}
    with tempfile.TemporaryDirectory(prefix="sync-bench-pp-") as d:
        model.save_pretrained(d)
        del model
        (server,) = launch_servers("embedded", d, 1, startup_timeout_s=600,
                                   embedded_args=["--dtype", "float32", "--weight-sync-timeout-s", "600"])
        try:
            client = server.client(timeout_s=600)
            for pp in (1, 2):
                spec = {"model_dir": d, "url": server.base_url, "bucket_size_mib": bucket_mib,
                        "load_format": load_format, "repeats": repeats, "delta": PP_DELTA[pp],
                        "first_version": 1000 * pp}
                t0 = time.perf_counter()
                ranks = _run_pp_layout(pp, spec, timeout_s=600)
                wall = time.perf_counter() - t0
                check = _check_server(client, d, PP_DELTA[pp], ranks[0]["last_version"])
                runs = ranks[0]["runs"]
                times = [r["weight_sync/time_s"] for r in runs]
                best = min(runs, key=lambda r: r["weight_sync/time_s"])
                layouts[str(pp)] = {
                    "trainer_processes": pp, "sources": ranks[0]["sources"],
                    "bytes": best["weight_sync/bytes"], "num_buckets": best["weight_sync/num_buckets"],
                    "num_tensors": best["weight_sync/num_tensors"],
                    "bucket_sizes": [s for r in ranks for s in r["bucket_sizes"]],
                    "sync_time_s": {"best": min(times), "median": statistics.median(times), "all": times},
                    "publish_wall_s": {"best": min(ranks[0]["publish_wall_s"]),
                                       "median": statistics.median(ranks[0]["publish_wall_s"])},
                    "split_best_s": {k.split("/")[1]: best[k] for k in (
                        "weight_sync/bucket_prepare_time_s", "weight_sync/broadcast_time_s",
                        "weight_sync/load_time_s", "weight_sync/control_time_s")},
                    "warnings": [w for r in ranks for w in r["warnings"]],
                    "build_s": max(r["build_s"] for r in ranks), "layout_wall_s": wall, "check": check,
                }
            client.close()
        finally:
            server.stop()
    # the raw baseline of each layout, twice, interleaved (it moves a lot on a loaded machine): the best counts
    raws: dict = {pp: [] for pp in layouts}
    for _ in range(2):
        for pp, lay in layouts.items():
            raws[pp].append(raw_broadcast_gbps(lay["bucket_sizes"], 3))
    for pp, lay in layouts.items():
        lay["raw_broadcast_gb_per_s_runs"] = raws[pp]
        lay["raw_broadcast_gb_per_s"] = raw = max(raws[pp])
        lay["sync_gb_per_s"] = {"best": lay["bytes"] / 1e9 / lay["sync_time_s"]["best"],
                                "median": lay["bytes"] / 1e9 / lay["sync_time_s"]["median"]}
        lay["ratio"] = {k: v / raw for k, v in lay["sync_gb_per_s"].items()}
    return {"model": PP_MODEL, "model_bytes": nbytes, "bucket_size_mib": bucket_mib, "load_format": load_format,
            "repeats": repeats, "load_avg_start": list(load_start), "load_avg_end": list(os.getloadavg()),
            "part_wall_s": time.perf_counter() - t_start, "layouts": layouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["big", "tiny", "both", "pp", "colocated", "all"], default="both",
                    help="both = big + tiny; all = big + tiny + pp")
    ap.add_argument("--pp-worker", help=argparse.SUPPRESS)  # internal: one trainer rank of part pp
    ap.add_argument("--bucket-size-mib", type=float, default=512.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load-format", choices=["flattened_bucket", "null", "both"], default="both",
                    help="weight_sync.load_format of the big part (null = one broadcast per tensor); part pp uses "
                         "null (the default of weight_sync.load_format) unless this is flattened_bucket")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sync_throughput.json"))
    args = ap.parse_args()
    if args.pp_worker:
        _pp_worker(json.loads(args.pp_worker))
        return
    torch.set_num_threads(1)
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if out.is_file() else {}  # parts not run keep their entries
    result.update({"host": os.uname().nodename, "cpus": os.cpu_count()})
    if args.part in ("tiny", "big", "both", "all"):  # the load average of the big / tiny parts
        result["load_avg_1m"] = os.getloadavg()[0]
    if args.part in ("tiny", "both", "all"):
        result["tiny"] = part_tiny(max(args.repeats, 5))
        t = result["tiny"]["median_s"]
        print(f"tiny model sync ({result['tiny']['model_bytes'] / 2**20:.1f} MiB), median of "
              f"{result['tiny']['repeats']} syncs:")
        print(f"  {'phase':<40} {'seconds':>9}")
        for k, label in (("bucket_prepare_time_s", "megatron -> HF tensors, cast, flatten"),
                         ("broadcast_time_s", "broadcast"), ("load_time_s", "server unflatten + load"),
                         ("control_time_s", "HTTP control calls"), ("time_s", "total")):
            print(f"  {label:<40} {t[k]:>9.4f}")
    if args.part in ("big", "both", "all"):
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
    if args.part in ("pp", "all"):
        fmt = "flattened_bucket" if args.load_format == "flattened_bucket" else None
        result["pp"] = p = part_pp(args.bucket_size_mib, max(args.repeats, 5), fmt)
        print(f"\nWeightPublisher end to end, synthetic Qwen2 ({p['model_bytes'] / 1e9:.2f} GB float32, untied), "
              f"load_format {fmt or 'null'}, buckets <= {p['bucket_size_mib']:.0f} MiB, {p['repeats']} timed publishes "
              f"(load average {p['load_avg_start'][0]:.1f} -> {p['load_avg_end'][0]:.1f}):")
        print(f"  {'layout':<24} {'buckets':>7} {'best s':>7} {'median s':>8} {'GB/s best':>9} {'GB/s med':>8} "
              f"{'raw GB/s':>8} {'ratio best':>10} {'ratio med':>9}  check")
        for pp, lay in p["layouts"].items():
            name = f"PP={pp} ({lay['trainer_processes']} process{'es' if int(pp) > 1 else ''})"
            print(f"  {name:<24} {lay['num_buckets']:>7.0f} {lay['sync_time_s']['best']:>7.3f} "
                  f"{lay['sync_time_s']['median']:>8.3f} {lay['sync_gb_per_s']['best']:>9.3f} "
                  f"{lay['sync_gb_per_s']['median']:>8.3f} {lay['raw_broadcast_gb_per_s']:>8.3f} "
                  f"{lay['ratio']['best']:>10.2f} {lay['ratio']['median']:>9.2f}  "
                  f"v{lay['check']['weight_version']}, {lay['check']['tensors_checked']} tensors ok")
            print(f"  {'':<24} split of the best: " + ", ".join(f"{k} {v:.3f}s" for k, v in lay["split_best_s"].items())
                  + (f"; WARNINGS: {lay['warnings']}" if lay["warnings"] else ""))
    if args.part in ("colocated", "all"):
        result["colocated"] = c = part_colocated(args.bucket_size_mib, args.repeats)
        print(f"\ncolocated hand-over ({c['model_bytes'] / 1e9:.2f} GB, {c['num_buckets']} buckets of <= "
              f"{c['bucket_size_mib']:.0f} MiB, shared memory), best of {args.repeats}:")
        print(f"  hand-over (named tensors, load_format null: the engine's copy only) {c['handover_gb_per_s']:.3f} "
              f"GB/s, in-process copy {c['copy_gb_per_s']:.3f} GB/s, ratio {c['ratio_to_copy']:.2f} (target >= 0.5); "
              f"broadcast path {c['broadcast_gb_per_s']} GB/s")
        print(f"  flattened_bucket (packed into a shared buffer, copied out): {c['bucket_gb_per_s']:.3f} GB/s, "
              f"ratio {c['bucket_ratio_to_copy']:.2f}")
        print(f"  flattened_bucket, buffers kept across updates: {c['kept_buffer_gb_per_s']:.3f} GB/s, ratio {c['kept_ratio_to_copy']:.2f}; "
              f"the same with one buffer (no overlap): ratio {c['kept_one_buffer_ratio_to_copy']:.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
