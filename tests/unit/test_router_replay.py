"""Rollout routing replay (issue 29, ALGORITHMS.md 9) on megatron-core's RouterReplay, one process.

- replaying the router's own choices gives the same log-probs and a mismatch of 0;
- after the router weights move, the experts the trainer dispatches to are exactly the engine's
  for every token and layer, the mismatch metric equals the hand count, and the router still
  receives gradients; under full activation recompute (REPLAY_BACKWARD inside autograd's backward)
  the gradients equal those without recompute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model  # noqa: E402

from megatron_rl.models.hf_config import build_transformer_config  # noqa: E402
from megatron_rl.models.hf_weights import load_hf_weights  # noqa: E402
from megatron_rl.trainer.batch import build_train_batch  # noqa: E402
from megatron_rl.trainer.router_replay import RoutingReplay, model_routers  # noqa: E402

CFG = tiny_hf_config(tie_word_embeddings=False, model_type="qwen3_moe")
SD = hf_state_dict(tiny_hf_model(CFG, seed=0), CFG)
K, LAYERS = CFG["num_experts_per_tok"], CFG["num_hidden_layers"]


def _model(recompute=None):
    from megatron_rl.models.builder import build_model

    tf = build_transformer_config(CFG, moe_enable_routing_replay=True, recompute=recompute)
    model = build_model(CFG, tf)
    load_hf_weights(model, SD)
    return model


def _batch(routed=None):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (4, 2, 5)]
    responses = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (3, 6, 2)]
    return build_train_batch(prompts, responses, advantages=[1.0, -1.0, 0.5],
                             rollout_logprobs=[[-1.0] * len(r) for r in responses], trained=[True] * 3, pad_id=0,
                             routed_experts=routed)


def _capture(model):
    """Per layer, the [S*B, E] routing map megatron-core dispatches with, from each router's output."""
    maps, hooks = {}, []
    for layer in model.decoder.layers:
        def hook(module, args, out, layer=layer.layer_number - 1):
            maps[layer] = out[1].detach().clone()
        hooks.append(layer.mlp.router.register_forward_hook(hook))
    return maps, hooks


def _forward(model, mb, routing=None, measure=False):
    from megatron_rl.trainer.logprobs import forward_logits

    if routing is not None:
        routing.before_forward(model, mb, measure=measure)
    try:
        return forward_logits(model, mb.input_ids)
    finally:
        if routing is not None:
            routing.finish()


def _engine_routing_from(maps, batch) -> list[torch.Tensor]:
    """Routing maps [S*B, E] (megatron order) -> per row [T_i, L, K] expert ids, as an engine reports."""
    n, s = batch.input_ids.shape
    rows = []
    for i in range(n):
        length = int(batch.seq_lengths[i]) - 1  # the last token is never fed back by an engine
        per_layer = []
        for layer in range(LAYERS):
            m = maps[layer].view(s, n, -1)[:length, i]  # [T, E] bool
            per_layer.append(torch.nonzero(m)[:, 1].view(length, K))
        rows.append(torch.stack(per_layer, dim=1))
    return rows


def test_replay_follows_the_engine_and_keeps_router_gradients(megatron_world1):
    model = _model()
    assert len(model_routers(model)) == LAYERS
    batch = _batch()
    maps, hooks = _capture(model)
    with torch.no_grad():
        plain = _forward(model, batch)
    own = _engine_routing_from(maps, batch)
    replayed_batch = _batch(routed=own)
    routed, valid = replayed_batch.routed_experts.padded(8)
    assert routed.shape == (3, 8, LAYERS, K)
    assert int(valid.sum()) == sum(int(n) - 1 for n in replayed_batch.seq_lengths)
    assert [r.dtype for r in replayed_batch.routed_experts.rows] == [torch.int16] * 3

    # replaying the router's own choice: same logits, no mismatch
    routing = RoutingReplay(model, replay=True, num_layers=LAYERS)
    with torch.no_grad():
        same = _forward(model, replayed_batch, routing, measure=True)
    # (valid: the filler positions, last token and padding, route elsewhere)
    assert (same - plain)[valid].abs().max() < 1e-6
    assert routing.mismatch_metrics() == {"train/router_mismatch": 0.0, "train/router_mismatch/layer_0": 0.0,
                                          "train/router_mismatch/layer_1": 0.0}

    # the router moves: without replay it picks other experts; with replay the engine's are used
    with torch.no_grad():
        for layer in model.decoder.layers:
            w = layer.mlp.router.weight
            w.copy_(torch.roll(w, 1, dims=0) * 3.0)
    with torch.no_grad():
        _forward(model, batch)
    moved = _engine_routing_from(maps, batch)
    want_mismatch = {}
    for layer in range(LAYERS):
        diff = [(torch.sort(a[:, layer]).values != torch.sort(b[:, layer]).values).any(dim=1)
                for a, b in zip(own, moved)]
        want_mismatch[layer] = float(torch.cat(diff).float().mean())
    assert min(want_mismatch.values()) > 0  # the test is not vacuous: the routers really moved

    logits = _forward(model, replayed_batch, routing, measure=True)
    dispatched = _engine_routing_from(maps, batch)
    for a, b in zip(dispatched, own):
        assert torch.equal(torch.sort(a, dim=2).values, torch.sort(b, dim=2).values)
    assert (logits - plain)[valid].abs().max() > 1e-3  # the moved router changed the gate weights
    got = routing.mismatch_metrics()
    total = sum(want_mismatch.values()) / LAYERS  # same valid count per layer
    assert got["train/router_mismatch"] == pytest.approx(total)
    for layer in range(LAYERS):
        assert got[f"train/router_mismatch/layer_{layer}"] == pytest.approx(want_mismatch[layer])
    # gradients reach the router through the probabilities gathered at the replayed ids
    loss = logits[valid].float().pow(2).mean()
    loss.backward()
    for layer in model.decoder.layers:
        assert layer.mlp.router.weight.grad is not None and layer.mlp.router.weight.grad.abs().sum() > 0
    for h in hooks:
        h.remove()


