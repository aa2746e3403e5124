"""`trainer.routed_rows`: the engine's routing kept per row (int16, unpadded) and handed out so that
each trainer rank receives only its data-parallel rows and its pipeline stage's layers (issue 29,
finding F1: padded and broadcast whole it was ~120 GiB a rank at the 30B recipe's scale)."""

from __future__ import annotations

import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.trainer.batch import build_train_batch
from megatron_rl.trainer.routed_rows import RoutedRows, dp_rows, hand_out

L, K = 4, 2


def _rows(lengths):
    # row i, position t, layer l -> experts (100 i + 10 t + l, +1000): every entry tells where it came from
    return [torch.stack([torch.tensor([[100 * i + 10 * t + layer, 1000 + 100 * i + 10 * t + layer] for layer in range(L)])
                         for t in range(n)]) for i, n in enumerate(lengths)]


def _batch(n_rows=8):
    prompts = [[1 + i] * (2 + i % 3) for i in range(n_rows)]
    responses = [[7] * (1 + i % 4) for i in range(n_rows)]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    return build_train_batch(prompts, responses, advantages=[0.0] * n_rows,
                             rollout_logprobs=[[-1.0] * len(r) for r in responses], trained=[True] * n_rows, pad_id=0,
                             routed_experts=_rows([n - 1 for n in lengths])), lengths


def test_rows_stay_int16_and_unpadded_and_pad_per_micro_batch():
    batch, lengths = _batch()
    rr = batch.routed_experts
    assert [r.shape for r in rr.rows] == [(n - 1, L, K) for n in lengths]
    assert {r.dtype for r in rr.rows} == {torch.int16}
    assert rr.nbytes() == sum(n - 1 for n in lengths) * L * K * 2
    mb = batch.select([5, 2], width=8)
    routed, valid = mb.routed_experts.padded(8)
    assert routed.dtype == torch.long and routed.shape == (2, 8, L, K)
    n5 = lengths[5] - 1
    assert routed[0, n5 - 1, 3].tolist() == [500 + 10 * (n5 - 1) + 3, 1500 + 10 * (n5 - 1) + 3]
    assert routed[0, n5:].tolist() == [[[0, 1]] * L] * (8 - n5)  # filler ids where nothing was routed
    assert valid.sum(dim=1).tolist() == [lengths[5] - 1, lengths[2] - 1]
    assert batch.slice(2, 4).routed_experts.rows[0] is rr.rows[2]


def test_the_broadcast_batch_carries_no_rows():
    batch, _ = _batch()
    sent = batch.for_broadcast()
    assert sent.routed_experts.rows == [None] * 8 and batch.routed_experts.rows[0] is not None
    assert len(pickle.dumps(sent)) < len(pickle.dumps(batch)) - batch.routed_experts.nbytes()
    with pytest.raises(ValueError, match="row 0 of this micro-batch is not held on this rank"):
        sent.routed_experts.padded(8)


def test_dp_rows_are_the_policy_trainers_shares():
    # PolicyTrainer: mini-batches of `mini` consecutive rows, each split into dp contiguous shares
    assert dp_rows(8, 4, 2, 0) == [0, 1, 4, 5]
    assert dp_rows(8, 4, 2, 1) == [2, 3, 6, 7]
    assert dp_rows(8, None, 2, 1) == [4, 5, 6, 7]
    assert dp_rows(6, 4, 1, 0) == list(range(6))


def test_keep_cuts_rows_and_layers():
    batch, _ = _batch()
    kept = batch.routed_experts.keep([1, 6], [2, 3])
    assert [r is None for r in kept.rows] == [True, False, True, True, True, True, False, True]
    assert kept.layers == (2, 3) and kept.column(3) == 1
    assert torch.equal(kept.rows[6], batch.routed_experts.rows[6][:, 2:4])
    with pytest.raises(ValueError, match="holds layers \\[2, 3\\], not layer 0"):
        kept.column(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out, tp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sends = []
    real_send = dist.send_object_list

    def counting_send(objs, dst, **kw):
        sends.append(dst)
        return real_send(objs, dst, **kw)

    dist.send_object_list = counting_send
    try:
        batch, _ = _batch()
        # the controller (rank 0) holds every row; the others got the broadcast copy
        rr = batch.routed_experts if rank == 0 else batch.for_broadcast().routed_experts
        if tp:  # TP 2 x DP 2 (megatron's order: TP fastest): TP ranks share rows and layers
            groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            tp_group, dp_rank, layers = groups[rank // 2], rank // 2, [0, 1, 2, 3]
        else:  # DP 2 x PP 2: stage 0 runs layers 0-1, stage 1 layers 2-3
            tp_group, dp_rank, stage = None, rank % 2, rank // 2
            layers = [2 * stage, 2 * stage + 1]
        mine = hand_out(rr, mini_batch_sequences=4, dp_size=2, dp_rank=dp_rank, layers=layers, tp_group=tp_group)
        out[rank] = ([i for i, r in enumerate(mine.rows) if r is not None], mine.layers, mine.nbytes(), mine.local,
                     [r.clone() if r is not None else None for r in mine.rows], list(sends))
    finally:
        dist.send_object_list = real_send
        dist.destroy_process_group()


def _hand_out_on_4_ranks(tp: bool) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(4, _free_port(), out, tp), nprocs=4, join=True)
        return dict(out)


def test_hand_out_gives_each_rank_its_rows_and_layers_only():
    got = _hand_out_on_4_ranks(tp=False)
    full, _ = _batch()
    for rank in range(4):
        rows, layers, nbytes, local, tensors, _ = got[rank]
        dp_rank, stage = rank % 2, rank // 2
        assert rows == dp_rows(8, 4, 2, dp_rank) and layers == (2 * stage, 2 * stage + 1) and local
        for i in rows:
            assert torch.equal(tensors[i], full.routed_experts.rows[i][:, 2 * stage: 2 * stage + 2])
        assert nbytes == sum(full.routed_experts.rows[i].numel() for i in rows) // 2 * 2  # half the layers, int16
    assert sum(got[r][2] for r in got) == full.routed_experts.nbytes()
    assert sorted(got[0][5]) == [1, 2, 3]  # one send per other rank, none to itself


def test_hand_out_sends_once_per_tensor_parallel_group():
    """TP 2 x DP 2: the controller sends DP rank 1's share to rank 2 only; rank 3 (its TP peer)
    gets it by the TP group's broadcast, and rank 1 (the controller's TP peer) from rank 0."""
    got = _hand_out_on_4_ranks(tp=True)
    full, _ = _batch()
    for rank in range(4):
        rows, layers, _, local, tensors, _ = got[rank]
        assert rows == dp_rows(8, 4, 2, rank // 2) and layers == (0, 1, 2, 3) and local
        for i in rows:
            assert torch.equal(tensors[i], full.routed_experts.rows[i])
    assert got[0][5] == [2]
