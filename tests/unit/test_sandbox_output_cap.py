"""CASES.md T07: tool output is capped while it is read, in UTF-8 bytes, head and tail kept,
binary-safe, with a marker stating the number of omitted bytes.

The cutting itself (`cap_output`) is checked with the case's exact numbers; (a), (b) and (d) also
run through a real `ProcessSandbox` (cap 4096 = 1024 head + 3072 tail), and (a) measures that the
trainer-side process stays within 64 MB while the program writes 100 MB.
"""

from __future__ import annotations

import os
import re

import pytest

from megatron_rl.tools.output_cap import OMITTED_MARKER, OutputCap, cap_output
from megatron_rl.tools.python_sandbox import PythonTool
from megatron_rl.tools.sandbox import ProcessSandbox, SandboxConfig, SandboxError

pytestmark = pytest.mark.skipif(not hasattr(os, "unshare"), reason="Linux only")

HEAD, TAIL = 1024, 3072
NUMBERS = "".join(f"{i}\n" for i in range(100000)).encode()


def _omitted(text: str) -> int:
    (n,) = re.findall(r"\[\.\.\. (\d+) bytes omitted \.\.\.\]", text)
    return int(n)


# ---- the cutting, exact numbers --------------------------------------------------------------------

def test_a_huge_line_keeps_head_and_tail_and_counts_the_rest():
    text, omitted = cap_output(b"x" * 10**8 + b"\n", HEAD, TAIL)
    assert omitted == 100000001 - 4096 == 99995905
    assert text == "x" * HEAD + OMITTED_MARKER.format(n=99995905) + "x" * (TAIL - 1) + "\n"


def test_c_a_head_only_budget_cuts_on_a_utf8_boundary():
    data = ("é" * 100 + "\n").encode()
    text, omitted = cap_output(data, 101, 0)
    head = text.split("\n[...")[0]
    assert head == "é" * 50 and len(head.encode()) == 100  # not 101 characters, no dangling 0xC3
    assert omitted == 201 - 100 and _omitted(text) == 101
    # the tail side too: a tail starting inside a character drops its continuation byte
    text, omitted = cap_output(("é" * 100).encode(), 0, 101)
    assert text.endswith("\n" + "é" * 50) and omitted == 100


def test_d_many_lines_keep_the_first_and_the_last():
    assert len(NUMBERS) == 588890
    text, omitted = cap_output(NUMBERS, HEAD, TAIL)
    assert omitted == 588890 - 4096 == 584794 and _omitted(text) == 584794
    assert text.startswith("0\n1\n2\n") and text.endswith("99998\n99999\n")


def test_streaming_in_chunks_equals_one_cut_and_stays_bounded():
    cap = OutputCap(HEAD, TAIL)
    for i in range(0, len(NUMBERS), 1000):
        cap.feed(NUMBERS[i:i + 1000])
        assert len(cap.head) <= HEAD and len(cap.tail) <= 2 * TAIL
    assert cap.text() == cap_output(NUMBERS, HEAD, TAIL)[0] and cap.total == 588890


def test_output_within_the_cap_is_untouched_and_binary_is_replaced():
    assert cap_output(b"hello\n", HEAD, TAIL) == ("hello\n", 0)
    assert cap_output(b"\xff\xfe\x00abc", HEAD, TAIL) == ("\ufffd\ufffd\x00abc", 0)
    assert cap_output(b"a" * 4096, HEAD, TAIL) == ("a" * 4096, 0)  # exactly the cap: no marker
    with pytest.raises(ValueError):
        OutputCap(-1, 10)


def test_config_checks_the_head_fraction():
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="output_head_fraction"):
            SandboxConfig(output_head_fraction=bad)
    assert SandboxConfig(max_output_bytes=64, output_head_fraction=1).max_output_bytes == 64


# ---- through a real sandbox ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox():
    try:
        sb = ProcessSandbox(SandboxConfig(pool_size=1, max_output_bytes=4096, output_head_fraction=0.25,
                                          wall_timeout_s=20, cpu_time_s=10, disk_mib=8))
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    yield sb
    sb.close()


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_a_hundred_megabytes_return_normally_in_bounded_memory(sandbox):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size (VmHWM) to the current one
    except OSError:
        pass
    before = _status("VmHWM")
    r = sandbox.run('print("x" * 10**8)')
    grown = _status("VmHWM") - before
    assert r.ok and r.exit_code == 0 and not r.error, r.error
    assert r.stdout_omitted_bytes == 99995905 and _omitted(r.stdout) == 99995905 and r.truncated
    assert r.stdout.startswith("x" * HEAD + "\n[...") and r.stdout.endswith("x" * (TAIL - 1) + "\n")
    assert grown < 64 * 2**20, f"the trainer-side process grew by {grown / 2**20:.0f} MB"


