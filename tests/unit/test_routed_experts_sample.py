"""Routed experts on the client side and through the sample's path (issue 29; ALGORITHMS.md section 9).

- ``GenerateResult.from_sglang`` / ``result_from_vllm`` decode SGLang 0.5.23's (base64 int32 bytes)
  and vLLM 0.33's (base64 ``.npy``) encodings, check them against the model and the answer's token
  counts, and refuse with an error naming the request;
- a partial rollout's parts join with the routing each part had (``join_routing``);
- dynamic sampling's kept groups, the asynchronous producer's queue and the producer's batch carry it;
- the embedded engine in process: per-expert weight names land in transformers' fused experts
  (in place for a broadcast), routing of a retracted request is recomputed, a dense model refuses.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.manager import Group, Sample, join_routing
from megatron_rl.rollout.result import GenerateResult, RoutedExpertsSpec, compact_routing
from megatron_rl.rollout.vllm_client import result_from_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from tiny_qwen2 import tiny_hf_config, tiny_hf_model  # noqa: E402

SPEC = RoutedExpertsSpec(num_layers=2, topk=2, num_experts=4)


def _routing(rows: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return np.stack([g.permutation(4)[:2] for _ in range(rows * 2)]).reshape(rows, 2, 2).astype(np.int32)


def _sglang(prompt: int, out: int, routed=None, *, finish=None, rid="req-1") -> dict:
    meta = {"id": rid, "finish_reason": finish or {"type": "length", "length": out}, "prompt_tokens": prompt,
            "completion_tokens": out, "weight_version": "3",
            "output_token_logprobs": [[-0.5, 10 + i, None] for i in range(out)]}
    if routed is not None:
        meta["routed_experts"] = routed if isinstance(routed, str) else \
            base64.b64encode(np.asarray(routed, dtype="<i4").tobytes()).decode()
    return {"output_ids": [10 + i for i in range(out)], "meta_info": meta}


def test_sglang_routing_is_decoded_checked_and_compact():
    r = _routing(4 + 3 - 1)
    res = GenerateResult.from_sglang(_sglang(4, 3, r), routed_experts=SPEC)
    assert res.routed_experts.dtype == np.int16 and res.routed_experts.flags.writeable
    assert np.array_equal(res.routed_experts, r)
    assert GenerateResult.from_sglang(_sglang(4, 3, r)).routed_experts is None  # not asked for: ignored
    # an abort may come without routing (SGLang: aborted while queued, a retracted request included)
    abort = {"type": "abort", "message": "Aborted", "status_code": None}
    assert GenerateResult.from_sglang(_sglang(4, 0, finish=abort), routed_experts=SPEC).routed_experts is None
    assert GenerateResult.from_sglang(_sglang(4, 3, finish=abort), routed_experts=SPEC).routed_experts is None
    with pytest.raises(RolloutServerError, match="has 5 positions"):  # but when it has routing, it is checked
        GenerateResult.from_sglang(_sglang(4, 3, _routing(5), finish=abort), routed_experts=SPEC)


@pytest.mark.parametrize("routed, match", [
    (None, "'req-1': routed_experts are missing .*--enable-return-routed-experts"),
    ("%%%", "'req-1': routed_experts is not valid base64"),
    (_routing(5), "'req-1': routed_experts has 5 positions; prompt \\+ completion - 1 = 6 expected"),
    (np.zeros((5, 1, 3), np.int32), "'req-1': routed_experts has 60 bytes: not a whole number of rows of 2 layers x "
                                    "top-2"),
    (np.full((6, 2, 2), 4, np.int32), "'req-1': routed_experts holds expert ids in \\[4, 4\\], outside the model's "
                                      "\\[0, 4\\)"),
])
def test_sglang_routing_errors_name_the_request(routed, match):
    with pytest.raises(RolloutServerError, match=match):
        GenerateResult.from_sglang(_sglang(4, 3, routed), routed_experts=SPEC)


def _npy(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return base64.b64encode(buf.getvalue()).decode()


def _vllm(prompt: int, out: int, routed) -> dict:
    ids = [10 + i for i in range(out)]
    return {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length", "stop_reason": None,
                         "logprobs": {"token_logprobs": [-0.5] * out, "tokens": [f"token_id:{t}" for t in ids]},
                         "routed_experts": routed}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}}


def test_vllm_routing_npy_uint8_and_refusals():
    r = _routing(4 + 3 - 1).astype(np.uint8)  # vLLM 0.33: uint8 up to 256 experts
    res = result_from_vllm(_vllm(4, 3, _npy(r)), rid="v-1", routed_experts=SPEC)
    assert res.routed_experts.dtype == np.int16 and np.array_equal(res.routed_experts, r)
    with pytest.raises(RolloutServerError, match="'v-1'.*routed_experts are missing"):
        result_from_vllm(_vllm(4, 3, None), rid="v-1", routed_experts=SPEC)
    with pytest.raises(RolloutServerError, match="'v-1'.*not \\[tokens, layers, top-k\\] integers"):
        result_from_vllm(_vllm(4, 3, _npy(np.zeros((6, 4), np.uint8))), rid="v-1", routed_experts=SPEC)
    with pytest.raises(RolloutServerError, match="'v-1'.*routed_experts is not base64 of a .npy array"):
        result_from_vllm(_vllm(4, 3, _npy(np.array([{"x": 1}], dtype=object))), rid="v-1", routed_experts=SPEC)
    with pytest.raises(RolloutServerError, match="'v-1'.*has 7 positions"):
        result_from_vllm(_vllm(4, 3, _npy(_routing(7).astype(np.uint8))), rid="v-1", routed_experts=SPEC)


def test_spec_from_hf_config_and_compact_dtype():
    hf = {"num_hidden_layers": 2, "num_experts_per_tok": 2}
    assert RoutedExpertsSpec.from_hf_config(dict(hf, num_experts=4)) == SPEC
    assert RoutedExpertsSpec.from_hf_config(dict(hf, num_local_experts=4)) == SPEC  # transformers 5's save_pretrained
    with pytest.raises(ValueError, match="Mixture-of-Experts model \\(model_type 'qwen2'\\)"):
        RoutedExpertsSpec.from_hf_config({"model_type": "qwen2", "num_hidden_layers": 2})
    assert compact_routing(np.array([[[70000]]])).dtype == np.int32


def _result(rid, prompt, out, routed):
    return GenerateResult(rid=rid, output_ids=list(range(out)), output_logprobs=[-1.0] * out, finish_type="length",
                          matched_stop=None, stop_reason="length", prompt_tokens=prompt, completion_tokens=out,
                          weight_version="1", routed_experts=routed)


def test_join_routing_keeps_each_parts_rows():
    first = _routing(4 + 5 - 1, seed=1)  # prompt 4, 5 tokens: positions [0, 8) under the old weights
    cont = _routing(9 + 3 - 1, seed=2)  # its continuation: prompt 4 + 5, 3 tokens, all under the new weights
    joined = join_routing(_result("a", 4, 5, first), _result("a-a1", 9, 3, cont))
    assert joined.shape == (4 + 8 - 1, 2, 2)
    assert np.array_equal(joined[:8], first) and np.array_equal(joined[8:], cont[8:])
    # a continuation aborted at once adds nothing; no routing asked for: None
    assert join_routing(_result("a", 4, 5, first), _result("a-a1", 9, 0, None)) is first
    assert join_routing(_result("a", 4, 5, None), _result("a-a1", 9, 3, None)) is None
    with pytest.raises(ValueError, match="continuation 'a-a1'.*do not cover its prompt of 9 tokens"):
        join_routing(_result("a", 4, 5, first), _result("a-a1", 9, 3, None))
    # an aborted continuation without routing: the parts cannot all be replayed (resubmitted from scratch)
    aborted = dataclasses.replace(_result("a-a1", 9, 3, None), finish_type="abort", stop_reason="abort")
    assert join_routing(_result("a", 4, 5, first), aborted) is None


def _sample(uid: str, j: int, acc: bool) -> Sample:
    prompt, resp = [1, 2, 3], [4 + j, 5, 6, 7][: 2 + j]
    return Sample(prompt_key=uid, group_uid=uid, prompt_ids=prompt, response_ids=resp,
                  rollout_logprobs=[-1.0] * len(resp), stop_reason="length", ground_truth="1", acc=acc,
                  score=1.0 if acc else -1.0,
                  routed_experts=compact_routing(_routing(len(prompt) + len(resp) - 1, seed=sum(map(ord, uid)) + j)))


def _groups(batch: int, n: int = 2) -> list[Group]:
    # groups 0 and 2 of each batch are informative (mixed accuracy), 1 is not
    return [Group(prompt_key=f"b{batch}-p{i}", group_uid=f"b{batch}-p{i}",
                  samples=[_sample(f"b{batch}-p{i}", j, acc=(i != 1 and j == 0)) for j in range(n)]) for i in range(3)]


def test_dynamic_sampling_and_the_async_queue_carry_the_routing():
    from megatron_rl.algorithms.dynamic_sampling import collect_groups, keep_group
    from megatron_rl.trainer.async_producer import AsyncProducer, StalenessGate
    from megatron_rl.trainer.batch import build_train_batch
    from megatron_rl.trainer.producer import ProducedStep, sample_routing

    made = {}

    def gen(batch_idx):
        made[batch_idx] = _groups(batch_idx)
        return made[batch_idx]

    kept, stats = collect_groups(gen, train_batch_size=3, max_num_gen_batches=4, ppo_mini_batch_size=1,
                                 keep_fn=lambda g: keep_group([float(s.acc) for s in g.samples]))
    assert [g.group_uid for g in kept] == ["b0-p0", "b0-p2", "b1-p0"] and stats["num_gen_batches"] == 2
    by_uid = {g.group_uid: g for b in made.values() for g in b}
    for g in kept:
        for s, orig in zip(g.samples, by_uid[g.group_uid].samples):
            assert s.routed_experts is orig.routed_experts  # the same array travels, untouched

    def produce(step):
        samples = [s for g in kept for s in g.samples]
        batch = build_train_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                  advantages=[0.0] * len(samples),
                                  rollout_logprobs=[s.rollout_logprobs for s in samples],
                                  trained=[True] * len(samples), pad_id=0, routed_experts=sample_routing(samples))
        return ProducedStep(batch, samples, kept, {}, {}, {}, 0, len(samples), 0, 0.0)

    ahead = AsyncProducer(produce, lambda: {}, StalenessGate(1, 0), first=1, last=2).start()
    try:
        got, _ = ahead.take(1, resync=lambda: None)
    finally:
        ahead.close()
    for i, s in enumerate(got.samples):
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        row = got.batch.routed_experts.rows[i]
        assert row.dtype == torch.int16 and row.shape[0] == n  # unpadded
        assert torch.equal(row.long(), torch.as_tensor(s.routed_experts).long())
        routed, valid = got.batch.routed_experts.select([i]).padded(got.batch.input_ids.shape[1])
        assert torch.equal(routed[0, :n], row.long()) and int(valid.sum()) == n


def test_the_producer_refuses_a_sample_without_matching_routing(tmp_path):
    import json

    from megatron_rl.trainer.producer import routed_experts_spec, sample_routing

    s = _sample("g7", 0, True)
    assert sample_routing([s])[0] is s.routed_experts
    s.routed_experts = s.routed_experts[:-1]
    with pytest.raises(ValueError, match="group g7 .* expected 4 positions"):
        sample_routing([s])
    s.routed_experts = None
    with pytest.raises(ValueError, match="group g7 .*routed_experts None"):
        sample_routing([s])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                                                      "num_experts_per_tok": 2, "num_experts": 4}))
    cfg = SimpleNamespace(rollout=SimpleNamespace(return_routed_experts=None), actor=SimpleNamespace(router_replay=True),
                          model=SimpleNamespace(path=str(tmp_path)))
    assert routed_experts_spec(cfg) == SPEC
    assert routed_experts_spec(SimpleNamespace(rollout=SimpleNamespace(return_routed_experts=None),
                                               actor=SimpleNamespace(router_replay=False))) is None


# ---- the embedded engine, in process ------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_engine():
    from megatron_rl.engine.batching import GenerationEngine

    model = tiny_hf_model(tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe"), seed=4)
    engine = GenerationEngine(model, eos_token_ids=[], max_batch_size=4)
    yield engine
    engine.close()


def test_per_expert_names_write_the_fused_experts(moe_engine):
    from megatron_rl.models.hf_weights import unfuse_hf_experts

    e = moe_engine
    fused = e.model.model.layers[1].mlp.experts
    names = e.weight_names()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    assert set(unfuse_hf_experts(e.model.state_dict())) == set(names)
    gate = torch.randn(32, 64)
    e.load_weights([("model.layers.1.mlp.experts.2.gate_proj.weight", gate)])
    assert torch.equal(fused.gate_up_proj[2, :32], gate)
    # a broadcast lands in place: the views share the fused parameter's storage
    up, down = e.direct_targets(["model.layers.1.mlp.experts.2.up_proj.weight",
                                 "model.layers.1.mlp.experts.0.down_proj.weight"], [torch.float32] * 2,
                                [[32, 64], [64, 32]])
    up.fill_(0.25)
    down.fill_(-1.0)
    assert (fused.gate_up_proj[2, 32:] == 0.25).all() and (fused.down_proj[0] == -1.0).all()
    assert torch.equal(e.get_parameter("model.layers.1.mlp.experts.2.up_proj.weight"), fused.gate_up_proj[2, 32:])
    assert e.direct_targets(["model.layers.1.mlp.experts.2.up_proj.weight"], [torch.bfloat16], [[32, 64]]) is None
    with pytest.raises(ValueError, match="unknown parameter name.*experts.4.up_proj"):
        e.load_weights([("model.layers.1.mlp.experts.4.up_proj.weight", gate)])  # 4 experts: 0..3
    with pytest.raises(ValueError, match=r"shape mismatch.*experts.1.down_proj.weight', \[32, 64\], \[64, 32\]"):
        e.load_weights([("model.layers.1.mlp.experts.1.down_proj.weight", gate)])
    assert len(e.weight_units("model.layers.1.mlp.experts.gate_up_proj")) == 8  # 4 experts x (gate, up)
    assert e.weight_units("model.layers.1.mlp.experts.2.up_proj.weight") == [(id(fused.gate_up_proj), 2, "up_proj")]


def _run(engine, reqs):
    done = threading.Event()
    left = [len(reqs)]

    def on_done(_):
        left[0] -= 1
        if left[0] == 0:
            done.set()

    for r in reqs:
        r.on_done = on_done
        engine.submit(r)
    return done


def _request(engine, rid, prompt, max_new, routed=True):
    from megatron_rl.engine.batching import Request
    from megatron_rl.engine.sampling import SamplingParams

    return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, temperature=1.0),
                   return_logprob=False, logprob_start_len=-1, generator=engine.new_generator(sum(map(ord, rid))),
                   on_done=lambda r: None, return_routed_experts=routed)


def _hf_ids(model, seq):
    caps = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, l=l: caps.__setitem__(l, o))
             for l, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=torch.tensor([seq]))
    for h in hooks:
        h.remove()
    return torch.stack([caps[l][2] for l in range(len(caps))], dim=1)  # [len, L, K]


def test_retracted_requests_recompute_their_routing(moe_engine):
    import time

    e = moe_engine
    e.step_delay_s = 0.01
    try:
        reqs = [_request(e, f"rt{i}", [5 + i, 6, 7], 30) for i in range(2)] + [_request(e, "plain", [9, 9], 30, False)]
        done = _run(e, reqs)
        time.sleep(0.1)
        e.pause("retract")
        assert all(r.num_retractions == 1 for r in reqs if r.output_ids) and reqs[0].num_retractions == 1
        e.resume()
        assert done.wait(60)
    finally:
        e.step_delay_s = 0.0
    assert reqs[2].routed_experts() is None and reqs[2].routed is None  # never asked: nothing recorded
    for r in reqs[:2]:
        got = r.routed_experts()
        seq = r.prompt_ids + r.output_ids
        assert got.shape == (len(seq) - 1, 2, 2)
        want = _hf_ids(e.model, seq)[: len(seq) - 1]
        assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got.reshape(-1, 2), want.reshape(-1, 2)))


def test_a_dense_model_refuses_return_routed_experts():
    from megatron_rl.engine.batching import GenerationEngine
    from megatron_rl.engine.bodies import RequestError

    engine = GenerationEngine(tiny_hf_model(tiny_hf_config(tie_word_embeddings=False)), eos_token_ids=[])
    try:
        assert not engine.routers.supported and engine.weight_names()
        with pytest.raises(RequestError, match="has no Mixture-of-Experts router"):
            engine.submit(_request(engine, "dense", [1, 2], 3))
    finally:
        engine.close()


def test_an_aborted_part_without_routing_is_resubmitted_from_scratch():
    """SGLang answers no routing for a request aborted while queued (a retracted one with tokens
    included): its prefix cannot be replayed, so the manager does not continue it (partial rollout)
    but samples the response anew. Only reachable with SGLang, hence an engine stand-in here."""
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.manager import RolloutManager

    class Engine(RolloutEngine):
        def __init__(self) -> None:
            self.calls = []

        def generate(self, input_ids, sampling_params, rid, return_logprob=True, *, eos_token_ids=None,
                     timeout_s=None, routed_experts=None):
            self.calls.append((rid, list(input_ids), routed_experts))
            if len(self.calls) == 1:  # aborted by a pause of the engines, with tokens but no routing
                manager.gate.begin_pause()
                manager.gate.end_pause()
                res = _result(rid, len(input_ids), 3, None)
                return dataclasses.replace(res, finish_type="abort", stop_reason="abort", abort_message="Aborted")
            return _result(rid, len(input_ids), 4, compact_routing(_routing(len(input_ids) + 3, seed=5)))

    Engine.__abstractmethods__ = frozenset()
    eng = Engine()
    manager = RolloutManager([eng], None, None, reward_fn="dapo_math", max_prompt_length=8, max_response_length=4,
                             partial_rollout=True, routed_experts=SPEC)
    try:
        res = manager.generate_ids([1, 2, 3], {"max_new_tokens": 4, "sampling_seed": 1}, "s1-b0-p0-r0")
    finally:
        manager.close()
    assert [(rid, ids) for rid, ids, _ in eng.calls] == [("s1-b0-p0-r0", [1, 2, 3]), ("s1-b0-p0-r0-a1", [1, 2, 3])]
    assert all(spec == SPEC for _, _, spec in eng.calls)  # every call asks for the routing
    assert res.finish_type == "length" and res.routed_experts.shape == (3 + 4 - 1, 2, 2)
