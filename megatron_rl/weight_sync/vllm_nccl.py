"""Trainer side of vLLM 0.33's NCCL weight transfer (``--weight-transfer-config '{"backend": "nccl"}'``).

A vLLM worker joins the transfer group in ``/init_weight_transfer_engine`` with
``StatelessProcessGroup.create(master_address, master_port, rank, world_size)`` (a torch
``TCPStore``, hosted by rank 0) and ``PyNcclCommunicator(pg, device)`` (NCCL through ctypes).
A torch ``ProcessGroup`` cannot join that communicator, so the trainer (always rank 0) does what
vLLM's own trainer side does, without importing vLLM (docs/VLLM_API.md section 3 names the files
and lines of vLLM 0.33.0 this follows):

1. host the store: bind ``master_address:master_port`` (IPv4, ``SO_REUSEADDR``) and start a
   ``TCPStore(world_size=..., is_master=True, use_libuv=False, master_listen_fd=...)``, which
   waits until the ``world_size - 1`` workers connected;
2. ``ncclGetUniqueId`` and ``store.set("broadcast_from/0/0", pickle of vLLM's ncclUniqueId)``
   (``StatelessProcessGroup.broadcast_obj(unique_id, src=0)``, the first broadcast of rank 0);
3. ``ncclCommInitRank(world_size, unique_id, 0)`` on the trainer's CUDA device;
4. the warm-up every ``PyNcclCommunicator`` issues right after its init: a one-element float32
   ``ncclAllReduce`` (sum), then a stream synchronize; a rank that skips it deadlocks the rest;
5. per ``/update_weights`` (unpacked): one ``ncclBroadcast`` from rank 0 per tensor, in the order of
   the posted ``names``, each ``numel`` elements of the posted dtype, from the tensor's own memory.

Security: the store is an unauthenticated TCP key-value server on the trainer, and vLLM's
workers ``pickle.loads`` what they read from it (``broadcast_from/0/0``). Anyone who can reach
``master_address:master_port`` while the group forms can read the unique id or plant a pickle
that runs code in the vLLM workers. The trainer only writes (it never unpickles anything it
reads), writes only the one pickle below (built from bytes, referencing nothing but
``_ctypes._unpickle`` and vLLM's ``ncclUniqueId``), and only to the ranks it told of the port
through its own ``/init_weight_transfer_engine`` calls; run it on a network only the trainer and
its engines reach (as for vLLM itself), with ``weight_sync.master_address`` an internal address.

The NCCL library is the one torch uses (``libnccl.so.2``, already loaded by a CUDA torch; else
the ``nvidia-nccl`` wheel's), or ``$MEGATRON_RL_NCCL_SO_PATH``. Everything here is imported lazily
by the sender and needs a CUDA GPU only from ``VllmNcclGroup.join`` on; without one it fails
with ``NcclUnavailableError`` saying what is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "NCCL_SO_ENV",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclError",
    "NcclLibrary",
    "NcclUnavailableError",
    "StoreRendezvous",
    "VllmNcclGroup",
    "broadcast_key",
    "nccl_dtype",
    "pickle_vllm_unique_id",
    "preflight",
    "require_cuda",
]

NCCL_SO_ENV = "MEGATRON_RL_NCCL_SO_PATH"
"""Environment variable naming the NCCL shared library to load instead of torch's."""

NCCL_UNIQUE_ID_BYTES = 128
"""``sizeof(ncclUniqueId)`` (``NCCL_UNIQUE_ID_BYTES`` in nccl.h; vLLM's ``ncclUniqueId`` is ``c_byte * 128``)."""

#: Where vLLM 0.33 defines ``ncclUniqueId`` (the class its workers unpickle the id as).
VLLM_UNIQUE_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")

#: ``ncclDataType_t`` of the dtypes vLLM's ``ncclDataTypeEnum.from_torch`` knows (nccl.h values).
_NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10,
}
_NCCL_SUM = 0


