"""Run untrusted model-written Python in a fresh, limited process per call, from a warm pool.

`Sandbox` is the interface the tools use (`run(code) -> SandboxResult`, `run_many`); a cluster can
put a stronger one (a container or microVM service) behind it. `ProcessSandbox` is the local one:
each call gets a new worker process (`sandbox_worker.py`, started ahead of time so the interpreter's
start-up is off the call's path), its own throw-away working directory (deleted after the call), a
scrubbed environment, and the layers listed in `sandbox_worker`'s docstring; the trainer enforces
the wall-clock limit (SIGKILL by pidfd to the program's process, init of its PID namespace, so every
process of the call dies; then any living process of the call's own uid), and caps stdout / stderr
while reading them (`output_cap`: head and tail kept, UTF-8 bytes, bounded memory).

What it is not: a VM. All layers share the host kernel, so a kernel bug is an escape; reading files
the sandbox uid may read (the standard library, world-readable files) is allowed; a program can
use its CPU and memory limits in full. Which layers were active is in `ProcessSandbox.layers` and
in each result's `layers`; `SandboxConfig.require_network_isolation` refuses to start without one.
The in-interpreter audit hook is a convenience (a readable error), never the boundary.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.tools.output_cap import OutputCap

logger = logging.getLogger(__name__)

_WORKER = Path(__file__).with_name("sandbox_worker.py")
_READABLE = ("/usr", "/lib", "/lib64", "/bin", "/dev/urandom", "/dev/zero", "/proc/self", "/proc/thread-self",
             "/sys/devices/system/cpu", "/etc/ld.so.cache", "/etc/localtime", "/etc/os-release")
_PID_MAX = 1 << 22  # the kernel's largest pid_max
_MAX_WORKERS = 256  # the largest pool_size and max_concurrency (each a process or thread)
_READY = b"__mrl_sandbox_ready__"  # sandbox_worker.READY (the worker is never imported here)


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (no isolation available, a worker that does not start)."""


