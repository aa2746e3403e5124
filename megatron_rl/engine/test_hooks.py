"""Fault injection into the embedded server, for tests only: never set these variables in normal use.

The trainer's recovery paths (a refused bucket, a sync retried, a group re-created) are hard to
reach with a healthy server; the variables below make the server fail on purpose, so that the
end-to-end tests (tests/e2e/test_weight_sync.py, tests/e2e/test_sync_faults.py) can reach them.
They are read once, when the server starts (``refused_update_calls``, ``step_delay_s``,
``forward_recorder``, ``processed_logprobs``, ``refuse_flush``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

__all__ = ["FAULT_REFUSE_FLUSH_ENV", "FAULT_REFUSE_UPDATES_ENV", "FORWARD_LOG_ENV", "PROCESSED_LOGPROBS_ENV",
           "STEP_DELAY_ENV", "forward_recorder", "processed_logprobs", "refuse_flush", "refused_update_calls",
           "step_delay_s"]

FAULT_REFUSE_UPDATES_ENV = "MEGATRON_RL_FAULT_REFUSE_WEIGHT_UPDATES"
"""Fault injection, for tests of the trainer's sync retry: a comma-separated list of 1-based
``/update_weights_from_distributed`` call numbers that this server refuses (HTTP 400, before joining
the broadcast, as a server that rejects a bucket does). Unset in normal use."""


def refused_update_calls() -> frozenset[int]:
    """The call numbers in ``FAULT_REFUSE_UPDATES_ENV`` (empty when unset or blank).

    Raises:
        ValueError: the value is not comma-separated integers >= 1 (the message names the variable).
    """
    raw = os.environ.get(FAULT_REFUSE_UPDATES_ENV, "").strip()
    if not raw:
        return frozenset()
    try:
        calls = frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{FAULT_REFUSE_UPDATES_ENV}={raw!r}: expected comma-separated call numbers like 2,3") from None
    if any(c < 1 for c in calls):
        raise ValueError(f"{FAULT_REFUSE_UPDATES_ENV}={raw!r}: call numbers start at 1")
    return calls


STEP_DELAY_ENV = "MEGATRON_RL_TEST_STEP_DELAY_S"
"""Tests only: seconds the scheduler sleeps before every generation step (a slow decode, so that a
pause or an update reliably lands while a request is running). Unset in normal use."""

FORWARD_LOG_ENV = "MEGATRON_RL_TEST_FORWARD_LOG"
"""Tests only: a file to which the server appends one JSON line per model forward,
``{"kind": "prefill"|"decode", "layers": [sum of layer 0's first parameter, ...]}``, read under the
model lock right before the forward: a test that knows each version's weights tells which version
of every layer each forward saw (case N10 C: never a half-applied update). Unset in normal use."""


def step_delay_s() -> float:
    """The value of ``STEP_DELAY_ENV`` in seconds (0 when unset).

    Raises:
        ValueError: not a number >= 0 (the message names the variable).
    """
    raw = os.environ.get(STEP_DELAY_ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ValueError(f"{STEP_DELAY_ENV}={raw!r}: expected seconds, e.g. 0.005") from None
    if value < 0:
        raise ValueError(f"{STEP_DELAY_ENV}={raw!r}: must be >= 0")
    return value


def forward_recorder(model) -> Callable[[str], None] | None:
    """The ``on_forward`` hook that writes ``FORWARD_LOG_ENV`` lines for ``model`` (an HF causal LM
    whose decoder layers are ``*.layers.<k>.*``), or None when the variable is unset."""
    path = os.environ.get(FORWARD_LOG_ENV, "").strip()
    if not path:
        return None
    firsts: dict[int, object] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if "layers" in parts:
            k = int(parts[parts.index("layers") + 1])
            firsts.setdefault(k, param)
    probes = [firsts[k] for k in sorted(firsts)]
    lock = threading.Lock()

    def record(kind: str) -> None:
        line = json.dumps({"kind": kind, "layers": [float(p.detach().double().sum()) for p in probes]})
        with lock, open(path, "a") as f:
            f.write(line + "\n")

    return record


PROCESSED_LOGPROBS_ENV = "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS"
"""Fault injection, a stand-in for a misconfigured engine (tests of the start-up check,
``megatron_rl.rollout.engine_checks``): ``1`` makes the server report each sampled token's log-prob
after temperature scaling, ``log_softmax(logits / temperature)``, as SGLang does without
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (and vLLM with ``--logprobs-mode processed_logprobs`` at
top-p 1), instead of the unscaled policy's; greedy requests and prompt log-probs stay raw, as in
both engines. Unset (or ``0``) in normal use."""


def processed_logprobs() -> bool:
    """Whether ``PROCESSED_LOGPROBS_ENV`` is ``1`` (False when unset, blank or ``0``).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    return _on_off(PROCESSED_LOGPROBS_ENV, "report temperature-scaled log-probs")


def _on_off(env: str, meaning: str) -> bool:
    """A ``0``/``1`` hook variable: True for ``1``; False when unset, blank or ``0``.

    Raises:
        ValueError: any other value (names the variable and what ``1`` does).
    """
    raw = os.environ.get(env, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{env}={raw!r}: expected 1 ({meaning}) or 0")
    return raw == "1"


FAULT_REFUSE_FLUSH_ENV = "MEGATRON_RL_FAULT_REFUSE_FLUSH"
"""Fault injection, for tests of the sync's step order (tests/e2e/test_sync_seams.py): ``1`` makes the
server refuse every cache flush (``/flush_cache`` answers 400, as SGLang does while requests hold
cache; the vLLM dialect's ``/reset_prefix_cache`` answers ``{"success": false}``), so a sync fails
after its weights landed and before its engines are labelled. Unset (or ``0``) in normal use."""


def refuse_flush() -> bool:
    """Whether ``FAULT_REFUSE_FLUSH_ENV`` is ``1`` (False when unset, blank or ``0``).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    return _on_off(FAULT_REFUSE_FLUSH_ENV, "refuse every cache flush")
