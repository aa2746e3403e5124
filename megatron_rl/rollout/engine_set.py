"""The controller's rollout engines: started (or reached at given URLs), connected, stopped.

Engines the run starts itself are launched in a background thread as soon as the run begins,
so that their start-up overlaps the trainer's model build; `connect` waits for them and returns
the `ServerFleet` (engines up/down, restarts) that the rollout manager and the weight publisher
share.

Colocated runs on several nodes (`rollout.colocate` under torchrun with more than one node):
local rank 0 of every node starts that node's `rollout.num_servers` engines, bound to 0.0.0.0;
it hands them the weights through 127.0.0.1 (the IPC route accepts only loopback peers of its
own process tree) and restarts its own dead engines (`restart_dead`); the controller reaches the
other nodes' engines at `advertised_urls()` (this node's address towards `MASTER_ADDR`) and
counts them in its fleet as engines it cannot restart itself.
"""

from __future__ import annotations

import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from megatron_rl.config.moe import routing_requested
from megatron_rl.parallel.nodes import NodeInfo, node_address
from megatron_rl.rollout.engine import engine_backend

logger = logging.getLogger(__name__)

__all__ = ["EngineSet", "colocated_engine_args", "rollout_server_env"]

_TRAINER_ONLY_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                     "TORCHELASTIC_RUN_ID", "CUDA_DEVICE_MAX_CONNECTIONS", "MEGATRON_RL_USER_OMP_NUM_THREADS")


def rollout_server_env(servers: int = 1) -> dict[str, str]:
    """The environment of an embedded rollout server: this process's, without the trainer's
    rank variables, with the user's OMP_NUM_THREADS if one was given, otherwise the server's share
    of the usable cores (`parallel/threads.thread_share`: it does not depend on the trainer's
    layout, since the server's thread count changes its numerics), MKL_NUM_THREADS alike, and
    passive OpenMP waiting unless the user set OMP_WAIT_POLICY."""
    from megatron_rl.parallel.threads import USER_OMP_ENV, run_thread_share

    env = dict(os.environ)
    user_threads = env.get(USER_OMP_ENV, env.get("OMP_NUM_THREADS", ""))
    for key in _TRAINER_ONLY_ENV:
        env.pop(key, None)
    threads = user_threads or str(run_thread_share(1, servers).server)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def colocated_engine_args(rollout) -> tuple[list[str], list[list[str]]]:
    """`(sglang_args, per_server_args)` of the engines `megatron-rl train` starts: with
    `rollout.colocate` and the sglang backend, engine *i* takes the trainer's GPUs
    `[i x tp_size, (i + 1) x tp_size)` (SGLang `--base-gpu-id`) and every engine runs with
    `--enable-memory-saver` (release / resume really hand memory back); otherwise the given
    `rollout.sglang_extra_args` and no per-engine flags."""
    args = list(rollout.sglang_extra_args)
    if not (rollout.colocate and rollout.backend == "sglang"):
        return args, []
    if "--enable-memory-saver" not in args:
        args.append("--enable-memory-saver")
    return args, [["--base-gpu-id", str(i * rollout.tp_size)] for i in range(rollout.num_servers)]


