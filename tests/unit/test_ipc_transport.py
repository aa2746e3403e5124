"""The colocated shared-memory transport (issue 17, CASES.md N12): packing, the restricted
unpickler, the peer-process check and segment lifetimes."""

import base64
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch

from megatron_rl.weight_sync.ipc import (ColocatedSender, HandleError, bucket_layout, deserialize_named_tensors,
                                         in_process_tree, pack_bucket, peer_pid, process_tree,
                                         serialize_named_tensors, shared_segments, unpack_bucket)

ME = frozenset({os.getpid()})


def test_n12a_receiver_copies_out_of_the_reused_buffer():
    buf = torch.zeros(16, dtype=torch.uint8)
    params = {k: torch.zeros(2) for k in "abcd"}
    for bucket in ([("a", torch.tensor([1., 2.])), ("b", torch.tensor([3., 4.]))],
                   [("c", torch.tensor([5., 6.])), ("d", torch.tensor([7., 8.]))]):
        metas = pack_bucket(bucket, buf, alignment=4)
        for name, view in unpack_bucket(buf, metas):
            params[name].copy_(view)  # what GenerationEngine.load_weights does
    assert {k: v.tolist() for k, v in params.items()} == {"a": [1, 2], "b": [3, 4], "c": [5, 6], "d": [7, 8]}


def test_n12b_non_contiguous_tensors_round_trip_bitwise():
    torch.manual_seed(0)
    t1 = torch.randn(8, 16).t()
    t2 = torch.randn(40, 60)[:, ::2]
    t3 = torch.randn(4, 8, 12).to(torch.bfloat16).permute(2, 0, 1)
    named = [("t1", t1), ("t2", t2), ("t3", t3)]
    assert not any(t.is_contiguous() for _, t in named)
    metas, used = bucket_layout(named)
    assert [m.end_idx - m.start_idx for m in metas] == [512, 4800, 768]
    assert [m.start_idx for m in metas] == [0, 512, 5632] and used == 6656
    buf = torch.empty(used, dtype=torch.uint8)
    out = unpack_bucket(buf, pack_bucket(named, buf))
    for (_, a), (_, b) in zip(named, out):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_n12c_buckets_through_shared_memory_leave_no_segment():
    before = set(shared_segments())  # segments earlier tests of this process left are not this sender's
    sender = ColocatedSender(bucket_bytes=64 << 20)
    target = {f"w{i}": torch.empty(16 << 20) for i in range(8)}  # 8 x 64 MiB fp32
    peak = 0
    for i in range(8):
        src = torch.full((16 << 20,), float(i))
        payload = sender.payload([(f"w{i}", src)])
        peak = max(peak, len(set(shared_segments()) - before))
        for name, view in deserialize_named_tensors(payload, trusted_pids=ME, load_format="flattened_bucket"):
            target[name].copy_(view)
        del view
        sender.after_bucket()
    assert peak <= 2
    sender.close()
    assert set(shared_segments()) - before == set()
    assert all(target[f"w{i}"][[0, -1]].tolist() == [i, i] for i in range(8))


def test_named_tensor_list_and_parameters_round_trip():
    named = [("x", torch.arange(6.).reshape(2, 3)), ("p", torch.nn.Parameter(torch.ones(3)))]
    out = deserialize_named_tensors(serialize_named_tensors(named), trusted_pids=ME)
    assert [n for n, _ in out] == ["x", "p"] and torch.equal(out[0][1], named[0][1])


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("obj, words", [
    ([("x", _Evil())], "global posix.system is not allowed"),
    ([("x", torch.ones(2))], "is not allowed"),  # plain pickle: torch.storage._load_from_bytes (torch.load)
])
def test_foreign_globals_are_refused(obj, words):
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises(HandleError, match=words):
        deserialize_named_tensors(payload, trusted_pids=ME)


