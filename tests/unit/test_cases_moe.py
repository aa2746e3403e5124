"""CASES M01 M03 M04 M05 M07 M08 (shared/cases/CASES.md, "Turn 3": Mixture-of-Experts with routing
replay), each with exactly the case's inputs and expected outputs, on the project's real functions:
the replay's token order (`RoutingReplay.before_forward` / `_token_order`), the pad fill
(`routed_rows.pad_routes` / `fill_pad_rows`), megatron-core's router at the replayed ids (through the
project's wrapper of `RouterReplay.get_replay_topk`), the layer mapping (`RoutedRows.keep`,
`model_routers`), the HF -> megatron router mapping (`build_transformer_config`) and the route
dtypes on the way from the engine to the trainer."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.rollout.result import GenerateResult, RoutedExpertsSpec, check_routed_experts
from megatron_rl.trainer.batch import build_train_batch, pack_sequences
from megatron_rl.trainer.routed_rows import RoutedRows, fill_pad_rows, pad_routes
from megatron_rl.trainer.router_replay import RoutingReplay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model  # noqa: E402


def _fake_model(layer_numbers):
    """A model chunk whose decoder layers (megatron's 1-based global `layer_number`) each have a
    router with a real megatron-core `RouterReplay`, as `model_routers` finds them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    layers = [SimpleNamespace(layer_number=n, mlp=SimpleNamespace(router=SimpleNamespace(router_replay=RouterReplay())))
              for n in layer_numbers]
    return SimpleNamespace(decoder=SimpleNamespace(layers=layers))


@pytest.fixture(autouse=True)
def _forget_router_replays():
    """RouterReplay() joins megatron-core's process-global list: leave it as it was."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = list(RouterReplay.global_router_replay_instances)
    yield
    RouterReplay.global_router_replay_instances[:] = before


def _targets(model):
    return [layer.mlp.router.router_replay.target_topk_idx for layer in model.decoder.layers]


# ---------------------------------------------------------------- M01
A = [[0, 1], [2, 3], [4, 5]]  # a0 a1 a2
B = [[6, 7], [1, 2]]  # b0 b1, then one pad


def _m01_batch(pad_to_multiple_of=1):
    rows = [torch.tensor(A).view(3, 1, 2), torch.tensor(B).view(2, 1, 2)]
    return build_train_batch([[5, 6], [8]], [[7], [9]], advantages=[1.0, 1.0], rollout_logprobs=[[-1.0], [-1.0]],
                             trained=[True, True], pad_id=0, pad_to_multiple_of=pad_to_multiple_of,
                             routed_experts=rows)


def _m01_rows(mb, **kw):
    model = _fake_model([1])
    RoutingReplay(model, replay=True, num_layers=1, topk=2, num_experts=8, **kw).before_forward(model, mb,
                                                                                               measure=False)
    return _targets(model)[0].tolist()


def test_M01_replay_rows_follow_megatrons_sequence_first_order_then_the_sp_split():
    """CASES.md M01 (miles PR 3146 / PR 465, AReaL PR 1207): B=2, S=3, top-2 of E=8; the rows set on
    the router (megatron-core `RouterReplay.set_target_indices`) are in token order s*B + b."""
    mb = _m01_batch()
    assert mb.input_ids.shape == (2, 3)
    f = pad_routes(1, 2, 8).tolist()[0]  # M03's fill of the one pad row (EP 1: [0, 1])
    assert f == [0, 1]
    got = _m01_rows(mb)
    assert got == [[0, 1], [6, 7], [2, 3], [1, 2], [4, 5], f]
    batch_first = [[0, 1], [2, 3], [4, 5], [6, 7], [1, 2], f]  # the bug: 4 of the 5 real tokens wrong
    assert sum(g != b for g, b in zip(got[:5], batch_first[:5])) == 4
    # TP2 + SP: each rank a contiguous slice of the s*B + b order
    assert _m01_rows(mb, tp_rank=0, tp_size=2, sequence_parallel=True) == [[0, 1], [6, 7], [2, 3]]  # a0 b0 a1
    assert _m01_rows(mb, tp_rank=1, tp_size=2, sequence_parallel=True) == [[1, 2], [4, 5], f]  # b1 a2 pad
    # as the trainer pads for SP (S a multiple of TP: S=4), megatron's split of S: s 0-1 and s 2-3
    sp = _m01_batch(pad_to_multiple_of=2)
    assert sp.input_ids.shape == (2, 4)
    assert _m01_rows(sp, tp_rank=0, tp_size=2, sequence_parallel=True) == [[0, 1], [6, 7], [2, 3], [1, 2]]
    assert _m01_rows(sp, tp_rank=1, tp_size=2, sequence_parallel=True) == [[4, 5]] + pad_routes(3, 2, 8).tolist()
    # packed THD (one row): each sample's positions back to back, then the alignment pads (to 8)
    packed = _m01_batch(pad_to_multiple_of=4)
    packed.packing = pack_sequences(packed)
    assert packed.packing.input_ids.shape == (1, 8)
    assert _m01_rows(packed) == A + B + pad_routes(3, 2, 8).tolist()
    assert pad_routes(3, 2, 8).tolist() == [[0, 1], [2, 3], [4, 5]]


def test_M01_per_sample_routes_replayed_in_a_batch_give_the_unreplayed_logits(megatron_world1):
    """CASES.md M01, on the tiny Qwen3-MoE (4 experts, top-2, 2 layers; one process): each sample
    alone (B=1) in RECORD mode gives its routes with no ordering ambiguity; replayed in the padded
    B=2 batch they give the unreplayed B=2 logits at every real position, and megatron-core's
    routing map holds tokens x k assignments, pads included (M03's forward check)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights
    from megatron_rl.trainer.logprobs import forward_logits
    from megatron_rl.trainer.router_replay import model_routers

    cfg = tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe")
    model = build_model(cfg, build_transformer_config(cfg, moe_enable_routing_replay=True))
    load_hf_weights(model, hf_state_dict(tiny_hf_model(cfg, seed=0), cfg))
    model.eval()
    routers = model_routers(model)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (5, 3)]
    responses = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (4, 2)]

    def batch(idx, routed=None):
        return build_train_batch([prompts[i] for i in idx], [responses[i] for i in idx], advantages=[0.0] * len(idx),
                                 rollout_logprobs=[[-1.0] * len(responses[i]) for i in idx], trained=[True] * len(idx),
                                 pad_id=0, routed_experts=routed)

    per_sample = []
    with torch.no_grad():
        for i in range(2):
            for _, inst in routers:
                inst.router_replay_action = RouterReplayAction.RECORD
            forward_logits(model, batch([i]).input_ids)
            per_sample.append(torch.stack([inst.recorded_topk_idx for _, inst in routers], dim=1))  # [T_i, L, K]
            for _, inst in routers:
                inst.clear_indices()
                inst.router_replay_action = None
        plain_batch = batch([0, 1])
        plain = forward_logits(model, plain_batch.input_ids)
    n, s = plain_batch.input_ids.shape
    assert (n, s) == (2, 9) and [r.shape[0] for r in per_sample] == [9, 5]
    # not vacuous: a batch-first flattening would hand most real tokens another token's experts
    per_row = torch.zeros(n, s, 2, 2, dtype=torch.long)  # [B, S, L, K], pads 0
    for i, r in enumerate(per_sample):
        per_row[i, : r.shape[0]] = torch.sort(r, dim=-1).values
    seq_first, batch_first = per_row.transpose(0, 1).reshape(s, n, 2, 2), per_row.reshape(s, n, 2, 2)
    real_sb = (torch.arange(s).unsqueeze(1) < plain_batch.seq_lengths.unsqueeze(0))  # [S, B]
    assert (seq_first != batch_first).flatten(2).any(-1)[real_sb].sum() >= 8

    replayed = batch([0, 1], routed=per_sample)
    maps = {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda m, a, out, l=layer.layer_number - 1: maps.__setitem__(l, out[1].detach())) for layer in model.decoder.layers]
    routing = RoutingReplay(model, replay=True, num_layers=2, topk=2)
    assert (routing.num_experts, routing.ep_size) == (4, 1)  # read from the model's config
    try:
        with torch.no_grad():
            routing.before_forward(model, replayed, measure=False)
            logits = forward_logits(model, replayed.input_ids)
    finally:
        routing.finish()
        for h in hooks:
            h.remove()
    real = torch.arange(s).unsqueeze(0) < plain_batch.seq_lengths.unsqueeze(1)  # [B, S]
    assert int(real.sum()) == 14
    assert (logits - plain)[real].abs().max() < 1e-5
    for layer in range(2):
        assert int(maps[layer].sum()) == s * n * 2  # tokens x k, the 4 pad positions included
        got = maps[layer].view(s, n, 4)
        for i in range(2):
            ids = torch.nonzero(got[: per_sample[i].shape[0], i])[:, 1].view(-1, 2)
            assert torch.equal(ids, torch.sort(per_sample[i][:, layer], dim=-1).values)


