"""One gloo rank of a distributed test (started by ``tiny_qwen2.run_ranks``); asserts inside the rank.

Scenario ``train``: TP = WORLD_SIZE (1 or 2). Load a random tiny Qwen2 into GPTModel with the
CPU compatibility layer, check the HF export round trip, logits / log-probs / entropy against
HF, then one forward / backward / optimizer step. Scenario ``layouts``: TP x PP x DP training of a
fixed batch (see ``scenario_layouts``). Scenario ``pp_logits``: PP = WORLD_SIZE logits, export and
streamed-checkpoint loading per architecture (see ``scenario_pp_logits``). Scenario ``convert_moe``:
EP = WORLD_SIZE loading and writing the streaming converter's qwen3_moe checkpoints (see
``scenario_convert_moe``). Prints ``RESULT {json}`` on success.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")


def scenario_train() -> dict:
    import torch

    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.cpu_compat import cpu_compat_enabled
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.logprobs import forward_logits, token_logprobs_and_entropy
    from tiny_qwen2 import hf_state_dict, ragged_batch, tiny_hf_config, tiny_hf_model

    started = time.monotonic()
    world_size = int(os.environ["WORLD_SIZE"])
    tie = os.environ.get("TIE", "0") == "1"
    model_type = os.environ.get("ARCH", "qwen2")
    kv_heads = int(os.environ.get("KV_HEADS", "2"))
    groups = initialize_parallel(tensor_model_parallel_size=world_size, backend="gloo", timeout_s=60, seed=1234)
    assert cpu_compat_enabled()
    assert (groups.world_size, groups.tp_size, groups.pp_size, groups.dp_size, groups.cp_size) == (
        world_size, world_size, 1, 1, 1,
    ), groups
    assert groups.tp_rank == groups.rank and groups.pp_rank == 0 and groups.dp_rank == 0
    import torch.distributed as dist

    assert dist.get_world_size(groups.tp) == world_size and dist.get_world_size(groups.dp) == 1

    hf_config = tiny_hf_config(tie_word_embeddings=tie, model_type=model_type, num_key_value_heads=kv_heads)
    hf_model = tiny_hf_model(hf_config, seed=0)  # same seed on every rank: same weights
    hf_sd = hf_state_dict(hf_model, hf_config)

    tf_config = build_transformer_config(hf_config, tensor_model_parallel_size=world_size)
    model = build_model(hf_config, tf_config)
    load_hf_weights(model, hf_sd, tp_rank=groups.tp_rank, tp_size=groups.tp_size)
    assert model.embedding.word_embeddings.weight.shape == (256 // world_size, 64)
    if os.environ.get("CKPT"):  # the layout-independent checkpoint streamed by import_from_hf loads at this TP
        from megatron.core import dist_checkpointing

        from megatron_rl.checkpoint.save import _model_sharded_state_dict

        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        loaded = dist_checkpointing.load(_model_sharded_state_dict([model]), os.environ["CKPT"])
        model.load_state_dict(loaded["model"], strict=True)
        for n, p in model.named_parameters():
            assert torch.equal(p, params[n]), n

    # Export round trip: gathered over TP, bit-identical, HF order.
    exported = list(iter_hf_weights(model, hf_config, tp_group=groups.tp))
    assert [name for name, _ in exported] == list(hf_sd), [name for name, _ in exported]
    for name, tensor in exported:
        assert torch.equal(tensor, hf_sd[name]), name

    input_ids, mask = ragged_batch(seed=1)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=input_ids, attention_mask=mask.long()).logits  # [B, S, V]
        logits = forward_logits(model, input_ids, attention_mask=mask)  # [B, S, Vp/tp]
        vocab_lo = groups.tp_rank * logits.shape[-1]
        local_ref = hf_logits[..., vocab_lo : min(vocab_lo + logits.shape[-1], hf_config["vocab_size"])]
        got = logits[..., : local_ref.shape[-1]]
        logit_err = float((got - local_ref)[mask].abs().max())
        assert logit_err < 1e-4, logit_err
        logprobs, entropy = token_logprobs_and_entropy(
            logits, labels, vocab_size=hf_config["vocab_size"], tp_group=groups.tp
        )
        ref_logp_all = torch.log_softmax(hf_logits.double(), dim=-1)
        ref_logprobs = ref_logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ref_entropy = -(ref_logp_all.exp() * ref_logp_all).sum(-1)
        logp_err = float((logprobs.double() - ref_logprobs)[mask].abs().max())
        ent_err = float((entropy.double() - ref_entropy)[mask].abs().max())
        assert logp_err < 1e-4 and ent_err < 1e-4, (logp_err, ent_err)

    # One training step through megatron DDP + optimizer.
    trainer = wrap_ddp_and_optimizer(model, tf_config, lr=1e-2, weight_decay=0.0, clip_grad=1.0)
    assert tf_config.finalize_model_grads_func is not None and tf_config.no_sync_func is not None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.optimizer.zero_grad()
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    logits = forward_logits(trainer.model[0], input_ids)
    logprobs, entropy = token_logprobs_and_entropy(
        logits, labels, vocab_size=hf_config["vocab_size"], tp_group=groups.tp
    )
    loss = -(logprobs * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    assert torch.isfinite(loss), loss
    loss.backward()
    tf_config.finalize_model_grads_func(trainer.model)
    ok, grad_norm, _ = trainer.optimizer.step()
    trainer.scheduler.step(increment=1)
    assert ok and grad_norm is not None and grad_norm > 0 and grad_norm == grad_norm, grad_norm
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))
    loss_value = float(loss)
    destroy_parallel()
    return {
        "rank": groups.rank,
        "loss": loss_value,
        "grad_norm": float(grad_norm),
        "logit_err": logit_err,
        "logp_err": logp_err,
        "entropy_err": ent_err,
        "seconds": time.monotonic() - started,
    }


def scenario_layouts() -> dict:
    """TP = $TP, PP = $PP, DP = the rest: log-probs, one mini-batch's gradients and two PPO updates
    of a fixed batch (micro-batches of 2 rows, or under the token budget $BUDGET); tensors go to
    $OUT_DIR/rank{r}.pt in HF names (first TP and DP rank of each stage), scalars to the RESULT
    line. The test compares every layout with one process."""
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import ActorConfig
    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.batch import build_train_batch
    from megatron_rl.trainer.policy import PolicyTrainer
    from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model

    tp, pp = int(os.environ["TP"]), int(os.environ["PP"])
    ep = int(os.environ.get("EP", "1"))  # expert parallelism (ARCH=qwen3_moe)
    arch = os.environ.get("ARCH", "qwen2")
    tie = os.environ.get("TIE", "0") == "1"
    g = initialize_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, backend="gloo", timeout_s=120, seed=1234)
    world = int(os.environ["WORLD_SIZE"])
    # a silent fall-back to one process must not pass: check the groups this rank really is in
    assert (g.world_size, g.tp_size, g.pp_size, g.dp_size) == (world, tp, pp, world // (tp * pp)), g
    assert dist.get_world_size(g.tp) == tp and dist.get_world_size(g.pp) == pp
    assert dist.get_world_size(g.dp_cp) == world // (tp * pp)
    assert g.ep_size == ep and dist.get_world_size(g.ep) == ep, g
    hf_config = tiny_hf_config(tie_word_embeddings=tie, model_type=arch)
    sd = hf_state_dict(tiny_hf_model(hf_config, seed=0), hf_config)
    sp = os.environ.get("SP", "0") == "1"
    replay = os.environ.get("REPLAY", "0") == "1"
    tf_config = build_transformer_config(hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         sequence_parallel=sp, expert_model_parallel_size=ep,
                                         moe_enable_routing_replay=arch == "qwen3_moe")
    model = build_model(hf_config, tf_config, pre_process=g.is_pipeline_first_stage,
                        post_process=g.is_pipeline_last_stage)
    load_hf_weights(model, sd, tp_rank=g.tp_rank, tp_size=tp)
    # local shard shapes: vocab rows and the column-parallel QKV / fc1 split over TP, layers over PP
    layers = model.decoder.layers
    assert len(layers) == hf_config["num_hidden_layers"] // pp
    qkv_rows = (hf_config["num_attention_heads"] + 2 * hf_config["num_key_value_heads"]) * 16  # head_dim 16
    assert layers[0].self_attention.linear_qkv.weight.shape == (qkv_rows // tp, 64)
    if arch == "qwen3_moe":  # this EP rank's experts, each split over the expert TP (= TP) ranks
        experts = layers[0].mlp.experts.local_experts
        assert len(experts) == hf_config["num_experts"] // ep
        assert experts[0].linear_fc1.weight.shape == (2 * hf_config["moe_intermediate_size"] // tp, 64)
    else:
        assert layers[0].mlp.linear_fc1.weight.shape == (2 * hf_config["intermediate_size"] // tp, 64)
    if g.is_pipeline_first_stage:
        assert model.embedding.word_embeddings.weight.shape == (256 // tp, 64)
    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                                use_distributed_optimizer=os.environ.get("DISTOPT", "0") == "1")
    loss = ActorConfig(
        loss_agg_mode=os.environ.get("AGG", "token-mean"),
        loss_scale_factor=10.0 if os.environ.get("AGG") == "seq-mean-token-sum-norm" else None,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, kl_loss_type="k3",
    )
    routing = None
    if arch == "qwen3_moe":
        from megatron_rl.trainer.router_replay import RoutingReplay

        routing = RoutingReplay(tm.model, replay=replay, tp_rank=g.tp_rank, tp_size=tp, sequence_parallel=sp,
                                num_layers=hf_config["num_hidden_layers"], tp_group=g.tp if tp > 1 else None)
    trainer = PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=hf_config["vocab_size"],
                            micro_batch_size=2, actor=loss, tp_group=g.tp if tp > 1 else None, routing=routing,
                            dp_group=g.dp_cp if g.dp_size > 1 else None, pp_group=g.pp if pp > 1 else None,
                            max_tokens_per_micro_batch=int(os.environ["BUDGET"]) if os.environ.get("BUDGET") else None,
                            equal_micro_batches=arch == "qwen3_moe" and ep > 1 and os.environ.get("EQUAL", "1") == "1")
    gen = torch.Generator().manual_seed(7)
    lengths = [(3, 5), (2, 2), (4, 7), (1, 3), (5, 4), (2, 6), (3, 1), (4, 4)]
    prompts = [torch.randint(1, 199, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(1, 199, (r,), generator=gen).tolist() for _, r in lengths]
    # rows 2-3 untrained: with DP=2, rank 1's share of the first mini-batch has no loss token, and
    # the shares of the second have 16 vs 8 tokens (case B05: the normaliser must be global)
    routed = None
    if arch == "qwen3_moe":  # engine routing: random distinct top-2 ids for every routed position
        e, k = hf_config["num_experts"], hf_config["num_experts_per_tok"]
        routed = [torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range((p + r - 1) * 2)]).view(-1, 2, k)
                  for p, r in lengths]
    batch = build_train_batch(prompts, responses, advantages=[1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75],
                              rollout_logprobs=[[-1.0] * len(r) for r in responses],
                              trained=[True, True, False, False, True, True, True, True], pad_id=0,
                              pad_to_multiple_of=tp if sp else 1, routed_experts=routed)
    old = trainer.compute_logprobs(batch, mini_batch_sequences=4)
    # off-policy by a fixed offset so the clip is exercised
    # (a function of (row, position) only: the same offsets whatever padding SP adds to the width; the
    # +0.02 keeps ppo_kl away from 0, where a relative tolerance would be meaningless)
    rows_pos = 1000 * torch.arange(old.shape[0]).unsqueeze(1) + torch.arange(old.shape[1]).unsqueeze(0)
    batch.old_logprobs = old + 0.05 * torch.sign(torch.sin(rows_pos.to(torch.float32))) + 0.02
    trainer.accumulate_gradients(batch.slice(0, 4))
    chunk = tm.model[0].module
    saved = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    with torch.no_grad():
        for n, p in chunk.named_parameters():
            p.copy_(p.main_grad)
        grads = {name: t.clone() for name, t in iter_hf_weights(chunk, hf_config, tp_group=g.tp if tp > 1 else None,
                                                                 ep_group=g.ep if ep > 1 else None)}
        for n, p in chunk.named_parameters():
            p.copy_(saved[n])
    if os.environ.get("DISTOPT", "0") == "1":
        grads = {}  # the distributed optimizer reduce-scatters: main_grad holds only this rank's reduced shard
    def hf_params() -> dict:
        with torch.no_grad():
            return {name: t.clone() for name, t in iter_hf_weights(chunk, hf_config, tp_group=g.tp if tp > 1 else None,
                                                                 ep_group=g.ep if ep > 1 else None)}

    # one optimizer step per mini-batch: weights after the first step and after the second
    history = trainer.update(batch.slice(0, 4), mini_batch_sequences=4)
    params1 = hf_params()
    history += trainer.update(batch.slice(4, 8), mini_batch_sequences=4)
    params = hf_params()
    if g.tp_rank == 0 and g.dp_rank == 0:
        torch.save({"grads": grads, "params1": params1, "params": params, "logprobs": old,
                    "loss_mask": batch.loss_mask},
                   Path(os.environ["OUT_DIR"]) / f"rank{g.rank}.pt")
    dist.barrier()
    destroy_parallel()
    return {"rank": g.rank, "tp": g.tp_size, "pp": g.pp_size, "dp": g.dp_size, "history": history,
            "routing_metrics": trainer.routing_metrics}


def scenario_pp_logits() -> dict:
    """PP = WORLD_SIZE (2), TP = 1, for each case of $CASES ([[arch, tie, kv_heads, ckpt_dir], ...]):
    load a random tiny HF model into this stage, compare the last stage's logits (megatron-core's
    forward-only pipeline schedule) with HF's, check this stage's HF export, and load the streamed
    dist checkpoint `ckpt_dir` (written by `import_from_hf` at TP=1, PP=1) into the stage: every
    parameter must equal the HF-loaded one."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.checkpoint.save import _model_sharded_state_dict
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.logprobs import forward_logits
    from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model

    pp = int(os.environ["WORLD_SIZE"])
    g = initialize_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, backend="gloo",
                            timeout_s=120, seed=1234)
    assert (g.pp_size, g.tp_size, g.dp_size) == (pp, 1, 1) and dist.get_world_size(g.pp) == pp, g
    out = {"rank": g.rank, "cases": []}
    for arch, tie, kv_heads, ckpt_dir in json.loads(os.environ["CASES"]):
        hf_config = tiny_hf_config(tie_word_embeddings=tie, model_type=arch, num_key_value_heads=kv_heads)
        hf_model = tiny_hf_model(hf_config, seed=0)
        hf_sd = hf_state_dict(hf_model, hf_config)
        tf_config = build_transformer_config(hf_config, pipeline_model_parallel_size=pp)
        model = build_model(hf_config, tf_config, pre_process=g.is_pipeline_first_stage,
                            post_process=g.is_pipeline_last_stage)
        assert len(model.decoder.layers) == hf_config["num_hidden_layers"] // pp
        load_hf_weights(model, hf_sd)
        exported = dict(iter_hf_weights(model, hf_config))
        for name, tensor in exported.items():
            assert torch.equal(tensor, hf_sd[name]), (arch, name)

        input_ids = torch.randint(1, hf_config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))

        def forward_step(data_iterator, m):
            logits = forward_logits(m, next(data_iterator))

            def loss_func(output):
                return torch.zeros(()), torch.tensor(0, dtype=torch.int), {"logits": output}

            return logits, loss_func

        model.eval()
        with torch.no_grad():
            collected = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([input_ids]), model=[model], num_microbatches=1,
                seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0], forward_only=True)
            logit_err = None
            if g.is_pipeline_last_stage:
                logits = collected[0]["logits"][..., : hf_config["vocab_size"]]  # [B, S, V] (padding cut)
                logit_err = float((logits - hf_model(input_ids=input_ids).logits).abs().max())
                assert logit_err < 1e-4, (arch, tie, kv_heads, logit_err)

        # the streamed (layout-independent) checkpoint loads into this pipeline stage
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        loaded = dist_checkpointing.load(_model_sharded_state_dict([model]), ckpt_dir)
        model.load_state_dict(loaded["model"], strict=True)
        for n, p in model.named_parameters():
            assert torch.equal(p, params[n]), (arch, n)
        out["cases"].append({"arch": arch, "tie": tie, "kv_heads": kv_heads, "logit_err": logit_err,
                             "exported": sorted(exported), "hf_names": sorted(hf_sd)})
    destroy_parallel()
    return out