def test_handles_outside_the_trusted_tree_and_bad_shapes_are_refused():
    payload = serialize_named_tensors([("x", torch.ones(4))])
    with pytest.raises(HandleError, match="does not belong to the trusted process tree"):
        deserialize_named_tensors(payload, trusted_pids=frozenset({1}))
    with pytest.raises(HandleError, match="not base64"):
        deserialize_named_tensors("%%%", trusted_pids=ME)
    with pytest.raises(HandleError, match="list of \\(name, tensor\\) pairs"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([1, 2])).decode(), trusted_pids=ME)
    with pytest.raises(HandleError, match="flattened_tensor"):
        deserialize_named_tensors(payload, trusted_pids=ME, load_format="flattened_bucket")


def test_peer_pid_and_process_tree():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", f"import socket,time; s=socket.create_connection(('127.0.0.1',{port})); time.sleep(30)"])
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        conn, (host, peer_port) = srv.accept()
        tree = process_tree(os.getpid())
        assert child.pid in tree and sibling.pid in tree
        assert peer_pid(port, peer_port, sorted(tree)) == child.pid
        assert in_process_tree(child.pid, os.getpid())
        assert not in_process_tree(child.pid, sibling.pid)  # not under the sibling's tree
        conn.close()
    finally:
        child.kill()
        sibling.kill()
        srv.close()


class _SlowReceiver:
    """An engine stand-in that decodes each bucket like the embedded server (same process: trusted),
    sleeps while "copying" (so packing the next bucket overlaps it), then checks the bytes it read
    before and after the sleep are the same (no buffer repacked under it) and keeps copies."""

    base_url = "http://receiver:1"

    def __init__(self, delay_s: float) -> None:
        import os as _os

        self.delay_s, self.me = delay_s, frozenset({_os.getpid()})
        self.received: list[tuple[str, torch.Tensor]] = []
        self.versions: list = []
        self.calls, self.busy, self.overlapped = 0, False, False

    def update_weights_from_tensor(self, payloads, *, load_format, flush_cache, weight_version, timeout_s):
        import time as _time

        self.calls += 1
        self.busy = True
        views = deserialize_named_tensors(payloads[0], trusted_pids=self.me, load_format=load_format)
        first = [v.clone() for _, v in views]
        _time.sleep(self.delay_s)
        assert all(torch.equal(a, v) for a, (_, v) in zip(first, views)), "a buffer was repacked while read"
        self.received += [(n, v.clone()) for n, v in views]
        self.versions.append(weight_version)
        self.busy = False
        return {"success": True}


def test_double_buffered_hand_over_overlaps_packing_and_keeps_order(monkeypatch):
    """5 buckets of one tensor each through 2 buffers: the engine gets every tensor in order with its
    values, the version only on the last bucket; packing ran while the engine was busy with the
    previous bucket (the overlap), and no buffer was repacked while the engine read it."""
    from megatron_rl.weight_sync import colocated as col

    engine = _SlowReceiver(delay_s=0.05)
    packed_while_busy = []
    real_payloads = ColocatedSender.payloads

    def payloads(self, named, copies):
        packed_while_busy.append(engine.busy)
        return real_payloads(self, named, copies)

    monkeypatch.setattr(ColocatedSender, "payloads", payloads)
    named = [(f"w{i}", torch.full((64,), float(i))) for i in range(5)]
    sender = col.ColocatedWeightSender([engine], bucket_size_mib=64 * 4 / 2**20, dtype=torch.float32, buffers=2)
    stats = sender.send(iter(named), weight_version="7")
    assert [n for n, _ in engine.received] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.received, named))
    assert engine.versions == [None, None, None, None, "7"] and stats["num_buckets"] == 5
    assert any(packed_while_busy[1:]), "no bucket was packed while the engine copied the previous one"
    one = col.ColocatedWeightSender([_SlowReceiver(0.0)], bucket_size_mib=64 * 4 / 2**20, dtype=torch.float32,
                                    buffers=1)
    assert one.send(iter(named), weight_version="7")["num_buckets"] == 5


