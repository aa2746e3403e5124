"""Routed experts from the embedded server to the training sample (issue 29, ALGORITHMS.md section 9).

A real embedded server process serves a tiny random Qwen3-MoE (4 experts, top-2, 2 layers) saved
with ``save_pretrained`` (per-expert names on disk, fused in memory). Checked against the same HF
model's own routers in a plain full forward of prompt + response:

- ``return_routed_experts`` answers, in SGLang 0.5.23's encoding, the top-k of every position the
  engine processed (all but the last token), under batching (left padding, shared prefill of n > 1,
  requests joining a running batch), with ``routed_experts_start_len``, and nothing for requests
  without the flag; the SGLang client parses and checks it;
- weight updates by broadcast (per tensor in place, and flattened buckets) and by the colocated
  ``/update_weights_from_tensor`` take the per-expert HF names and write the fused experts;
- a partial rollout continued across live weight updates carries, per segment, the routing each
  segment had (each under its own weights);
- the vLLM dialect answers ``choices[0].routed_experts`` as vLLM 0.33 does and ``VLLMClient`` parses it;
- the producer passes every sample's routing into the ``TrainBatch``.

Routing is compared as a set per (position, layer); positions where the HF router's k-th and
(k+1)-th probabilities are within 1e-4 (a near-tie that float rounding of a batched, KV-cached
forward may flip) are not compared, and must be rare.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.launcher import launch_rollout_server
from megatron_rl.rollout.result import RoutedExpertsSpec
from megatron_rl.weight_sync.publisher import WeightPublisher
from megatron_rl.weight_sync.sender import WeightSyncSender

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from tiny_qwen2 import tiny_hf_config, tiny_hf_model  # noqa: E402

TINY = ROOT / "examples" / "tiny"
VOCAB = 128  # the tiny task's tokenizer
EOS = 2
LAYERS, TOPK, EXPERTS = 2, 2, 4
SPEC = RoutedExpertsSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
TIE = 1e-4


def save_tiny_moe(path: Path) -> Path:
    """A random 2-layer Qwen3-MoE (4 experts, top-2, vocab 128, EOS 2) with the tiny task's tokenizer."""
    cfg = tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe")
    cfg.update(vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1, pad_token_id=0)
    tiny_hf_model(cfg, seed=3).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / "base_model" / f, path / f)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_routing(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's routing of `seq` in one plain forward: ids [len, L, K] and the margin between
    the k-th and (k+1)-th router probability [len, L]."""
    caps: dict[int, tuple] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, a, out, l=l: caps.__setitem__(l, out))
             for l, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    ids = torch.stack([caps[l][2] for l in range(LAYERS)], dim=1)  # [len, L, K]
    probs = torch.stack([torch.softmax(caps[l][0].float(), -1) for l in range(LAYERS)], dim=1)  # [len, L, E]
    top = probs.sort(dim=-1, descending=True).values
    return ids, top[..., TOPK - 1] - top[..., TOPK]


def check_routing(got, model, seq: list[int], *, start: int = 0, positions=None) -> tuple[int, int]:
    """Assert `got` [T, L, K] is the HF router's top-k set at positions `start..` of `seq` (only at
    `positions` when given), T = len(seq) - 1 - start; returns (compared, near-ties skipped)."""
    got = torch.as_tensor(np.array(got)).long()
    assert tuple(got.shape) == (len(seq) - 1 - start, LAYERS, TOPK), (tuple(got.shape), len(seq), start)
    ids, margin = hf_routing(model, seq)
    compared = skipped = 0
    for t in range(start, len(seq) - 1) if positions is None else positions:
        for l in range(LAYERS):
            if margin[t, l] < TIE:
                skipped += 1
                continue
            compared += 1
            assert set(got[t - start, l].tolist()) == set(ids[t, l].tolist()), (t, l, got[t - start, l], ids[t, l])
    return compared, skipped


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/generate", json=body, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_RL_TEST_STEP_DELAY_S="0.01")
    with launch_rollout_server(model_dir, log_path=tmp_path_factory.mktemp("logs") / "server.log", env=env,
                               extra_args=["--dtype", "float32", "--max-batch-size", "8", "--weight-version", "0"],
                               startup_timeout_s=180) as proc:
        yield proc


def test_routing_of_every_processed_position_equals_the_hf_router(server, hf):
    client = server.client(timeout_s=60, generate_timeout_s=120)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
    sps = [{"max_new_tokens": 10 + 3 * i, "temperature": 1.0, "sampling_seed": 100 + i} for i in range(4)]
    # one batch call: left padding, a shared prefill (prompts 0 and 2), rows leaving at different steps
    results = client.generate_batch(prompts, sps, [f"b{i}" for i in range(4)], routed_experts=SPEC)
    # more requests joining a running batch at later step boundaries
    with ThreadPoolExecutor(4) as pool:
        futs = []
        for i in range(4):
            futs.append(pool.submit(client.generate, [20 + i] * (3 + i), {"max_new_tokens": 24 - 4 * i,
                                    "temperature": 1.0, "sampling_seed": i}, f"j{i}", routed_experts=SPEC))
            time.sleep(0.03)
        results += [f.result() for f in futs]
    compared = skipped = 0
    for res, prompt in zip(results, prompts + [[20 + i] * (3 + i) for i in range(4)]):
        r = res.routed_experts
        assert r is not None and r.dtype == np.int16 and r.flags.c_contiguous
        assert r.shape == (res.prompt_tokens + res.completion_tokens - 1, LAYERS, TOPK)
        c, s = check_routing(r, hf, prompt + res.output_ids)
        compared, skipped = compared + c, skipped + s
    assert skipped <= 0.05 * compared, (compared, skipped)
    client.close()


def test_wire_format_n_and_start_len_and_requests_without_the_flag(server, hf):
    body = {"input_ids": [[3, 4, 5, 6], [30, 31]], "sampling_params": {"max_new_tokens": 6, "n": 2,
            "sampling_seed": 7}, "rid": ["n0", "n1"], "return_routed_experts": True}
    outs = _post(server, body).json()
    assert [o["meta_info"]["id"] for o in outs] == ["n0_0", "n0_1", "n1_0", "n1_1"]
    for o, prompt in zip(outs, [[3, 4, 5, 6]] * 2 + [[30, 31]] * 2):
        meta = o["meta_info"]
        raw = base64.b64decode(meta["routed_experts"])  # SGLang 0.5.23: base64 of int32 bytes
        rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
        assert len(raw) == rows * LAYERS * TOPK * 4
        check_routing(np.frombuffer(raw, dtype="<i4").reshape(rows, LAYERS, TOPK), hf, prompt + o["output_ids"])
    # routed_experts_start_len: positions [start, seqlen - 1)
    greedy = {"input_ids": [9, 8, 7, 6, 5], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
              "return_routed_experts": True, "routed_experts_start_len": 3}
    o = _post(server, greedy).json()
    raw = base64.b64decode(o["meta_info"]["routed_experts"])
    got = np.frombuffer(raw, dtype="<i4").reshape(-1, LAYERS, TOPK)
    check_routing(got, hf, [9, 8, 7, 6, 5] + o["output_ids"], start=3)
    bad = _post(server, dict(greedy, routed_experts_start_len=6))
    assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
    # without the flag: no routing in the answer, also when it shares a forward with one that has it
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_post, server, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8},
                                        "return_routed_experts": True})
        b = pool.submit(_post, server, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})
        with_flag, without = a.result().json(), b.result().json()
    assert "routed_experts" in with_flag["meta_info"] and "routed_experts" not in without["meta_info"]


def test_client_checks_the_routing_against_the_model(server):
    client = server.client(timeout_s=60, generate_timeout_s=120)
    sp = {"max_new_tokens": 4, "sampling_seed": 1}
    # another top-k or number of layers than the server's model: the rows do not come out whole, or
    # not as many as prompt + completion - 1
    with pytest.raises(RolloutServerError, match=r"'wrong-k': routed_experts (has \d+ bytes|has \d+ positions)"):
        client.generate([5, 6], sp, "wrong-k", routed_experts=RoutedExpertsSpec(LAYERS, 3, EXPERTS))
    with pytest.raises(RolloutServerError, match=r"'wrong-l': routed_experts (has \d+ bytes|has \d+ positions)"):
        client.generate([5, 6], sp, "wrong-l", routed_experts=RoutedExpertsSpec(3, TOPK, EXPERTS))
    with pytest.raises(RolloutServerError, match=r"'few-experts'.*outside the model's \[0, 2\)"):
        for i in range(8):  # some position is routed to expert 2 or 3
            client.generate([5, 6, 7, 8, 9], dict(sp, sampling_seed=i), "few-experts",
                            routed_experts=RoutedExpertsSpec(LAYERS, TOPK, 2))
    client.close()


def _variant(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The weights of `version`: every router's rows rolled by `version` experts (routing moves) and
    the experts scaled (outputs move); everything else as `base`."""
    out = {}
    for n, t in base.items():
        if n.endswith("mlp.gate.weight"):
            t = torch.roll(t, version, dims=0)
        elif ".mlp.experts." in n:
            t = t * (1.0 + 0.1 * version)
        out[n] = t.clone()
    return out