def scenario_b24() -> dict:
    """Case B24 at TP=2: shards are gathered by their stable names even when a parameter lost
    megatron's TP attributes; contradicting metadata, a shard shaped like the full tensor and an
    unmapped parameter each raise before the first tensor is yielded (nothing partial is sent)."""
    import torch

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from tiny_qwen2 import hf_state_dict, tiny_hf_config, tiny_hf_model

    g = initialize_parallel(tensor_model_parallel_size=2, backend="gloo", timeout_s=120, seed=1234)
    assert g.tp_size == 2
    hf_config = tiny_hf_config(tie_word_embeddings=False)
    sd = hf_state_dict(tiny_hf_model(hf_config, seed=0), hf_config)
    model = build_model(hf_config, build_transformer_config(hf_config, tensor_model_parallel_size=2))
    load_hf_weights(model, sd, tp_rank=g.tp_rank, tp_size=2)
    attn, mlp = model.decoder.layers[0].self_attention, model.decoder.layers[0].mlp
    # column-parallel [512-like full rows] and row-parallel weights are local halves
    assert attn.linear_qkv.weight.shape[0] * 2 == sum(sd[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0]
                                                      for x in "qkv")
    assert attn.linear_proj.weight.shape[1] * 2 == sd["model.layers.0.self_attn.o_proj.weight"].shape[1]
    # 1. the metadata removed from one column- and one row-parallel weight: gathered bit-exactly
    for p in (attn.linear_qkv.weight, attn.linear_proj.weight):
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                delattr(p, attr)
    got = dict(iter_hf_weights(model, hf_config, tp_group=g.tp))
    assert got.keys() == sd.keys(), sorted(set(sd) ^ set(got))
    mismatched = [k for k in sd if not torch.equal(got[k], sd[k])]
    assert not mismatched, mismatched
    errors = {}

    def first_yield_error(label):
        it = iter_hf_weights(model, hf_config, tp_group=g.tp)
        try:
            next(it)
        except ValueError as e:
            errors[label] = str(e)
            return
        raise AssertionError(f"{label}: a tensor was yielded")

    # 2. metadata contradicting the name (fc1 marked row-parallel)
    mlp.linear_fc1.weight.partition_dim = 1
    first_yield_error("contradiction")
    mlp.linear_fc1.weight.partition_dim = 0
    # 3. a local shard shaped like the full tensor (the slime#2280 symptom, reversed)
    real = attn.linear_qkv.weight
    attn.linear_qkv.weight = torch.nn.Parameter(torch.zeros(real.shape[0] * 2, real.shape[1]))
    first_yield_error("full-size shard")
    attn.linear_qkv.weight = real
    # 4. a parameter with no HF mapping (e.g. an expert weight of an unsupported layer)
    mlp.register_parameter("extra_expert", torch.nn.Parameter(torch.zeros(4, 4)))
    first_yield_error("unmapped")
    destroy_parallel()
    return {"rank": g.rank, "errors": errors}