class NcclUnavailableError(RuntimeError):
    """The trainer cannot take part in vLLM's NCCL transfer here: no CUDA GPU, or no NCCL library."""


class NcclError(RuntimeError):
    """An NCCL call returned an error (the message carries NCCL's own text)."""


def broadcast_key(src: int, index: int) -> str:
    """``StatelessProcessGroup``'s store key of the ``index``-th ``broadcast_obj`` from rank ``src``."""
    return f"broadcast_from/{src}/{index}"


def pickle_vllm_unique_id(raw: bytes) -> bytes:
    """The bytes ``pickle.dumps`` makes of vLLM's ``ncclUniqueId`` holding ``raw``, without vLLM.

    A ctypes structure pickles as ``_ctypes._unpickle(cls, ({}, bytes(obj)))``; this writes that
    call with the class named by module and qualified name (``VLLM_UNIQUE_ID_CLASS``), in protocol
    4 with the framing and memo opcodes ``pickle.dumps`` emits, so the bytes are identical to what
    a vLLM rank 0 would store (the contract test compares them).

    Args:
        raw: the 128 bytes of an ``ncclUniqueId`` (``ncclGetUniqueId``).

    Raises:
        ValueError: ``raw`` is not 128 bytes.
    """
    raw = bytes(raw)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")

    def text(s: str) -> bytes:  # SHORT_BINUNICODE + MEMOIZE
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b + b"\x94"

    module, name = VLLM_UNIQUE_ID_CLASS
    body = (text("_ctypes") + text("_unpickle") + b"\x93\x94"  # STACK_GLOBAL _ctypes._unpickle
            + text(module) + text(name) + b"\x93\x94"  # STACK_GLOBAL vllm...ncclUniqueId
            + b"}\x94"  # EMPTY_DICT (the instance __dict__)
            + b"C" + bytes([len(raw)]) + raw + b"\x94"  # SHORT_BINBYTES
            + b"\x86\x94" + b"\x86\x94"  # TUPLE2 ({}, raw); TUPLE2 (cls, state)
            + b"R\x94" + b".")  # REDUCE; STOP
    return b"\x80\x04" + b"\x95" + struct.pack("<Q", len(body)) + body  # PROTO 4, FRAME


class StoreRendezvous:
    """Rank 0 of a vLLM ``StatelessProcessGroup``: hosts its ``TCPStore`` and writes broadcasts.

    Only the sending half of ``broadcast_obj`` is implemented: the trainer never reads (never
    unpickles) anything from the store. Construction blocks until ``world_size - 1`` clients
    connected (torch's ``wait_for_workers``, as vLLM's ``create``).

    Args:
        host: address to bind and advertise (``weight_sync.master_address``); IPv4.
        port: TCP port to listen on.
        world_size: 1 (the trainer) + every engine worker.
        timeout_s: how long to wait for the workers and the store's operation timeout (seconds).

    Raises:
        ValueError: ``world_size`` < 2.
        OSError: the port cannot be bound.
        RuntimeError (torch ``DistStoreError``): not every worker connected within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, world_size: int, *, timeout_s: float) -> None:
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (the trainer and at least one worker), got {world_size}")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, int(port)))
            listener.listen()
        except OSError:
            listener.close()
            raise
        from torch.distributed import TCPStore

        # the store owns the listening socket from here on, and closes it when it fails too (so it
        # is not closed here: that fd number may already be another thread's)
        self.store = TCPStore(host_name=host, port=int(port), world_size=world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), use_libuv=False, master_listen_fd=listener.detach())
        self.host, self.port, self.world_size = host, int(port), world_size
        self._sent = 0

    def broadcast_pickled(self, payload: bytes) -> str:
        """``broadcast_obj(obj, src=0)`` on rank 0 with ``payload = pickle.dumps(obj)`` already made.

        Returns the key written (``broadcast_from/0/<n>``, n counting from 0).
        """
        key = broadcast_key(0, self._sent)
        self.store.set(key, payload)
        self._sent += 1
        return key

    def close(self) -> None:
        """Drop the store (its server thread stops with the last reference)."""
        self.store = None


def require_cuda() -> None:
    """Raise ``NcclUnavailableError`` unless torch sees a CUDA GPU.

    The message names what is missing: a CPU-only torch build, or no visible GPU.
    """
    if torch.version.cuda is None:
        raise NcclUnavailableError(
            f"vLLM's NCCL weight transfer needs a CUDA GPU on the trainer, but torch {torch.__version__} is a "
            "CPU-only build (torch.version.cuda is None); use rollout.backend=vllm-embedded on CPU")
    if not torch.cuda.is_available():
        raise NcclUnavailableError(
            f"vLLM's NCCL weight transfer needs a CUDA GPU on the trainer, but torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}) sees none (torch.cuda.is_available() is False; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "use rollout.backend=vllm-embedded on CPU")


def _library_candidates() -> list[str]:
    """Where to look for NCCL: ``$MEGATRON_RL_NCCL_SO_PATH`` alone when set, else torch's soname
    (already loaded by a CUDA torch) and the ``nvidia-nccl`` wheel's copy."""
    if os.environ.get(NCCL_SO_ENV):
        return [os.environ[NCCL_SO_ENV]]
    found = ["libnccl.so.2"]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        found.append(str(Path(loc) / "lib" / "libnccl.so.2"))
    return found


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


