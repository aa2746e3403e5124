"""The weight publisher: DESIGN.md step 7, the trainer's new weights to the rollout engines.

Stage routing: each pipeline stage's source rank (TP rank 0 of the first data-parallel replica)
sends its own stage's HF-named tensors to the engines over its own weight-update group
(`weight_update_group` for stage 0, `weight_update_group_pp{k}` for stage k, each with that rank
as rank 0, as slime does), and posts the matching `/update_weights_from_distributed` calls
itself; no tensor passes through another trainer rank. The other TP ranks of that replica take
part in the TP gathers (`models.hf_weights.iter_hf_weights`). The controller (global rank 0)
alone pauses the engines, opens and closes the update session, checks the version and resumes.

One sync, collective over every trainer rank (typed messages, no sentinels):
  1. controller: restart dead engines (`ServerFleet`), then send a `SyncPlan` to every rank;
  2. every stage source (re)creates its group when the plan says so; errors are shared;
  3. controller: pause + open the session on every engine;
  4. stage 0, 1, ... in turn send their tensors (no version label rides on any bucket);
     after each stage its source shares a `StageReport`;
  5. controller: close the session without a label, flush, then label every engine with the new
     version (labels rolled back if one fails), check them, continue. A refused flush leaves every
     engine paused and reporting the version it had.
A failed attempt (any step) is retried once with every group re-created; a second failure raises
`WeightSyncError` on every rank.

Live mode (`publish(version, live=True)`, for a producer generating while the trainer trains): the
controller first aborts the requests too stale to finish (`stale_below`; through the fleet's
clients, each abort answered before any pause, case N10 D), then pauses with `rollout.pause_mode`
(`abort`: requests in flight end aborted and the rollout manager resubmits them after the
continue; `in_place`: they stay frozen and continue on the new weights, their KV cache kept, so a
flush refused for them is not an error), updates, flushes and continues. Both modes tell the fleet's `GenerationGate` (when there is one)
when the pause begins and ends and which version the engines hold (before the continue). The
default path (`live=False`) sends exactly the synchronous sync's calls.

Colocated runs (`node_sources=True`, issue 17): the sources are the nodes' local rank 0, each
handing the whole model (pipeline_model_parallel_size 1) to its own node's engines by IPC
handles at the same time as the others (step 4 is one round, its reports gathered); the other
ranks of each source's TP group take part in its gathers. The controller still alone opens and
closes the session on every engine of every node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.errors import RolloutServerError, WeightSyncError
from megatron_rl.weight_sync.receiver import EngineSession
from megatron_rl.weight_sync.sender import sync_metrics
from megatron_rl.parallel.control import (ControllerFailed, broadcast_object, gather_objects, receive_from_controller,
                                         send_to_ranks)

logger = logging.getLogger(__name__)

__all__ = ["SyncPlan", "StageReport", "WeightPublisher", "stage_group_name"]

_SUM_KEYS = ("bytes", "num_buckets", "num_tensors", "broadcast_time_s", "prepare_time_s", "load_time_s")
_TIME_KEYS = ("broadcast_time_s", "prepare_time_s", "load_time_s")


def stage_group_name(stage: int) -> str:
    """Name of pipeline stage `stage`'s weight-update group on the engines."""
    return "weight_update_group" if stage == 0 else f"weight_update_group_pp{stage}"


@dataclass(frozen=True)
class SyncPlan:
    """Controller -> every rank: take part in the sync to `version` now.

    Attributes:
        version: the weight version the engines will hold.
        urls: base URLs of the engines that are up (every stage's group spans these).
        reinit: re-create every stage's group first (first sync, engines changed, or a retry).
        attempt: 1, or 2 for the retry after a failure.
    """

    version: int
    urls: tuple[str, ...]
    reinit: bool
    attempt: int


@dataclass(frozen=True)
class StageReport:
    """A stage source -> every rank after its part: `error` None when it went well."""

    stage: int
    error: str | None
    stats: dict | None = None


