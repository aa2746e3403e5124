"""The breaker pass's findings, each as a hostile program that must be refused or killed with the host
unharmed (docs/MULTITURN.md, "breaker findings"). Every program first disables the in-interpreter audit
hook (found through `gc`, its closure's set of blocked events emptied: five lines), because the hook is
a convenience, never the boundary: what is checked here is the kernel's. Controls run the same program
with the one layer under test off and show it then gets through.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import textwrap
import time

import pytest

from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig, SandboxError, _uid_of, processes_of_uid
from megatron_rl.tools.tool_config import build_tools

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the uid layers and /proc checks need root (CI runs as root)")
pytestmark = pytest.mark.skipif(not hasattr(os, "unshare"), reason="Linux only")

LIMITS = dict(cpu_time_s=2, wall_timeout_s=2, memory_mib=512, max_processes=8, disk_mib=8, pool_size=0)
SHARED_UID = 1_999_999  # a uid no one else on the machine uses, shared by every call of its sandbox

BYPASS = """
import gc
for o in gc.get_objects():
    if isinstance(o, set) and "ctypes.dlopen" in o:
        o.clear()  # the audit hook now allows everything
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
"""

SURVIVOR = BYPASS + """
import os, time
assert libc.prctl(1, 0, 0, 0, 0) == 0  # PR_SET_PDEATHSIG: none, so the worker's death no longer kills it
try:
    os.setsid()                        # and out of the process group the trainer kills
except OSError:
    pass                               # already a session leader (no PID namespace: the worker itself)
pids = [os.readlink("/proc/self")]
for i in range({n}):
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:  # a grandchild, orphaned, in a session of its own
            libc.prctl(1, 0, 0, 0, 0)
            os.write(w, os.readlink("/proc/self").encode())
            time.sleep(300)
        os._exit(0)
    os.waitpid(child, 0)
    pids.append(os.read(r, 20).decode())
print(*pids, flush=True)
time.sleep(300)
"""

COUNT_FORKS = BYPASS + """
import os, time
n = 0
for i in range(40):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
    except OSError:
        break
print(n, os.getuid(), flush=True)
time.sleep({sleep})
"""


def _sandbox(**config) -> ProcessSandbox:
    try:
        return ProcessSandbox(SandboxConfig(**{**LIMITS, **config}))
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")


def _alive(pids: list[int], uid: int) -> list[int]:
    return [p for p in pids if _uid_of(str(p)) == uid]


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass


# ---- HIGH: a process that outlives its call -----------------------------------------------------------

@ROOT_ONLY
@pytest.mark.parametrize("uids", ["per_call", "shared"])
def test_no_process_survives_its_call(uids):
    """Before: the program, init of its PID namespace, cleared PR_SET_PDEATHSIG and left the process
    group; killing the worker left it (and its grandchildren) running as the shared uid 65534, holding
    its RLIMIT_NPROC. Now the trainer kills that init itself (a pidfd), which kills the namespace."""
    config = {} if uids == "per_call" else dict(per_call_uid_base=0, drop_to_uid=SHARED_UID)
    sb = _sandbox(**config)
    try:
        r = sb.run(textwrap.dedent(SURVIVOR.format(n=LIMITS["max_processes"] - 2)))
        assert r.timed_out and r.layers["pid_namespace"], (r.error, r.stderr)
        uid = r.layers["uid"]
        assert (uid == SHARED_UID) == (uids == "shared") and uid != 0
        pids = [int(p) for p in r.stdout.split()]
        assert len(pids) == LIMITS["max_processes"] - 1, (r.stdout, r.stderr)
        assert not _alive(pids, uid) and not processes_of_uid(uid)  # right at the call's end, no waiting
        # the next call on the same uid (shared) or a fresh one still gets its full RLIMIT_NPROC
        r2 = sb.run(textwrap.dedent(COUNT_FORKS.format(sleep=0)))
        n, uid2 = map(int, r2.stdout.split())
        assert n == LIMITS["max_processes"] - 1, (r2.stdout, r2.stderr)
        assert (uid2 == uid) == (uids == "shared")
    finally:
        sb.close()


@ROOT_ONLY
def test_without_a_pid_namespace_the_per_call_uid_still_kills_everything():
    """The fallback where no PID namespace can be made: every process of the call's own uid is killed."""
    sb = _sandbox(pid_namespace=False)
    try:
        r = sb.run(textwrap.dedent(SURVIVOR.format(n=3)))
        pids = [int(p) for p in r.stdout.split()]
        assert r.timed_out and len(pids) == 4 and not r.layers.get("pid_namespace")
        assert not _alive(pids, r.layers["uid"]) and not processes_of_uid(r.layers["uid"])
    finally:
        sb.close()


@ROOT_ONLY
def test_survivor_control_without_pid_namespace_or_own_uid_survives():
    """Control: with neither layer (shared uid, no PID namespace) the grandchildren do survive."""
    sb = _sandbox(pid_namespace=False, per_call_uid_base=0, drop_to_uid=SHARED_UID - 1)
    pids: list[int] = []
    try:
        r = sb.run(textwrap.dedent(SURVIVOR.format(n=2)))
        pids = [int(p) for p in r.stdout.split()]
        assert len(_alive(pids[1:], SHARED_UID - 1)) == 2
    finally:
        _kill(pids[1:])
        sb.close()


# ---- HIGH: unix path sockets, capabilities -------------------------------------------------------------

CONNECT_UNIX = BYPASS + """
import socket
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect({path!r})
    s.sendall(b"hello")
    print("connected")
except OSError as e:
    print("refused:", type(e).__name__)
"""