def _per_expert(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    from megatron_rl.models.hf_weights import unfuse_hf_experts

    named = unfuse_hf_experts(state)
    assert any(".mlp.experts.3.down_proj.weight" in n for n in named) and not any(n.endswith("gate_up_proj")
                                                                                 for n in named)
    return [(n, t.contiguous()) for n, t in named.items()]


def _set(model, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])


def _greedy_check(client, model, version: str) -> None:
    res = client.generate([7, 3, 9, 11], {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                          uuid.uuid4().hex, routed_experts=SPEC)
    assert res.weight_version == version
    compared, skipped = check_routing(res.routed_experts, model, [7, 3, 9, 11] + res.output_ids)
    assert compared > 0 and skipped <= 2


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"], ids=["in_place", "flattened_bucket"])
def test_broadcast_update_takes_per_expert_names(server, model_dir, load_format):
    model = load_hf(model_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = server.client(timeout_s=60, generate_timeout_s=120)
    sender = WeightSyncSender([client], group_name=f"moe-{load_format}", timeout_s=60, bucket_size_mib=0.05,
                              load_format=load_format)
    try:
        sender.init_group()
        for version in (1, 2, 0):
            state = _variant(base, version)
            sender.sync(_per_expert(state), weight_version=str(version))
            _set(model, state)
            name = "model.layers.1.mlp.experts.2.down_proj.weight"
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=1000))
            assert torch.equal(got, state["model.layers.1.mlp.experts.down_proj"][2])  # the fused tensor's slice
            _greedy_check(client, model, str(version))
    finally:
        sender.close()
        client.close()


