"""Weight sync end to end: a torchrun-like trainer process broadcasts perturbed weights to a real server.

The trainer process has its own gloo default group (world size 1, like a torchrun rank) and
joins the server in a second, private group (SGLang's recipe). After each sync the server's
greedy output must equal HF ``generate`` greedy on the trainer's perturbed weights.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
import torch

from tests.e2e.random_qwen2 import save_random_qwen2
import torch.multiprocessing as mp

from megatron_rl.rollout.launcher import find_free_port, launch_rollout_server

ROOT = Path(__file__).resolve().parents[2]
EOS = 2
PROMPTS = [[5, 6, 7], [11, 3, 90, 17, 4], [100]]


def _save_model(path):
    """A 2-layer Qwen2 of 2.28 MiB in float32 (embeddings and lm_head 1 MiB each: 3 buckets of 1 MiB)."""
    return save_random_qwen2(path, vocab_size=4096, hidden_size=64, intermediate_size=128)


def _greedy(model, prompt, n=12):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _trainer(model_dir, base_url, queue):
    """Trainer rank: default gloo world of 1, then syncs to the server (results go to ``queue``)."""
    try:
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from megatron_rl.rollout.client import RolloutClient
        from megatron_rl.errors import WeightSyncError
        from megatron_rl.weight_sync.sender import WeightSyncSender

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        client = RolloutClient(base_url, timeout_s=60, generate_timeout_s=60)
        report = {"original_hf": [_greedy(model, p) for p in PROMPTS]}

        def perturb(seed):
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)

        def server_greedy():
            return [
                client.generate(p, {"max_new_tokens": 12, "temperature": 0}, rid=f"g{i}").output_ids
                for i, p in enumerate(PROMPTS)
            ]

        for step, bucket_mib in ((1, 1), (2, 512)):
            perturb(step)
            sender = WeightSyncSender([client], bucket_size_mib=bucket_mib, timeout_s=60)
            sender.init_group()
            metrics = sender.sync(model.state_dict().items(), weight_version=str(step))
            report[f"step{step}"] = {
                "metrics": metrics,
                "hf": [_greedy(model, p) for p in PROMPTS],
                "server": server_greedy(),
                "version": client.weight_version(),
                "norm": client.get_weights_by_name("model.norm.weight", truncate_size=4),
                "trainer_norm": model.state_dict()["model.norm.weight"][:4].tolist(),
                "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            }
            if step == 1:
                # an unknown name fails the sync without touching any weight (all-or-nothing load)
                bad = [("model.norm.weight", torch.zeros(64)), ("model.no_such.weight", torch.zeros(3))]
                try:
                    sender.sync(bad, weight_version="bad")
                    report["bad"] = "no error"
                except WeightSyncError as e:
                    client.continue_generation()
                    report["bad"] = {
                        "error": str(e),
                        "group_broken": e.group_broken,
                        "version": client.weight_version(),
                        "norm": client.get_weights_by_name("model.norm.weight", truncate_size=4),
                        "server": server_greedy(),
                    }
            sender.close()  # destroy: the next sender re-creates a group of the same name on both sides
        # fail fast: a server that refuses a bucket never joins the broadcast; no waiting for the timeout
        sender = WeightSyncSender([client], group_name="failfast", timeout_s=60)
        sender.init_group()
        client.destroy_weights_update_group("failfast")  # the server forgets its side
        t0 = time.monotonic()
        try:
            sender.sync([("model.norm.weight", torch.zeros(64))], weight_version="never")
            report["failfast"] = "no error"
        except WeightSyncError as e:
            report["failfast"] = {"seconds": time.monotonic() - t0, "group_broken": e.group_broken}
        sender.close()
        client.continue_generation()
        report["final_version"] = client.weight_version()
        assert dist.get_world_size() == 1  # the trainer's own world is untouched
        dist.destroy_process_group()
        queue.put(report)
    except BaseException:
        queue.put({"exception": traceback.format_exc()})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_qwen2_sync")
    _save_model(model_dir)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    extra = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "120"]
    with launch_rollout_server(model_dir, log_path=log, extra_args=extra) as proc:
        yield model_dir, proc


def test_sync_then_server_greedy_equals_hf_greedy(server):
    model_dir, proc = server
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(str(model_dir), proc.base_url, queue))
    trainer.start()
    try:
        report = queue.get(timeout=400)
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert "exception" not in report, report.get("exception", "") + "\n--- server log ---\n" + proc.log_tail()
    for step, n_buckets in ((1, 3), (2, 1)):
        r = report[f"step{step}"]
        assert r["version"] == str(step)
        assert r["server"] == r["hf"], f"step {step}"
        assert r["norm"] == pytest.approx(r["trainer_norm"], abs=0)
        assert r["metrics"]["weight_sync/num_buckets"] == n_buckets
        assert r["metrics"]["weight_sync/bytes"] == r["state_bytes"] and r["metrics"]["weight_sync/gbps"] > 0
    # the perturbation really changed the outputs, so the equality above is informative
    assert report["step1"]["hf"] != report["original_hf"] and report["step2"]["hf"] != report["step1"]["hf"]
    bad = report["bad"]
    assert isinstance(bad, dict), bad
    assert "model.no_such.weight" in bad["error"] and not bad["group_broken"]
    assert (
        bad["version"] == "1" and bad["norm"] == report["step1"]["norm"] and bad["server"] == report["step1"]["server"]
    )
    ff = report["failfast"]
    assert isinstance(ff, dict) and ff["group_broken"] and ff["seconds"] < 30, ff
    assert report["final_version"] == "2"


_CRASH = """
import os, sys
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.weight_sync.sender import WeightSyncSender
s = WeightSyncSender([RolloutClient(sys.argv[1], timeout_s=60)], timeout_s=60)
s.init_group()
os._exit(0)  # dies with its group still registered on the server
"""

_REFUSED = """
import sys
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.errors import WeightSyncError
from megatron_rl.weight_sync.sender import WeightSyncSender
s = WeightSyncSender([RolloutClient(sys.argv[1], timeout_s=60)], timeout_s=60, backend="nccl")
try:
    s.init_group()
