"""The colocated weight transport: tensors handed over by IPC handles, SGLang's
`/update_weights_from_tensor` body (`serialized_named_tensors`, SGLANG_API.md 2.4).

**Wire format.** As SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)`: the
payload is torch-multiprocessing's pickle (`ForkingPickler`, so every tensor travels as a handle
to its storage, never as bytes) in base64. `obj` is a list of `(name, tensor)` pairs, or, with
`load_format: flattened_bucket`, a dict `{"flattened_tensor": uint8 1-D tensor, "metadata": [...]}`
whose entries carry SGLang's `FlattenedTensorMetadata` fields (`name, shape, dtype, start_idx,
end_idx, numel`; byte offsets into the uint8 tensor). On CPU the storages are POSIX shared memory
under torch's `file_system` sharing strategy (a name in /dev/shm, `torch_<pid>_<n>_<k>`, reachable
over HTTP, unlike the default `file_descriptor` strategy whose fds need a Unix socket); on GPU
they are CUDA IPC handles (`torch.multiprocessing.reductions.reduce_tensor`).

**Safety (the receiver, `deserialize_named_tensors`).** Nothing from the network is unpickled with
`pickle.loads`. A restricted `Unpickler` resolves only an allow-list of globals, each mapped to a
reviewed callable: torch's storage/tensor rebuild functions of `torch.multiprocessing.reductions`
(`rebuild_tensor`, `rebuild_typed_storage`, `rebuild_storage_filename` wrapped to accept only
shared-memory names of the form `/torch_<pid>_...` whose `<pid>` is in the trusted process tree,
and `rebuild_cuda_tensor` only when CUDA is present), `torch.Tensor`, `torch.nn.Parameter`,
`torch.storage.UntypedStorage`, `torch.Size`, torch dtypes, and SGLang's `FlattenedTensorMetadata`
(mapped to this module's own dataclass). Every other global, `persistent_load`, and the
`file_descriptor` strategy's `rebuild_storage_fd` are refused. The decoded object must then be one
of the two shapes above. The HTTP route (`megatron_rl.engine.memory_routes`) also requires that
the request comes from 127.0.0.1 and that the peer process of the TCP connection is the server's
`--parent-pid` (the trainer that launched it) or a descendant of it, found through /proc
(`peer_pid`, `in_process_tree`): handles from any other process on the host are rejected. We chose
the /proc check over a shared-secret token file because it needs no secret on disk and binds the
handle to the same process tree the `/torch_<pid>` names are checked against.

**Buffers (CASES.md N12).** `ColocatedSender` packs each bucket into ONE reusable shared buffer
with `copy_` into typed views (non-contiguous tensors are handled on the sender, no `view(-1)` of
the source); the receiver copies out into its parameters (`GenerationEngine.load_weights`), keeps
no view, and drops every handle before it replies; the sender frees its buffer when the update
ends (`close`), so no trainer-created segment outlives the update. On GPU the sender calls
`torch.cuda.ipc_collect()` after each bucket and at the end (slime #1731). The CUDA path follows
torch's API but cannot run here (no GPU): untested.

Standard library and torch only.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import logging
import os
import pickle
import re
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_rl.weight_sync.buckets import dtype_from_name, dtype_name

logger = logging.getLogger(__name__)

__all__ = [
    "ColocatedSender",
    "FlattenedTensorMetadata",
    "HandleError",
    "deserialize_named_tensors",
    "in_process_tree",
    "pack_bucket",
    "peer_pid",
    "serialize_named_tensors",
    "shared_segments",
    "unpack_bucket",
]

ALIGNMENT = 512
"""Byte alignment of every tensor in a packed bucket (and of the bucket's used size)."""
_SHM_NAME = re.compile(rb"^/torch_(\d+)_\d+_\d+$")


class HandleError(ValueError):
    """A payload of `/update_weights_from_tensor` refused: bad base64, a global outside the
    allow-list, a handle from outside the trusted process tree, or a wrong shape of object."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's metadata of one tensor in a flattened bucket (`sglang.srt.weight_sync.tensor_bucket`):
    byte offsets `[start_idx, end_idx)` into the uint8 bucket, logical shape, dtype, element count."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


# ---- packing (sender) and unpacking (receiver) -------------------------------------------


def _align(n: int, a: int = ALIGNMENT) -> int:
    return -(-n // a) * a


def bucket_layout(named: Sequence[tuple[str, torch.Tensor]], alignment: int = ALIGNMENT) -> tuple[list[FlattenedTensorMetadata], int]:
    """Metadata of `named` packed back to back, each tensor at a multiple of `alignment` bytes, and
    the bucket's used size in bytes (rounded up to `alignment`)."""
    metas, off = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        metas.append(FlattenedTensorMetadata(name=name, shape=list(t.shape), dtype=dtype_name(t.dtype),
                                             start_idx=off, end_idx=off + nbytes, numel=t.numel()))
        off = _align(off + nbytes, alignment)
    return metas, off


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], buffer: torch.Tensor,
                alignment: int = ALIGNMENT) -> list[FlattenedTensorMetadata]:
    """Copy `named` into the uint8 `buffer` (reused between buckets) at `bucket_layout` offsets.
    Non-contiguous tensors are copied element by element in logical order (`copy_` into a typed
    view of the buffer; never `view(-1)` of the source). Returns the metadata.

    Raises:
        ValueError: the bucket needs more bytes than `buffer` holds.
    """
    metas, used = bucket_layout(named, alignment)
    if used > buffer.numel():
        raise ValueError(f"bucket of {used} bytes does not fit the {buffer.numel()}-byte buffer")
    for (_, t), m in zip(named, metas):
        dst = buffer[m.start_idx:m.end_idx].view(t.dtype).view(t.shape)
        dst.copy_(t.detach())
    return metas


