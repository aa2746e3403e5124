"""The sandbox's worker: started as `python -I sandbox_worker.py SPEC_JSON`, runs one program, exits.

Standard library only, never imported by the trainer. `sandbox.ProcessSandbox` starts it ahead of
time (the warm pool) in its own session, with a scrubbed environment and a fresh working
directory as cwd. Before it says "ready" on stdout it puts itself behind every layer it can
(each reported back in the ready line, so the trainer knows what was really enforced):

1. namespaces (`unshare`): a new network namespace (only a loopback that is down: every connect
   fails) and a new PID namespace whose init is the process that will run the program (it reports its
   host pid in the ready line: the trainer kills it by pidfd, which kills every process the program
   started, whatever session it moved to); a new mount namespace with a tmpfs of `disk_mib` (and
   bounded inodes) over the working directory, and, as root, a folder only root may enter hidden under
   an empty tmpfs with only the interpreter's folders bind-mounted back read-only; a new IPC namespace
   (SysV IPC and POSIX message queues of the call alone, shared memory bounded to `memory_mib`, gone
   with the call). Without root a new user namespace comes first (needs unprivileged user namespaces);
2. resource limits (`setrlimit`): CPU seconds, address space, processes, open files, file size;
3. Landlock (Linux >= 5.13, unprivileged): writes, creates, removes only below the working
   directory; TCP connect and bind refused (ABI >= 4); signals and abstract unix sockets scoped
   to the sandbox (ABI >= 6);
4. every capability dropped (bounding, ambient, inheritable, permitted, effective) and, when
   started as root, all groups dropped and the uid / gid set to the call's own unprivileged one
   (`per_call_uid_base` + this worker's host pid; `RLIMIT_NPROC` then counts this call alone);
5. seccomp-bpf: `socket()` refused (unix path sockets included), no new namespaces, no io_uring, no
   kernel keyrings, no `memfd_create` (unless `allow_memfd`), no SysV IPC without an IPC namespace;
6. after the program arrives: a `sys.addaudithook` hook that refuses sockets, subprocesses,
   `exec`, `ctypes`, writes outside the working directory and `/proc/<other pid>` (a guard in the
   same interpreter, disabled from Python in a few lines: a friendly error, never the boundary; the
   layers above are the kernel's).

Then it reads the program (UTF-8) from stdin until EOF and `exec`s it as `__main__`: stdout and
stderr are the pipes the trainer reads. An exception prints its traceback and exits 1. No logging:
what it writes is its ready line and the program's output.
"""

import json
import os
import resource
import sys

READY = "__mrl_sandbox_ready__"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _unshare(spec, layers):
    if not hasattr(os, "unshare"):
        layers["namespaces_error"] = "os.unshare needs Python >= 3.12 (python_executable)"
        return False
    flags = 0
    if spec["network_namespace"]:
        flags |= os.CLONE_NEWNET
    if spec["pid_namespace"]:
        flags |= os.CLONE_NEWPID
    if spec["ipc_namespace"]:
        flags |= os.CLONE_NEWIPC  # SysV IPC and POSIX message queues: private, gone with the call
    if spec["disk_mib"] or (os.geteuid() == 0 and spec["uid"]):
        flags |= os.CLONE_NEWNS  # the tmpfs, and the interpreter shown to the unprivileged uid
    if not flags:
        return False
    if os.geteuid() != 0:
        flags |= os.CLONE_NEWUSER
    try:
        os.unshare(flags)
    except OSError as e:
        layers["namespaces_error"] = f"unshare: {e}"
        return False
    layers["network_namespace"] = bool(flags & os.CLONE_NEWNET)
    layers["pid_namespace"] = bool(flags & os.CLONE_NEWPID)
    layers["mount_namespace"] = bool(flags & os.CLONE_NEWNS)
    layers["ipc_namespace"] = bool(flags & os.CLONE_NEWIPC)
    if flags & os.CLONE_NEWIPC:
        _bound_ipc(spec, layers)
    return bool(flags & os.CLONE_NEWPID)


