"""The rollout servers of a run and what happens when one fails (DESIGN.md step 0 and step 7).

A ``ServerFleet`` holds one ``RolloutClient`` per server and, for servers this run started, the
``ServerProcess`` that can restart it. Requests go only to servers marked up. When a request
fails without an answer (connection refused or reset, timeout) the caller reports it:

* the server is checked (process alive, ``/health``); a server that still answers stays up and
  the request is retried;
* a dead or silent server is marked down. While other servers remain up it is dropped, with a
  warning, until the next weight sync (``recover``), where it is restarted and joins the new
  weight-update group; its requests are retried on the others;
* when no server remains up, it is restarted at once and re-synced to the trainer's current
  weight version (the ``resync`` callback) before any request reaches it, so a server is never
  sampled at a version other than the trainer's (DESIGN.md step 0).

Servers not started by this run (``rollout.server_urls``) cannot be restarted: they are dropped
while down and taken back once ``/health`` answers again at a sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.live import GenerationGate
from megatron_rl.errors import RolloutServerError

logger = logging.getLogger(__name__)

__all__ = ["ServerFleet"]


class ServerFleet:
    """Rollout servers, their up/down state and their restarts.

    Args:
        clients: one client per server.
        processes: the ``ServerProcess`` of each server started by this run (same order), or None
            for servers at given URLs (no restart possible).
        max_restarts: restarts allowed per run in total; one more failure stops the run.
        resync: called with the list of up clients after an immediate restart (no other server was
            up); it must re-create the weight-update group and push the current weights. Set by
            the controller once the weight sync exists (``set_resync``).

    Thread-safe: rollout threads call ``report_failure`` concurrently; one of them handles a given
    failure, the others see the new state and retry.
    """

    def __init__(
        self,
        clients: Sequence[RolloutClient],
        processes: Sequence | None = None,
        *,
        max_restarts: int = 3,
        resync: Callable[[list[RolloutClient]], None] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("ServerFleet needs at least one rollout server")
        if processes is not None and len(processes) != len(clients):
            raise ValueError(f"{len(processes)} processes for {len(clients)} clients")
        self.clients = list(clients)
        self.processes = list(processes) if processes is not None else [None] * len(self.clients)
        self.max_restarts = max_restarts
        self._resync = resync
        self._admit: Callable[[RolloutClient], None] | None = None
        self._refused = False
        self._up = [True] * len(self.clients)
        self._epoch = [0] * len(self.clients)  # bumped at every state change of a server
        self._lock = threading.RLock()
        self._synced = threading.Event()
        """Clear while a restarted server waits for its re-sync: `pick` waits, so no request reaches
        weights the trainer does not hold. The re-sync itself runs outside `_lock` (asynchronous
        training runs it on the main thread, whose publish needs the lock)."""
        self._synced.set()
        self.restarts = 0
        self.membership_changed = False
        """True when the set of up servers changed since the weight-update group was last made."""
        self.gate = GenerationGate()
        """What the rollout manager and the weight publisher share about live updates (pauses, the
        published version, requests in flight; ``megatron_rl.rollout.live``)."""

    def set_admit(self, admit: Callable[[RolloutClient], None]) -> None:
        """Set the start-up checks a given engine (one this run did not start) must pass again
        when `recover` takes it back (it may have been restarted with other settings):
        `admit(client)` raises `RolloutServerError` to keep it out."""
        self._admit = admit

    def _admitted(self, i: int) -> bool:
        """Run the start-up checks on server `i`, just brought back; False (and marked down again,
        logged with the reason) when it fails them."""
        if self._admit is None:
            return True
        try:
            self._admit(self.clients[i])
            return True
        except RolloutServerError as e:
            self._up[i] = False
            self._epoch[i] += 1
            self._refused = True
            logger.error("rollout server %d (%s) came back but fails the start-up checks; it stays out: %s", i,
                         self.clients[i].base_url, e)
            return False

    def set_resync(self, resync: Callable[[list[RolloutClient]], None]) -> None:
        """Set the callback that re-creates the weight-update group and pushes the current weights."""
        self._resync = resync

    def up_indices(self) -> list[int]:
        """Indices of the servers that take requests now."""
        with self._lock:
            return [i for i, up in enumerate(self._up) if up]

    def up_clients(self) -> list[RolloutClient]:
        """Clients of the servers that take requests now (the weight sync targets these)."""
        with self._lock:
            return [c for c, up in zip(self.clients, self._up) if up]

    def pick(self, key: int) -> tuple[int, int]:
        """Server for request number ``key`` (round-robin over up servers): ``(index, epoch)``.

        Raises:
            RolloutServerError: no server is up (a failed restart left none).
        """
        self._synced.wait()
        with self._lock:
            up = [i for i, u in enumerate(self._up) if u]
            if not up:
                raise RolloutServerError("no rollout server is up")
            i = up[key % len(up)]
            return i, self._epoch[i]

    def _alive(self, i: int) -> bool:
        proc = self.processes[i]
        if proc is not None and not proc.alive():
            return False
        return self.clients[i].is_healthy(timeout_s=5.0)

    def report_failure(self, index: int, epoch: int, error: BaseException) -> None:
        """A request to server ``index`` (picked at ``epoch``) got no answer: check and recover.

        Returns once a retry makes sense (the server answers, another is up, or it was restarted
        and re-synced).

        Raises:
            RolloutServerError: the server is down and cannot come back (restart budget spent,
                restart failed, or nothing can restart it) while no other server is up.
        """
        with self._lock:
            if self._epoch[index] != epoch or not self._up[index] and any(self._up):
                return  # another thread handled this server already
            if self._up[index] and self._alive(index):
                logger.warning("rollout server %d (%s): request failed (%s) but the server answers; retrying",
                               index, self.clients[index].base_url, error)
                return
            if self._up[index]:
                self._up[index] = False
                self._epoch[index] += 1
                self.membership_changed = True
                logger.warning("rollout server %d (%s) is down: %s", index, self.clients[index].base_url, error)
            if any(self._up):
                logger.warning("rollout server %d dropped until the next weight sync; its requests go to the "
                               "%d other server(s)", index, sum(self._up))
                return
            # restart this server, or, when this run cannot restart it (another node's colocated
            # engine, a given URL), a down one it can: restarting any server beats stopping the run
            target = index if self.processes[index] is not None else next(
                (i for i, p in enumerate(self.processes) if p is not None), index)
            if target != index:
                logger.warning("rollout server %d cannot be restarted by this process; restarting rollout server %d "
                               "(%s) instead", index, target, self.clients[target].base_url)
            self._restart(target, error)
            clients = self.up_clients()
            if self._resync is None:
                raise RolloutServerError("a rollout server was restarted but there is no weight sync to re-sync it")
            self._synced.clear()
        try:  # outside the lock (see `_synced`); requests wait in `pick` meanwhile
            self._resync(clients)
        finally:
            self._synced.set()
        with self._lock:
            self.membership_changed = False
        logger.warning("rollout server %d re-synced to the trainer's current weights", target)

    def _restart(self, index: int, error: BaseException | None) -> None:
        proc = self.processes[index]
        if proc is None:
            raise RolloutServerError(
                f"rollout server {self.clients[index].base_url} is down ({error}) and was not started by this run, "
                "so it cannot be restarted; no other rollout server is up"
            )
        if self.restarts >= self.max_restarts:
            raise RolloutServerError(
                f"rollout server {index} ({self.clients[index].base_url}) is down ({error}) and the restart budget "
                f"is spent (rollout.max_server_restarts={self.max_restarts}); last lines of {proc.log_path}:\n"
                f"{proc.log_tail(20)}"
            )
        self.restarts += 1
        logger.warning("restarting rollout server %d (%s), restart %d of at most %d", index,
                       self.clients[index].base_url, self.restarts, self.max_restarts)
        proc.restart()
        self._up[index] = True
        self._epoch[index] += 1
        self.membership_changed = True
        logger.warning("rollout server %d restarted (pid %d)", index, proc.process.pid)

    def sync_done(self) -> None:
        """The weight sync after `recover` ended (the publisher calls it, also after a failed sync,
        which stops the run): requests held in `pick` go on."""
        self._synced.set()

    def check_all(self) -> None:
        """Mark down every up server whose process died or whose ``/health`` does not answer."""
        with self._lock:
            for i, up in enumerate(self._up):
                if up and not self._alive(i):
                    self._up[i] = False
                    self._epoch[i] += 1
                    self.membership_changed = True
                    logger.warning("rollout server %d (%s) is down (found before a weight sync)", i,
                                   self.clients[i].base_url)

    def recover(self) -> bool:
        """Before a weight sync: restart the started servers that are down, take back given ones
        that answer again. Returns True when the set of up servers changed since the group was made
        (then the weight-update group must be re-created over ``up_clients()``); resets that flag.
        A server brought back holds weights the trainer does not: `pick` waits (every server)
        until the sync that includes it ends and its caller calls `sync_done`.

        Raises:
            RolloutServerError: a restart failed or the budget is spent while no server is up.
        """
        with self._lock:
            self._refused = False
            for i, up in enumerate(self._up):
                if up:
                    continue
                if self.processes[i] is None:
                    if self.clients[i].is_healthy(timeout_s=5.0):
                        self._up[i] = True
                        self._epoch[i] += 1
                        self.membership_changed = True
                        if self._admitted(i):
                            self._synced.clear()  # its weights are not the trainer's until this sync ends
                            logger.warning("rollout server %d (%s) answers again; it rejoins at this sync", i,
                                           self.clients[i].base_url)
                    continue
                try:
                    self._restart(i, None)  # started again by this run with the run's own flags: not re-checked
                    self._synced.clear()  # back on the checkpoint's weights until this sync ends
                except RolloutServerError:
                    if not any(self._up):
                        raise
                    logger.exception("rollout server %d could not be restarted; continuing without it", i)
            if self._refused and not any(self._up):
                raise RolloutServerError("no rollout server is up: the ones brought back failed the start-up checks "
                                         "(logged above)")
            changed, self.membership_changed = self.membership_changed, False
            return changed