_VOIDP = ctypes.c_void_p
#: name -> (restype, argtypes), as nccl.h declares them (``ncclComm_t`` and ``cudaStream_t`` are pointers).
_FUNCTIONS = {
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(_UniqueId)]),
    "ncclCommInitRank": (ctypes.c_int, [ctypes.POINTER(_VOIDP), ctypes.c_int, _UniqueId, ctypes.c_int]),
    "ncclAllReduce": (ctypes.c_int, [_VOIDP, _VOIDP, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _VOIDP, _VOIDP]),
    "ncclBroadcast": (ctypes.c_int, [_VOIDP, _VOIDP, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _VOIDP, _VOIDP]),
    "ncclCommAbort": (ctypes.c_int, [_VOIDP]),
}


class NcclLibrary:
    """The few NCCL calls the trainer side needs, through ctypes (as vLLM's ``pynccl_wrapper``).

    Use ``NcclLibrary.load()``; every call raises ``NcclError`` with NCCL's text on a non-zero result.
    """

    _cache: dict[str, NcclLibrary] = {}
    _lock = threading.Lock()

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn = {}
        for name, (restype, argtypes) in _FUNCTIONS.items():
            fn = getattr(lib, name)  # AttributeError: not an NCCL library
            fn.restype, fn.argtypes = restype, argtypes
            self._fn[name] = fn
        self._last_error = getattr(lib, "ncclGetLastError", None)  # NCCL >= 2.13
        if self._last_error is not None:
            self._last_error.restype, self._last_error.argtypes = ctypes.c_char_p, [_VOIDP]

    @classmethod
    def load(cls, path: str | None = None) -> NcclLibrary:
        """Load NCCL from ``path``, else from ``$MEGATRON_RL_NCCL_SO_PATH``, else torch's ``libnccl.so.2``.

        Raises:
            NcclUnavailableError: no candidate loads, or one lacks an NCCL symbol (names every
                path tried and the environment variable to set).
        """
        candidates = [path] if path else _library_candidates()
        errors = []
        with cls._lock:
            for candidate in candidates:
                if candidate in cls._cache:
                    return cls._cache[candidate]
                try:
                    lib = cls(ctypes.CDLL(candidate), candidate)
                except (OSError, AttributeError) as e:
                    errors.append(f"{candidate}: {e}")
                    continue
                cls._cache[candidate] = lib
                return lib
        raise NcclUnavailableError(
            "cannot load the NCCL library for vLLM's weight transfer (tried " + "; ".join(errors)
            + f"); install a CUDA build of torch (it ships libnccl.so.2) or set {NCCL_SO_ENV} to libnccl.so.2's path")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            text = self._fn["ncclGetErrorString"](result).decode(errors="replace")
            last = self._last_error(None) if self._last_error is not None else None
            raise NcclError(f"{what} failed: NCCL error {result}: {text}"
                            + (f" ({last.decode(errors='replace')})" if last else ""))

    def version(self) -> int:
        """``ncclGetVersion``: e.g. 23007 for 2.30.7."""
        v = ctypes.c_int()
        self._check(self._fn["ncclGetVersion"](ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def get_unique_id(self) -> bytes:
        """``ncclGetUniqueId``: 128 bytes naming a new communicator (also works without a GPU)."""
        uid = _UniqueId()
        self._check(self._fn["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid)

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> ctypes.c_void_p:
        """``ncclCommInitRank`` on the current CUDA device; blocks until all ``world_size`` ranks joined."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId.from_buffer_copy(bytes(unique_id))
        comm = _VOIDP()
        self._check(self._fn["ncclCommInitRank"](ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm

    def all_reduce_sum(self, tensor: torch.Tensor, comm, stream: torch.cuda.Stream) -> None:
        """In-place ``ncclAllReduce`` (sum) of a contiguous CUDA tensor, enqueued on ``stream``."""
        self._check(self._fn["ncclAllReduce"](tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                              nccl_dtype(tensor.dtype), _NCCL_SUM, comm, stream.cuda_stream),
                    "ncclAllReduce")

    def broadcast(self, tensor: torch.Tensor, root: int, comm, stream: torch.cuda.Stream) -> None:
        """In-place ``ncclBroadcast`` of a contiguous CUDA tensor from ``root``, enqueued on ``stream``."""
        self._check(self._fn["ncclBroadcast"](tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                              nccl_dtype(tensor.dtype), root, comm, stream.cuda_stream),
                    "ncclBroadcast")

    def comm_abort(self, comm) -> None:
        """``ncclCommAbort``: free the communicator without waiting for peers."""
        self._check(self._fn["ncclCommAbort"](comm), "ncclCommAbort")


def nccl_dtype(dtype: torch.dtype) -> int:
    """NCCL's ``ncclDataType_t`` for a torch dtype, for the dtypes vLLM 0.33 can receive.

    Raises:
        ValueError: a dtype vLLM's ``ncclDataTypeEnum.from_torch`` does not know (e.g. bool).
    """
    try:
        return _NCCL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"vLLM's NCCL weight transfer cannot send {dtype} (it takes "
                         f"{', '.join(str(d).removeprefix('torch.') for d in _NCCL_DTYPES)})") from None


def preflight() -> NcclLibrary:
    """Check, before any engine is asked to join, that this process can be rank 0: a CUDA GPU
    and a loadable NCCL. Returns the library.

    Raises:
        NcclUnavailableError: as ``require_cuda`` and ``NcclLibrary.load``.
    """
    require_cuda()
    return NcclLibrary.load()


class BroadcastWork:
    """The broadcasts of one bucket, seen as a ``dist.Work`` (``is_completed`` / ``wait``).

    Holds the tensors until the event after their broadcasts completed (NCCL reads them on the stream).
    """

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self.event = event
        self._tensors = tensors

    def is_completed(self) -> bool:
        """True once every broadcast of the bucket finished on the GPU."""
        done = self.event.query()
        if done:
            self._tensors = []
        return done

    def wait(self, timeout: timedelta | float | None = None) -> None:
        """Block until completed. Raises ``TimeoutError`` after ``timeout`` (seconds or timedelta)."""
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while not self.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"NCCL broadcast did not complete in {limit:.0f} s")
            time.sleep(0.001)


class VllmNcclGroup:
    """The trainer's rank 0 in a vLLM engine's NCCL weight-transfer group. Build it with ``join``."""

    def __init__(self, lib: NcclLibrary, comm, rendezvous: StoreRendezvous, device: torch.device,
                 world_size: int) -> None:
        self.lib, self.comm, self.rendezvous, self.device, self.world_size = lib, comm, rendezvous, device, world_size

    @classmethod
    def join(cls, host: str, port: int, world_size: int, *, timeout_s: float,
             device: int | torch.device | None = None) -> VllmNcclGroup:
        """Form the group with the engines' workers (the module docstring's steps 1-4) as rank 0.

        Call it while the engines' ``/init_weight_transfer_engine`` calls are in flight (it blocks
        until they joined). ``ncclCommInitRank`` has no timeout: when a worker never gets there this
        blocks forever, so run it in a thread and give up on it (``WeightSyncSender`` does).

        Args:
            host, port: where to host the store (the ``master_address`` / ``master_port`` posted).
            world_size: 1 + the engines' workers (``/get_world_size`` summed).
            timeout_s: seconds to wait for the workers to connect to the store.
            device: the CUDA device to send from; None: the current one.

        Raises:
            NcclUnavailableError: no CUDA GPU or no NCCL library (before the store is opened).
            NcclError: an NCCL call failed. RuntimeError: the store rendezvous timed out.
        """
        lib = preflight()
        index = device if isinstance(device, int) else None if device is None else torch.device(device).index
        device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        rendezvous = StoreRendezvous(host, port, world_size, timeout_s=timeout_s)
        comm = None
        try:
            unique_id = lib.get_unique_id()
            rendezvous.broadcast_pickled(pickle_vllm_unique_id(unique_id))
            with torch.cuda.device(device):
                comm = lib.comm_init_rank(world_size, unique_id, 0)
                stream = torch.cuda.current_stream(device)
                warmup = torch.zeros(1, dtype=torch.float32, device=device)  # (1,) PyNcclCommunicator's warm-up
                lib.all_reduce_sum(warmup, comm, stream)
                stream.synchronize()
        except BaseException:
            cls(lib, comm, rendezvous, device, world_size).destroy()  # aborts the communicator if there is one
            raise
        logger.info("joined vLLM's NCCL weight-transfer group at %s:%d as rank 0 of %d (NCCL %d, %s)",
                    host, port, world_size, lib.version(), device)
        return cls(lib, comm, rendezvous, device, world_size)

    def broadcast(self, tensors: list[torch.Tensor]) -> BroadcastWork:
        """Enqueue one ``ncclBroadcast`` from rank 0 per tensor, in order, on the current stream.

        Args:
            tensors: CUDA tensors on this group's device, each in the dtype and shape posted for
                it in ``/update_weights`` (non-contiguous ones are copied first).

        Returns:
            a ``BroadcastWork`` completing when all of them are sent.

        Raises:
            ValueError: a tensor on another device or of a dtype vLLM cannot receive.
            NcclError: the enqueue failed (the group is then unusable).
        """
        if self.comm is None:
            raise NcclError("broadcast on a destroyed vLLM NCCL group")
        sent = []
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            for t in tensors:
                if t.device != self.device:
                    raise ValueError(f"tensor on {t.device}, but the vLLM NCCL group sends from {self.device}")
                t = t if t.is_contiguous() else t.contiguous()
                self.lib.broadcast(t, 0, self.comm, stream)
                sent.append(t)
            event = torch.cuda.Event()
            event.record(stream)
        return BroadcastWork(event, sent)

    def destroy(self) -> None:
        """Abort the communicator (in a daemon thread, 5 s at most, as vLLM does: an abort can
        block while a peer is gone) and close the store. Idempotent."""
        comm, self.comm = self.comm, None
        if comm is not None:
            lib, device = self.lib, self.device

            def abort() -> None:
                try:
                    with torch.cuda.device(device):
                        lib.comm_abort(comm)
                except Exception as e:  # noqa: BLE001 - best effort at teardown
                    logger.warning("ncclCommAbort of the vLLM weight-transfer group: %s", e)

            t = threading.Thread(target=abort, name="vllm-nccl-abort", daemon=True)
            t.start()
            t.join(timeout=5.0)
        self.rendezvous.close()
