"""The second breaker pass's findings (docs/MULTITURN.md, "breaker findings, second pass"): SysV IPC and
kernel keyrings that outlived the call, `memfd_create` outside RLIMIT_AS, a trainer with >= 1024 open
files whose every call failed, quadratic tool-call parsing, and folders left by a SIGKILLed trainer.
As in test_sandbox_breaker.py, each hostile program first disables the in-interpreter audit hook, so
only the kernel layers are checked.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.tools.base import ToolCall, ToolResult
from megatron_rl.tools.parsing import MAX_CALLS_PER_TURN, parse_tool_calls, run_tool_call
from megatron_rl.tools.python_sandbox import PythonTool
from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig, SandboxError, remove_dead_workdirs

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the per-call uid and the host's IPC need root (CI runs as root)")
pytestmark = pytest.mark.skipif(not hasattr(os, "unshare"), reason="Linux only")

LIMITS = dict(cpu_time_s=2, wall_timeout_s=5, memory_mib=512, max_processes=8, disk_mib=8, pool_size=0)

BYPASS = """
import gc
for o in gc.get_objects():
    if isinstance(o, set) and "ctypes.dlopen" in o:
        o.clear()  # the audit hook now allows everything
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
"""


def _sandbox(**config) -> ProcessSandbox:
    try:
        return ProcessSandbox(SandboxConfig(**{**LIMITS, **config}))
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")


def _run(code: str, **config):
    sb = _sandbox(**config)
    try:
        return sb.run(textwrap.dedent(BYPASS + code))
    finally:
        sb.close()


# ---- HIGH: SysV IPC shared with the host, outliving the call ---------------------------------------

KEY = 0x4D520000 + os.getpid() % 0xFFFF  # this test's own keys
IPC_CREATE = """
libc.shmget.restype = ctypes.c_int
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
sid = libc.shmget({key}, 1 << 20, 0o1000 | 0o666)  # IPC_CREAT, 1 MiB, world readable
if sid < 0:
    print("shmget", os.strerror(ctypes.get_errno()))
else:
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 0x41, 1 << 20)
    q = libc.msgget({key} + 1, 0o1000 | 0o666)
    class M(ctypes.Structure):
        _fields_ = [("t", ctypes.c_long), ("d", ctypes.c_char * 64)]
    print("created", sid >= 0, q >= 0, libc.msgsnd(q, ctypes.byref(M(1, b"from call A")), 64, 0o4000) == 0)
"""
IPC_ATTACH = """
print(libc.shmget({key}, 0, 0), os.strerror(ctypes.get_errno()), libc.msgget({key} + 1, 0), os.strerror(ctypes.get_errno()))
"""


def _host_ipc(kind: str) -> list[dict[str, int]]:
    """The host's SysV objects (/proc/sysvipc/shm or msg of this, the trainer's, IPC namespace)."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
    head = lines[0].split()
    return [dict(zip(head, map(int, line.split()))) for line in lines[1:]]