except WeightSyncError as e:
    print("REFUSED", e)
"""

_SYNC = """
import sys, torch
from transformers import AutoModelForCausalLM
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.weight_sync.sender import WeightSyncSender
c = RolloutClient(sys.argv[1], timeout_s=60)
s = WeightSyncSender([c], timeout_s=60)
s.init_group()
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
s.sync(model.state_dict().items(), weight_version="after-crash")
s.close()
print("VERSION", c.weight_version())
"""


def test_a_dead_trainers_group_and_a_refused_group_set_up(server):
    """A trainer that died with its group registered on a server it did not start does not block
    the next trainer (the stale group is destroyed first); a server that refuses the group makes
    `init_group` fail and the process exit at once, not after the rendezvous timeout (60 s here)."""
    import subprocess
    import sys

    model_dir, proc = server
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def run(script, *args):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", script, proc.base_url, *map(str, args)], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:] + "\n--- server log ---\n" + proc.log_tail()
        return out, time.monotonic() - t0

    run(_CRASH)
    out, seconds = run(_REFUSED)
    assert "REFUSED init_weights_update_group refused by a server" in out.stdout, out.stdout + out.stderr
    assert "backend 'nccl'" in out.stdout
    assert "still had a weight-update group 'weight_update_group'" in out.stderr  # the dead trainer's, destroyed
    assert seconds < 45, f"the refused set-up took {seconds:.0f} s to exit (rendezvous timeout 60 s)"
    out, _ = run(_SYNC, model_dir)
    assert "VERSION after-crash" in out.stdout


_DIES_MID_SYNC = """
import os, sys, threading, time, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.weight_sync.sender import WeightSyncSender
c = RolloutClient(sys.argv[1], timeout_s=60)
s = WeightSyncSender([c], timeout_s=60)  # load_format null: one broadcast per tensor, received in place
s.init_group()
sd = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).state_dict()
names = ["lm_head.weight", "model.norm.weight"]
first = torch.full_like(sd[names[0]], 0.25)
s.begin_update()
threading.Thread(target=lambda: c.update_weights_from_distributed(
    names, ["float32"] * 2, [list(sd[n].shape) for n in names], group_name=s.group_name, flush_cache=False,
    weight_version="never", timeout_s=60), daemon=True).start()