def _unix_listener():
    folder = tempfile.mkdtemp(prefix="mrl-host-sock-")  # below /tmp: every folder above it can be entered
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "host.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)  # file permissions would let anyone connect: the sandbox must stop it
    srv.listen(2)
    srv.settimeout(0.5)
    return srv, path


@ROOT_ONLY
@pytest.mark.parametrize("seccomp", [True, False])
def test_unix_path_socket_on_the_host_is_refused(seccomp):
    """Before: connect() to a host unix socket (/run/...) worked: a network namespace does not isolate
    path sockets, and Landlock does not check connect. Now seccomp refuses socket() (the control,
    seccomp off, connects)."""
    srv, path = _unix_listener()
    sb = _sandbox(seccomp=seccomp)
    try:
        r = sb.run(textwrap.dedent(CONNECT_UNIX.format(path=path)))
        try:
            conn, _ = srv.accept()
            got = conn.recv(10)
            conn.close()
        except (socket.timeout, TimeoutError):
            got = b""
        if seccomp:
            assert r.stdout == "refused: PermissionError\n" and got == b"", (r.stdout, r.stderr)
            assert "socket" in r.layers["seccomp"]
        else:
            assert r.stdout == "connected\n" and got == b"hello", (r.stdout, r.stderr)
    finally:
        srv.close()
        shutil.rmtree(os.path.dirname(path))
        sb.close()


CAPS = BYPASS + """
import os
status = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\\t" in l)
print(*(int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), status["NoNewPrivs"].strip())
for call in ("os.unshare(os.CLONE_NEWUSER)", "os.unshare(os.CLONE_NEWNET)", "os.fork() or os._exit(0)",
             "libc.syscall(425, 8, ctypes.create_string_buffer(120)) != -1 or 1/0"):  # io_uring_setup
    try:
        eval(call)
        print("allowed")
    except (OSError, ZeroDivisionError) as e:
        print("refused", type(e).__name__)
try:
    print(sorted(os.listdir("/root")))
except OSError as e:
    print("refused", type(e).__name__)
"""


@ROOT_ONLY
@pytest.mark.parametrize("landlock", [True, False])
def test_every_capability_is_dropped_and_no_namespace_can_be_made(landlock):
    """Before: CAP_DAC_READ_SEARCH was kept (to read an interpreter under /root). Now none is left:
    the interpreter is bind-mounted read-only below an empty tmpfs over the folder only root enters."""
    sb = _sandbox(landlock=landlock)
    try:
        r = sb.run(textwrap.dedent(CAPS))
        lines = r.stdout.splitlines()
        assert r.ok and lines[0] == "0 0 0 0 0 1", (r.stdout, r.stderr)
        assert r.layers["capabilities"] == "none"
        # new user / network namespaces refused (seccomp); fork allowed; io_uring_setup refused
        assert lines[1:5] == ["refused PermissionError"] * 2 + ["allowed", "refused ZeroDivisionError"], lines
        # /root: Landlock refuses to list it; without Landlock it shows only what was exposed (a pyenv)
        shown = {e.split(os.sep)[2] for e in r.layers.get("exposed", []) if e.startswith("/root/")}
        assert lines[5] in ("refused PermissionError", str(sorted(shown))), lines[5]
    finally:
        sb.close()


# ---- MEDIUM: one call's processes do not starve another's ---------------------------------------------

@ROOT_ONLY
def test_concurrent_calls_each_get_their_own_nproc():
    """Before: every call ran as uid 65534, so RLIMIT_NPROC was shared: one call's fork bomb starved
    the others. Now each call has its own uid: two calls holding their processes at once both get all."""
    sb = _sandbox(pool_size=2, wall_timeout_s=8)
    try:
        results = sb.run_many([textwrap.dedent(COUNT_FORKS.format(sleep=1.5))] * 2)
        counts = [tuple(map(int, r.stdout.split())) for r in results]
        assert [n for n, _ in counts] == [LIMITS["max_processes"] - 1] * 2, [r.stderr for r in results]
        assert counts[0][1] != counts[1][1]  # two uids
    finally:
        sb.close()


# ---- LOW: tmpfs inodes, an empty tool list ------------------------------------------------------------

@ROOT_ONLY
def test_empty_files_stop_at_the_inode_bound():
    sb = _sandbox(wall_timeout_s=8)
    try:
        r = sb.run("n = 0\ntry:\n    while True:\n        open(f'f{n}', 'w').close()\n        n += 1\n"
                   "except OSError as e:\n    print(n, e.strerror)")
        n, why = r.stdout.split(" ", 1)
        assert why.strip() == "No space left on device" and int(n) < 8 * 256, r.stdout
    finally:
        sb.close()


@pytest.mark.parametrize("text, message", [
    ("tools: []\n", r"tools.yaml: tools: no tool is configured"),
    ("tools:\n", r"tools.yaml: tools: no tool is configured"),
    ("{}\n", r"tools.yaml: tools: no tool is configured"),
    ("tools: 5\n", r"tools.yaml: tools: must be a list of tool entries, got int"),
    ("tools:\n  - name: python\n    config: {wall_timeout_s: ten, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox wall_timeout_s must be a number, got 'ten'"),
    ("tools:\n  - name: python\n    config: {output_head_fraction: 2, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox output_head_fraction=2 is out of range"),
    ("tools:\n  - name: python\n    config: {seccomp: 'no', pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox seccomp must be true or false"),
    ("tools:\n  - name: python\n    config: [1]\n", r"tools.yaml: tools\[0\].config: expected a mapping"),
])
def test_tool_config_mistakes_name_the_file_and_key(tmp_path, text, message):
    f = tmp_path / "tools.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_tools(f)