def test_b_binary_output_is_decoded_without_error(sandbox):
    r = sandbox.run('import sys; sys.stdout.buffer.write(b"\\xff\\xfe\\x00abc")')
    assert r.ok and r.stdout == "\ufffd\ufffd\x00abc" and not r.truncated


def test_d_many_lines_through_the_sandbox(sandbox):
    r = sandbox.run("for i in range(100000): print(i)")
    assert r.ok and r.stdout_omitted_bytes == 584794 and _omitted(r.stdout) == 584794
    assert r.stdout.startswith("0\n1\n2\n") and r.stdout.endswith("\n99999\n")


def test_the_tool_shows_the_model_the_tail_of_a_traceback(sandbox):
    r = PythonTool(sandbox=sandbox).call({"code": "print('y' * 100000)\nraise ValueError('the end')"})
    assert not r.ok and "ValueError: the end" in r.error
    assert r.metrics["omitted_bytes"] == 100001 - 4096 and "bytes omitted" in r.output


class _StallingSelector:
    """selectors.DefaultSelector whose select first reports only the program's exit (its output waits
    in the pipe) and then stalls `stall_s` (a trainer thread descheduled under load or waiting for the GIL)."""

    def __init__(self, real, stall_s: float, pidfds: set):
        self.sel, self.stall_s, self.pidfds, self.stalled = real(), stall_s, pidfds, False

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.sel.close()

    def register(self, fd, events):
        return self.sel.register(fd, events)

    def unregister(self, fd):
        return self.sel.unregister(fd)

    def select(self, timeout=None):
        import time

        if self.stalled:
            return self.sel.select(timeout)
        while True:  # the output stays unread in the pipe until the exit shows (it fits the pipe's buffer)
            exits = [e for e in self.sel.select(timeout) if e[0].fd in self.pidfds]
            if exits:
                self.stalled = True
                time.sleep(self.stall_s)
                return exits


@pytest.mark.parametrize("stall_s, wall_s", [(0.7, 20), (2.5, 1.0)], ids=["past_the_exit_grace", "past_the_wall_limit"])
def test_output_is_read_whole_when_the_reading_thread_stalls(monkeypatch, stall_s, wall_s):
    """The program prints and exits at once; the thread reading its pipes then does not run for
    `stall_s` (load, GIL). Before: past the 0.5 s grace after the exit it stopped reading, and the
    model got an empty answer (a resumed tool run differed from the uninterrupted one in CI); past
    the wall limit the program counted as timed out. Now: the whole output, exit status 0."""
    import megatron_rl.tools.sandbox as sandbox_module

    try:
        sb = ProcessSandbox(SandboxConfig(pool_size=0, wall_timeout_s=wall_s, cpu_time_s=10, disk_mib=8))
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    pidfds: set = set()
    real_open = os.pidfd_open

    def pidfd_open(pid, *a):
        fd = real_open(pid, *a)
        pidfds.add(fd)
        return fd

    monkeypatch.setattr(sandbox_module.os, "pidfd_open", pidfd_open)
    real = sandbox_module.selectors.DefaultSelector
    made: list = []

    def selector():
        made.append(_StallingSelector(real, stall_s, pidfds))
        return made[-1]

    monkeypatch.setattr(sandbox_module.selectors, "DefaultSelector", selector)
    clock, calls_after = sandbox_module.time.monotonic, [0]

    def monotonic():  # the stall also lands after the exit was noted (the next look at the clock)
        if made and made[-1].stalled:
            calls_after[0] += 1
            return clock() + (stall_s if calls_after[0] > 1 else 0.0)
        return clock()

    monkeypatch.setattr(sandbox_module.time, "monotonic", monotonic)
    try:
        r = sb.run("import sys, os\nsys.stdout.write('x' * 3000 + '\\n'); sys.stdout.flush(); os._exit(0)")
    finally:
        sb.close()
    assert r.exit_code == 0 and not r.timed_out and r.error == "", (r.error, r.exit_code)
    assert r.stdout == "x" * 3000 + "\n"