def _remove_host_ipc(key: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for row in _host_ipc("shm"):
        if row["key"] == key:
            libc.shmctl(row["shmid"], 0, None)  # IPC_RMID
    for row in _host_ipc("msg"):
        if row["key"] == key + 1:
            libc.msgctl(row["msqid"], 0, None)


@ROOT_ONLY
def test_sysv_ipc_dies_with_the_call():
    """Before: a 1 MiB segment and a message queue made by one call stayed in the host's IPC namespace
    (unbounded by memory_mib, readable and removable by later calls). Now each call has an IPC
    namespace of its own: nothing is left on the host and a second call cannot find the key."""
    sb = _sandbox()
    try:
        r = sb.run(textwrap.dedent(BYPASS + IPC_CREATE.format(key=KEY)))
        assert r.ok and r.stdout == "created True True True\n", (r.stdout, r.stderr)
        assert r.layers["ipc_namespace"] is True and r.layers["ipc_bounded_mib"] == LIMITS["memory_mib"]
        uid = r.layers["uid"]
        left = [row for kind in ("shm", "msg") for row in _host_ipc(kind) if row["uid"] == uid or row["key"] in (KEY, KEY + 1)]
        assert left == []
        r2 = sb.run(textwrap.dedent(BYPASS + IPC_ATTACH.format(key=KEY)))
        assert r2.stdout == "-1 No such file or directory -1 No such file or directory\n", (r2.stdout, r2.stderr)
    finally:
        sb.close()
        _remove_host_ipc(KEY)


@ROOT_ONLY
@pytest.mark.parametrize("seccomp", [True, False])
def test_without_an_ipc_namespace_seccomp_refuses_sysv_ipc(seccomp):
    """The fallback where no IPC namespace is made: seccomp refuses shmget, msgget, semget, mq_open.
    Control (seccomp off too): the segment is made in the host's namespace and outlives the call."""
    try:
        r = _run(IPC_CREATE.format(key=KEY), ipc_namespace=False, seccomp=seccomp)
        assert r.layers["ipc_namespace"] is False
        if seccomp:
            assert r.stdout == "shmget Operation not permitted\n", (r.stdout, r.stderr)
            assert "shmget, msgget, semget, mq_open" in r.layers["seccomp"]
            assert [row for row in _host_ipc("shm") if row["key"] == KEY] == []
        else:
            assert r.stdout == "created True True True\n", (r.stdout, r.stderr)
            (row,) = [row for row in _host_ipc("shm") if row["key"] == KEY]
            assert row["size"] == 1 << 20 and row["uid"] == r.layers["uid"]
    finally:
        _remove_host_ipc(KEY)


# ---- MEDIUM: kernel keyrings; memfd_create -----------------------------------------------------------

ADD_KEY = """
nr = {{"x86_64": 248, "aarch64": 217}}[os.uname().machine]
libc.syscall.restype = ctypes.c_long
print(libc.syscall(nr, b"user", b"k", b"x" * 4000, 4000, -4), os.strerror(ctypes.get_errno()))  # the user keyring
"""


@ROOT_ONLY
def test_add_key_is_refused():
    """Before: 200 keys of 4000 bytes stayed in the call uid's keyring after the call (and uids come
    back: base + pid). Now add_key, request_key and keyctl fail with EPERM."""
    r = _run(ADD_KEY.format())
    assert r.stdout == "-1 Operation not permitted\n", (r.stdout, r.stderr)
    assert "add_key, request_key, keyctl" in r.layers["seccomp"]


MEMFD = """
try:
    fd = os.memfd_create("m")
    os.write(fd, b"z" * (1 << 20))
    print("memfd", os.fstat(fd).st_size)
except OSError as e:
    print("refused", e.strerror)
"""


@ROOT_ONLY
@pytest.mark.parametrize("allow", [False, True])
def test_memfd_create_is_refused_unless_allowed(allow):
    """Before: memfd files held memory outside RLIMIT_AS (640 MiB with a 256 MiB limit). Now refused;
    the control `allow_memfd: true` gets it."""
    r = _run(MEMFD, allow_memfd=allow)
    assert r.stdout == ("memfd 1048576\n" if allow else "refused Operation not permitted\n"), (r.stdout, r.stderr)
    assert ("memfd_create" in r.layers["seccomp"]) != allow


WATCH = """
import time
fd = libc.inotify_init1(0)
if fd < 0:
    print("refused", os.strerror(ctypes.get_errno()))
else:
    import select
    libc.inotify_add_watch(fd, {folder!r}.encode(), 0xfff)
    ready = select.select([fd], [], [], 4.0)[0]
    print("seen", bool(ready) and b"made_by_the_host" in os.read(fd, 4096))
"""


@ROOT_ONLY
@pytest.mark.parametrize("seccomp", [True, False])
def test_file_watches_are_refused(seccomp):
    """Third breaker pass: Landlock does not cover inotify / fanotify, so a watch on a world-readable
    folder (here one like /tmp) reported the names of files the host created there during the call.
    Now inotify_init* and fanotify_init fail with EPERM; the control without seccomp sees the name."""
    import tempfile
    import threading
    import time

    folder = tempfile.mkdtemp(prefix="mrl-watch-test-")
    os.chmod(folder, 0o755)
    try:
        done = threading.Event()

        def make():  # a new file every 0.2 s until the call ends: one lands after the watch, however slow the start
            for i in range(40):
                if done.wait(0.2):
                    return
                Path(folder, f"made_by_the_host_{i}").write_text("x")

        maker = threading.Thread(target=make)
        maker.start()
        try:
            r = _run(WATCH.format(folder=folder), seccomp=seccomp)
        finally:
            done.set()
            maker.join()
        assert r.stdout == ("refused Operation not permitted\n" if seccomp else "seen True\n"), (r.stdout, r.stderr)
        if seccomp:
            assert "inotify_init1" in r.layers["seccomp"] and "fanotify_init" in r.layers["seccomp"]
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


# ---- MEDIUM: a trainer with >= 1024 open files --------------------------------------------------------

def test_a_trainer_with_many_open_files_still_runs_calls(tmp_path):
    """Before: select.select in the worker's kill raised "filedescriptor out of range in select()" once
    the trainer held >= 1024 descriptors: every call was an infrastructure failure and left its folder.
    Now poll is used, and run's clean-up steps cannot skip one another."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1300")
    if soft != resource.RLIM_INFINITY and soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1300, hard))
    fds = []
    tool = None
    try:
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        assert max(fds) >= 1024
        try:
            tool = PythonTool(**{**LIMITS, "work_root": str(tmp_path)})
        except SandboxError as e:
            pytest.skip(f"no sandbox on this machine: {e}")
        r = run_tool_call(ToolCall(name="python", arguments={"code": "print(6*7)"}), {"python": tool})
        assert (r.ok, r.output, r.infrastructure, r.error) == (True, "42\n", False, "")
    finally:
        if tool is not None:
            tool.close()
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert list(tmp_path.iterdir()) == []  # every folder removed


# ---- MEDIUM: quadratic tool-call parsing ---------------------------------------------------------------

class _CountingText(str):
    """A text that counts the characters its `find` calls examine (the parser's scans)."""

    scanned = 0

    def find(self, sub, start=0, end=None):  # noqa: D102
        at = str.find(self, sub, start, len(self) if end is None else end)
        self.scanned += (len(self) if at < 0 else at + len(sub)) - start
        return at


@pytest.mark.parametrize("n", [10, 20000])
def test_tool_call_parsing_is_linear(n):
    """Before: `<tool_call>(.*?)</tool_call>` with finditer and sub searched to the end of the text from
    every unclosed opener (16000 openers: 52 s holding the GIL). Now one scan with str.find: the
    characters examined are at most the text's length plus one opener per call, and N unclosed
    openers give one error whatever N (hermes); a code block without its closing fence is no call."""
    text = _CountingText("<tool_call>" * n)
    assert parse_tool_calls(text, fmt="hermes") == [
        ToolResult(ok=False, error="malformed tool call: <tool_call> without a closing </tool_call>")]
    assert len(text) <= text.scanned <= len(text) + len("<tool_call>")
    # every ```python opener holds a fence that closes the block before it, so only the last can be
    # unclosed: the code format was never quadratic; an unclosed block is still one scan and no call
    code = _CountingText("```python\n" + "print(1)\n" * n)
    assert parse_tool_calls(code, fmt="code") == [] and len(code) - 1 <= code.scanned <= len(code)  # the newline is matched, not found


@pytest.mark.parametrize("fmt, call", [
    ("hermes", '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>\n'),
    ("code", "```python\n1\n```\n"),
])
def test_calls_past_the_cap_are_one_error(fmt, call):
    """At most MAX_CALLS_PER_TURN calls are read from one turn (the rollout refuses those past
    max_parallel_calls anyway); past them one error, not thousands of answers."""
    text = _CountingText(call * (MAX_CALLS_PER_TURN * 4))
    out = parse_tool_calls(text, fmt=fmt)
    assert out[:-1] == [ToolCall(name="python", arguments={"code": "1" if fmt == "hermes" else "1\n"})] * MAX_CALLS_PER_TURN
    assert out[-1] == ToolResult(ok=False, error=f"only the first {MAX_CALLS_PER_TURN} tool calls of a turn are "
                                                 "read; the rest were ignored")
    assert text.scanned <= (MAX_CALLS_PER_TURN + 1) * len(call)  # stopped at the cap, not at the end


# ---- LOW: folders of a SIGKILLed trainer ---------------------------------------------------------------

DIES = """
import os, sys
from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig
sb = ProcessSandbox(SandboxConfig(pool_size=2, work_root=sys.argv[1]))
while len(sb.idle_pids()) < 2:
    pass
os.kill(os.getpid(), 9)  # the trainer dies without closing the sandbox
"""


def test_a_later_sandbox_removes_the_folders_of_a_dead_trainer(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", DIES, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    left = sorted(p.name for p in tmp_path.iterdir())
    if out.returncode != -9:
        pytest.skip(f"no sandbox on this machine: {out.stderr[-500:]}")
    assert len(left) == 2 and all(n.startswith("mrl-tool-") for n in left), left
    ns = os.stat("/proc/self/ns/pid").st_ino
    keep = [f"mrl-tool-{ns}-1-abcdefgh",  # a living pid (1): never removed
            f"mrl-tool-{ns + 1}-999999-abcdefgh",  # another PID namespace
            "mrl-tool-abcdefgh"]  # the old unmarked name: whose it is cannot be proven
    for name in keep:
        (tmp_path / name).mkdir()
    removed = remove_dead_workdirs(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)