def scenario_convert_moe() -> dict:
    """EP = WORLD_SIZE (2; TP = PP = 1, DP = 2) on the tiny qwen3_moe of $HF_DIR: the streamed dist
    checkpoint $CKPT (written by `import_from_hf` in one process) loads into this EP rank's model, every
    parameter equal to `load_hf_weights` of the same HF tensors; the model's sharded state dict
    (`checkpoint.save._model_sharded_state_dict`) is saved to $SAVE_DIR at EP2; after one PPO update
    a full run checkpoint (`save_checkpoint`: model, optimizer, run state) goes to $RUN_DIR step 1 and
    rank 0 writes the trained weights, gathered over EP into HF names, to $OUT_DIR/trained.pt."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.save import _in_process_results_queue, _model_sharded_state_dict, save_checkpoint
    from megatron_rl.config.schema import ActorConfig
    from megatron_rl.models.builder import build_model, wrap_ddp_and_optimizer
    from megatron_rl.models.hf_config import build_transformer_config
    from megatron_rl.models.hf_weights import iter_hf_weights, load_hf_weights
    from megatron_rl.parallel.groups import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.batch import build_train_batch
    from megatron_rl.trainer.policy import PolicyTrainer

    ep = int(os.environ["WORLD_SIZE"])
    g = initialize_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep, backend="gloo",
                            timeout_s=120, seed=1234)
    assert g.ep_size == ep and dist.get_world_size(g.ep) == ep and g.dp_size == ep, g
    hf_dir = os.environ["HF_DIR"]
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    tf_config = build_transformer_config(hf_config, expert_model_parallel_size=ep)
    model = build_model(hf_config, tf_config)
    experts = model.decoder.layers[0].mlp.experts.local_experts
    assert len(experts) == hf_config["num_experts"] // ep
    load_hf_weights(model, hf_dir)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = dist_checkpointing.load(_model_sharded_state_dict([model]), os.environ["CKPT"])
    model.load_state_dict(loaded["model"], strict=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    # not vacuous: this rank's experts differ from the other rank's (they are experts ep_rank * 2 + e)
    first = experts[0].linear_fc2.weight.detach().contiguous()
    others = [torch.empty_like(first) for _ in range(ep)]
    dist.all_gather(others, first, group=g.ep)
    assert not torch.equal(others[0], others[1])

    _in_process_results_queue()
    dist_checkpointing.save(_model_sharded_state_dict([model]), os.environ["SAVE_DIR"])

    tm = wrap_ddp_and_optimizer(model, tf_config, lr=1e-2, weight_decay=0.0, clip_grad=1.0)
    actor = ActorConfig(loss_agg_mode="token-mean", loss_scale_factor=None, clip_ratio_low=0.2,
                        clip_ratio_high=0.28, clip_ratio_c=3.0, kl_loss_type="k3")
    trainer = PolicyTrainer(tm.model, tm.optimizer, tm.scheduler, vocab_size=hf_config["vocab_size"],
                            micro_batch_size=2, actor=actor, dp_group=g.dp_cp)
    gen = torch.Generator().manual_seed(7 + g.rank)  # each DP rank its own rows
    prompts = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (3, 2, 4, 1)]
    responses = [torch.randint(1, 199, (n,), generator=gen).tolist() for n in (5, 2, 7, 3)]
    batch = build_train_batch(prompts, responses, advantages=[1.0, -0.5, 0.25, -1.0],
                              rollout_logprobs=[[-1.0] * len(r) for r in responses], trained=[True] * 4, pad_id=0)
    batch.old_logprobs = trainer.compute_logprobs(batch)
    trainer.update(batch, mini_batch_sequences=4)
    chunk = tm.model[0].module
    changed = [n for n, p in chunk.named_parameters() if not torch.equal(p.detach(), params[n])]
    assert any(".local_experts." in n for n in changed), changed
    save_checkpoint(os.environ["RUN_DIR"], 1, model=tm.model, optimizer=tm.optimizer, scheduler=tm.scheduler,
                    run_state={}, config_yaml="a: 1\n", keep_last_n=1, is_writer=g.rank == 0)
    trained = {name: t.clone() for name, t in iter_hf_weights(chunk, hf_config, ep_group=g.ep)}
    if g.rank == 0:
        torch.save(trained, Path(os.environ["OUT_DIR"]) / "trained.pt")
    dist.barrier()
    destroy_parallel()
    return {"rank": g.rank, "ep_rank": g.ep_rank, "params": len(params), "changed": len(changed)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK')}] %(name)s: %(message)s")
    scenario = sys.argv[1]
    result = {"train": scenario_train, "layouts": scenario_layouts, "pp_logits": scenario_pp_logits,
              "b24": scenario_b24, "convert_moe": scenario_convert_moe}[scenario]()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
