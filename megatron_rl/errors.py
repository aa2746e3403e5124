"""The project's error types, shared by every layer (config, rollout, weight sync, engine).

`RolloutServerError` and `WeightSyncError` are failures of *external* parts (a server process, an
HTTP call, a broadcast group), kept apart from ``ValueError``/``TypeError`` (user mistakes) so that
callers can apply one retry policy to them (see ``RolloutClient``: only requests that never reached
the server and idempotent GETs are retried; everything else surfaces as one of these).
This module imports nothing of the project, so any package may import it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "RolloutServerError", "WeightSyncError"]


class ConfigError(ValueError):
    """A config value that cannot work: the message names the key (`section.field`), the bad value
    and what is allowed. A `ValueError`, so callers that catch user mistakes catch it too."""


class RolloutServerError(RuntimeError):
    """A rollout server failed: it did not start, answered with an error, or broke the protocol.

    Attributes:
        url: the server URL (or endpoint URL) involved, when known.
        status_code: the HTTP status of the failed answer, or None (no answer / startup failure).
        body: the server's answer body (decoded JSON or text), or None. Never holds credentials.
    """

    def __init__(
        self, message: str, *, url: str | None = None, status_code: int | None = None, body: object = None
    ) -> None:
        super().__init__(message)
        self.url = url
        self.status_code = status_code
        self.body = body


class WeightSyncError(RuntimeError):
    """Pushing trainer weights to the rollout servers failed.

    When this is raised the servers may hold partly updated weights and stay paused; the
    caller must run a complete sync again (after re-creating the group when ``group_broken``)
    before sampling from them.

    Attributes:
        group_broken: True when the broadcast group is out of step (a server refused a bucket
            while the trainer was already broadcasting) and must be re-created with
            ``WeightSyncSender.init_group()``.
    """

    def __init__(self, message: str, *, group_broken: bool = False) -> None:
        super().__init__(message)
        self.group_broken = group_broken