def test_colocated_update_from_tensor_takes_per_expert_names(server, model_dir):
    from megatron_rl.weight_sync.ipc import serialize_named_tensors

    model = load_hf(model_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = server.client(timeout_s=60, generate_timeout_s=120)
    state = _variant(base, 3)
    named = _per_expert(state)
    client.release_memory_occupation()
    client.resume_memory_occupation()
    client.begin_weight_update()
    try:
        experts = [(n, t) for n, t in named if ".mlp.experts." in n]
        rest = [(n, t) for n, t in named if ".mlp.experts." not in n]
        client.update_weights_from_tensor([serialize_named_tensors([(n, t.clone()) for n, t in rest])])
        client.update_weights_from_tensor([serialize_named_tensors([(n, t.clone()) for n, t in experts[:-1]])])
        occ = client.memory_occupation()
        assert occ["weights"] == "stale" and occ["stale_tensors"] == 1  # one expert part not yet rewritten
        client.update_weights_from_tensor([serialize_named_tensors([(n, t.clone()) for n, t in experts[-1:]])],
                                          weight_version="3")
    finally:
        client.end_weight_update()
    assert client.memory_occupation()["weights"] == "resident"
    _set(model, state)
    _greedy_check(client, model, "3")
    # back to the base weights for the other tests
    client.begin_weight_update()
    client.update_weights_from_tensor([serialize_named_tensors([(n, t.clone()) for n, t in _per_expert(base)])],
                                      weight_version="0")
    client.end_weight_update()
    client.close()


class HFPublisher(WeightPublisher):
    """The real weight publisher (controller, world of one) sending `states[version]` by per-expert names."""

    def __init__(self, fleet, states: dict[int, dict[str, torch.Tensor]]) -> None:
        pgs = SimpleNamespace(rank=0, world_size=1, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0, tp_size=1)
        super().__init__(None, {}, pgs, fleet=fleet, pause_mode="abort", sender_factory=lambda urls, name:
                         WeightSyncSender([c for c in fleet.clients if c.base_url in urls], group_name=name,
                                          timeout_s=60))
        self.states = states
        self.publishing = 0

    def _stage_weights(self):
        yield from _per_expert(self.states[self.publishing])

    def publish(self, version: int, **kw) -> dict:
        self.publishing = version
        return super().publish(version, **kw)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()  # the clients are the manager's: not closed here


def _live(client) -> int:
    info = client.server_info()
    return info["num_running_reqs"] + info["num_waiting_reqs"]


def test_partial_rollout_keeps_the_routing_each_segment_had(server, model_dir):
    """Requests aborted by live updates are continued with their prefix: each position's routing is
    the one of the weights that processed it (the segment that generated the token after it)."""
    from megatron_rl.rollout.manager import RolloutManager

    model = load_hf(model_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {v: _variant(base, v) for v in range(4)}
    states[99] = base  # published at the end: the base weights back for the other tests
    client = server.client(timeout_s=60, generate_timeout_s=300)
    client.update_weight_version("0", abort_all_requests=False)
    manager = RolloutManager([client], None, None, reward_fn="dapo_math", max_prompt_length=64,
                             max_response_length=96, partial_rollout=True, pause_timeout_s=120, routed_experts=SPEC)
    manager.gate.set_version(0)
    publisher = HFPublisher(manager.fleet, states)
    prompts = [[5 + i, 9, 11 + i, 4] for i in range(6)]
    items = [(p, {"max_new_tokens": 96, "min_new_tokens": 96, "temperature": 1.0, "sampling_seed": i}, f"pr-{i}")
             for i, p in enumerate(prompts)]
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = manager.generate_batch_ids(items)
        except BaseException as e:  # noqa: BLE001 - asserted below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    try:
        t.start()
        published = 0
        while t.is_alive() and published < 3:
            deadline = time.monotonic() + 30
            while t.is_alive() and _live(client) == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)
            if not t.is_alive():
                break
            published += 1
            publisher.publish(published, live=True)
        t.join(300)
        assert not t.is_alive() and "error" not in box, box.get("error")
        assert published >= 2, "generation ended before two updates landed"
        compared = skipped = continued = 0
        for res, prompt in zip(box["out"], prompts):
            assert res.finish_type == "length" and len(res.output_ids) == 96
            seq = prompt + res.output_ids
            r = res.routed_experts
            assert r.shape == (len(seq) - 1, LAYERS, TOPK)
            spans = list(res.version_spans)
            continued += len(spans) > 1
            bounds = [0] + [len(prompt) + start - 1 for _, start in spans[1:]] + [len(seq) - 1]
            for (version, _), lo, hi in zip(spans, bounds, bounds[1:]):  # segment k processed [lo, hi)
                _set(model, states[version])
                c, s = check_routing(r, model, seq, positions=range(lo, hi))
                compared, skipped = compared + c, skipped + s
        assert continued > 0, "no response was continued across an update"
        assert skipped <= 0.05 * compared, (compared, skipped)
    finally:
        publisher.publish(99)
        publisher.close()
        manager.close()
        client.update_weight_version("0", abort_all_requests=False)


def test_vllm_dialect_answers_routed_experts_as_vllm(model_dir, hf, tmp_path):
    from megatron_rl.rollout.vllm_client import VLLMClient

    with launch_rollout_server(model_dir, log_path=tmp_path / "vllm.log", startup_timeout_s=180,
                               extra_args=["--dtype", "float32", "--api-dialect", "vllm",
                                           "--enable-return-routed-experts"]) as proc:
        client = VLLMClient(proc.base_url, timeout_s=60, generate_timeout_s=120)
        try:
            for i, prompt in enumerate([[5, 6, 7], [30, 31, 32, 33, 34]]):
                res = client.generate(prompt, {"max_new_tokens": 9, "sampling_seed": i}, f"v{i}", routed_experts=SPEC)
                assert res.routed_experts.shape == (len(prompt) + res.completion_tokens - 1, LAYERS, TOPK)
                check_routing(res.routed_experts, hf, prompt + res.output_ids)
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "routed_experts_prompt_start": 2}
            choice = httpx.post(proc.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            import io

            arr = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
            assert arr.dtype == np.uint8  # vLLM: uint8 up to 256 experts
            check_routing(arr, hf, [5, 6, 7, 8] + choice["token_ids"], start=2)
        finally:
            client.close()


def test_producer_passes_each_samples_routing_into_the_batch(server, model_dir):
    from megatron_rl.algorithms.daa import DifficultyTracker
    from megatron_rl.config.loader import load_config
    from megatron_rl.data.dataset import PromptDataset, load_rows
    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.manager import RolloutManager
    from megatron_rl.trainer.producer import RolloutProducer
    from transformers import AutoTokenizer

    cfg = load_config(TINY / "grpo.yaml", [f"model.path={model_dir}", "actor.router_replay=true", "rollout.n=2",
                                           "data.train_batch_size=3", "actor.ppo_mini_batch_size=1",
                                           "data.max_response_length=12", "rollout.num_servers=1"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(TINY / "data" / "train.parquet")[:6]
    with RewardPool(1, 30.0) as pool:
        manager = RolloutManager([server.client(timeout_s=60, generate_timeout_s=120)], tok, pool,
                                 reward_fn="dapo_math", max_prompt_length=cfg.data.max_prompt_length,
                                 max_response_length=cfg.data.max_response_length, eos_token_ids=[EOS])
        manager.gate.set_version(int(manager.clients[0].weight_version()))
        try:
            producer = RolloutProducer(cfg, manager, PromptDataset(rows, seed=0, shuffle=False), DifficultyTracker(),
                                       pad_id=0, dp_size=1)
            assert manager.routed_experts == SPEC
            produced = producer.produce(1)
        finally:
            manager.close()
    batch, samples = produced.batch, produced.samples
    assert len(samples) == 6 and len(batch.routed_experts) == len(batch.input_ids)
    assert batch.routed_experts.layers == tuple(range(LAYERS)) and batch.routed_experts.topk == TOPK
    routed, valid = batch.routed_experts.padded(batch.input_ids.shape[1])
    hf = load_hf(model_dir)
    for i, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        assert s.routed_experts.shape == (n, LAYERS, TOPK)
        assert torch.equal(routed[i, :n], torch.as_tensor(s.routed_experts).long())
        assert valid[i, :n].all() and not valid[i, n:].any()
        check_routing(s.routed_experts, hf, list(s.prompt_ids) + list(s.response_ids))
