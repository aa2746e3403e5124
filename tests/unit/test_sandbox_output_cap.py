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
