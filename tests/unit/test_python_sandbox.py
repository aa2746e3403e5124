"""The sandboxed python tool, its call parsing and its config file (issue 31, first slice).

Each hostile program runs twice: in the default sandbox, and with the in-interpreter audit hook off
(`kernel_only`), so the kernel layers (namespaces, Landlock, uid, rlimits) are checked on their own.
Negative controls run the same program with the protections off and show it then gets through, so
each refusal test would fail without its protection.
"""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from megatron_rl.tools.base import Tool, ToolCall, ToolResult
from megatron_rl.tools.parsing import format_tool_response, parse_tool_calls, run_tool_call, run_tool_calls
from megatron_rl.tools.python_sandbox import PythonTool
from megatron_rl.tools.registry import TOOLS
from megatron_rl.tools.sandbox import SandboxConfig, SandboxError
from megatron_rl.tools.tool_config import build_tools, load_tool_config

pytestmark = pytest.mark.skipif(not hasattr(os, "unshare"), reason="Linux only")

LIMITS = dict(cpu_time_s=1, wall_timeout_s=8, memory_mib=512, max_processes=8, max_output_bytes=256, disk_mib=8)
OPEN = dict(network_namespace=False, pid_namespace=True, landlock=False, seccomp=False, audit_hook=False, drop_to_uid=0,
            require_network_isolation=False)


def _tool(**config) -> PythonTool:
    """A python tool; skips (saying why) only where this kernel cannot give the sandbox at all."""
    try:
        return PythonTool(**config)
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")


@pytest.fixture(scope="module")
def tool():
    t = _tool(pool_size=2, **LIMITS)
    yield t
    t.close()


@pytest.fixture(scope="module")
def kernel_only():
    t = _tool(pool_size=1, audit_hook=False, **LIMITS)
    yield t
    t.close()


@pytest.fixture(params=["default", "kernel_only"])
def sandboxed(request, tool, kernel_only):
    return tool if request.param == "default" else kernel_only


def run(t: PythonTool, code: str) -> ToolResult:
    return t.call({"code": textwrap.dedent(code)})


def _children() -> set[int]:
    out = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            out.update(int(p) for p in (task / "children").read_text().split())
        except FileNotFoundError:  # a thread of this process ended between the listing and the read
            continue
    return out


def _procs_in_pid_ns(ns: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "ns" / "pid") == ns:
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def _wait_until(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# ---- ordinary programs ----------------------------------------------------------------------------

def test_prints_what_the_program_prints(tool):
    r = run(tool, "print(2 + 3)")
    assert r.ok and r.output == "5\n" and r.to_message() == "5\n"
    r = run(tool, "s = 0\nfor i in range(10):\n    s += i\nprint(s, 'done')")
    assert r.ok and r.output == "45 done\n"


def test_exception_reports_the_traceback(tool):
    r = run(tool, "x = 1 / 0")
    assert not r.ok and "status 1" in r.error and "ZeroDivisionError: division by zero" in r.error
    assert "sandbox_worker" not in r.error  # the worker's own frame is cut
    r = run(tool, "print('unclosed)")
    assert not r.ok and "SyntaxError: unterminated string literal" in r.error and "sandbox_worker" not in r.error
    r = run(tool, "import sys\nprint('partial')\nsys.exit('bye')")
    assert not r.ok and r.output == "partial\n" and r.error == "the program exited with status 1\nbye"


def test_working_directory_is_writable_and_thrown_away(tool):
    r = run(tool, "open('f.txt', 'w').write('hi'); import os; print(open('f.txt').read(), os.getcwd())")
    assert r.ok, r.error
    text, workdir = r.output.split()
    assert text == "hi" and not os.path.exists(workdir)


def test_each_call_is_a_fresh_process(tool):
    assert run(tool, "x = 41").ok
    r = run(tool, "print(x)")
    assert not r.ok and "NameError" in r.error


# ---- hostile programs -----------------------------------------------------------------------------

def test_infinite_loop_is_killed_at_the_cpu_limit(sandboxed):
    r = run(sandboxed, "while True:\n    pass")
    assert not r.ok and "CPU-time limit of 1 s" in r.error, r.error
    assert r.metrics["exit_code"] == 137


def test_sleeping_program_times_out_with_the_reason():
    t = _tool(pool_size=0, wall_timeout_s=1, cpu_time_s=5)
    try:
        calls = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "import time\\ntime.sleep(30)"}}</tool_call>')
        t0 = time.monotonic()
        r = run_tool_call(calls[0], {"python": t})
        assert time.monotonic() - t0 < 20
        assert not r.ok and r.metrics["timed_out"] and "wall-clock limit of 1 s" in r.error
        assert "Error: timed out" in format_tool_response(r)
    finally:
        t.close()