def _bound_ipc(spec, layers):
    """In the new IPC namespace (its sysctls are its own): SysV shared memory of the whole call at most
    `memory_mib` (it is not counted by RLIMIT_AS) and few message queues (16 KiB each). Best effort:
    a /proc/sys that cannot be written is recorded; the namespace still dies with the call."""
    page = os.sysconf("SC_PAGE_SIZE")
    mib = int(spec["memory_mib"])
    values = {"kernel/shmmax": mib << 20, "kernel/shmall": (mib << 20) // page, "kernel/shmmni": 64,
              "kernel/msgmni": 16}
    try:
        for name, value in values.items():
            with open(f"/proc/sys/{name}", "w") as f:
                f.write(str(value))
        layers["ipc_bounded_mib"] = mib
    except OSError as e:
        layers["ipc_bound_error"] = f"{name}: {e.strerror}"


def _make_private(layers):
    """Make every mount of the new mount namespace private: nothing done here propagates to the host."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None) != 0:  # MS_REC | MS_PRIVATE
        layers["mounts_error"] = f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
        return False
    return True


def _blocker(path):
    """The highest folder above `path` that a uid owning nothing, in no group, may not enter (or None)."""
    parts = os.path.realpath(path).split(os.sep)[1:-1]
    for i in range(1, len(parts) + 1):
        folder = os.sep + os.sep.join(parts[:i])
        try:
            if not os.stat(folder).st_mode & 0o001:
                return folder
        except OSError:
            return None
    return None


def _expose(paths, layers, writable=""):
    """As root, in the new mount namespace, before becoming an unprivileged uid: the interpreter may sit
    below a folder only root may enter (a pyenv under /root, 0700). Hide each such folder under an empty
    tmpfs (mode 0755) and bind-mount back, read-only, only the needed paths: the program can import the
    standard library without any capability, and sees nothing else of that folder. `writable` (the
    working directory, when `work_root` is below such a folder) is bound back writable."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind, ms_rec = 1, 2, 4, 32, 4096, 1 << 14
    hidden = {}
    for p in sorted({os.path.realpath(p) for p in paths if os.path.exists(p)}):
        top = _blocker(p)
        if top and not any(p == q or p.startswith(q + os.sep) for q in hidden.get(top, [])):
            hidden.setdefault(top, []).append(p)
    exposed = []
    for top, below in hidden.items():
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in below]  # before the tmpfs hides them
        if libc.mount(b"tmpfs", top.encode(), b"tmpfs", ms_nosuid | ms_nodev, b"size=1m,nr_inodes=1024,mode=0755") != 0:
            layers["expose_error"] = f"mount tmpfs over {top}: {os.strerror(ctypes.get_errno())}"
            return
        for p, fd in zip(below, fds):
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(p, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
                open(p, "a").close()
            src = f"/proc/self/fd/{fd}".encode()
            ro = 0 if p == writable else ms_rdonly
            if libc.mount(src, p.encode(), None, ms_bind | ms_rec, None) != 0 or libc.mount(
                    None, p.encode(), None, ms_remount | ms_bind | ro | ms_nosuid | ms_nodev, None) != 0:
                layers["expose_error"] = f"bind-mount {p}: {os.strerror(ctypes.get_errno())}"
                return
            os.close(fd)
            exposed.append(p)
    if exposed:
        layers["exposed"] = exposed


def _private_tmpfs(spec, layers):
    """In the new mount namespace: a tmpfs of `disk_mib` over the working directory, so the program's
    files are bounded in total, invisible outside, and gone with the namespace."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_nosuid, ms_nodev = 2, 4
    # nr_inodes: a program creating empty files must not pin unbounded kernel memory (1 inode per 4 KiB)
    opts = f"size={int(spec['disk_mib'])}m,nr_inodes={max(64, int(spec['disk_mib']) * 256)},mode=0700".encode()
    if libc.mount(b"tmpfs", spec["workdir"].encode(), b"tmpfs", ms_nosuid | ms_nodev, opts) != 0:
        layers["tmpfs_error"] = f"mount tmpfs: {os.strerror(ctypes.get_errno())}"
        return
    layers["tmpfs_mib"] = int(spec["disk_mib"])


def _reap_as_parent(child, trainer):
    """Outside the PID namespace: wait for its init and exit with its status (128 + signal). If the
    trainer dies first (no one is left to enforce the wall-clock limit), kill the init."""
    import select

    os.close(0)
    try:
        fds = [os.pidfd_open(child), os.pidfd_open(trainer)]
        poller = select.poll()  # never select.select: no limit on descriptor numbers
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = []
        while not ready:
            ready = [fd for fd, _ in poller.poll()]
        if fds[1] in ready:  # the trainer exited (a pidfd becomes readable only then)
            os.kill(child, 9)
    except (OSError, InterruptedError):
        pass
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _rlimits(spec, layers, base_tasks):
    mib = 1024 * 1024
    cpu = int(spec["cpu_time_s"])
    # RLIMIT_NPROC counts every task of the real uid: without a uid of its own, the trainer's too
    nproc = int(spec["max_processes"]) + (0 if "uid" in layers else base_tasks)
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (spec["memory_mib"] * mib,) * 2,
        resource.RLIMIT_NPROC: (nproc, nproc),
        resource.RLIMIT_NOFILE: (spec["max_open_files"],) * 2,
        resource.RLIMIT_FSIZE: (spec["max_file_size_mib"] * mib,) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)
    layers["rlimits"] = True


def _tasks_of_uid(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _landlock(spec, layers):
    """Kernel-enforced: writes only below the working directory, reads only below it and the
    readable paths, no TCP, scoped signals. Records the ABI in `layers` (0 when unavailable)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_create, sys_add, sys_restrict = 444, 445, 446  # x86_64 and aarch64 share these numbers
    abi = libc.syscall(sys_create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        layers["landlock_error"] = "Landlock is not available in this kernel"
        return 0
    read = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read_file, read_dir
    write = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))  # write, remove, make_*
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # refer, truncate
    file_only = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)
    net = 0b11 if abi >= 4 else 0  # bind_tcp, connect_tcp: handled, no rule allows any port
    scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    attr = RulesetAttr(read | write, net, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    rfd = libc.syscall(sys_create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        layers["landlock_error"] = f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
        return 0
    rules = {spec["workdir"]: read | write, "/dev/null": (read | write) & file_only}
    for path in [*spec["readable_paths"], *_python_dirs(spec)]:
        rules.setdefault(os.path.realpath(path), read)
    ok = True
    for path, allowed in rules.items():
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a readable path that does not exist here
        if not os.path.isdir(path):
            allowed &= file_only
        rule = PathBeneath(allowed, fd)
        ok = ok and libc.syscall(sys_add, rfd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) == 0
        os.close(fd)
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, required without CAP_SYS_ADMIN
    ok = ok and libc.syscall(sys_restrict, rfd, ctypes.c_uint32(0)) == 0
    err = ctypes.get_errno()
    os.close(rfd)
    if not ok:
        layers["landlock_error"] = f"landlock: {os.strerror(err)}"
        return 0
    layers["landlock_abi"] = abi
    return abi


def _python_dirs(spec):
    return [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable))]