def test_replay_under_full_recompute_uses_the_same_experts_in_backward(megatron_world1):
    """Full activation recompute reruns each layer's forward inside autograd's backward: it must
    replay the same ids (REPLAY_BACKWARD), so the gradients equal those without recompute."""
    batch = _batch()
    rng = torch.Generator().manual_seed(5)
    lengths = [int(n) - 1 for n in batch.seq_lengths]
    routed = [torch.stack([torch.randperm(CFG["num_experts"], generator=rng)[:K] for _ in range(n * LAYERS)])
              .view(n, LAYERS, K) for n in lengths]
    batch = _batch(routed=routed)
    grads = []
    for recompute in (None, "full"):
        model = _model(recompute=recompute)
        model.train()
        routing = RoutingReplay(model, replay=True, num_layers=LAYERS)
        maps, hooks = _capture(model)
        routing.before_forward(model, batch, measure=False)
        from megatron_rl.trainer.logprobs import forward_logits

        logits = forward_logits(model, batch.input_ids)
        logits[batch.loss_mask].float().pow(2).mean().backward()
        assert all(not inst.replay_backward_list for _, inst in model_routers(model)) == (recompute == "full")
        routing.finish()
        for h in hooks:
            h.remove()
        for a, b in zip(_engine_routing_from(maps, batch), routed):
            assert torch.equal(torch.sort(a, dim=2).values, torch.sort(b, dim=2).values)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


def test_replay_without_routing_data_is_a_clear_error(megatron_world1):
    model = _model()
    routing = RoutingReplay(model, replay=True, num_layers=LAYERS)
    with pytest.raises(ValueError, match="routed_experts"):
        routing.before_forward(model, _batch(), measure=False)


def test_replay_refuses_routing_with_another_top_k(megatron_world1):
    model = _model()
    batch = _batch()
    n = [int(x) - 1 for x in batch.seq_lengths]
    routing = RoutingReplay(model, replay=True, num_layers=LAYERS, topk=K)
    # the engine served a model routing each token to K + 1 experts
    wider = _batch(routed=[torch.arange(K + 1).expand(t, LAYERS, K + 1) for t in n])
    assert wider.routed_experts.rows[0].dtype == torch.int16
    with pytest.raises(ValueError, match=f"top-{K + 1} per position, the model routes each token to {K} experts"):
        routing.before_forward(model, wider, measure=False)
    # and another layer count: fewer (a layer missing) or more than the model has
    fewer = _batch(routed=[torch.arange(K).expand(t, LAYERS - 1, K) for t in n])
    with pytest.raises(ValueError, match=f"routed_experts holds layers \\[0\\], not layer {LAYERS - 1}"):
        routing.before_forward(model, fewer, measure=False)
    more = _batch(routed=[torch.arange(K).expand(t, LAYERS + 1, K) for t in n])
    with pytest.raises(ValueError, match=f"expected layers of a {LAYERS}-layer model"):
        routing.before_forward(model, more, measure=False)
    with pytest.raises(ValueError, match="sequence 0: routed_experts holds expert ids outside"):
        _batch(routed=[torch.full((t, LAYERS, K), 40000) for t in n])
