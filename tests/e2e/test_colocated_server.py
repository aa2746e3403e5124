"""The embedded server's colocated-mode endpoints as a real subprocess (issue 17, CASES.md N11/N12):
release / resume / update_weights_from_tensor, refusals in between, and the process-tree check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.weight_sync.ipc import ColocatedSender, serialize_named_tensors, shared_segments

from tests.e2e.test_rollout_server import save_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # big enough (~70 MiB fp32) that releasing it shows in the RSS
    return save_tiny_qwen2(tmp_path_factory.mktemp("coloc_qwen2"), vocab_size=16384, hidden_size=512)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with launch_rollout_server(model_dir, log_path=log, startup_timeout_s=180,
                               extra_args=["--dtype", "float32", "--weight-version", "v0"]) as proc:
        yield proc


def _greedy(client):
    import uuid

    return client.generate([1, 5, 7], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                           rid=uuid.uuid4().hex).output_ids


def _state_dict(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).state_dict()


def test_release_update_resume_cycle(server, model_dir):
    before = set(shared_segments())  # earlier tests' tensors of this process may still await collection
    client = server.client()
    ref = _greedy(client)
    weights = list(_state_dict(model_dir).items())
    rep = client.release_memory_occupation()
    assert rep["rss_before"] - rep["rss_after"] > 30 * 2**20  # the ~70 MiB of weights went back to the OS
    assert client.memory_occupation()["weights"] == "released"
    with pytest.raises(RolloutServerError, match="503.*weights are released"):
        _greedy(client)
    client.health_generate()  # 200, no forward
    assert "Cache flushed" in client.flush_cache()  # KV released: a no-op, no crash (SGLang #19029)
    client.resume_memory_occupation(["weights"])
    with pytest.raises(RolloutServerError, match="503.*not rewritten"):  # resumed, not yet rewritten
        _greedy(client)
    first = [(n, t.clone()) for n, t in weights[:3]]  # serialising moves a CPU tensor into shared memory
    payload = serialize_named_tensors(first)
    with pytest.raises(RolloutServerError, match="between begin_weight_update"):
        client.update_weights_from_tensor([payload])
    client.begin_weight_update()
    client.update_weights_from_tensor([payload], flush_cache=True)  # KV released: flush skipped
    with pytest.raises(RolloutServerError, match="503.*not rewritten"):
        _greedy(client)
    del first, payload
    sender = ColocatedSender(bucket_bytes=8 << 20)
    rest = weights[3:]
    for i in range(0, len(rest), 4):  # buckets through one reused shared buffer
        client.update_weights_from_tensor([sender.payload(rest[i:i + 4])], load_format="flattened_bucket",
                                          weight_version="v1" if i + 4 >= len(rest) else None)
        sender.after_bucket()
    sender.close()
    assert set(shared_segments()) - before == set()  # no trainer-created segment outlives the update
    client.end_weight_update()
    with pytest.raises(RolloutServerError, match="503.*KV cache is released"):
        _greedy(client)
    client.resume_memory_occupation(["kv_cache"])
    assert client.memory_occupation() | {"rss_bytes": 0} == {"weights": "resident", "kv_cache": "resident",
                                                               "stale_tensors": 0, "rss_bytes": 0}
    assert _greedy(client) == ref and client.model_info()["weight_version"] == "v1"


def test_handles_from_outside_the_trainer_tree_are_rejected(server, tmp_path):
    """A double-forked process (re-parented away from the test, the server's --parent-pid) posts
    a valid payload of its own: 403, nothing loaded."""
    out = tmp_path / "answer.json"
    code = textwrap.dedent(f"""
        import json, os, sys, httpx, torch
        if os.fork():
            os._exit(0)
        os.setsid()
        if os.fork():
            os._exit(0)
        import time; time.sleep(0.3)  # re-parented by now
        from megatron_rl.weight_sync.ipc import serialize_named_tensors
        p = serialize_named_tensors([("model.norm.weight", torch.zeros(512))])
        r = httpx.post("{server.base_url}/update_weights_from_tensor", json={{"serialized_named_tensors": [p]}})
        open({str(out)!r}, "w").write(json.dumps({{"status": r.status_code, "body": r.json(), "ppid": os.getppid()}}))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    for _ in range(200):
        if out.exists() and out.read_text():
            break
        import time

        time.sleep(0.1)
    ans = json.loads(out.read_text())
    assert ans["status"] == 403 and "not in the process tree" in ans["body"]["message"], ans


def test_release_refused_while_busy_and_unknown_tags(server):
    r = httpx.post(f"{server.base_url}/release_memory_occupation", json={"tags": ["nope"]})
    assert r.status_code == 400


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["named", "flattened_bucket"])
def test_two_engines_three_updates_from_one_parameter_buffer(model_dir, server, load_format, tmp_path):
    """The trainer's side as in a run: HF-named views of ONE flat parameter buffer (megatron's DDP
    layout) handed to two engines, three updates with the buffer changed in place in between. Every
    engine holds the new values after each update (read back by /get_weights_by_name); with named
    tensors the buffer's own segment stays openable across updates (one serialisation per engine:
    one payload read by two engines would unlink it after the first), and the bucket path reuses its
    buffer across 3+ buckets per update the same way."""
    from megatron_rl.weight_sync.colocated import ColocatedWeightSender

    state = _state_dict(model_dir)
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    views, off = [], 0
    for name, t in state.items():
        views.append((name, flat[off:off + t.numel()].view(t.shape)))
        off += t.numel()
    log = tmp_path / "second.log"
    with launch_rollout_server(model_dir, log_path=log, startup_timeout_s=180,
                               extra_args=["--dtype", "float32", "--weight-version", "v0"]) as second:
        clients = [server.client(), second.client()]
        sender = ColocatedWeightSender(clients, bucket_size_mib=8, dtype=torch.float32, load_format=load_format)
        sender.init_group()
        probe = "model.layers.1.mlp.down_proj.weight"
        for step in range(3):
            flat.mul_(0.5).add_(float(step))  # the optimizer writes the parameters in place
            sender.begin_update()
            stats = sender.send(iter(views), weight_version=f"u{step}")
            sender.finish_update(f"u{step}")
            assert stats["num_buckets"] >= 3, stats
            want = dict(views)[probe][:4].tolist()
            for c in clients:
                got = c.get_weights_by_name(probe, truncate_size=4)
                assert torch.allclose(torch.tensor(got), torch.tensor(want)), (step, c.base_url)
                assert c.model_info()["weight_version"] == f"u{step}"
        sender.close()
    assert flat.is_shared() == (load_format is None)
