"""Tool infrastructure failures (CASES.md T10) are explained in the log: `run_tool_call` logs a
rate-limited WARNING with the reason, whether the tool raises or returns `infrastructure=True`
(a python sandbox whose worker could not start), and the sample stays invalid as before."""

from __future__ import annotations

import logging

import pytest

from megatron_rl.tools import parsing
from megatron_rl.tools.base import Tool, ToolCall
from megatron_rl.tools.parsing import InfraFailureLog, run_tool_call
from megatron_rl.tools.python_sandbox import PythonTool
from megatron_rl.tools.sandbox import Sandbox, SandboxResult

LOGGER = "megatron_rl.tools.parsing"


class Raising(Tool):
    """`python(code)` whose backend refuses every connection."""

    name = "python"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def call(self, arguments):
        raise ConnectionError("sandbox service refused the connection")


class NeverReady(Sandbox):
    """A sandbox whose worker never gets ready (as `ProcessSandbox._run_in` after `wait_ready` fails)."""

    def run(self, code):
        return SandboxResult(stdout="", stderr="", exit_code=None, infrastructure=True,
                             error="the sandbox worker did not start within 30 s")


@pytest.fixture()
def fresh_log(monkeypatch):
    log = InfraFailureLog(first=5, every=100)
    monkeypatch.setattr(parsing, "INFRA_FAILURES", log)
    return log


def _call():
    return ToolCall(name="python", arguments={"code": "print(1)"})


def _warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_raising_tool_logs_a_warning_with_the_reason(caplog, fresh_log):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    res = run_tool_call(_call(), {"python": Raising()})
    assert res.infrastructure and not res.ok
    (rec,) = _warnings(caplog)
    msg = rec.getMessage()
    assert "infrastructure failure #1" in msg and "'python'" in msg
    assert "ConnectionError: sandbox service refused the connection" in msg
    assert rec.exc_info is not None  # the traceback of the tool's bug or outage


def test_sandbox_that_never_starts_logs_a_warning(caplog, fresh_log):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    res = run_tool_call(_call(), {"python": PythonTool(sandbox=NeverReady())})
    assert res.infrastructure and not res.ok
    (rec,) = _warnings(caplog)
    assert "the sandbox worker did not start within 30 s" in rec.getMessage()
    assert "#1" in rec.getMessage()


def test_ordinary_tool_errors_are_not_logged(caplog, fresh_log):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    res = run_tool_call(ToolCall(name="nope", arguments={}), {"python": Raising()})
    assert not res.ok and not res.infrastructure
    assert _warnings(caplog) == [] and fresh_log.count == 0


def test_rate_limited_first_five_then_every_hundredth(caplog, fresh_log):
    """250 failures: #1-#5, #100 and #200 are logged (7 lines), the count is kept for all."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    tools = {"python": Raising()}
    for _ in range(250):
        run_tool_call(_call(), tools)
    msgs = [r.getMessage() for r in _warnings(caplog)]
    assert len(msgs) == 7 and fresh_log.count == 250
    assert [m.split("#")[1].split(" ")[0] for m in msgs] == ["1", "2", "3", "4", "5", "100", "200"]
    assert "the first 5 then every 100th are logged" in msgs[4]