FORKS = """
import os, time
n = 0
for i in range(40):
    try:
        if os.fork() == 0:
            os.setsid()  # out of the process group the trainer kills: only the PID namespace stops it
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError:
        break
print(n, os.readlink("/proc/self/ns/pid"), flush=True)
time.sleep(60)
"""


def test_fork_bomb_is_refused_by_the_audit_hook(tool):
    r = run(tool, "import os\nwhile True:\n    os.fork()")
    assert not r.ok and "os.fork is not allowed" in r.error


@pytest.mark.skipif(os.geteuid() != 0, reason="reads other processes' /proc/<pid>/ns, which needs root here")
def test_fork_bomb_is_contained_by_the_kernel(kernel_only, tool):
    before = _children()
    r = run(kernel_only, FORKS)
    assert not r.ok and r.metrics["timed_out"]
    n, ns = r.output.split()
    assert int(n) < LIMITS["max_processes"]  # RLIMIT_NPROC for the sandbox uid
    # the program's processes all die with the worker (PID namespace), the trainer's are untouched
    assert _wait_until(lambda: not _procs_in_pid_ns(ns)), _procs_in_pid_ns(ns)
    pool = lambda: set(kernel_only.sandbox.idle_pids()) | set(tool.sandbox.idle_pids())  # noqa: E731
    assert _wait_until(lambda: _children() - pool() <= before), (_children(), pool(), before)
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the control runs the program as root, without RLIMIT_NPROC")
def test_fork_control_without_the_uid_drop_forks_freely():
    t = _tool(pool_size=0, wall_timeout_s=2, **{k: v for k, v in OPEN.items() if k != "pid_namespace"},
                   max_processes=8)
    try:
        r = run(t, FORKS)
        assert int(r.output.split()[0]) == 40
    finally:
        t.close()


def test_huge_allocation_raises_memory_error(sandboxed):
    r = run(sandboxed, "x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert not r.ok and "MemoryError" in r.error and "allocated" not in r.output


WRITE = """
import os
try:
    open({path!r}, "w").write("owned")
except OSError as e:
    print("refused:", type(e).__name__)
"""


def test_write_outside_the_working_directory_is_refused(sandboxed, tmp_path):
    os.chmod(tmp_path, 0o777)  # so that plain file permissions would not stop it: the sandbox must
    target = tmp_path / "escaped.txt"
    r = run(sandboxed, WRITE.format(path=str(target)))
    assert "refused: PermissionError" in r.output, (r.output, r.error)
    assert not target.exists()


def test_write_control_without_protection_gets_through(tmp_path):
    t = _tool(pool_size=0, **OPEN)
    try:
        target = tmp_path / "escaped.txt"
        run(t, WRITE.format(path=str(target)))
        assert target.read_text() == "owned"
    finally:
        t.close()


FILL_DISK = """
n = 0
try:
    for i in range(20):
        open(f"f{i}", "wb").write(b"x" * (1 << 20))
        n += 1
except OSError as e:
    print("stopped", e.strerror)
print(n)
"""


def test_filling_the_disk_stops_at_the_quota(sandboxed):
    r = run(sandboxed, FILL_DISK)
    assert r.ok and r.output.startswith("stopped No space left on device\n"), r.output
    assert int(r.output.split()[-1]) <= 8  # disk_mib=8


def test_disk_control_without_the_quota_writes_everything():
    t = _tool(pool_size=0, disk_mib=0)
    try:
        assert run(t, FILL_DISK).output == "20\n"
    finally:
        t.close()


CONNECT = """
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"hello")
    print("connected")
except OSError as e:
    print("refused:", type(e).__name__, e)
"""


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.5)
    return srv


