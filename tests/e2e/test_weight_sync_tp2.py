"""Weight sync from a TP=2 megatron trainer to two embedded servers (issue 5's first "Done when").

Two real embedded servers in their own processes; two gloo trainer ranks (this file run as a
script, TP = 2) holding the SFT'd tiny model in megatron-core. Rank 0 is the controller: it gathers
the TP shards into HF tensors (rank 1 takes part in every gather) and broadcasts them to both
servers in one weight-update group. After every sync, each server's greedy generations must equal
a greedy decoding loop over the trainer's own megatron forward (logits gathered over TP, padded
vocabulary masked), for bucket sizes of 1 MiB (several buckets) and 512 MiB (one bucket) on the
same weights, over two rounds of changed weights: round 1 in SGLang's `flattened_bucket` format,
round 2 with one broadcast per tensor (`load_format` null, `weight_sync.load_format`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny"
MAX_NEW = 12


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.cpu_compat import enable_cpu_compat
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.logprobs import forward_logits

    torch.set_num_threads(1)
    enable_cpu_compat()
    pgs = initialize_parallel(tensor_model_parallel_size=2, backend="gloo", timeout_s=300, seed=1)
    hf_config = json.loads((TINY / "base_model" / "config.json").read_text())
    vocab = hf_config["vocab_size"]
    eos = hf_config["eos_token_id"]
    tf_config = build_transformer_config(hf_config, tensor_model_parallel_size=2)
    model = build_model(hf_config, tf_config)
    load_hf_weights(model, str(TINY / "base_model"), tp_rank=pgs.tp_rank, tp_size=2)
    model.eval()
    prompts = json.loads(os.environ["SYNC_PROMPTS"])
    controller = pgs.rank == 0

    def megatron_greedy(prompt: list[int]) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(MAX_NEW):
            with torch.no_grad():
                shard = forward_logits(model, torch.tensor([ids]))[0, -1]  # [Vp/tp]
            parts = [torch.empty_like(shard) for _ in range(2)]
            dist.all_gather(parts, shard.contiguous(), group=pgs.tp)
            logits = torch.cat(parts)[:vocab]  # [V], padded rows dropped
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
        return out

    def perturb(round_: int) -> None:
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                # same seed on both ranks: replicated params (norms) stay identical across TP
                g = torch.Generator().manual_seed(zlib.crc32(f"{round_}/{name}".encode()))
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * float(p.detach().float().std().clamp(min=1e-3)))

    report: dict = {"rounds": []}
    sender = clients = None
    if controller:
        from megatron_rl.rollout.client import RolloutClient
        from megatron_rl.weight_sync.sender import WeightSyncSender

        clients = [RolloutClient(u, timeout_s=120, generate_timeout_s=300) for u in os.environ["SYNC_URLS"].split(",")]
        sender = WeightSyncSender(clients, timeout_s=300)
        sender.init_group()
    report["base"] = [megatron_greedy(p) for p in prompts]
    version = 0
    for round_ in (1, 2):
        perturb(round_)
        want = [megatron_greedy(p) for p in prompts]
        entry = {"megatron": want, "syncs": []}
        # round 1: SGLang's flattened_bucket format, round 2: one broadcast per tensor (load_format null)
        fmt = "flattened_bucket" if round_ == 1 else None
        for bucket_mib in ((1, 512) if round_ == 1 else (512, 1)):
            version += 1
            named = iter_hf_weights(model, hf_config, tp_group=pgs.tp)
            if controller:
                sender.bucket_size_mib = bucket_mib
                sender.load_format = fmt
                metrics = sender.sync(named, weight_version=str(version))
                servers = [[c.generate(p, {"max_new_tokens": MAX_NEW, "temperature": 0.0}, rid=f"v{version}-{i}").output_ids
                            for i, p in enumerate(prompts)] for c in clients]
                entry["syncs"].append({"bucket_mib": bucket_mib, "num_buckets": metrics["weight_sync/num_buckets"],
                                       "load_format": fmt, "num_tensors": metrics["weight_sync/num_tensors"],
                                       "versions": [c.weight_version() for c in clients], "servers": servers})
            else:
                for _ in named:  # take part in the TP gathers
                    pass
            dist.barrier()
        report["rounds"].append(entry)
    if controller:
        sender.close()
        for c in clients:
            c.close()
        print("RESULT " + json.dumps(report), flush=True)
    destroy_parallel()


def test_tp2_trainer_two_servers_greedy_equals_megatron_any_bucket_size(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import load_rows
    from megatron_rl.data.prompts import render_prompt_ids
    from megatron_rl.ports import find_free_port
    from megatron_rl.rollout.launcher import launch_servers

    tok = AutoTokenizer.from_pretrained(TINY / "base_model")
    rows = load_rows(TINY / "data" / "test.jsonl")[:6]
    prompts = [render_prompt_ids(tok, r.messages) for r in rows]
    servers = launch_servers("embedded", TINY / "base_model", 2, log_dir=tmp_path, startup_timeout_s=300,
                             embedded_args=["--dtype", "float32"])
    try:
        port = find_free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", SYNC_PROMPTS=json.dumps(prompts),
                       SYNC_URLS=",".join(s.base_url for s in servers),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            procs.append(subprocess.Popen([sys.executable, __file__], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=900)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        assert all(p.returncode == 0 for p in procs), "\n=====\n".join(o[-5000:] for o in outs) + "\n" + "\n".join(
            s.log_tail(20) for s in servers)
        line = [x for x in outs[0].splitlines() if x.startswith("RESULT ")][-1]
        report = json.loads(line[len("RESULT "):])
    finally:
        for s in servers:
            s.stop()
    rounds = report["rounds"]
    # the weights changed the outputs in each round, so the equalities below are informative
    assert report["base"] != rounds[0]["megatron"] != rounds[1]["megatron"]
    version = 0
    for r in rounds:
        assert any(len(g) > 1 for g in r["megatron"])
        buckets = {}
        for sync in r["syncs"]:
            version += 1
            assert sync["versions"] == [str(version)] * 2
            for server_out in sync["servers"]:
                assert server_out == r["megatron"], (sync["bucket_mib"], sync["load_format"], server_out, r["megatron"])
            buckets[sync["bucket_mib"]] = sync["num_buckets"]
        assert buckets[512] == 1 and buckets[1] >= 3, buckets
    assert [s["load_format"] for r in rounds for s in r["syncs"]] == ["flattened_bucket"] * 2 + [None] * 2
    assert len({s["num_tensors"] for r in rounds for s in r["syncs"]}) == 1  # every tensor sent in either format


if __name__ == "__main__":
    _rank_main()