time.sleep(1.0)
dist.broadcast(first, src=0, group=s._pg)  # the first of two tensors, then the trainer dies
time.sleep(0.5)
os._exit(0)
"""


def test_a_sync_cut_off_mid_way_marks_the_version_partial(server):
    """With load_format null the server receives into its parameters; a trainer that dies after the
    first of two tensors leaves them partly written. The server must not keep serving them under
    the old version: the version gets the "+partial" suffix (in /model_info and every generation's
    meta_info) until a full sync sets a new one."""
    import subprocess
    import sys

    from megatron_rl.rollout.client import RolloutClient

    model_dir, proc = server
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = RolloutClient(proc.base_url, timeout_s=60)
    before = client.weight_version()
    assert not before.endswith("+partial")
    out = subprocess.run([sys.executable, "-c", _DIES_MID_SYNC, proc.base_url, str(model_dir)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    deadline = time.monotonic() + 150  # the server's receive of the second tensor fails (peer gone, or 120 s timeout)
    while client.weight_version() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.weight_version() == before + "+partial", proc.log_tail()
    head = torch.tensor(client.get_weights_by_name("lm_head.weight", truncate_size=4))
    assert torch.equal(head.flatten()[:4], torch.full((4,), 0.25))  # the first tensor did land
    client.continue_generation()  # the dead trainer's session stays open: the next trainer must cope
    res = client.generate_raw({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert res["meta_info"]["weight_version"] == before + "+partial"
    # a full sync (the next trainer's) clears it
    out = subprocess.run([sys.executable, "-c", _SYNC, proc.base_url, str(model_dir)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:] + "\n--- server log ---\n" + proc.log_tail()
    assert "VERSION after-crash" in out.stdout
    assert "closed the weight-update session the earlier trainer left open" in out.stderr
    client.close()


_REFUSED_SECOND_BUCKET = """
import sys, torch
from transformers import AutoModelForCausalLM
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.errors import WeightSyncError
from megatron_rl.weight_sync.sender import WeightSyncSender
c = RolloutClient(sys.argv[1], timeout_s=60)
s = WeightSyncSender([c], timeout_s=60, bucket_size_mib=0.1)  # several buckets
s.init_group()
sd = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).state_dict()
try:
    s.sync(sd.items(), weight_version="1")  # the server refuses call 2: bucket 1 has landed
except WeightSyncError as e:
    print("ERROR", e)
    if e.group_broken:  # what the trainer does: re-create the group, then sync again
        s.destroy()
        s.init_group()
print("AFTER_FAIL", c.weight_version())
s.sync(sd.items(), weight_version="1")
print("AFTER_RETRY", c.weight_version())
s.close()
"""


def test_a_refused_later_bucket_marks_the_version_partial(tmp_path):
    """A session whose second bucket is refused (fault injection) has written the first: the version
    gets "+partial"; the retry's full sync clears it."""
    import subprocess
    import sys

    from megatron_rl.engine.test_hooks import FAULT_REFUSE_UPDATES_ENV

    model_dir = tmp_path / "model"
    _save_model(model_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    server_env = dict(env, **{FAULT_REFUSE_UPDATES_ENV: "2"})
    extra = ["--dtype", "float32", "--weight-version", "0", "--weight-sync-timeout-s", "60"]
    with launch_rollout_server(model_dir, log_path=tmp_path / "server.log", extra_args=extra, env=server_env) as proc:
        out = subprocess.run([sys.executable, "-c", _REFUSED_SECOND_BUCKET, proc.base_url, str(model_dir)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:] + "\n--- server log ---\n" + proc.log_tail()
    assert "earlier calls of this session did" in out.stdout and "'0+partial'" in out.stdout, out.stdout
    assert "AFTER_FAIL 0+partial" in out.stdout
    assert "AFTER_RETRY 1" in out.stdout