class EngineSet:
    """The run's rollout engines (controller only).

    Args:
        cfg: the run's `Config` (`rollout.*`, `model.path`, `weight_sync.timeout_s`, `run_dir`).
        node: this process's node (`parallel.nodes.node_info()`); None = node 0 of 1. A colocated
            run with `node.nnodes > 1` binds its engines to 0.0.0.0 and logs node k's engines
            (k > 0) in `run_dir/node<k>/` (module docstring).

    Engines are started at once (unless `rollout.server_urls` names running ones); call
    `connect()` before use (controller) and `stop()` at the end (it also cancels a launch in
    progress).
    """

    def __init__(self, cfg, node: NodeInfo | None = None) -> None:
        self.cfg = cfg
        self.node = node or NodeInfo(0, 1, 0, 1)
        self.multinode = bool(cfg.rollout.colocate) and self.node.nnodes > 1
        self.processes: list = []
        self.clients: list = []
        self.fleet = None
        self.restarts = 0
        self._given_up: list = []
        """Engines past the restart budget (`restart_dead` leaves them alone)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="server-launch")
        self._launch = self._pool.submit(self._start) if not cfg.rollout.server_urls else None

    def _start(self) -> list[str]:
        from pathlib import Path

        from megatron_rl.rollout.launcher import launch_servers

        cfg, r = self.cfg, self.cfg.rollout
        sglang_args, per_server_args = colocated_engine_args(r)
        log_dir = Path(cfg.run_dir) / (f"node{self.node.node_rank}" if self.node.node_rank else "")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.processes = launch_servers(
            r.backend, cfg.model.path, r.num_servers, ports=r.server_ports, log_dir=log_dir,
            **({"host": "0.0.0.0"} if self.multinode else {}),
            startup_timeout_s=r.startup_timeout_s, env=rollout_server_env(r.num_servers), api_key=r.api_key,
            admin_api_key=r.admin_api_key, random_seed=cfg.trainer.seed,
            enable_deterministic_inference=r.enable_deterministic_inference,
            embedded_args=["--max-batch-size", str(r.server_max_batch_size),
                           # the server's rendezvous / broadcast timeout = the trainer's (a failed
                           # group set-up frees the server's control thread as soon as the trainer gives up)
                           "--weight-sync-timeout-s", str(cfg.weight_sync.timeout_s),
                           "--run-dir", str(cfg.run_dir)],
            sglang_python=r.sglang_python,
            tp_size=r.tp_size, mem_fraction_static=r.mem_fraction_static, skip_tokenizer_init=r.skip_tokenizer_init,
            sglang_args=sglang_args, vllm_python=r.vllm_python, vllm_args=r.vllm_extra_args,
            per_server_args=per_server_args,
            # MoE (issue 29): engines record the routed experts for rollout routing replay; their
            # expert parallelism follows the model (launcher.engine_ep_size: rollout.tp_size for MoE)
            return_routed_experts=routing_requested(cfg),
            # vLLM: the transfer engine of the trainer's weight_sync.backend; the CPU build where there is no GPU
            weight_transfer_backend=cfg.weight_sync.backend, vllm_device="auto",
        )
        if self.multinode:  # bound to 0.0.0.0: this node's own calls go through the loopback address
            return [f"http://127.0.0.1:{server.port}" for server in self.processes]
        return [server.base_url for server in self.processes]

    def local_urls(self) -> list[str]:
        """URLs of the engines this process started, as this host reaches them (waits for the launch).

        Raises:
            RolloutServerError: an engine did not come up.
        """
        return list(self._launch.result()) if self._launch is not None else []

    def advertised_urls(self) -> list[str]:
        """URLs of this node's engines as every node reaches them: with colocation on several
        nodes, this host's address towards `MASTER_ADDR` (also on the controller's node: the URL
        list goes to every node, where 127.0.0.1 would name the wrong host); otherwise `local_urls()`."""
        urls = self.local_urls()
        if not self.multinode:
            return urls
        host = node_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        return [f"http://{host}:{server.port}" for server in self.processes]

    def _answers(self, server) -> bool:
        """Whether a running engine answers `/health` within 5 s (a hung one is restarted too)."""
        client = server.client(timeout_s=5.0, max_retries=0)
        try:
            return client.is_healthy(timeout_s=5.0)
        finally:
            client.close()

    def restart_dead(self) -> int:
        """A node leader (not the controller): restart this node's engines that exited or stopped
        answering `/health` (stopped first, as the controller's fleet does), within
        `rollout.max_server_restarts` for this node; returns how many were restarted. An engine
        past the budget stays down (the controller's fleet runs without it) and is logged."""
        from megatron_rl.errors import RolloutServerError

        restarted = 0
        for i, server in enumerate(self.processes):
            if server in self._given_up:
                continue
            if server.process.poll() is None and self._answers(server):
                continue
            if self.restarts >= self.cfg.rollout.max_server_restarts:
                self._given_up.append(server)  # not checked again: a hung one would cost 5 s every step
                logger.error("node %d: rollout server %d exited or does not answer /health and the restart budget "
                             "is spent (rollout.max_server_restarts=%d); the run goes on without it",
                             self.node.node_rank, i, self.cfg.rollout.max_server_restarts)
                continue
            self.restarts += 1
            logger.warning("node %d: restarting rollout server %d (%s), restart %d of at most %d",
                           self.node.node_rank, i, server.log_path, self.restarts, self.cfg.rollout.max_server_restarts)
            try:
                server.restart()
                restarted += 1
            except RolloutServerError as e:
                logger.error("node %d: rollout server %d could not be restarted: %s", self.node.node_rank, i, e)
        return restarted

    def client(self, url: str, *, generate_timeout_s: float | None = None):
        """A new `RolloutEngine` client of the engine at `url` with the run's keys."""
        r = self.cfg.rollout
        return engine_backend(r.backend).client(
            url, api_key=r.api_key, admin_api_key=r.admin_api_key, timeout_s=60.0,
            generate_timeout_s=generate_timeout_s or r.timeout_s)

    def connect(self, remote_urls=()):
        """Wait for the engines, build one client each and the `ServerFleet`; returns the fleet.
        `remote_urls`: the other nodes' colocated engines (in the fleet after this node's; the
        fleet cannot restart them, their node leaders do).

        Raises:
            RolloutServerError: an engine did not come up (the message holds its log tail).
        """
        from megatron_rl.rollout.fleet import ServerFleet

        from megatron_rl.errors import RolloutServerError

        r = self.cfg.rollout
        urls = (self.advertised_urls() if self._launch is not None else list(r.server_urls))
        everyone = [*urls, *remote_urls]
        repeated = sorted({u for u in everyone if everyone.count(u) > 1})
        if repeated:
            raise RolloutServerError(f"colocated engines of different nodes answer at the same URL(s) {repeated}: two "
                                     "nodes on one host with fixed rollout.server_ports? Unset rollout.server_ports "
                                     "or give each host its own")
        self.clients = [self.client(u) for u in everyone]
        processes = ([*self.processes, *[None] * len(remote_urls)] if self._launch is not None else None)
        self.fleet = ServerFleet(self.clients, processes, max_restarts=r.max_server_restarts)
        return self.fleet

    def stop(self) -> None:
        """Close the clients and stop the engines this run started (waits for a launch in progress)."""
        for c in self.clients:
            c.close()
        if self._launch is not None:
            self._launch.cancel()
            try:
                self._launch.result(timeout=self.cfg.rollout.startup_timeout_s + 30)
            except Exception:  # noqa: BLE001 - the launch error was already raised by connect()
                pass
        for server in self.processes:
            server.stop()
        self._pool.shutdown(wait=False)

    def dead_servers(self) -> str:
        """A report of started engines that are no longer running (exit code, log tail), or ""."""
        lines = []
        for i, server in enumerate(self.processes):
            code = server.process.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                lines.append(f"rollout server {i} (pid {server.process.pid}) is dead ({how}); last lines of "
                             f"{server.log_path}:\n{server.log_tail(20)}")
        return "\n".join(lines)