@dataclass(kw_only=True)
class SandboxConfig:
    """Limits and layers of `ProcessSandbox`; keys of the `python` tool's `config` in a tool config."""

    wall_timeout_s: float = 10.0
    """Wall-clock limit of one call in seconds, start-up excluded (finite, > 0); then the process group is killed."""
    cpu_time_s: int = 5
    """CPU-time limit in seconds (RLIMIT_CPU, >= 1); the kernel kills the program at this plus 1 s."""
    memory_mib: int = 1024
    """Address-space limit in MiB (RLIMIT_AS, >= 64); a larger allocation raises MemoryError."""
    max_processes: int = 16
    """Processes and threads the program may have at once (RLIMIT_NPROC, >= 1; per sandbox uid)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE, >= 16)."""
    max_file_size_mib: int = 16
    """Largest file the program may write, MiB (RLIMIT_FSIZE, >= 0)."""
    disk_mib: int = 64
    """Size of the working directory in MiB: a private tmpfs (memory-backed) in the worker's own mount
    namespace, invisible outside; 0 = a plain folder under `work_root` (only `max_file_size_mib` per file)."""
    max_output_bytes: int = 4096
    """stdout and stderr are each cut to this many UTF-8 bytes (>= 64) while they are read: a head and
    a tail are kept (`output_head_fraction`), the middle is dropped and replaced by a marker that
    states the number of bytes omitted. The program is never killed for writing more."""
    output_head_fraction: float = 0.25
    """Share of `max_output_bytes` kept from the start of each stream (0 to 1); the rest is kept from
    the end, where results and tracebacks are (the default keeps 1024 head + 3072 tail bytes)."""
    max_code_bytes: int = 1 << 20
    """A longer program is refused without running (bytes, >= 1)."""
    pool_size: int = 4
    """Workers kept started and waiting (0 to 256; 0 starts every call cold)."""
    max_concurrency: int = 16
    """Calls run at once by `run_many` (threads waiting on worker processes, 1 to 256)."""
    network_namespace: bool = True
    """Run in a new network namespace (no interfaces up: no network at all)."""
    pid_namespace: bool = True
    """Run as init of a new PID namespace (killing it kills every process the program started)."""
    ipc_namespace: bool = True
    """Run in a new IPC namespace: SysV shared memory, message queues, semaphores and POSIX message
    queues are the call's own, bounded (shared memory to `memory_mib` in all) and gone with it. Off, or
    where no namespace can be made, seccomp refuses `shmget`, `msgget`, `semget` and `mq_open`."""
    landlock: bool = True
    """Landlock: writes only below the working directory, TCP refused (Linux >= 5.13)."""
    readable_paths: list[str] = field(default_factory=lambda: list(_READABLE))
    """With Landlock: the only paths the program may read, besides its working directory and the
    interpreter's own folders (`sys.prefix`, `sys.path`); a missing path is skipped."""
    seccomp: bool = True
    """A seccomp-bpf filter: `socket()` of any family refused (unix path sockets included), no new
    namespaces, no io_uring, no kernel keyrings (`add_key`, `request_key`, `keyctl`), no file watches
    (`inotify_init*`, `fanotify_init`), no `memfd_create` (unless `allow_memfd`), no SysV IPC or `mq_open` without an IPC namespace (x86_64 and aarch64;
    elsewhere the layer is recorded as unavailable)."""
    allow_memfd: bool = False
    """Let the program call `memfd_create` (refused by seccomp by default: its memory is not counted
    by RLIMIT_AS)."""
    audit_hook: bool = True
    """A `sys.addaudithook` guard in the program's interpreter (bypassable; the last layer)."""
    drop_to_uid: int = 65534
    """When the trainer runs as root, the uid and gid the program runs as if `per_call_uid_base` is 0
    (0 keeps root, without capabilities: unsafe)."""
    per_call_uid_base: int = 2_000_000_000
    """When the trainer runs as root (and `drop_to_uid` is not 0): each call runs as its own uid and gid,
    this plus the worker's host pid (unique while the call lives), so RLIMIT_NPROC is per call and every
    process of a call can be found and killed by its uid. The `per_call_uid_base` .. +4194304 (pid_max)
    range must belong to no one on the host. 0 = every call shares `drop_to_uid`."""
    require_network_isolation: bool = True
    """Refuse to start unless a kernel layer (network namespace or Landlock TCP) blocks the network."""
    python_executable: str = ""
    """Interpreter for the program ("" = the trainer's `sys.executable`)."""
    site_packages: bool = True
    """Let the program import installed packages (numpy, sympy, ...); False runs `python -I -S`."""
    preload_modules: list[str] = field(default_factory=list)
    """Modules each worker imports before the call (off the call's path), e.g. ["numpy", "sympy"]."""
    work_root: str = ""
    """An existing folder under which each call's working directory is made ("" = the system temp folder)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the program; nothing else of the trainer's environment passes."""

    def __post_init__(self) -> None:
        bounds = {"wall_timeout_s": (1e-9, None), "cpu_time_s": (1, None), "memory_mib": (64, None),
                  "max_processes": (1, None), "max_open_files": (16, None), "max_file_size_mib": (0, None),
                  "disk_mib": (0, None), "max_output_bytes": (64, None), "output_head_fraction": (0, 1),
                  "max_code_bytes": (1, None), "pool_size": (0, _MAX_WORKERS), "max_concurrency": (1, _MAX_WORKERS),
                  "drop_to_uid": (0, 2**32 - 2), "per_call_uid_base": (0, 2**32 - 2 - _PID_MAX)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            kind = (int, float) if name in ("wall_timeout_s", "output_head_fraction") else int
            if not isinstance(value, kind) or isinstance(value, bool):  # "10" (a string) fails here, named
                raise ValueError(f"sandbox {name} must be a number, got {value!r} (see SandboxConfig.{name})")
        # NaN compares false with everything; .inf passes any lower bound: a limit must be finite
        checks = [(name, math.isfinite(getattr(self, name)) and low <= getattr(self, name)
                   and (high is None or getattr(self, name) <= high)) for name, (low, high) in bounds.items()]
        checks.append(("per_call_uid_base", self.per_call_uid_base == 0 or self.per_call_uid_base >= 1000))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"sandbox {name}={getattr(self, name)!r} is out of range (see SandboxConfig.{name})")
        if not isinstance(self.preload_modules, list) or not all(isinstance(m, str) for m in self.preload_modules):
            raise TypeError(f"sandbox preload_modules must be a list of module names, got {self.preload_modules!r}")
        if not isinstance(self.readable_paths, list) or not all(isinstance(p, str) for p in self.readable_paths):
            # a bare string would be iterated character by character: "/" makes the whole filesystem readable
            raise ValueError(f"sandbox readable_paths must be a list of paths, got {self.readable_paths!r}")
        for name in ("network_namespace", "pid_namespace", "ipc_namespace", "landlock", "seccomp", "allow_memfd",
                     "audit_hook",
                     "require_network_isolation", "site_packages"):
            if not isinstance(getattr(self, name), bool):  # 'false' (a string) would leave the layer on
                raise ValueError(f"sandbox {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.work_root, str) or (self.work_root and not os.path.isdir(self.work_root)):
            raise ValueError(f"sandbox work_root={self.work_root!r} is not an existing folder (see SandboxConfig.work_root)")


@dataclass(kw_only=True)
class SandboxResult:
    """One program's run."""

    stdout: str
    """Its standard output, cut to `max_output_bytes` as head + omitted-bytes marker + tail (decoded
    as UTF-8, bad bytes replaced)."""
    stderr: str
    """Its standard error, cut the same way."""
    exit_code: int | None
    """0 on success; 128 + N when killed by signal N; None when it never ran."""
    error: str = ""
    """Why it failed in words ("" on success): time-out, CPU limit, exit status, refusal."""
    timed_out: bool = False
    """Killed at the wall-clock limit."""
    truncated: bool = False
    """Some of stdout or stderr was dropped."""
    stdout_omitted_bytes: int = 0
    """Bytes of stdout dropped by the cap (also stated in the marker inside `stdout`)."""
    stderr_omitted_bytes: int = 0
    """Bytes of stderr dropped by the cap."""
    wall_s: float = 0.0
    """Seconds from sending the program to the worker's exit."""
    cpu_s: float = 0.0
    """CPU seconds the worker and its children used."""
    layers: dict[str, Any] = field(default_factory=dict)
    """The isolation layers the worker reported active (and why a missing one is missing)."""
    infrastructure: bool = False
    """The program never ran because the sandbox itself failed (a worker that could not start or
    never got ready): not the program's doing (`ToolResult.infrastructure`, CASES.md T10)."""

    @property
    def ok(self) -> bool:
        """The program ran and exited 0."""
        return self.exit_code == 0 and not self.error


class Sandbox(ABC):
    """Where tools run untrusted code. Implementations must never raise for what the code does."""

    @abstractmethod
    def run(self, code: str) -> SandboxResult:
        """Run one Python program; its failures come back in the result."""

    def run_many(self, codes: Sequence[str]) -> list[SandboxResult]:
        """Run several programs (of different samples) concurrently; results in input order.
        This default runs them one after the other."""
        return [self.run(c) for c in codes]

    def close(self) -> None:
        """Stop workers and delete their folders. Calling it twice is harmless."""


def _drain(fds: set[int], caps: dict) -> None:
    """Read what the exited program left in its pipes (`fds`), without waiting: everything it wrote
    before it exited is there. The read loop stops 0.5 s after the exit (a descendant outside the PID
    namespace may hold a pipe open); a trainer thread that did not run for those 0.5 s (a loaded
    machine, the GIL) used to leave that output unread: the model then saw an empty answer (the cause
    of a resumed tool run that differed from the uninterrupted one in CI)."""
    for fd in fds:
        os.set_blocking(fd, False)
        try:
            for _ in range(64):  # at most 4 MiB a pipe (a writer outside the namespace may still write)
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                caps[fd].feed(chunk)
        except BlockingIOError:
            pass


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` (a pidfd: readable once its process exited) becomes readable within `timeout_s`.
    poll, never select.select: a trainer with >= 1024 open files has descriptors select cannot take."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        if poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            return True
        if time.monotonic() >= deadline:
            return False


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _uid_of(pid: str) -> int:
    """The real uid of a living process (the /proc folder's owner can be root); -1 for a zombie (dead,
    waiting for its parent, often the host's init, to collect it) or a process that is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return -1
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def processes_of_uid(uid: int) -> list[int]:
    """Ids of the living processes whose real uid is `uid` (as this process sees /proc)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]


def kill_uid(uid: int, rounds: int = 50) -> bool:
    """SIGKILL every process running as `uid` until none is left (a process forking meanwhile is caught
    in the next round; RLIMIT_NPROC bounds them). Returns whether none is left. Only for a uid that
    belongs to one call: never the shared `drop_to_uid`."""
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
    return not processes_of_uid(uid)


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _workdir_prefix() -> str:
    """`mrl-tool-<pid namespace>-<trainer pid>-`: whose folder it is, so a later trainer can remove the
    folders of one that was SIGKILLed (`remove_dead_workdirs`)."""
    return f"mrl-tool-{_pid_ns()}-{os.getpid()}-"


_WORKDIR_NAME = re.compile(r"mrl-tool-(\d+)-(\d+)-[A-Za-z0-9_]{8}")  # tempfile.mkdtemp's 8 characters


def remove_dead_workdirs(root: str = "") -> list[str]:
    """Delete the call folders under `root` ("" = the temp folder) left by a trainer that died without
    cleaning up (SIGKILL, OOM): only folders named by `_workdir_prefix` in this PID namespace, owned by
    this uid, whose trainer pid no longer exists (a reused pid keeps them: left, never wrongly removed).
    Returns the removed paths."""
    root = root or tempfile.gettempdir()
    ns, removed = _pid_ns(), []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for e in entries:
        m = _WORKDIR_NAME.fullmatch(e.name)
        if not m or int(m.group(1)) != ns or int(m.group(2)) == os.getpid():
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            os.kill(int(m.group(2)), 0)
            continue  # its trainer lives (or its pid was reused): not ours to judge
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    if removed:
        logger.info("removed %d sandbox folders of dead trainers under %s", len(removed), root)
    return removed


class _Worker:
    """One started worker process and its working directory."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.workdir = tempfile.mkdtemp(prefix=_workdir_prefix(), dir=cfg.work_root or None)
        keys = ("cpu_time_s", "memory_mib", "max_processes", "max_open_files", "max_file_size_mib", "disk_mib",
                "network_namespace", "pid_namespace", "ipc_namespace", "landlock", "seccomp", "allow_memfd",
                "audit_hook", "drop_to_uid",
                "per_call_uid_base", "readable_paths", "preload_modules")
        spec = {"workdir": self.workdir, **{k: getattr(cfg, k) for k in keys}}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.workdir,
               "TMPDIR": self.workdir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **cfg.env}
        argv = [cfg.python_executable or sys.executable, "-I", *([] if cfg.site_packages else ["-S"]),
                str(_WORKER), json.dumps(spec)]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         cwd=self.workdir, env=env, start_new_session=True, close_fds=True)
        except OSError:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.layers: dict[str, Any] | None = None
        self.pending_stdout = b""
        self.init_fd: int | None = None  # a pidfd of the PID namespace's init (the program's process)
        self.init_pid = 0
        self.own_uid = cfg.per_call_uid_base and os.geteuid() == 0 and cfg.drop_to_uid

    def wait_ready(self, timeout_s: float) -> str:
        """Read the ready line (once); returns "" or why the worker did not get ready."""
        if self.layers is not None:
            return ""
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return f"the sandbox worker did not start within {timeout_s:.0f} s"
                chunk = os.read(fd, 65536)
                if not chunk:
                    try:
                        self.proc.wait(timeout=5)
                        err = self.proc.stderr.read(4000).decode("utf-8", "replace").strip()[-2000:]
                    except subprocess.TimeoutExpired:
                        err = "(closed its stdout without exiting)"
                    return f"the sandbox worker exited while starting: {err}"
                buf += chunk
        line, self.pending_stdout = buf.split(b"\n", 1)
        if not line.startswith(_READY):
            return f"the sandbox worker wrote {line[:200]!r} instead of its ready line"
        self.layers = json.loads(line[len(_READY):])
        init = self.layers.pop("init_pid", None)
        try:
            fd = os.pidfd_open(init)
        except (OSError, TypeError):
            return f"the sandbox worker's program process {init!r} is not there"
        if init != self.proc.pid and _ppid(init) != self.proc.pid:  # checked after the pidfd: no pid reuse
            os.close(fd)
            return f"the sandbox worker reported process {init}, which is not its own"
        self.init_fd, self.init_pid = fd, init
        return ""

    def kill(self) -> None:
        """SIGKILL the program's process (init of its PID namespace: every process it started dies with
        it, whatever session it moved to and whatever it did to PR_SET_PDEATHSIG), the worker and its
        process group. Uses os.kill, never Popen.kill, which would reap the process before `wait4` can."""
        if self.proc.returncode is not None:
            return
        if self.init_fd is not None:
            try:
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.init_pid != self.proc.pid:  # the worker outside reaps it (no zombie left) and exits
                try:
                    worker_fd = os.pidfd_open(self.proc.pid)
                except ProcessLookupError:
                    pass
                else:
                    try:
                        _readable(worker_fd, 2)
                    finally:
                        os.close(worker_fd)
        for kill, target in ((os.killpg, self.proc.pid), (os.kill, self.proc.pid)):
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def finish(self) -> None:
        """After `kill` and the worker's exit: wait until the program's process has fully exited (for a
        PID namespace's init that is after every process of the namespace is gone), then kill whatever
        still runs as the call's own uid (the fallback without a PID namespace). Nothing of the call
        survives it."""
        if self.init_fd is not None:
            if not _readable(self.init_fd, 5):
                logger.warning("the sandbox program's process did not exit within 5 s of SIGKILL")
            os.close(self.init_fd)
            self.init_fd = None
        uid = (self.layers or {}).get("uid")
        if self.own_uid and uid:
            kill_uid(uid)

    def cleanup(self) -> None:
        """After `kill` and the worker's exit: `finish`, close the pipes, delete the folder."""
        try:
            self.finish()
        finally:  # the pipes and the folder go even if `finish` failed
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
            shutil.rmtree(self.workdir, ignore_errors=True)
        if os.path.exists(self.workdir):
            logger.warning("could not remove the sandbox folder %s", self.workdir)


class ProcessSandbox(Sandbox):
    """The local sandbox: a fresh limited process per call, taken from a pool of started workers.

    Thread-safe: `run` may be called from several threads; `run_many` uses up to
    `max_concurrency` of its own. Raises `SandboxError` at construction when the first worker
    does not start or `require_network_isolation` is set and no kernel layer blocks the network.
    """

    _START_TIMEOUT_S = 60.0

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False
        self._refilling = False
        self._refill_thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="sandbox")
        remove_dead_workdirs(self.config.work_root)
        probe = _Worker(self.config)
        why = probe.wait_ready(self._START_TIMEOUT_S)
        if why:
            probe.kill()
            probe.proc.wait()
            probe.cleanup()
            raise SandboxError(why)
        self.layers: dict[str, Any] = dict(probe.layers or {})
        if self.config.require_network_isolation and not self.network_isolated(self.layers):
            probe.kill()
            probe.proc.wait()
            probe.cleanup()
            raise SandboxError(
                "no kernel layer blocks the network here (network namespace: "
                f"{self.layers.get('namespaces_error', 'off')}; Landlock: {self.layers.get('landlock_error', 'off')}); "
                "set require_network_isolation: false to run with the audit hook alone")
        logger.info("python sandbox layers: %s", self.layers)
        self._idle.append(probe)
        self._refill()

    @staticmethod
    def network_isolated(layers: dict[str, Any]) -> bool:
        """Whether the reported layers include a kernel-enforced network block."""
        return (bool(layers.get("network_namespace")) or int(layers.get("landlock_abi", 0)) >= 4
                or bool(layers.get("seccomp")))  # no socket() at all

    def _refill_in_background(self) -> None:
        """Start the missing workers on a thread of their own, off the caller's path."""
        with self._lock:
            if self._closed or self._refilling or len(self._idle) >= self.config.pool_size:
                return
            self._refilling = True
            self._refill_thread = threading.Thread(target=self._refill, name="sandbox-refill", daemon=True)
            self._refill_thread.start()

    def _refill(self) -> None:
        try:
            self._refill_loop()
        finally:
            with self._lock:
                self._refilling = False

    def _refill_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed or len(self._idle) >= self.config.pool_size:
                    return
            w = _Worker(self.config)
            with self._lock:
                if self._closed:
                    w.kill()
                    w.proc.wait()
                    w.cleanup()
                    return
                self._idle.append(w)

    def _take(self) -> tuple[_Worker, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(0), True
        return _Worker(self.config), False

    def run(self, code: str) -> SandboxResult:
        """Run `code` in a fresh worker; see `SandboxResult` (never raises for the program's behaviour)."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        data = code.encode("utf-8", errors="replace")
        if len(data) > self.config.max_code_bytes:
            limit = self.config.max_code_bytes
            return SandboxResult(stdout="", stderr="", exit_code=None,
                                 error=f"the program is {len(data)} bytes, over the limit of {limit}")
        try:
            worker, warm = self._take()
        except OSError as e:
            return SandboxResult(stdout="", stderr="", exit_code=None, error=f"the sandbox could not start: {e}",
                                 infrastructure=True)
        try:
            result = self._run_in(worker, data)
            result.layers = dict(worker.layers or {}, warm=warm)
            return result
        finally:  # each step on its own: one that fails must not skip the others (a leaked folder or group)
            try:
                worker.kill()
            except Exception:
                logger.exception("killing sandbox worker %d failed", worker.proc.pid)
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("sandbox worker %d did not exit after SIGKILL", worker.proc.pid)
            except Exception:
                logger.exception("waiting for sandbox worker %d failed", worker.proc.pid)
            try:
                worker.cleanup()
            except Exception:
                logger.exception("cleaning up after sandbox worker %d failed", worker.proc.pid)
                shutil.rmtree(worker.workdir, ignore_errors=True)
            self._refill_in_background()

    def _run_in(self, worker: _Worker, data: bytes) -> SandboxResult:
        cfg = self.config
        why = worker.wait_ready(self._START_TIMEOUT_S)
        if why:
            return SandboxResult(stdout="", stderr="", exit_code=None, error=why, infrastructure=True)
        t0 = time.monotonic()
        deadline = t0 + cfg.wall_timeout_s
        try:
            worker.proc.stdin.write(data)
            worker.proc.stdin.close()
        except BrokenPipeError:
            pass
        head = int(cfg.max_output_bytes * cfg.output_head_fraction)
        caps = {fd: OutputCap(head, cfg.max_output_bytes - head)
                for fd in (worker.proc.stdout.fileno(), worker.proc.stderr.fileno())}
        caps[worker.proc.stdout.fileno()].feed(worker.pending_stdout)
        timed_out = False
        exited_at = None
        pidfd = os.pidfd_open(worker.proc.pid)
        with selectors.DefaultSelector() as sel:
            for fd in caps:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(pidfd, selectors.EVENT_READ)
            open_fds = set(caps)
            while True:
                now = time.monotonic()
                if exited_at is not None and (not open_fds or now - exited_at > 0.5):
                    break  # after the exit, descendants outside a PID namespace may hold the pipes
                if now >= deadline and exited_at is None:
                    if not _readable(pidfd, 0):
                        timed_out = True
                        break
                    sel.unregister(pidfd)  # it exited in time; this thread just did not look (load, GIL)
                    exited_at = now
                for key, _ in sel.select(0.5 if exited_at is not None else min(deadline - now, 0.5)):
                    if key.fd == pidfd:
                        sel.unregister(pidfd)
                        exited_at = time.monotonic()
                        continue
                    chunk = os.read(key.fd, 1 << 16)  # read as written, kept within the cap: bounded memory
                    if not chunk:
                        sel.unregister(key.fd)
                        open_fds.discard(key.fd)
                        continue
                    caps[key.fd].feed(chunk)
        if not timed_out:
            _drain(open_fds, caps)
        os.close(pidfd)
        worker.kill()
        _, status, usage = os.wait4(worker.proc.pid, 0)
        worker.proc.returncode = code = os.waitstatus_to_exitcode(status)
        exit_code = 128 - code if code < 0 else code
        cpu_s = usage.ru_utime + usage.ru_stime
        out_cap, err_cap = caps.values()
        stdout, stderr = out_cap.text(), err_cap.text()
        if timed_out:
            error = f"timed out: the program ran past the wall-clock limit of {cfg.wall_timeout_s:g} s and was killed"
        elif exit_code != 0 and cpu_s >= cfg.cpu_time_s - 0.05:
            error = f"killed: the program used its CPU-time limit of {cfg.cpu_time_s} s"
        elif exit_code > 128:
            sig = exit_code - 128
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            error = f"killed by signal {name}"
        elif exit_code != 0:
            error = f"the program exited with status {exit_code}"
        else:
            error = ""
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, error=error, timed_out=timed_out,
                             truncated=bool(out_cap.omitted or err_cap.omitted), stdout_omitted_bytes=out_cap.omitted,
                             stderr_omitted_bytes=err_cap.omitted, wall_s=time.monotonic() - t0, cpu_s=cpu_s)

    def run_many(self, codes: Sequence[str]) -> list[SandboxResult]:
        """Run the programs concurrently (up to `max_concurrency` at once); results in input order."""
        return list(self._executor.map(self.run, codes))

    def close(self) -> None:
        """Kill the idle workers, delete their folders, stop the thread pool."""
        with self._lock:
            self._closed, refill = True, self._refill_thread
        if refill is not None:
            refill.join(timeout=30)  # it stops at its next check and removes the worker it was starting
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()
            w.proc.wait()
            w.cleanup()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> ProcessSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def idle_pids(self) -> list[int]:
        """Process ids of the started workers waiting in the pool."""
        with self._lock:
            return [w.proc.pid for w in self._idle]

    def describe(self) -> dict[str, Any]:
        """The config and the active layers, for the run's log."""
        return {"config": asdict(self.config), "layers": dict(self.layers)}
