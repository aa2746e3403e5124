"""The trainer side of vLLM's NCCL weight transfer (`megatron_rl.weight_sync.vllm_nccl`), on CPU.

What runs here: the pickle of the unique id, the store rendezvous (keys and payload, read back by
torch TCPStore clients as vLLM's workers read them), `ncclGetUniqueId` from torch's own NCCL
(it needs no GPU), the dtype map, and every error path without a GPU. What cannot: a
communicator (`ncclCommInitRank`), the warm-up all-reduce and the broadcasts need CUDA GPUs; the
check against vLLM's own code is `tests/e2e/test_vllm_contract.py`.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import pickletools
import socket
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from megatron_rl.errors import WeightSyncError
from megatron_rl.ports import find_free_port
from megatron_rl.weight_sync import vllm_nccl as vn
from megatron_rl.weight_sync.sender import WeightSyncSender

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")


class _LocalUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class _Restricted(pickle.Unpickler):
    """Loads the unique-id pickle with vLLM's class replaced by a local twin; refuses anything else."""

    def find_class(self, module, name):
        if (module, name) == vn.VLLM_UNIQUE_ID_CLASS:
            return _LocalUniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")


def _load(payload: bytes) -> bytes:
    return bytes(_Restricted(io.BytesIO(payload)).load())


def test_unique_id_pickle_is_a_ctypes_unpickle_of_vllms_class():
    raw = bytes(range(128))
    payload = vn.pickle_vllm_unique_id(raw)
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(payload)]
    strings = [arg for name, arg in ops if name == "SHORT_BINUNICODE"]
    assert strings == ["_ctypes", "_unpickle", *vn.VLLM_UNIQUE_ID_CLASS]
    assert ("SHORT_BINBYTES", raw) in ops and ops[0] == ("PROTO", 4) and ops[-1][0] == "STOP"
    assert _load(payload) == raw  # a valid pickle, and it carries exactly the id
    with pytest.raises(ModuleNotFoundError, match="vllm"):  # the trainer itself cannot (and never does) load it
        pickle.loads(payload)
    with pytest.raises(ValueError, match="128 bytes"):
        vn.pickle_vllm_unique_id(raw[:127])


def test_store_rendezvous_writes_broadcast_obj_keys_that_workers_read():
    """Rank 0 waits for both workers, then writes `broadcast_from/0/<n>` as `broadcast_obj` does;
    the workers are torch TCPStore clients built as `StatelessProcessGroup.create` builds them."""
    port = find_free_port("127.0.0.1")
    box: dict = {}

    def host():
        try:
            box["rdv"] = vn.StoreRendezvous("127.0.0.1", port, 3, timeout_s=60)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=host)
    t.start()
    workers = []
    for _ in range(2):
        for _attempt in range(100):  # the host may not listen yet
            try:
                workers.append(TCPStore("127.0.0.1", port, world_size=3, is_master=False,
                                        timeout=timedelta(seconds=30), use_libuv=False))
                break
            except Exception:  # noqa: BLE001
                threading.Event().wait(0.05)
    t.join(timeout=60)
    assert "error" not in box and len(workers) == 2
    rdv = box["rdv"]
    raw = bytes(reversed(range(128)))
    assert rdv.broadcast_pickled(vn.pickle_vllm_unique_id(raw)) == "broadcast_from/0/0"
    assert rdv.broadcast_pickled(b"second") == "broadcast_from/0/1"
    for w in workers:
        assert _load(w.get("broadcast_from/0/0")) == raw
        assert w.get("broadcast_from/0/1") == b"second"
    rdv.close()


def test_store_rendezvous_times_out_when_a_worker_never_comes():
    port = find_free_port("127.0.0.1")
    with pytest.raises(RuntimeError, match="clients"):  # torch: "... 0/1 clients joined"
        vn.StoreRendezvous("127.0.0.1", port, 2, timeout_s=1)
    with socket.socket() as s:  # the port is released again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    with pytest.raises(ValueError, match="world_size"):
        vn.StoreRendezvous("127.0.0.1", port, 1, timeout_s=1)


def test_nccl_library_errors_name_the_path_and_the_variable(monkeypatch, tmp_path):
    with pytest.raises(vn.NcclUnavailableError, match=rf"{tmp_path}/libnccl.so.2.*{vn.NCCL_SO_ENV}"):
        vn.NcclLibrary.load(str(tmp_path / "libnccl.so.2"))
    monkeypatch.setenv(vn.NCCL_SO_ENV, "libc.so.6")  # loads, but is no NCCL
    with pytest.raises(vn.NcclUnavailableError, match=r"libc.so.6: .*ncclGetErrorString"):
        vn.NcclLibrary.load()