def _capset(libc, ctypes, effective, permitted):
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)(Data(effective, permitted, 0), Data(0, 0, 0))
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:  # _LINUX_CAPABILITY_VERSION_3
        raise OSError(ctypes.get_errno(), "capset")


def _drop_privileges(spec, layers):
    """Drop every capability (bounding set, ambient, inheritable, permitted, effective) and, as root,
    become the call's own uid / gid with no supplementary groups. The one exception, recorded in
    `layers`: without a mount namespace to expose an interpreter only root may read, and with Landlock
    bounding reads, CAP_DAC_READ_SEARCH is kept so the standard library can be imported."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid = spec["uid"] if os.geteuid() == 0 else 0
    keep = 0
    if uid and any(_blocker(d) for d in _python_dirs(spec) if os.path.exists(d)):
        if not layers.get("landlock_abi"):
            sys.stderr.write(f"uid {uid} cannot read the interpreter's folders and neither a mount namespace "
                             "nor Landlock is available: install Python where any uid can read it, or set "
                             "drop_to_uid: 0 (root, unsafe)\n")
            sys.exit(2)
        keep = 1 << 2  # CAP_DAC_READ_SEARCH
    for cap in range(64):  # needs CAP_SETPCAP: before the uid change (past the last one: EINVAL, harmless)
        if not keep >> cap & 1:
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    if uid:
        os.chown(spec["workdir"], uid, uid)
        if keep:
            libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: the permitted set survives setuid
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        layers["uid"] = uid
        libc.prctl(8, 0, 0, 0, 0)
    _capset(libc, ctypes, keep, keep)
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    caps = {k: int(status.get(k, "0"), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    if any(v & ~keep for k, v in caps.items() if k != "CapBnd"):
        raise OSError(f"capabilities left after the drop: {caps}")
    layers["capabilities"] = "CAP_DAC_READ_SEARCH (no mount namespace to expose the interpreter)" if keep else "none"
    if caps["CapBnd"] & ~keep:  # not root and no user namespace: no CAP_SETPCAP to shrink it; none can be gained
        layers["capabilities"] += " (bounding set kept: unprivileged, no_new_privs)"


_ARCH = {"x86_64": (0xC000003E, {"socket": 41, "unshare": 272, "setns": 308, "clone": 56, "shmget": 29,
                                  "semget": 64, "msgget": 68, "mq_open": 240, "add_key": 248, "request_key": 249,
                                  "keyctl": 250, "memfd_create": 319, "inotify_init": 253, "inotify_init1": 294,
                                  "fanotify_init": 300}),
         "aarch64": (0xC00000B7, {"socket": 198, "unshare": 97, "setns": 268, "clone": 220, "shmget": 194,
                                  "semget": 190, "msgget": 186, "mq_open": 180, "add_key": 217, "request_key": 218,
                                  "keyctl": 219, "memfd_create": 279, "inotify_init1": 26, "fanotify_init": 262})}
_IPC = ("shmget", "msgget", "semget", "mq_open")
_KEYS = ("add_key", "request_key", "keyctl")
_WATCH = ("inotify_init", "inotify_init1", "fanotify_init")  # aarch64 has no inotify_init


def _seccomp(spec, layers):
    """A seccomp-bpf filter (kernel-enforced, inherited by every child, cannot be removed): `socket()`
    of any family fails with EPERM (AF_UNIX path sockets too, which neither the network namespace nor
    Landlock stops; `socketpair` stays: it connects to nothing), no new namespaces (`unshare`, `setns`,
    `clone` with a CLONE_NEW* flag; `clone3`, whose flags a filter cannot read, answers ENOSYS so libc
    falls back to `clone`), no io_uring (its operations bypass seccomp), no kernel keyrings (`add_key`,
    `request_key`, `keyctl`: a key outlives the call in its uid's keyring, and uids come back), no
    file watches (`inotify_init*`, `fanotify_init`: Landlock does not cover them, and a watch on a
    world-readable folder such as /tmp reported the names of files the host made there; each
    watch also pins kernel memory RLIMIT_AS does not count: third breaker pass), no
    `memfd_create` (memory outside RLIMIT_AS; unless `allow_memfd`), and, without an IPC namespace of
    its own, no SysV IPC or POSIX message queue (`shmget`, `msgget`, `semget`, `mq_open`: the host's
    objects outlive the call). Another architecture's system call kills the process. An unknown
    machine records the layer as unavailable."""
    import ctypes

    machine = os.uname().machine
    if machine not in _ARCH:
        layers["seccomp_error"] = f"no system call table for {machine}"
        return
    arch, nr = _ARCH[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    clone_new = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
    prog = [(ld, 4), (jeq, arch, "next", "kill"), (ld, 0)]
    if machine == "x86_64":
        prog.append((jge, 0x40000000, "eperm", "next"))  # the x32 ABI
    refused = ["socket", "unshare", "setns", *_KEYS, *(w for w in _WATCH if w in nr)]
    if not spec["allow_memfd"]:
        refused.append("memfd_create")
    if not layers.get("ipc_namespace"):
        refused += _IPC
    for name in refused:
        prog.append((jeq, nr[name], "eperm", "next"))
    for n in (425, 426, 427):  # io_uring_setup, io_uring_enter, io_uring_register (both tables)
        prog.append((jeq, n, "eperm", "next"))
    prog += [(jeq, 435, "enosys", "next"),  # clone3
             (jeq, nr["clone"], "next", "allow"), (ld, 16), (jset, clone_new, "eperm", "allow"),
             ("allow", ret, allow), ("eperm", ret, eperm), ("enosys", ret, enosys), ("kill", ret, kill)]
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    code = []
    for i, ins in enumerate(prog):
        if isinstance(ins[0], str):
            ins = ins[1:]
        op, k, *jumps = ins
        jt, jf = (0 if j == "next" else labels[j] - i - 1 for j in jumps) if jumps else (0, 0)
        code.append(Filter(op, jt, jf, k))
    arr = (Filter * len(code))(*code)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    if libc.prctl(22, 2, ctypes.byref(Prog(len(code), arr)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        layers["seccomp_error"] = f"seccomp: {os.strerror(ctypes.get_errno())}"
        return
    layers["seccomp"] = ", ".join([*refused, "clone(CLONE_NEW*)", "clone3", "io_uring"]) + " refused"


def _audit_hook(workdir):
    """Refuse, inside this interpreter, what the program has no business doing (bypassable)."""
    real = os.path.realpath
    root = real(workdir)
    # /proc is the host's (not remounted in the PID namespace): this process is /proc/<host pid>
    own_proc = (f"/proc/{os.readlink('/proc/self')}/", "/proc/self/", "/proc/thread-self/")
    blocked = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork",
               "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
               "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
               "socket.getaddrinfo", "socket.gethostbyname", "os.kill", "os.killpg"}
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree", "os.chroot"}

    def inside(path):
        if isinstance(path, int):
            return True
        p = real(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep)

    def hook(event, args):
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            p = real(os.fsdecode(path))
            writing = (flags & _WRITE_FLAGS) if flags else any(c in (mode or "") for c in "wax+")
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {p}")
            if p.startswith("/proc/") and not (p + "/").startswith(own_proc) and p.split("/")[2].isdigit():
                raise PermissionError(f"sandbox: reading other processes' /proc entries is not allowed: {p}")
        elif event in path_events:
            if event in ("os.rename", "os.link"):
                paths = args[:2]
            elif event == "os.symlink":
                paths = args[1:2]  # the link's target may point anywhere; the link itself is what is written
            else:
                paths = args[:1]
            for a in paths:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


def main():
    spec = json.loads(sys.argv[1])
    layers = {}
    # the call's own uid (as root): the worker's host pid is unique while the call lives
    base = spec["per_call_uid_base"]
    spec["uid"] = 0 if not spec["drop_to_uid"] else (base + os.getpid() if base else spec["drop_to_uid"])
    base_tasks = _tasks_of_uid(os.getuid()) if os.geteuid() != 0 else 0
    trainer = os.getppid()
    in_new_pid_ns = _unshare(spec, layers)
    if in_new_pid_ns:
        child = os.fork()  # the child is init of the new PID namespace and runs the program
        if child:
            _reap_as_parent(child, trainer)
    if layers.get("mount_namespace") and _make_private(layers):
        if os.geteuid() == 0 and spec["uid"]:
            workdir = os.path.realpath(spec["workdir"])
            _expose([*spec["readable_paths"], *_python_dirs(spec), workdir], layers, writable=workdir)
        if spec["disk_mib"]:
            _private_tmpfs(spec, layers)
    os.chdir(spec["workdir"])
    if spec["landlock"]:
        _landlock(spec, layers)
    _drop_privileges(spec, layers)
    if in_new_pid_ns:
        # after the uid change, which clears it: if the reaper outside dies, so does this init (and its
        # namespace), even when the program left the process group the trainer kills
        import ctypes

        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    _rlimits(spec, layers, base_tasks)
    for m in spec["preload_modules"]:
        __import__(m)
    global traceback
    import traceback

    if spec["seccomp"]:
        _seccomp(spec, layers)
    # /proc is the host's: this is the host pid of the namespace's init, which the trainer kills
    layers["init_pid"] = int(os.readlink("/proc/self"))
    out = sys.stdout
    out.write(READY + json.dumps(layers) + "\n")
    out.flush()
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    sys.stdin.close()
    if spec["audit_hook"]:
        _audit_hook(spec["workdir"])
    sys.argv = ["<tool>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    status = 0
    try:
        exec(compile(code, "<tool>", "exec"), namespace)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        sys.stdout.flush()
        tb = e.__traceback__.tb_next  # without this file's frame
        if tb is None:  # a SyntaxError: compile() failed, no frame of the program
            sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        else:
            traceback.print_exception(type(e), e, tb)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # skip the interpreter's tear-down: the process and its namespaces are thrown away anyway
    os._exit(status & 0xFF)

if __name__ == "__main__":
    main()