@pytest.mark.parametrize("buffers", [1, 2])
def test_a_refused_bucket_waits_for_the_one_in_flight_and_raises(buffers):
    """Bucket 2 of 5 refused: the error raised is that one (not a later bucket's), nothing is left
    reading a buffer, and no bucket behind it is sent, so the version label never arrives."""
    from megatron_rl.errors import RolloutServerError, WeightSyncError
    from megatron_rl.weight_sync import colocated as col

    class Refuses(_SlowReceiver):
        def update_weights_from_tensor(self, payloads, **kw):
            if self.calls == 2:
                self.calls += 1
                raise RolloutServerError("bucket 2 refused", status_code=400)
            if self.calls == 3:
                self.calls += 1
                raise RolloutServerError("bucket 3 refused", status_code=400)
            return super().update_weights_from_tensor(payloads, **kw)

    engine = Refuses(delay_s=0.02)
    sender = col.ColocatedWeightSender([engine], bucket_size_mib=64 * 4 / 2**20, dtype=torch.float32,
                                       buffers=buffers)
    with pytest.raises(WeightSyncError, match="bucket 2 refused"):
        sender.send(iter([(f"w{i}", torch.ones(64)) for i in range(5)]), weight_version="1")
    assert not engine.busy  # nothing was left reading a freed buffer
    assert "1" not in engine.versions and engine.calls <= 3  # buckets 3-5 were not sent after the failure


def test_named_tensor_hand_over_points_at_the_parameters_themselves():
    """`load_format` null (what runs use): the engine reads the trainer's parameter storage by handle.
    The first update moves the storage into shared memory in place (the parameter and its views keep
    their values and stay one storage), later updates add no segment and deliver what the parameter
    holds at send time; a fresh tensor (a converted one) gets a segment that is gone after the update.
    Two engines, three updates: the parameter's segment stays openable throughout."""
    from megatron_rl.weight_sync import colocated as col

    before = set(shared_segments())
    flat = torch.arange(24.0)  # a megatron-style parameter buffer: parameters are views of it
    w, b = flat[:16].view(4, 4), flat[16:20]
    engines = [_SlowReceiver(0.0), _SlowReceiver(0.0)]
    sender = col.ColocatedWeightSender(engines, bucket_size_mib=1.0, dtype=torch.float32, load_format=None)
    assert sender.takes_views
    for step in range(3):
        fresh = torch.full((3,), float(step))  # e.g. regrouped q/k/v: a new tensor each update
        stats = sender.send(iter([("w", w), ("b", b), ("q", fresh)]), weight_version=str(step))
        for e in engines:
            got = dict(e.received[-3:])
            assert torch.equal(got["w"], w) and torch.equal(got["b"], b) and torch.equal(got["q"], fresh)
            assert e.versions[-1] == str(step)
        assert stats["num_tensors"] == 3 and stats["bytes"] == (16 + 4 + 3) * 4
        assert flat.is_shared() and w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        del fresh
        assert len(set(shared_segments()) - before) == 1  # the parameters' own segment only
        flat.add_(1.0)  # the optimizer step writes the parameters in place
    assert torch.equal(flat, torch.arange(24.0) + 3)
    with pytest.raises(ValueError, match="load_format"):
        col.ColocatedWeightSender(engines, load_format="safetensors")


def test_sweep_removes_segments_of_dead_processes_only():
    """A segment named after a pid that is gone (a run killed with its torch_shm_manager) is removed;
    one of a live process (this one) stays."""
    from megatron_rl.weight_sync.ipc import sweep_orphan_segments

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"/dev/shm/torch_{dead.pid}_123_0"
    mine = f"/dev/shm/torch_{os.getpid()}_sweeptest_0"
    for path in (orphan, mine):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    try:
        removed = sweep_orphan_segments()
        assert (os.path.basename(orphan), 4096) in removed
        assert not os.path.exists(orphan) and os.path.exists(mine)
        assert all(not n.startswith(f"torch_{os.getpid()}_") for n, _ in removed)
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)