def unpack_bucket(flat: torch.Tensor, metadata: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    """`(name, view)` pairs into the uint8 bucket `flat` (views: the caller copies them out).
    `metadata` entries are `FlattenedTensorMetadata` or dicts with its fields.

    Raises:
        HandleError: an entry out of the bucket's bounds, or whose size disagrees with shape x dtype.
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise HandleError(f"flattened_tensor must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metadata:
        get = m.get if isinstance(m, dict) else (lambda k, m=m: getattr(m, k, None))
        name, start, end = get("name"), get("start_idx"), get("end_idx")
        if not isinstance(name, str) or not isinstance(start, int) or not isinstance(end, int):
            raise HandleError(f"bad metadata entry {m!r}")
        dtype = get("dtype")
        dtype = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(str(dtype))
        shape = [int(d) for d in get("shape")]
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end <= flat.numel() or end - start != numel * dtype.itemsize:
            raise HandleError(f"metadata of {name!r}: bytes [{start}, {end}) do not hold {shape} {dtype} "
                              f"inside a {flat.numel()}-byte bucket")
        out.append((name, flat[start:end].view(dtype).view(shape)))
    return out


# ---- serialisation (SGLang's MultiprocessingSerializer semantics) ------------------------


@contextlib.contextmanager
def _file_system_strategy() -> Iterator[None]:
    """torch's `file_system` sharing strategy for the duration (handles are /dev/shm names)."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(obj: Any) -> str:
    """`obj` (a list of `(name, tensor)` or a flattened-bucket dict) as SGLang's
    `MultiprocessingSerializer.serialize(obj, output_str=True)`: ForkingPickler, base64. CPU
    tensors are moved into shared memory (`file_system` strategy) as a side effect; CUDA tensors
    become IPC handles.

    A CPU payload is for ONE receiver: serialising takes one reference on each segment
    (`_shared_incref`) and a receiver drops one when it opens it (`rebuild_storage_filename`), so a
    payload read by two receivers drops one reference too many and the segment's name is unlinked
    while its owner still uses it; serialise once per receiver."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reducers)

    buf = io.BytesIO()
    with _file_system_strategy():
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _checked_storage_filename(trusted: frozenset[int]):
    from torch.multiprocessing.reductions import rebuild_storage_filename

    def rebuild(cls, manager, handle, size, dtype=None):
        if cls is not torch.UntypedStorage and not (isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage)):
            raise HandleError(f"storage class {cls!r} is not allowed")
        if not isinstance(handle, bytes) or not isinstance(manager, bytes) or len(manager) > 4096:
            raise HandleError("storage handle must be a shared-memory name (bytes)")
        m = _SHM_NAME.match(handle)
        if m is None or int(m.group(1)) not in trusted:
            raise HandleError(f"shared-memory handle {handle[:64]!r} does not belong to the trusted process tree")
        if not isinstance(size, int) or size < 0:
            raise HandleError(f"bad storage size {size!r}")
        return rebuild_storage_filename(cls, manager, handle, size, dtype)

    return rebuild


def _checked_rebuild_tensor(cls, storage, metadata):
    from torch.multiprocessing.reductions import rebuild_tensor

    if cls not in (torch.Tensor, torch.nn.Parameter):
        raise HandleError(f"tensor class {cls!r} is not allowed")
    return rebuild_tensor(cls, storage, metadata)


class _HandleUnpickler(pickle.Unpickler):
    """Resolves only the allow-list of the module docstring; refuses persistent ids."""

    def __init__(self, data: bytes, trusted: frozenset[int]) -> None:
        super().__init__(io.BytesIO(data))
        import torch.multiprocessing.reductions as red

        allowed: dict[tuple[str, str], Any] = {
            ("torch.multiprocessing.reductions", "rebuild_tensor"): _checked_rebuild_tensor,
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"): red.rebuild_typed_storage,
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _checked_storage_filename(trusted),
            ("torch", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
            ("torch", "Size"): torch.Size,
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
            ("megatron_rl.weight_sync.ipc", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        }
        if torch.cuda.is_available():  # pragma: no cover - GPU only
            allowed[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = red.rebuild_cuda_tensor
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        fn = self._allowed.get((module, name))
        if fn is not None:
            return fn
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise HandleError(f"global {module}.{name} is not allowed in a weight payload")

    def persistent_load(self, pid: Any) -> Any:
        raise HandleError("persistent ids are not allowed in a weight payload")


def deserialize_named_tensors(payload: str, *, trusted_pids: frozenset[int],
                              load_format: Optional[str] = None) -> list[tuple[str, torch.Tensor]]:
    """Decode one entry of `serialized_named_tensors` into `(name, tensor)` pairs; with
    `load_format="flattened_bucket"` these are views into the bucket (copy them out, then drop).

    Args:
        payload: base64 of torch-multiprocessing's pickle (`serialize_named_tensors`).
        trusted_pids: pids whose shared-memory segments may be opened (the trusted process tree).
        load_format: None / "direct" (a list of pairs) or "flattened_bucket" (a dict).

    Raises:
        HandleError: bad base64, a refused global or handle, or an object of the wrong shape.
    """
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise HandleError(f"serialized_named_tensors: not base64 ({e})") from None
    try:
        obj = _HandleUnpickler(data, trusted_pids).load()
    except HandleError:
        raise
    except Exception as e:  # a malformed pickle or a handle that cannot be opened
        raise HandleError(f"serialized_named_tensors: cannot decode ({type(e).__name__}: {e})") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise HandleError("load_format flattened_bucket needs {'flattened_tensor', 'metadata'}")
        if not isinstance(obj["flattened_tensor"], torch.Tensor) or not isinstance(obj["metadata"], list):
            raise HandleError("flattened_tensor must be a tensor and metadata a list")
        return unpack_bucket(obj["flattened_tensor"], obj["metadata"])
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise HandleError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


# ---- the peer process (receiver) ---------------------------------------------------------


def _ppid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def in_process_tree(pid: int, root: int) -> bool:
    """Whether `pid` is `root` or a descendant of it (walks /proc/<pid>/stat parents; Linux)."""
    seen = 0
    while pid and seen < 4096:
        if pid == root:
            return True
        nxt = _ppid(pid)
        if nxt is None or nxt == pid:
            return False
        pid, seen = nxt, seen + 1
    return False


def process_tree(root: int) -> frozenset[int]:
    """`root` and every live descendant of it (one scan of /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _ppid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += children.get(p, [])
    return frozenset(out)


def _socket_inode(local_port: int, peer_port: int) -> Optional[int]:
    """Inode of the TCP socket bound to 127.0.0.1:`peer_port` connected to :`local_port`
    (the client's end of our connection), from /proc/net/tcp and tcp6."""
    want_local, want_remote = f"{peer_port:04X}", f"{local_port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[1].rsplit(":", 1)[1] == want_local and cols[2].rsplit(":", 1)[1] == want_remote:
                return int(cols[9])
    return None


def peer_pid(local_port: int, peer_port: int, candidates: Sequence[int]) -> Optional[int]:
    """The pid among `candidates` that holds the client end of the loopback TCP connection
    (`peer_port` -> our `local_port`), or None (Linux /proc; other processes are not scanned)."""
    inode = _socket_inode(local_port, peer_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in candidates:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


def shared_segments(pid: Optional[int] = None) -> list[str]:
    """torch `file_system` shared-memory segments of `pid` (default: this process) alive in /dev/shm."""
    prefix = f"torch_{os.getpid() if pid is None else pid}_"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def sweep_orphan_segments() -> list[tuple[str, int]]:
    """Remove torch `file_system` segments (/dev/shm/torch_<pid>_*) whose creating process is gone.

    Colocated runs keep the trainer's parameters in such segments for the whole run; torch's
    `torch_shm_manager` removes them when the trainer exits, even after SIGKILL, but not when the
    manager itself is killed with it (a whole-job SIGKILL: scancel, a time limit, the OOM killer),
    which leaves a model's worth of RAM in /dev/shm. Called when a colocated run starts. A segment
    of a live pid (ours, another job's) is never touched; one that cannot be removed is skipped.

    Returns:
        (name, bytes) of every segment removed.
    """
    removed = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(r"torch_(\d+)_.*", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue  # alive under another user, or not a pid
        path = os.path.join("/dev/shm", name)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
            removed.append((name, size))
        except OSError:
            continue
    return removed


def loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8 or ::1)."""
    try:
        return host == "::1" or socket.inet_aton(host)[0] == 127
    except OSError:
        return False


# ---- the sender (trainer) ----------------------------------------------------------------


class ColocatedSender:
    """Packs buckets into one reusable buffer and serialises each as one
    `/update_weights_from_tensor` payload (`flattened_bucket`). CPU: a shared-memory buffer;
    CUDA (untested here): a device buffer handed over by CUDA IPC, with `torch.cuda.ipc_collect()`
    after each bucket (`after_bucket`) and at `close`.

    Args:
        bucket_bytes: capacity of the buffer, bytes (grown when one tensor alone is bigger).
        device: where the buffer lives ("cpu" or a CUDA device).
    """

    def __init__(self, bucket_bytes: int, device: str | torch.device = "cpu") -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.device = torch.device(device)
        self._buffer: Optional[torch.Tensor] = None

    def payload(self, named: Sequence[tuple[str, torch.Tensor]]) -> str:
        """Pack `named` (one bucket) and return its serialised `flattened_bucket` payload, for one
        engine (`payloads` for several). The buffer is reused by the next call: post the payload and
        wait for the reply first."""
        return self.payloads(named, 1)[0]

    def payloads(self, named: Sequence[tuple[str, torch.Tensor]], copies: int) -> list[str]:
        """Pack `named` once and return `copies` serialisations of it, one per receiving engine (each
        serialisation takes one reference on the shared segment and each receiver drops one: a
        payload must be read by one engine only, or the segment is unlinked while the buffer is
        still reused)."""
        _, used = bucket_layout(named)
        if self._buffer is None or self._buffer.numel() < used:
            self._buffer = None
            self._buffer = _new_buffer(max(self.bucket_bytes, used), self.device)
        obj = {"flattened_tensor": self._buffer[:used], "metadata": _wire_metadata(pack_bucket(named, self._buffer))}
        return [serialize_named_tensors(obj) for _ in range(copies)]

    def after_bucket(self) -> None:
        """Release the IPC handles the receiver has let go of (CUDA: `torch.cuda.ipc_collect`)."""
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.ipc_collect()

    def close(self) -> None:
        """Free the buffer (its shared-memory segment is unlinked once the receiver dropped it)."""
        self._buffer = None
        self.after_bucket()


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes`: on CPU allocated straight in shared memory (`file_system`
    strategy), so that serialising it does not copy it there (`share_memory_` would); on CUDA a
    plain device tensor (its IPC handle is taken when serialised)."""
    if device.type != "cpu":  # pragma: no cover - GPU only
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        with _file_system_strategy():
            storage = torch.UntypedStorage._new_shared(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    except (AttributeError, RuntimeError):  # a torch without _new_shared: shared on first serialisation
        return torch.empty(nbytes, dtype=torch.uint8)


def _wire_metadata(metas: list[FlattenedTensorMetadata]) -> list[Any]:
    """Metadata as SGLang's own class when SGLang is importable (a real server's unpickler needs
    it), else as dicts of its fields (what the embedded server reads)."""
    try:  # pragma: no cover - SGLang is not installed in the trainer's environment here
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SGLangMeta

        return [SGLangMeta(name=m.name, shape=torch.Size(m.shape), dtype=dtype_from_name(m.dtype),
                           start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel) for m in metas]
    except ImportError:
        return [dict(m.__dict__) for m in metas]