def _accepted(srv) -> bool:
    try:
        conn, _ = srv.accept()
        conn.close()
        return True
    except (socket.timeout, TimeoutError):
        return False


def test_network_is_unreachable(sandboxed):
    srv = _listener()
    try:
        r = run(sandboxed, CONNECT.format(port=srv.getsockname()[1]))
        assert "connected" not in r.output
        assert not _accepted(srv)
    finally:
        srv.close()


def test_network_control_without_protection_connects():
    t = _tool(pool_size=0, **OPEN)
    srv = _listener()
    try:
        r = run(t, CONNECT.format(port=srv.getsockname()[1]))
        assert "connected" in r.output and _accepted(srv)
    finally:
        srv.close()
        t.close()


def test_trainer_secrets_stay_out(monkeypatch, tmp_path, sandboxed):
    monkeypatch.setenv("MRL_TEST_SECRET", "hunter2")
    secret = tmp_path / "token"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    t = _tool(**{**asdict(sandboxed.sandbox.config), "pool_size": 0})  # the same layers, started after setenv
    try:
        code = f"""
        import os
        print("env", os.environ.get("MRL_TEST_SECRET"))
        for p in ["/proc/{os.getpid()}/environ", {str(secret)!r}]:
            try:
                print("read", "hunter2" in open(p, "rb").read().decode("latin-1"))
            except OSError as e:
                print("refused", type(e).__name__)
        """
        r = run(t, code)
        assert r.ok, r.error
        assert r.output.split("\n")[:3] == ["env None", "refused PermissionError", "refused PermissionError"]
    finally:
        t.close()


def test_output_is_truncated(tool):
    r = run(tool, "print('x' * 100000)")
    assert r.ok and r.metrics["truncated"] and r.metrics["omitted_bytes"] == 100001 - 256
    # max_output_bytes=256: a quarter from the start, the rest from the end (test_sandbox_output_cap.py: T07)
    assert r.output == "x" * 64 + "\n[... 99745 bytes omitted ...]\n" + "x" * 191 + "\n"
    r = run(tool, "while True:\n    print('y' * 1000)")  # an endless flood runs into a limit, read as it comes
    assert not r.ok and ("CPU-time limit" in r.error or r.metrics["timed_out"]) and "bytes omitted" in r.output


def test_calls_of_different_samples_overlap(tool):
    code = "import time\nt0 = time.time()\ntime.sleep(2)\nprint(t0, time.time())"
    calls = parse_tool_calls("".join(f"```python\n{code}\n```" for _ in range(8)), fmt="code")
    results = run_tool_calls(calls, {"python": tool})
    assert all(r.ok for r in results), [r.error for r in results]
    spans = [tuple(map(float, r.output.split())) for r in results]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all eight ran at one moment


# ---- calls the model gets wrong -------------------------------------------------------------------

