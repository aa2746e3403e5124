"""Fault injection into the embedded server, for tests only: never set these variables in normal use.

The trainer's recovery paths (a refused bucket, a sync retried, a group re-created) are hard to
reach with a healthy server; the variables below make the server fail on purpose, so that the
end-to-end tests (tests/e2e/test_weight_sync.py, tests/e2e/test_sync_faults.py) can reach them.
They are read once, when the server starts (``refused_update_calls``).
"""

from __future__ import annotations

import os

__all__ = ["FAULT_REFUSE_UPDATES_ENV", "refused_update_calls"]

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