class WeightPublisher:
    """Every trainer rank holds one; `publish(version)` is called by every rank after each update.

    Args:
        model: this rank's model chunk (DDP-wrapped or not).
        hf_config: the HF config the model was built from.
        pgs: `ProcessGroups` of this rank.
        sender_factory: `sender_factory(urls, group_name) -> WeightSyncSender` (built on stage
            source ranks only, lazily, with the run's weight_sync settings and the engines' keys).
        fleet: the controller's `ServerFleet` (None on other ranks).
        check_checksums: verify every tensor on every engine after each sync (slow; tests/debug).
        run_dir: named in the error that stops the run.
        pause_mode: how a live update pauses the engines (`rollout.pause_mode`): `abort` or `in_place`.
        node_sources: colocated mode: every node's local rank 0 (`node_leader`) is a source and
            feeds its own node's engines (module docstring).
        node_leader: this rank is its node's local rank 0 (used with `node_sources`).

    Raises:
        ValueError: a bad `pause_mode`; with `node_sources`, a node leader that is not TP rank 0
            (a TP group spanning nodes).
    """

    def __init__(self, model, hf_config: dict, pgs, *, sender_factory, fleet=None,
                 check_checksums: bool = False, run_dir=None, pause_mode: str = "abort",
                 node_sources: bool = False, node_leader: bool = False) -> None:
        if pause_mode not in ("abort", "in_place"):
            raise ValueError(f"pause_mode must be 'abort' or 'in_place', got {pause_mode!r}")
        self.model = model
        self.hf_config = hf_config
        self.pgs = pgs
        self.sender_factory = sender_factory
        self.fleet = fleet
        self.check = check_checksums
        self.run_dir = run_dir
        self.is_controller = pgs.rank == 0
        # one copy of the stage's weights: DP rank 0; with expert parallelism the experts are spread
        # over the EP group, whose ranks sit in different DP ranks: expert-DP rank 0 (TP x EP ranks)
        ep_size = getattr(pgs, "ep_size", 1)
        if ep_size > 1 and getattr(pgs, "etp_size", pgs.tp_size) != pgs.tp_size:
            raise ValueError(f"weight sync with expert_tensor_parallel_size={pgs.etp_size} != tensor_model_parallel_size="
                             f"{pgs.tp_size} is not supported: set trainer.expert_tensor_parallel_size to the TP size")
        self.ep_group = pgs.ep if ep_size > 1 else None
        self.in_first_replica = (pgs.edp_rank == 0 if ep_size > 1 else pgs.dp_rank == 0) and pgs.cp_rank == 0
        self.is_source = self.in_first_replica and pgs.tp_rank == 0 and getattr(pgs, "ep_rank", 0) == 0
        self.node_sources = node_sources
        if node_sources:
            if node_leader and pgs.tp_rank != 0:
                raise ValueError(f"rank {pgs.rank} is its node's local rank 0 but TP rank {pgs.tp_rank}: colocated "
                                 "mode needs each tensor-parallel group inside one node")
            self.is_source = node_leader
        self.pause_mode = pause_mode
        self._live: tuple[bool, int | None] = (False, None)
        self._stale_aborted = 0
        self.sender = None
        self._urls: tuple[str, ...] = ()
        self._expected: dict = {}
        self.sources = self._source_ranks()

    def _source_ranks(self) -> list[int]:
        """Global rank of every stage's source, by stage (the same list on every rank); with
        `node_sources`, every node leader's, by rank."""
        mine = (self.pgs.pp_rank, self.pgs.rank) if self.is_source else None
        self._tp_source = self.pgs.rank
        if self.pgs.world_size == 1:
            return [0]
        if self.pgs.tp_size > 1:
            self._tp_source = dist.get_global_rank(self.pgs.tp, 0)
        return [rank for _, rank in sorted(x for x in self._gathered(mine) if x is not None)]

    # ------------------------------------------------------------------ the controller's side
    def publish(self, version: int, *, live: bool = False, stale_below: int | None = None) -> dict:
        """Controller: run the sync to `version` (retried once); other ranks: follow it.

        Args:
            version: the weight version the engines will hold.
            live: generation may be in flight (the asynchronous producer): pause with
                `pause_mode` (module docstring). False: the synchronous sync's calls exactly.
            stale_below: live only: abort first, and have resubmitted from scratch, the requests
                in flight whose oldest weight version is below this (e.g. `version - max_staleness`);
                None: abort none. Only the controller's value counts.

        Returns the controller's metrics (`weight_sync/*`, `rollout/server_restarts`,
        `rollout/servers_up`, with `live`: `weight_sync/stale_aborted`); {} on other ranks.

        Raises:
            WeightSyncError: the sync failed twice (every rank raises it; the newest checkpoint
                stays the last complete one).
            RolloutServerError: no engine could be brought back (controller; the others get
                `RuntimeError` through the channel).
        """
        if not self.is_controller:
            return self.follow(receive_from_controller(self.pgs))
        self._live = (live, stale_below if live else None)
        self._stale_aborted = 0
        try:
            return self._publish(version)
        finally:
            self.fleet.sync_done()  # engines `recover` brought back take requests only from here

    def _publish(self, version: int) -> dict:
        """The controller's attempts of `publish` (its docstring)."""
        error = None
        for attempt in (1, 2):
            try:
                plan = self._plan(version, attempt)
            except RolloutServerError as e:
                send_to_ranks(ControllerFailed(f"{type(e).__name__}: {e}"), self.pgs)
                raise
            send_to_ranks(plan, self.pgs)
            metrics, error = self._run(plan)
            if error is None:
                if attempt == 2:
                    logger.warning("weight sync to version %d succeeded on the retry", version)
                return metrics
            if attempt == 1:
                logger.warning("weight sync to version %d failed (%s); retrying once with a new group", version, error)
        raise self._failed_twice(version, error)

    def _plan(self, version: int, attempt: int) -> SyncPlan:
        self.fleet.check_all()
        changed = self.fleet.recover()
        urls = tuple(c.base_url for c in self.fleet.up_clients())
        if not urls:
            raise RolloutServerError("no rollout server is up to sync to")
        if changed:
            logger.warning("rollout servers changed (%d up); re-creating the weight-update group", len(urls))
        return SyncPlan(version=version, urls=urls, reinit=changed or attempt == 2, attempt=attempt)

    def _failed_twice(self, version: int, error: str | None) -> WeightSyncError:
        """The error every rank raises; it names the checkpoint actually on disk."""
        text = f"weight sync to version {version} failed twice, the run stops: {error}."
        if self.run_dir is not None:
            from megatron_rl.checkpoint.save import latest_checkpoint

            latest = latest_checkpoint(self.run_dir)
            text += (f" The newest checkpoint, step {latest} in {self.run_dir}/checkpoints, is intact; rerun the same "
                     "command to resume from it" if latest is not None else
                     f" No checkpoint was written in {self.run_dir}; rerun the same command to start again from step 0")
        return WeightSyncError(text)

    # ------------------------------------------------------------------ every other rank
    def follow(self, plan) -> dict:
        """Other ranks: take part in the sync of `plan` (already received from the controller) and
        in its retry. Raises `WeightSyncError` when it failed twice, `RuntimeError` when the
        controller stopped."""
        while True:
            if not isinstance(plan, SyncPlan):
                raise RuntimeError(f"expected a weight-sync plan from the controller, got {type(plan).__name__}")
            _, error = self._run(plan)
            if error is None:
                return {}
            if plan.attempt == 2:
                raise self._failed_twice(plan.version, error)
            plan = receive_from_controller(self.pgs)

    # ------------------------------------------------------------------ one attempt, every rank
    def _run(self, plan: SyncPlan) -> tuple[dict, str | None]:
        """One attempt on every rank; returns (the controller's metrics, the error every rank saw)."""
        t0 = time.perf_counter()
        error = self._shared_error(self._ensure_group(plan) if self.is_source else None)
        opened = error is None  # an open was attempted: a failure from here on closes what it opened
        if error is None:
            error = self._from(0, self._open_session() if self.is_controller else None)
        stats: list[dict] = []
        if self.node_sources and error is None:  # colocated: every node leader feeds its engines at once
            report = None
            if self.is_source:
                report = self._send_stage(0, plan)
            elif self._tp_source in self.sources:
                self._take_part()
            reports = self._gathered(report)
            error = next((r.error for r in reports if r is not None and r.error is not None), None)
            stats = [r.stats or {} for r in reports if r is not None]
        for stage, src in enumerate([] if self.node_sources else self.sources):
            if error is not None:
                break
            report = None
            if self.pgs.rank == src:
                report = self._send_stage(stage, plan)
            elif self.in_first_replica and self.pgs.pp_rank == stage:
                self._take_part()
            report = broadcast_object(report, src=src, world_size=self.pgs.world_size)
            error = report.error
            stats.append(report.stats or {})
        if self.is_controller and error is not None and opened:
            self._close_after_error()  # also after a partly failed open (else the retry is refused)
        if error is None:
            error = self._from(0, self._finish(plan.version) if self.is_controller else None)
        checked = {}
        if error is None and self.check:
            error, checked = self._check_all()
        if error is not None:
            return {}, error
        return self._metrics(stats, checked, time.perf_counter() - t0), None

    def _gathered(self, mine) -> list:
        """Every rank's `mine`, by rank (a world of one: `[mine]`)."""
        return gather_objects(mine, world_size=self.pgs.world_size)

    def _shared_error(self, mine: str | None) -> str | None:
        """The first error of any rank (every rank gets the same answer)."""
        return next((e for e in self._gathered(mine) if e is not None), None)

    def _from(self, src: int, value):
        return broadcast_object(value, src=src, world_size=self.pgs.world_size)

    def _ensure_group(self, plan: SyncPlan) -> str | None:
        """A stage source: the group over `plan.urls`, re-created when the plan or a change says so."""
        try:
            if self.sender is not None and (plan.reinit or plan.urls != self._urls or not self.sender.initialized):
                self.close()  # best effort on the engines: a dead one cannot answer
                self.sender = None
            if self.sender is None:
                self.sender = self.sender_factory(list(plan.urls), stage_group_name(self.pgs.pp_rank))
                self._urls = tuple(plan.urls)
                self.sender.init_group()
        except Exception as e:  # noqa: BLE001 - shared with every rank (a rank that raised alone would
            return f"stage {self.pgs.pp_rank}: {type(e).__name__}: {e}"  # leave the others in a collective)
        return None

    @property
    def _gate(self):
        """The fleet's `GenerationGate` (None without a fleet or one)."""
        return getattr(self.fleet, "gate", None)

    def _open_session(self) -> str | None:
        live, stale_below = self._live
        gate = self._gate
        stale = gate.take_stale(stale_below) if gate is not None and stale_below is not None else []
        self._stale_aborted += len(stale)
        if gate is not None:
            gate.begin_pause()
        if stale:
            self._abort_stale(stale)
        try:
            self.sender.begin_update(self.pause_mode if live else "abort")
        except WeightSyncError as e:
            return str(e)
        return None

    def _abort_stale(self, rids: list[str]) -> None:
        """Abort `rids` on every engine that is up, each abort answered before this returns (so
        before any pause, case N10 D), through the fleet's clients: the ones that sent them (a vLLM
        client aborts only the requests it knows). A failed abort is logged: that engine's requests
        fail with it."""
        clients: list[EngineSession] = self.fleet.up_clients()
        for client in clients:
            for rid in rids:
                try:
                    client.abort_request(rid)
                except RolloutServerError as e:
                    logger.warning("aborting stale request %s on %s failed: %s", rid, client.base_url, e)

    def _send_stage(self, stage: int, plan: SyncPlan) -> StageReport:
        """This stage's source: send the stage's tensors (the TP peers gather along in `_take_part`).
        No label goes with them: `_finish` labels the engines after the flush."""
        weights = self._stage_weights()
        if self.check:
            self._expected = {}
            weights = self.sender.checksums(weights, self._expected)
        try:
            stats = self.sender.send(weights)
        except Exception as e:  # noqa: BLE001 - shared with every rank, see _ensure_group
            for _ in weights:  # drain: the TP peers' gathers stay in step
                pass
            return StageReport(stage, f"stage {stage}: {type(e).__name__}: {e}")
        return StageReport(stage, None, stats)

    def _stage_weights(self):
        from megatron_rl.models.hf_weights import iter_hf_weights

        tp_group = self.pgs.tp if self.pgs.tp_size > 1 else None
        views = bool(getattr(self.sender, "takes_views", False))  # the colocated named-tensor hand-over
        with torch.no_grad():
            yield from iter_hf_weights(self.model, self.hf_config, tp_group=tp_group, copy=not views,
                                       ep_group=self.ep_group)

    def _take_part(self) -> None:
        """A TP (or EP) peer of a stage source: iterate the stage's tensors (the gathers are collective)."""
        for _ in self._stage_weights():
            pass

    def _close_after_error(self) -> None:
        self.sender.close_session_after_error()

    def _finish(self, version: int) -> str | None:
        live, _ = self._live
        gate = self._gate
        try:  # the engines hold `version` from before the continue: requests sent after see it
            self.sender.finish_update(str(version), flush_refusal_ok=live and self.pause_mode == "in_place",
                                      before_continue=None if gate is None else lambda: gate.set_version(version))
        except WeightSyncError as e:
            return str(e)
        if gate is not None:
            gate.end_pause()
        return None

    def _check_all(self) -> tuple[str | None, dict]:
        """Every source checks its own stage's tensors on every engine; errors and counts shared."""
        mine: dict = {}
        error = None
        if self.is_source:
            try:
                mine = self.sender.check_checksums(self._expected)
            except WeightSyncError as e:
                error = str(e)
        error = self._shared_error(error)
        total: dict = {}
        for m in self._gathered(mine):
            for k, v in (m or {}).items():
                total[k] = total.get(k, 0.0) + v
        return error, total

    def _metrics(self, stats: list[dict], checked: dict, elapsed: float) -> dict:
        if not self.is_controller:
            return {}
        s = {k: float(sum(st.get(k, 0.0) for st in stats)) for k in _SUM_KEYS}
        if self.node_sources:  # the nodes hand over at the same time: the wall-time parts are the slowest node's
            s.update({k: float(max((st.get(k, 0.0) for st in stats), default=0.0)) for k in _TIME_KEYS})
        send_s = s["broadcast_time_s"] + s["load_time_s"] + s["prepare_time_s"]
        metrics = {**sync_metrics(s, elapsed, control_s=max(elapsed - send_s, 0.0)), **checked}
        if self._live[0]:
            metrics["weight_sync/stale_aborted"] = float(self._stale_aborted)
        if self.fleet is not None:
            metrics["rollout/server_restarts"] = self.fleet.restarts
            metrics["rollout/servers_up"] = len(self.fleet.up_clients())
        logger.info("weight sync: %d tensors, %.1f MiB in %d buckets from %d source(s), %.2f s",
                    s["num_tensors"], s["bytes"] / 2**20, s["num_buckets"], len(self.sources), elapsed)
        return metrics

    def close(self) -> None:
        """Destroy this rank's group (stage sources), stop the sender's threads, close its clients."""
        if self.sender is not None:
            self.sender.close()
            clients: dict[int, EngineSession] = {
                id(c): c for c in [*self.sender.clients, *getattr(self.sender, "control_clients", [])]}
            for client in clients.values():
                client.close()