# ---------------------------------------------------------------- M03
def _rank_loads(rows, ep=4, experts=8):
    return torch.bincount(torch.as_tensor(rows).reshape(-1) // (experts // ep), minlength=ep).tolist()


@pytest.mark.parametrize("n, loads", [(1, [1, 1, 0, 0]), (2, [1, 1, 1, 1]), (4, [2, 2, 2, 2])])
def test_M03_pad_rows_are_distinct_in_range_and_spread_over_ep_ranks(n, loads):
    """CASES.md M03 (slime issue 822 / PR 2308, miles PRs 645 2697 2770, verl PR 7524, SGLang PR
    36404): E=8, EP=4 (rank r owns experts 2r, 2r+1), top-2; real rows [[3,5],[6,1]], N pad rows."""
    routes = torch.tensor([[3, 5], [6, 1]] + [[-1, -1]] * n)
    out = fill_pad_rows(routes, num_experts=8, ep_size=4)
    assert out[:2].tolist() == [[3, 5], [6, 1]]
    pads = out[2:]
    assert all(len(set(r)) == 2 and all(0 <= e < 8 for e in r) for r in pads.tolist())
    routing_map = torch.zeros(2 + n, 8, dtype=torch.bool).scatter_(1, out, True)
    assert int(routing_map.sum()) == (2 + n) * 2
    assert _rank_loads(pads) == loads
    if n == 4:
        assert int(routing_map.sum()) == 12
        assert pads.tolist() == [[0, 2], [4, 6], [1, 3], [5, 7]]  # slime PR 2308's rank-first order
        assert _rank_loads([[0, 1]] * 4) == [8, 0, 0, 0]  # the constant [0, 1] fill, the bug
    if n == 2:  # the per-row stride (p*k + c) % E, the bug: [2, 2, 0, 0]
        assert _rank_loads([[(p * 2 + c) % 8 for c in range(2)] for p in range(2)]) == [2, 2, 0, 0]
    # a flag instead of the sentinel: the same fill, whatever the pad rows held
    valid = torch.tensor([True, True] + [False] * n)
    assert torch.equal(fill_pad_rows(torch.tensor([[3, 5], [6, 1]] + [[0, 0]] * n), valid, num_experts=8,
                                     ep_size=4), out)


def test_M03_a_partially_valid_row_is_refused_naming_it_never_filled():
    """CASES.md M03: the row [4, -1] cannot be repaired by filling: refused, naming the row here,
    the sample when a batch is built, the request when the engine returns it."""
    with pytest.raises(ValueError, match=r"row 1 is partly valid .*\[4, -1\]"):
        fill_pad_rows(torch.tensor([[3, 5], [4, -1], [-1, -1]]), num_experts=8, ep_size=4)
    with pytest.raises(ValueError, match="sequence 1: routed_experts holds expert ids outside"):
        RoutedRows.from_samples([np.array([[[3, 5]]]), np.array([[[6, 1]], [[4, -1]]])], [2, 3])
    from megatron_rl.errors import RolloutServerError

    with pytest.raises(RolloutServerError, match=r"'req-7': routed_experts holds expert ids in \[-1, 6\]"):
        check_routed_experts(np.array([[[3, 5]], [[4, -1]], [[6, 1]]]), RoutedExpertsSpec(1, 2, 8), rows=3,
                             what="'req-7'")


def test_M03_the_replayed_pads_are_the_fill_in_the_forward_order():
    """CASES.md M03 through `RoutingReplay.before_forward`: E=8 at EP=4 (`num_experts`, `ep_size`),
    the micro-batch's pad positions get the rank-first fill in megatron's token order."""
    mb = _m01_batch(pad_to_multiple_of=4)  # S=4: b's position 2 and both rows' position 3 are pads
    model = _fake_model([1])
    RoutingReplay(model, replay=True, num_layers=1, topk=2, num_experts=8, ep_size=4).before_forward(
        model, mb, measure=False)
    assert _targets(model)[0].tolist() == [[0, 1], [6, 7], [2, 3], [1, 2], [4, 5], [0, 2], [4, 6], [1, 3]]


# ---------------------------------------------------------------- M04
def _gate(logits, replayed, *, pre_softmax):
    """megatron-core's `topk_routing_with_score_function` with replay on the project's wrapped
    `RouterReplay` (as `RoutingReplay.before_forward` sets it): (probs [T, E], routing map)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    model = _fake_model([1])
    rr = RoutedRows.from_samples([torch.tensor(replayed).view(-1, 1, len(replayed[0]))], [len(replayed)])
    mb = SimpleNamespace(input_ids=torch.zeros(1, len(replayed), dtype=torch.long), routed_experts=rr, packing=None)
    RoutingReplay(model, replay=True, num_layers=1, topk=2, num_experts=4).before_forward(model, mb, measure=False)
    inst = model.decoder.layers[0].mlp.router.router_replay
    return topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, score_function="softmax",
                                            router_replay=inst)


def test_M04_replayed_gate_weights_come_from_the_live_logits_at_the_replayed_ids():
    """CASES.md M04 (ISEEKYAN/Megatron-LM PRs 79 and 49, prime-rl PR 2738, AReaL PR 1207,
    NeMo-Automodel PR 2797, flashinfer PR 3024): one token, E=4, top-2, logits [2, 1, 0.5, 0],
    replayed ids [0, 2] (the router's own top-2 is {0, 1}), stand-in loss 1*w0 + 2*w2."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]], requires_grad=True)
    probs, routing_map = _gate(logits, [[0, 2]], pre_softmax=False)  # HF norm_topk_prob=True
    assert routing_map.tolist() == [[True, False, True, False]]
    torch.testing.assert_close(probs, torch.tensor([[0.817574, 0.0, 0.182426, 0.0]]), atol=1e-6, rtol=0)
    (1 * probs[0, 0] + 2 * probs[0, 2]).backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.149146, 0.0, 0.149146, 0.0]]), atol=1e-6, rtol=0)
    # the buggy sparse gather (the trainer's own top-2 first) reads [0.731059, 0.0] and sends the
    # gradient [+0.196612, -0.196612, 0, 0] into expert 1, which was not used: not what is computed
    own = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    assert own.tolist() == pytest.approx([0.731059, 0.268941], abs=1e-6)
    assert abs(float(probs[0, 0]) - 0.731059) > 0.08 and float(probs[0, 2]) > 0.18
    # HF norm_topk_prob=False (pre_softmax=True): the softmax over all experts at the replayed ids
    logits2 = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    probs, _ = _gate(logits2, [[0, 2]], pre_softmax=True)
    torch.testing.assert_close(probs, torch.tensor([[0.579259, 0.0, 0.129250, 0.0]]), atol=1e-6, rtol=0)
    # column order within a row does not matter: [2, 0] gives the same per-expert weights
    for pre in (False, True):
        a, _ = _gate(logits2, [[0, 2]], pre_softmax=pre)
        b, _ = _gate(logits2, [[2, 0]], pre_softmax=pre)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------- M05