def test_unique_id_from_torchs_nccl_without_a_gpu():
    try:
        lib = vn.NcclLibrary.load()
    except vn.NcclUnavailableError as e:
        pytest.skip(f"no NCCL library with this torch: {e}")
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert len(a) == len(b) == 128 and a != b
    assert lib.version() >= 21800
    with pytest.raises(ValueError, match="128 bytes"):
        lib.comm_init_rank(2, a[:64], 0)


@needs_no_gpu
def test_no_gpu_is_a_clear_error_before_the_store_opens(monkeypatch):
    with pytest.raises(vn.NcclUnavailableError, match=r"needs a CUDA GPU.*is_available\(\) is False.*vllm-embedded"):
        vn.require_cuda()
    port = find_free_port("127.0.0.1")
    with pytest.raises(vn.NcclUnavailableError, match="CUDA GPU"):
        vn.VllmNcclGroup.join("127.0.0.1", port, 2, timeout_s=1)
    with socket.socket() as s:  # nothing was bound
        s.bind(("127.0.0.1", port))
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(vn.NcclUnavailableError, match="CPU-only build"):
        vn.preflight()


def test_dtypes_are_ncclDataType_t_values_vllm_knows():
    assert [vn.nccl_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8)] == [
        9, 6, 7, 4, 1]
    with pytest.raises(ValueError, match="cannot send torch.bool"):
        vn.nccl_dtype(torch.bool)


class _RecordingClient:
    base_url = "http://vllm:0"

    def __init__(self):
        self.calls = []
        self.posted = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            if name == "update_weights_from_distributed":
                self.posted.append((args, kwargs))
            return {"world_size": 1} if name == "tp_size" else {}
        return call


class _FakeGroup:
    """Stands in for `VllmNcclGroup` (which needs a GPU): records what would be broadcast."""

    def __init__(self):
        self.sent = []

    def broadcast(self, tensors):
        self.sent.append([(str(t.dtype).removeprefix("torch."), list(t.shape), t.is_contiguous()) for t in tensors])
        return self

    def is_completed(self):
        return True

    def wait(self, timeout=None):
        pass

    def destroy(self):
        pass


def test_sender_transport_checks():
    with pytest.raises(ValueError, match="backend='nccl' and load_format=None"):
        WeightSyncSender([_RecordingClient()], backend="gloo", transport="vllm-nccl")
    with pytest.raises(ValueError, match="backend='nccl' and load_format=None"):
        WeightSyncSender([_RecordingClient()], backend="nccl", load_format="flattened_bucket", transport="vllm-nccl")
    with pytest.raises(ValueError, match="transport must be"):
        WeightSyncSender([_RecordingClient()], transport="pynccl")


@needs_no_gpu
def test_sender_without_gpu_fails_before_asking_any_engine_to_join():
    client = _RecordingClient()
    sender = WeightSyncSender([client], backend="nccl", transport="vllm-nccl", timeout_s=5)
    with pytest.raises(WeightSyncError, match="needs a CUDA GPU on the trainer"):
        sender.init_group()
    assert client.calls == [] and not sender.initialized
    sender.close()


def test_sender_broadcasts_each_bucket_in_the_posted_order():
    """What vLLM's `receive_weights` relies on: per `/update_weights`, one broadcast per posted name,
    in order, each in the posted dtype and shape, from contiguous memory."""
    client = _RecordingClient()
    sender = WeightSyncSender([client], backend="nccl", transport="vllm-nccl", bucket_size_mib=0.001)
    sender._pg = group = _FakeGroup()  # init_group needs a GPU
    weights = [("w.0", torch.zeros(8, 16, dtype=torch.bfloat16).t()), ("b.0", torch.zeros(16)),
               ("w.1", torch.zeros(100, 10, dtype=torch.bfloat16)), ("pos", torch.arange(5))]
    stats = sender.send(iter(weights), weight_version="3")
    assert len(client.posted) == len(group.sent) == stats["num_buckets"] >= 2
    for (args, kwargs), sent in zip(client.posted, group.sent, strict=True):
        names, dtypes, shapes = args
        assert [(d, s, True) for d, s in zip(dtypes, shapes)] == sent and kwargs["load_format"] is None
    assert [n for (args, _) in client.posted for n in args[0]] == [n for n, _ in weights]
    assert [sh for (args, _) in client.posted for sh in args[2]][0] == [16, 8]
    sender.close()


@pytest.mark.parametrize("backend, transport", [("vllm", "vllm-nccl"), ("vllm-embedded", "torch")])
def test_trainer_picks_vllms_nccl_group_for_real_vllm_only(backend, transport):
    from pathlib import Path

    from megatron_rl.config import load_config
    from megatron_rl.trainer.setup import _sender_factory

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples/qwen2.5-32b/dapo-vllm.yaml", [f"rollout.backend={backend}"])
    sender = _sender_factory(cfg, None)(["http://127.0.0.1:1"], "weight_update_group")
    assert sender.transport == transport and sender.backend == "nccl" and sender.load_format is None
    sender.close()