class _Boom(Tool):
    name = "boom"
    parameters = {"type": "object", "properties": {}, "required": []}

    def call(self, arguments):
        raise RuntimeError("bug in the tool")


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "python", "arguments": {"code": </tool_call>', "invalid JSON inside <tool_call>"),
    ('<tool_call>[1, 2]</tool_call>', "expected a JSON object, got list"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "python"}</tool_call>', 'no "arguments"'),
    ('<tool_call>{"name": "python", "arguments": "{bad"}</tool_call>', "is not valid JSON"),
    ('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "missing required argument(s) ['code']"),
    ('<tool_call>{"name": "python", "arguments": {"code": 5}}</tool_call>', "must be a string, got int"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1", "x": 1}}</tool_call>', "unknown argument(s) ['x']"),
    ('<tool_call>{"name": "pyhton", "arguments": {"code": "1"}}</tool_call>', "unknown tool 'pyhton'; available tools: boom, python"),
    ('<tool_call>{"name": "boom", "arguments": {}}</tool_call>', "tool 'boom' failed: RuntimeError: bug in the tool"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}', "without a closing </tool_call>"),
])
def test_bad_calls_reach_the_model_as_errors(tool, text, reason):
    (call,) = parse_tool_calls(text)
    r = run_tool_call(call, {"python": tool, "boom": _Boom()})
    assert not r.ok and reason in r.error, r.error
    assert format_tool_response(r).startswith("<tool_response>\nError: ")


def test_parsing_both_formats():
    calls = parse_tool_calls('a <tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call> b')
    assert calls == [ToolCall(name="python", arguments={"code": "print(1)"})]
    text = "Let me compute.\n```python\nprint(2 + 3)\n```\n```output\n5\n```\nand\n```python\nx = 1\n```"
    assert parse_tool_calls(text, fmt="code") == [ToolCall(name="python", arguments={"code": "print(2 + 3)\n"}),
                                                  ToolCall(name="python", arguments={"code": "x = 1\n"})]
    assert parse_tool_calls("no calls here") == []
    assert format_tool_response(ToolResult(ok=True, output="5\n"), fmt="code") == "```output\n5\n\n```"
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        parse_tool_calls("", fmt="xml")


def test_oversized_program_is_refused_without_running():
    t = _tool(pool_size=0, max_code_bytes=10)
    try:
        r = run(t, "print('a much longer program')")
        assert not r.ok and "over the limit of 10" in r.error
    finally:
        t.close()


# ---- registry and config file ---------------------------------------------------------------------

def test_registered_tools_are_pinned():
    assert TOOLS.names() == ["python"]
    assert TOOLS.get("python") is PythonTool


def test_sandbox_config_refuses_bad_values():
    with pytest.raises(ValueError, match="memory_mib=1"):
        SandboxConfig(memory_mib=1)
    with pytest.raises(TypeError, match="wall_timeout"):
        SandboxConfig(wall_timeout=3)


def test_tool_config_builds_the_tools(tmp_path):
    f = tmp_path / "tools.yaml"
    f.write_text("tools:\n  - name: python\n    config: {wall_timeout_s: 3, pool_size: 0}\n"
                 "  - class_name: megatron_rl.tools.python_sandbox.PythonTool\n    config: {pool_size: 0}\n"
                 "    tool_schema: {type: function, function: {name: calc, description: a calculator}}\n")
    tools = build_tools(f)
    try:
        assert sorted(tools) == ["calc", "python"]
        assert tools["python"].sandbox.config.wall_timeout_s == 3 and tools["calc"].description == "a calculator"
        assert tools["calc"].schema()["function"]["name"] == "calc"
        assert run_tool_call(ToolCall(name="calc", arguments={"code": "print(6 * 7)"}), tools).output == "42\n"
    finally:
        for t in tools.values():
            t.close()


def test_shipped_tool_config_loads():
    (spec,) = load_tool_config(Path(__file__).resolve().parents[2] / "examples" / "tools" / "python_tool.yaml")
    assert spec.cls is PythonTool and spec.config["wall_timeout_s"] == 10


@pytest.mark.parametrize("text, message", [
    ("tool:\n  - name: python\n", r"tools.yaml: unknown key 'tool'; did you mean 'tools'\?"),
    ("tools:\n  - nmae: python\n", r"tools.yaml: tools\[0\]: unknown key 'nmae'; did you mean 'name'\? \(allowed keys: class_name, config, name, tool_schema\)"),
    ("tools:\n  - name: python\n    config: {wall_timeout: 3}\n", r"tools.yaml: tools\[0\].config: unknown key 'wall_timeout'; did you mean 'wall_timeout_s'\?"),
    ("tools:\n  - name: pyton\n", r"tools.yaml: tools\[0\].name: unknown tool 'pyton'; did you mean 'python'\?"),
    ("tools:\n  - class_name: os.path.join\n", r"tools\[0\].class_name: 'os.path.join' is not a subclass"),
    ("tools:\n  - name: python\n    config: {memory_mib: 1, pool_size: 0}\n", r"tools.yaml: tools\[0\].config: sandbox memory_mib=1 is out of range"),
    ("tools:\n  - name: python\n    tool_schema: {function: {nme: x}}\n", r"tools\[0\].tool_schema.function: unknown key 'nme'; did you mean 'name'\?"),
    ("tools: [\n", r"tools.yaml: not valid YAML"),
    # breaker, second pass: each used to be accepted
    ("tools:\n  - name: python\n    tool_schema: {function: {parameters: x}}\n",
     r"tools.yaml: tools\[0\].tool_schema.function.parameters: must be a mapping \(a JSON schema object\), got str"),
    ("tools:\n  - name: python\n    tool_schema: {function: {name: 5}}\n",
     r"tools.yaml: tools\[0\].tool_schema.function.name: must be a string, got int"),
    ("tools:\n  - name: python\n    tool_schema: {function: {parameters: {properties: [code]}}}\n",
     r"tools\[0\].tool_schema.function.parameters.properties: must be a mapping"),
    ("tools:\n  - name: python\n    config: {wall_timeout_s: .inf, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox wall_timeout_s=inf is out of range"),
    ("tools:\n  - name: python\n    config: {wall_timeout_s: .nan, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox wall_timeout_s=nan is out of range"),
    ("tools:\n  - name: python\n    config: {output_head_fraction: .nan, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox output_head_fraction=nan is out of range"),
    ("tools:\n  - name: python\n    config: {pool_size: 100000}\n",
     r"tools.yaml: tools\[0\].config: sandbox pool_size=100000 is out of range"),
    ("tools:\n  - name: python\n    config: {max_concurrency: 257, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox max_concurrency=257 is out of range"),
    ("tools:\n  - name: python\n    config: {work_root: /nonexistent/mrl, pool_size: 0}\n",
     r"tools.yaml: tools\[0\].config: sandbox work_root='/nonexistent/mrl' is not an existing folder"),
])
def test_tool_config_mistakes_fail_at_start(tmp_path, text, message):
    f = tmp_path / "tools.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_tools(f)


def test_a_broken_schema_is_an_infrastructure_error_not_an_exception():
    """Before: a tool whose `parameters` is not a mapping (accepted from a tool config) made
    `check_arguments`, outside run_tool_call's try, raise AttributeError into the rollout."""
    t = _Boom()
    t.parameters = "x"
    r = run_tool_call(ToolCall(name="boom", arguments={}), {"boom": t})
    assert (r.ok, r.infrastructure) == (False, True) and r.error.startswith("tool 'boom' failed: AttributeError"), r


TRAINER_DIES = """
import os, sys, threading, time
from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig
sb = ProcessSandbox(SandboxConfig(pool_size=0, wall_timeout_s=600))
code = "import os, time\\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\\ntime.sleep(600)"
w = sb._take()[0]
w.wait_ready(60)
w.proc.stdin.write(code.encode())
w.proc.stdin.close()
print(os.read(w.proc.stdout.fileno(), 200).decode().strip(), w.workdir, flush=True)
os._exit(0)  # the trainer dies mid-call, without closing the sandbox
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="reads other processes' /proc/<pid>/ns, which needs root here")
def test_a_running_program_dies_with_the_trainer(tool):
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", TRAINER_DIES], capture_output=True, text=True, env=env, timeout=60)
    ns, workdir = out.stdout.split()
    assert ns.startswith("pid:["), (out.stdout, out.stderr)
    assert _wait_until(lambda: not _procs_in_pid_ns(ns)), _procs_in_pid_ns(ns)
    os.rmdir(workdir)  # a dead trainer leaves its (empty: the files were on the tmpfs) folders behind


def test_the_trainer_cannot_be_signalled(sandboxed):
    r = run(sandboxed, f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\n"
                       "except OSError as e:\n    print('refused', type(e).__name__)")
    # the audit hook refuses; without it the trainer's pid does not exist in the PID namespace
    assert r.output in ("refused PermissionError\n", "refused ProcessLookupError\n"), (r.output, r.error)