R = torch.tensor([[10 * layer, 10 * layer + 1] for layer in range(4)]).expand(3, 4, 2)  # [T=3, 4 layers, 2]


@pytest.mark.parametrize("key, value", [("mlp_only_layers", [0]), ("decoder_sparse_step", 2),
                                        ("first_k_dense_replace", 1)])
def test_M05_dense_first_layers_are_refused_naming_the_hf_key(key, value):
    """CASES.md M05 (verl PRs 5037 and 5452, SkyRL PRs 1335 and 1910, prime-rl PR 1807): dense-first
    models stay unsupported (issue 23): the config is refused, naming the HF key."""
    from megatron_rl.models.hf_config import build_transformer_config, moe_spec

    cfg = {**tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe"), "num_hidden_layers": 4, key: value}
    with pytest.raises(ValueError, match=key):
        moe_spec(cfg)
    with pytest.raises(ValueError, match=key):
        build_transformer_config(cfg)


def test_M05_each_router_gets_its_own_layers_routes_at_pp1_and_pp2():
    """CASES.md M05 on a 4-layer model whose layers are all MoE (the only supported kind): engine
    routes R[:, l] = [10l, 10l+1]; the router of global layer l receives R[:, l] at PP1, and at PP2
    stage 0 gets layers 0-1 and stage 1 layers 2-3 (never R[:, 0:2] by list position)."""
    rr = RoutedRows.from_samples([R], [3])

    def routed_on(stage_layers, rows):
        model = _fake_model([g + 1 for g in stage_layers])  # megatron's layer_number: global, 1-based
        mb = SimpleNamespace(input_ids=torch.zeros(1, 3, dtype=torch.long), routed_experts=rows, packing=None)
        RoutingReplay(model, replay=True, num_layers=4, topk=2, num_experts=64).before_forward(model, mb,
                                                                                               measure=False)
        return [t[0].tolist() for t in _targets(model)]

    assert routed_on([0, 1, 2, 3], rr) == [[0, 1], [10, 11], [20, 21], [30, 31]]
    stage0, stage1 = rr.keep([0], [0, 1]), rr.keep([0], [2, 3])  # what `hand_out` gives each PP stage
    assert stage0.rows[0].shape == (3, 2, 2) and stage1.layers == (2, 3)
    assert routed_on([0, 1], stage0) == [[0, 1], [10, 11]]
    assert routed_on([2, 3], stage1) == [[20, 21], [30, 31]]
    with pytest.raises(ValueError, match=r"holds layers \[2, 3\], not layer 0"):  # a stage given another's layers
        routed_on([0, 1], stage1)


def test_M05_a_layer_axis_other_than_the_models_is_refused_with_both_numbers():
    """CASES.md M05: the engine's layer axis must be the model's (every layer MoE: 4); 5 or the 3 of
    a MoE-only count for another model are refused, the message stating both numbers."""
    from megatron_rl.errors import RolloutServerError

    spec = RoutedExpertsSpec(num_layers=4, topk=2, num_experts=64)
    assert check_routed_experts(R.numpy(), spec, rows=3, what="'r'").tolist() == R.tolist()
    for layers in (5, 3):
        bad = np.zeros((3, layers, 2), dtype=np.int32)
        with pytest.raises(RolloutServerError, match=rf"has shape \[3, {layers}, 2\], the model needs \[tokens, 4 "
                                                     r"layers, top-2\]"):
            check_routed_experts(bad, spec, rows=3, what="'r'")


# ---------------------------------------------------------------- M07
def _hf_router_weights(logits, norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=4, num_experts=4, num_experts_per_tok=2,
                                               norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
        _, scores, indices = router(torch.tensor([logits]))
    return indices[0].tolist(), scores[0].tolist()


@pytest.mark.parametrize("norm_topk_prob, pre_softmax, weights", [(True, False, [0.731059, 0.268941]),
                                                                  (False, True, [0.579259, 0.213097])])
def test_M07_norm_topk_prob_maps_to_the_softmax_placement(norm_topk_prob, pre_softmax, weights):
    """CASES.md M07 (Qwen3 issue 687; megatron-core `topk_routing_with_score_function`): logits
    [2, 1, 0.5, 0], k=2; HF's router and the converted megatron router give the same weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from megatron_rl.models.hf_config import build_transformer_config

    cfg = {**tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe"), "norm_topk_prob": norm_topk_prob}
    tf = build_transformer_config(cfg)
    assert tf.moe_router_pre_softmax is pre_softmax
    probs, routing_map = topk_routing_with_score_function(
        torch.tensor([[2.0, 1.0, 0.5, 0.0]]), tf.moe_router_topk, use_pre_softmax=tf.moe_router_pre_softmax,
        score_function=tf.moe_router_score_function)
    assert routing_map.tolist() == [[True, True, False, False]]
    assert probs[0, :2].tolist() == pytest.approx(weights, abs=1e-6)
    assert float(probs.sum()) == pytest.approx(sum(weights), abs=1e-6)  # 0.792356 without renormalising
    ids, hf = _hf_router_weights([2.0, 1.0, 0.5, 0.0], norm_topk_prob)
    assert ids == [0, 1] and hf == pytest.approx(weights, abs=1e-6)
    if not norm_topk_prob:  # the bug: False mapped to megatron's default gives [0.731059, 0.268941]
        wrong, _ = topk_routing_with_score_function(torch.tensor([[2.0, 1.0, 0.5, 0.0]]), 2, use_pre_softmax=False)
        assert wrong[0, :2].tolist() == pytest.approx([0.731059, 0.268941], abs=1e-6)
        assert abs(float(wrong[0, 0]) - float(probs[0, 0])) > 0.1


def test_M07_a_missing_norm_topk_prob_is_hfs_default_false():
    """CASES.md M07: a default `Qwen3MoeConfig` (transformers 5.24: norm_topk_prob False) must not
    map to megatron's default (pre_softmax False)."""
    from transformers import Qwen3MoeConfig

    from megatron_rl.models.hf_config import build_transformer_config

    assert Qwen3MoeConfig().norm_topk_prob is False
    cfg = tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe")
    del cfg["norm_topk_prob"]
    assert build_transformer_config(cfg).moe_router_pre_softmax is True


def test_M07_tiny_qwen3_moe_without_norm_topk_prob_equals_hf(megatron_world1):
    """CASES.md M07's model check for `norm_topk_prob=False` (True: `test_models_moe.py::
    test_moe_model_equals_hf_and_exports_bit_exact`): HF logits equal the converted megatron
    model's within 1e-5."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import load_hf_weights
    from megatron_rl.trainer.logprobs import forward_logits

    cfg = {**tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe"), "norm_topk_prob": False}
    hf = tiny_hf_model(cfg, seed=0)
    model = build_model(cfg, build_transformer_config(cfg))
    load_hf_weights(model, hf_state_dict(hf, cfg))
    model.eval()
    ids = torch.randint(1, 199, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = forward_logits(model, ids)[..., : cfg["vocab_size"]]
        want = hf(input_ids=ids).logits
        assert (got - want).abs().max() < 1e-5
        hf_renorm = tiny_hf_model({**cfg, "norm_topk_prob": True}, seed=0)  # not vacuous: the flag matters
        assert (hf_renorm(input_ids=ids).logits - want).abs().max() > 1e-4


# ---------------------------------------------------------------- M08
IDS = [0, 127, 128, 200, 255, 256, 300, 511]


def _npy(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _vllm_turn(prompt: int, routed: str, rid: str):
    from megatron_rl.rollout.vllm_client import result_from_vllm

    ids = [10, 11]
    body = {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length", "stop_reason": None,
                         "logprobs": {"token_logprobs": [-0.5] * 2, "tokens": [f"token_id:{t}" for t in ids]},
                         "routed_experts": routed}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2}}
    return result_from_vllm(body, rid=rid, routed_experts=SPEC512)


SPEC512 = RoutedExpertsSpec(num_layers=1, topk=2, num_experts=512)


def test_M08_compact_route_dtypes_round_trip_without_wrapping():
    """CASES.md M08 (prime-rl PRs 3051 and 2487, NeMo-RL PRs 3113 and 4240, verl PR 7880): ids
    {0, 127, 128, 200, 255, 256, 300, 511} of a 512-expert model from the engine's payload through
    a two-turn stitch (turn 1 only ids <= 255, in a narrower payload; turn 2 with 300) to the
    trainer's gather: lossless, one dtype a run (from the expert count), int64 at the trainer."""
    from megatron_rl.engine.moe import encode_routed_experts, encode_routed_experts_npy
    from megatron_rl.rollout.multiturn import Episode
    from megatron_rl.trainer.producer import sample_routing

    # the dtype is the model's, chosen once: never uint8 (300 -> 44, 511 -> 255) or int8 (200 -> -56,
    # 255 -> -1, the missing-route sentinel)
    assert SPEC512.dtype() == np.int16 and RoutedExpertsSpec(1, 2, 256).dtype() == np.int16
    pairs = np.array(IDS, dtype=np.int64).reshape(4, 1, 2)
    # engine payloads: SGLang int32 bytes, vLLM .npy (uint16 for 512 experts)
    sglang = {"output_ids": [1, 2], "meta_info": {
        "id": "s", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 1, None], [-0.5, 2, None]], "weight_version": "1", "routed_experts": encode_routed_experts(pairs)}}
    got = GenerateResult.from_sglang(sglang, routed_experts=SPEC512).routed_experts
    assert got.dtype == np.int16 and got.reshape(-1).tolist() == IDS
    payload = encode_routed_experts_npy(pairs, 512)
    assert np.load(io.BytesIO(base64.b64decode(payload))).dtype == np.uint16
    with pytest.raises(ValueError, match=r"\[0, 511\] outside the model's \[0, 256\)"):  # never 300 -> 44
        encode_routed_experts_npy(pairs, 256)

    # two turns: turn 1 (prompt 3, 2 tokens: 4 rows, ids <= 255) came as uint8 from an engine that
    # narrows per request; turn 2 (prompt 3 + 2 + 1 tool token, 2 tokens: 7 rows) as uint16 with 300
    turn1 = np.array([0, 127, 128, 200, 255, 0, 127, 128], dtype=np.uint8).reshape(4, 1, 2)
    turn2 = np.concatenate([turn1.astype(np.uint16),
                            np.array([256, 300, 511, 300, 300, 0], dtype=np.uint16).reshape(3, 1, 2)])
    ep = Episode([1, 2, 3], max_tokens=16)
    ep.add_model_turn(_vllm_turn(3, _npy(turn1), "t1"))
    assert ep.add_env_tokens([99])
    ep.add_model_turn(_vllm_turn(6, _npy(turn2), "t2"))
    stitched = ep.result().routed_experts
    assert stitched.dtype == np.int16 and stitched.tolist() == turn2.astype(np.int64).tolist()
    assert stitched[4:].reshape(-1).tolist() == [256, 300, 511, 300, 300, 0]

    # to the trainer: the batch keeps int16, the replay gets int64; a uint16 row (torch has no CPU
    # max for uint16) is range-checked after the upcast
    sample = SimpleNamespace(routed_experts=stitched, prompt_ids=[1, 2, 3], response_ids=[10, 11, 99, 10, 11],
                             group_uid="g", prompt_key="p")
    rows = sample_routing([sample])
    batch = build_train_batch([[1, 2, 3]], [[10, 11, 99, 10, 11]], advantages=[0.0], rollout_logprobs=[[-1.0] * 5],
                              trained=[True], pad_id=0, routed_experts=rows)
    routed, valid = batch.routed_experts.padded(8)
    assert routed.dtype == torch.int64 and routed[0, :7].tolist() == turn2.astype(np.int64).tolist()
    with pytest.raises(NotImplementedError):
        torch.tensor(IDS, dtype=torch.uint16).max()  # why the check upcasts first
    from_uint16 = RoutedRows.from_samples([np.array(IDS, dtype=np.uint16).reshape(4, 1, 2)], [5])
    assert from_uint16.rows[0].dtype == torch.int16 and from_uint16.padded(5)[0][0, :4].reshape(-1).tolist() == IDS
    # the sentinel stays distinct from expert 255 and is refused, never taken for an id
    from megatron_rl.errors import RolloutServerError

    with pytest.raises(RolloutServerError, match=r"expert ids in \[-1, 511\]"):
        check_routed_experts(np.array([-1, 255, 511, 0], dtype=np.int32).reshape(2, 1, 2), SPEC512, rows=2,
                             what="'r'")
