#!/usr/bin/env python
"""Helpers the sbatch scripts in this folder call: interface addresses, per-engine ports, the
job-layout checks that run before any GPU work, and waiting for rollout servers.

    python slurm/jobtool.py ipv4 --iface ib0            # this node's IPv4 on ib0 (error if missing)
    python slurm/jobtool.py ports --host IP --base 30000 --slot 2 --count 3 [--job JOBID]
    python slurm/jobtool.py check --config R.yaml --trainer-nodes 4 ... [overrides]
    python slurm/jobtool.py wait-health --timeout 600 URL [URL ...]
    python slurm/jobtool.py vllm-cmd --python P --model M --host IP --port N ... [--ep-size E]
                                     [--enable-return-routed-experts] [--extra-args "..."]

Ports (CASES.md B31): SGLang picks its NCCL port as ``http_port + random(100, 1000)`` when none is
given, so engines sharing a node can collide. Here every engine on a node gets its own block of
``PORT_BLOCK`` ports starting at ``base + slot * PORT_BLOCK`` (slot = the engine's local index on
the node); inside the block the first free ports are taken (checked by binding), so the result
depends only on (node, slot) and what is already bound there, never on a random offset, and two
engines can never be handed the same port. A port is handed out minutes before its server binds it,
so ``--job`` also records a claim for the job in a node-local folder that other jobs on the node skip
while the job is alive (`claim_ports`): two jobs that start together never pick the same ports.

Interfaces (B31): on multi-NIC clusters ``hostname --ip-address`` may return the management
network's address. The user names the interface (``MEGATRON_RL_IFACE``, e.g. ``ib0`` or
``bond0``); each node resolves that interface's IPv4 itself and a node without it stops the job
with an error naming the node and the interface.

Engines (``ROLLOUT_BACKEND``): ``sglang`` or ``vllm`` on the rollout nodes; in CPU mode the embedded
server stands in for either, speaking the matching API (``--api-dialect vllm`` for vLLM). `check`
names the ``rollout.backend`` the trainer then needs (`trainer_backend`); `vllm-cmd` prints the
``vllm serve`` line of ``megatron_rl.rollout.launcher.build_vllm_command``, so that a Slurm engine and
one started by ``megatron-rl train`` get the same flags.

Mixture-of-Experts models (issue 29): `check` names each engine's expert-parallel size
(``ROLLOUT_EP_SIZE``; unset = ``ROLLOUT_TP_SIZE`` for a model whose config.json names routed experts,
as `megatron_rl.rollout.launcher.engine_ep_size` does, else 1) and whether the engines record the
routed experts (``actor.router_replay``); ``lib/engine.sh`` passes them on (SGLang ``--ep-size`` /
vLLM ``--enable-expert-parallel``, ``--enable-return-routed-experts``).

Standard library + psutil + PyYAML only, except `check` and `vllm-cmd` (they import megatron_rl).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence

PORT_BLOCK = 16
"""Ports reserved per engine slot on a node: slot i owns [base + 16 i, base + 16 i + 16)."""

ENGINES = ("sglang", "vllm")
"""Values of ROLLOUT_BACKEND: which servers the job starts on the rollout nodes."""

TRAINER_BACKEND = {("gpu", "sglang"): "sglang", ("gpu", "vllm"): "vllm",
                   ("cpu", "sglang"): "embedded", ("cpu", "vllm"): "vllm-embedded"}
"""(MEGATRON_RL_DEVICE, ROLLOUT_BACKEND) -> the trainer's ``rollout.backend``: the API its client speaks
to the job's engines (in CPU mode the embedded server, in SGLang's or vLLM's dialect)."""


class JobConfigError(ValueError):
    """A job setting that cannot work; the message names the setting and what was expected."""


def interface_table() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4 addresses, ``{name: [ipv4, ...]}`` (psutil)."""
    import psutil

    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }


def resolve_ipv4(iface: str, table: Mapping[str, Sequence[str]], node: str) -> str:
    """The first IPv4 address of interface ``iface`` in ``table`` (as `interface_table` returns).

    Args:
        iface: interface name the user chose (MEGATRON_RL_IFACE), e.g. ``ib0``.
        table: ``{interface: [ipv4, ...]}`` of node ``node``.
        node: node name, only for the error message.

    Raises:
        JobConfigError: the node has no such interface, or it has no IPv4 address; the message
            names the node, the interface and the interfaces the node does have.
    """
    if iface not in table:
        have = ", ".join(f"{n} ({', '.join(a) or 'no IPv4'})" for n, a in sorted(table.items())) or "none"
        raise JobConfigError(
            f"MEGATRON_RL_IFACE={iface}: node {node} has no interface {iface!r}; its interfaces: {have}. "
            "Set MEGATRON_RL_IFACE (slurm/env.sh) to an interface every node of the job has"
        )
    addrs = list(table[iface])
    if not addrs:
        raise JobConfigError(f"MEGATRON_RL_IFACE={iface}: interface {iface!r} on node {node} has no IPv4 address")
    return addrs[0]


def port_is_free(host: str, port: int) -> bool:
    """True when a TCP socket can bind ``host:port`` now (SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def slot_ports(
    base: int,
    slot: int,
    count: int,
    *,
    host: str = "127.0.0.1",
    is_free: Callable[[str, int], bool] = port_is_free,
    block: int = PORT_BLOCK,
) -> list[int]:
    """``count`` free ports for engine ``slot`` on this node, from its own block of ``block`` ports.

    Args:
        base: first port of slot 0 (e.g. 30000 for rollout engines).
        slot: the engine's index on its node (SLURM_LOCALID), >= 0.
        count: ports it needs (SGLang: 3 = http, NCCL, dist-init).
        host: address the ports will be bound on (checked by binding it).
        is_free: the check; tests pass a fake table of busy ports.

    Returns:
        ``count`` distinct ports in ``[base + slot * block, base + (slot + 1) * block)``, the lowest
        free ones, in increasing order.

    Raises:
        JobConfigError: bad arguments, or fewer than ``count`` free ports in the slot's block.
    """
    if slot < 0 or count < 1 or count > block:
        raise JobConfigError(f"port slot {slot}, count {count}: need slot >= 0 and 1 <= count <= {block}")
    lo = base + slot * block
    hi = lo + block
    if base < 1024 or hi - 1 > 65535:
        raise JobConfigError(f"base port {base} with slot {slot}: ports {lo}-{hi - 1} are outside 1024-65535")
    free = [p for p in range(lo, hi) if is_free(host, p)]
    if len(free) < count:
        raise JobConfigError(
            f"only {len(free)} of the {block} ports {lo}-{hi - 1} of engine slot {slot} are free on {host}; "
            f"{count} are needed: pick another base port (ROLLOUT_BASE_PORT / TRAINER_BASE_PORT)"
        )
    return free[:count]


def claims_dir_default() -> str:
    """Where port claims live: node-local and shared by every job on the node.

    ``MEGATRON_RL_PORT_CLAIMS`` when set, else ``/dev/shm/megatron-rl-ports`` (``/tmp/...`` without
    /dev/shm). Per-job private /tmp (Slurm's job_container/tmpfs) would hide other jobs' claims, which
    is why /dev/shm comes first.
    """
    if os.environ.get("MEGATRON_RL_PORT_CLAIMS"):
        return os.environ["MEGATRON_RL_PORT_CLAIMS"]
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    return os.path.join(root, "megatron-rl-ports")


_LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "REQUEUED",
                "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}


def slurm_job_alive(job: str) -> bool:
    """True while Slurm job ``job`` is queued or running (``squeue -h -j JOB -o %T``).

    An unknown job (ended and purged) is dead; when ``squeue`` cannot be run at all the job is
    assumed alive, so that a claim is never taken away by mistake.
    """
    import subprocess

    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if out.returncode != 0:
        return "Invalid job id" not in out.stderr
    return any(state.strip() in _LIVE_STATES for state in out.stdout.split())


def claim_ports(
    base: int,
    slot: int,
    count: int,
    *,
    job: str,
    host: str = "127.0.0.1",
    claims_dir: str | None = None,
    is_free: Callable[[str, int], bool] = port_is_free,
    job_alive: Callable[[str], bool] = slurm_job_alive,
    block: int = PORT_BLOCK,
) -> list[int]:
    """`slot_ports`, plus a claim on the ports for Slurm job ``job`` that other jobs on the node respect.

    A port is handed out minutes before its server binds it (SGLang loads the model first, torchrun
    binds the rendezvous port when the trainer step starts), so a bind check alone lets two jobs
    that start together on one node pick the same ports. Each handed-out port therefore gets a claim
    file ``claims_dir/PORT`` holding the job id, written under an exclusive lock on
    ``claims_dir/lock``; another job skips a port whose claim belongs to a job that is still alive
    (`job_alive`). Claims of ended jobs, and of an earlier run of the same job (a requeue), are
    taken over. Within one job the slots' blocks never overlap, so its own claims never conflict.

    Args:
        job: the Slurm job id (SLURM_JOB_ID) the ports are for.
        claims_dir: node-local folder of the claims (`claims_dir_default`); created mode 1777.
        is_free / job_alive: the bind check and the liveness check; tests pass fakes.

    Returns:
        ``count`` ports in the slot's block, the lowest ones that are bindable and unclaimed.

    Raises:
        JobConfigError: as `slot_ports`; also when fewer than ``count`` ports of the block are
            both free and unclaimed (the message names the jobs holding claims).
    """
    import fcntl

    claims_dir = claims_dir or claims_dir_default()
    try:
        os.makedirs(claims_dir, exist_ok=True)
        if os.stat(claims_dir).st_uid == os.getuid():
            os.chmod(claims_dir, 0o1777)
        lock_fd = os.open(os.path.join(claims_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        print(f"jobtool ports: warning: no port claims ({claims_dir}: {e}); ports are only checked by binding",
              file=sys.stderr)
        return slot_ports(base, slot, count, host=host, is_free=is_free, block=block)
    alive: dict[str, bool] = {}
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        claimed_by: dict[int, str] = {}

        def usable(h: str, port: int) -> bool:
            if not is_free(h, port):
                return False
            f = os.path.join(claims_dir, str(port))
            try:
                with open(f) as fh:
                    owner = fh.read().split()[0]
            except (OSError, IndexError):
                return True
            if owner == str(job):
                return True
            if owner not in alive:
                alive[owner] = job_alive(owner)
            if alive[owner]:
                claimed_by[port] = owner
                return False
            return os.access(f, os.W_OK)  # a stale claim another user wrote cannot be taken over

        try:
            ports = slot_ports(base, slot, count, host=host, is_free=usable, block=block)
        except JobConfigError as e:
            if claimed_by:
                holders = ", ".join(sorted(set(claimed_by.values())))
                raise JobConfigError(f"{e} (ports claimed by running job(s) {holders} are not free)") from None
            raise
        for port in ports:
            tmp = os.path.join(claims_dir, f".{port}.{os.getpid()}")
            with open(tmp, "w") as fh:
                fh.write(f"{job}\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, os.path.join(claims_dir, str(port)))
        return ports
    finally:
        os.close(lock_fd)


def check_job(
    config: str,
    overrides: Sequence[str],
    *,
    total_nodes: int,
    trainer_nodes: int,
    rollout_nodes: int,
    gpus_per_node: int,
    rollout_tp_size: int,
    engines_per_node: int,
    device: str,
    rollout_backend: str = "",
    rollout_ep_size: int | None = None,
) -> dict:
    """The static checks of one job, run on the batch host before any step starts (seconds).

    Loads the recipe with its overrides (megatron-rl's own static checks: unknown keys, model
    layout vs config.json, batch sizes), then again with the ``rollout.backend`` the trainer will
    be given (`TRAINER_BACKEND`: e.g. vLLM's weight transfer needs pipeline_model_parallel_size 1),
    then checks the node split, the trainer world against TP x PP, the mini-batch split over
    data-parallel ranks, the rollout engines' TP against the GPUs of a node, that model.path and
    the data files exist, and that a run_dir holding checkpoints is not combined with
    trainer.resume_mode=disable.

    Args:
        rollout_backend: ROLLOUT_BACKEND, ``sglang`` or ``vllm``; empty = the recipe's engine
            (``vllm`` for ``rollout.backend`` vllm / vllm-embedded, else ``sglang``).
        rollout_ep_size: ROLLOUT_EP_SIZE, the expert-parallel size of each GPU engine (must divide
            ROLLOUT_TP_SIZE; vLLM: 1 or ROLLOUT_TP_SIZE); None = `rollout_ep_size_of` the model.

    Returns:
        ``{"trainer_world", "dp", "engines", "engines_per_node", "model_path", "run_dir",
        "rollout_backend", "trainer_backend", "vllm_python", "vllm_extra_args", "colocate",
        "rollout_ep_size", "router_replay"}`` (model_path and
        run_dir resolved against the recipe's folder / the working directory; the last two are the
        recipe's ``rollout.vllm_python`` and ``rollout.vllm_extra_args``, the latter as one
        shell-quoted string; ``colocate`` 1 with ``rollout.colocate``: the trainer starts its
        ``rollout.num_servers`` engines itself and the job has no rollout step; ``rollout_ep_size``
        the GPU engines' EP size, 1 in CPU mode and with colocation (the trainer's launcher derives
        its own); ``router_replay`` 1 with ``actor.router_replay``: engines start with
        ``--enable-return-routed-experts``).

    Raises:
        JobConfigError: the message names the setting (job variable or config key).
    """
    import shlex

    from megatron_rl.config import load_config
    from megatron_rl.config.moe import routing_requested
    from megatron_rl.trainer.preflight import get_check

    if device not in ("gpu", "cpu"):
        raise JobConfigError(f"device {device!r} (--device, MEGATRON_RL_DEVICE in the sbatch scripts): expected gpu or cpu")
    if rollout_backend and rollout_backend not in ENGINES:
        raise JobConfigError(f"ROLLOUT_BACKEND={rollout_backend}: expected {' or '.join(ENGINES)} (the rollout "
                             "engines the job starts; unset = the recipe's rollout.backend)")

    def load(trainer_backend: str | None):
        # the config exactly as the trainer gets it: train.sbatch appends rollout.backend=<trainer_backend>
        extra = [f"rollout.backend={trainer_backend}"] if trainer_backend else []
        try:  # train.sbatch passes trainer.nproc_per_node=GPUS_PER_NODE before the user's overrides
            return load_config(config, [f"trainer.nproc_per_node={gpus_per_node}", *overrides, *extra])
        except (ValueError, FileNotFoundError) as e:
            how = f" with ROLLOUT_BACKEND={rollout_backend} (rollout.backend={trainer_backend})" if extra else ""
            raise JobConfigError(f"{config}{how}: {e}") from None

    cfg = load(TRAINER_BACKEND[device, rollout_backend] if rollout_backend else None)
    if not rollout_backend:
        rollout_backend = "vllm" if cfg.rollout.backend in ("vllm", "vllm-embedded") else "sglang"
        if cfg.rollout.backend != TRAINER_BACKEND[device, rollout_backend]:
            cfg = load(TRAINER_BACKEND[device, rollout_backend])
    trainer_backend = TRAINER_BACKEND[device, rollout_backend]
    if trainer_nodes < 1:
        raise JobConfigError(f"TRAINER_NODES={trainer_nodes}: at least one trainer node is needed")
    if rollout_nodes < 0:
        raise JobConfigError(f"ROLLOUT_NODES={rollout_nodes}: must be >= 0 (0 = servers share the trainer nodes); "
                             f"TRAINER_NODES={trainer_nodes} leaves no nodes of the job's {total_nodes} for the rollout")
    if trainer_nodes + rollout_nodes != total_nodes:
        raise JobConfigError(
            f"TRAINER_NODES={trainer_nodes} + ROLLOUT_NODES={rollout_nodes} = {trainer_nodes + rollout_nodes} "
            f"but the job has {total_nodes} node(s) (#SBATCH --nodes); make them add up"
        )
    if gpus_per_node < 1:
        raise JobConfigError(f"GPUS_PER_NODE={gpus_per_node}: must be >= 1 (trainer processes per node)")
    t = cfg.trainer
    mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
    world = trainer_nodes * gpus_per_node
    if world % mp:
        raise JobConfigError(
            f"TRAINER_NODES={trainer_nodes} x GPUS_PER_NODE={gpus_per_node} = {world} trainer ranks do not divide "
            f"into trainer.tensor_model_parallel_size {t.tensor_model_parallel_size} x "
            f"trainer.pipeline_model_parallel_size {t.pipeline_model_parallel_size} x "
            f"trainer.context_parallel_size {t.context_parallel_size} = {mp}"
        )
    if cfg.rollout.colocate:
        # `megatron-rl train` starts the engines itself: each trainer node's local rank 0 starts
        # rollout.num_servers on its node's devices and feeds them (docs/COLOCATE.md): no rollout step
        if rollout_nodes != 0:
            raise JobConfigError(
                f"rollout.colocate: true runs the engines on the trainer's own nodes (each node's local rank 0 starts "
                f"rollout.num_servers of them); the job has ROLLOUT_NODES={rollout_nodes}: submit with "
                "ROLLOUT_NODES=0 (every node trains), or set rollout.colocate=false for separate rollout nodes")
        per_node = cfg.rollout.num_servers
    elif device == "gpu":
        if rollout_tp_size < 1 or gpus_per_node % rollout_tp_size:
            raise JobConfigError(
                f"ROLLOUT_TP_SIZE={rollout_tp_size} must divide GPUS_PER_NODE={gpus_per_node} (one rollout engine "
                "per ROLLOUT_TP_SIZE GPUs of a rollout node; engines spanning nodes are not supported here)"
            )
        per_node = gpus_per_node // rollout_tp_size
        if rollout_nodes == 0:
            raise JobConfigError("ROLLOUT_NODES=0 on GPUs: the trainer takes every GPU of its nodes; give the "
                                 "rollout engines nodes of their own")
    else:
        per_node = engines_per_node
        if per_node < 1:
            raise JobConfigError(f"ENGINES_PER_NODE={per_node}: must be >= 1")
    engines = per_node * (rollout_nodes or trainer_nodes)  # 0 rollout nodes: servers on the trainer nodes
    if cfg.model.path is None:
        raise JobConfigError("model.path is not set: pass MODEL_PATH=/path/to/hf-model (a Hugging Face folder)")
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        # the launch-time checks that hold on the batch host too, each with the job variables behind it
        for name, hint in (("world_size", "TRAINER_NODES x GPUS_PER_NODE"),
                           ("data_parallel_split", "TRAINER_NODES x GPUS_PER_NODE"),
                           ("model_files", "MODEL_PATH / model.path"),
                           ("data_files", "data.train_files / data.val_files"),
                           ("run_dir", "RUN_DIR / run_dir; a requeued job needs trainer.resume_mode=auto")):
            try:
                get_check(name).run(cfg)
            except RuntimeError as e:
                raise JobConfigError(f"{e} ({hint})") from None
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    ep = 1
    if device == "gpu" and not cfg.rollout.colocate:
        ep = rollout_ep_size_of(cfg, rollout_tp_size, rollout_backend, rollout_ep_size)
    elif rollout_ep_size not in (None, 1):
        raise JobConfigError(f"ROLLOUT_EP_SIZE={rollout_ep_size}: only GPU engines on rollout nodes take it (CPU mode "
                             "and rollout.colocate have no separate engines of ROLLOUT_TP_SIZE GPUs); unset it")
    return {"trainer_world": world, "dp": world // mp, "engines": engines, "engines_per_node": per_node,
            "model_path": str(cfg.model.path), "run_dir": str(cfg.run_dir), "rollout_backend": rollout_backend,
            "trainer_backend": trainer_backend, "vllm_python": cfg.rollout.vllm_python,
            "vllm_extra_args": shlex.join(cfg.rollout.vllm_extra_args), "colocate": int(cfg.rollout.colocate),
            "rollout_ep_size": ep, "router_replay": int(routing_requested(cfg))}


def rollout_ep_size_of(cfg, rollout_tp_size: int, rollout_backend: str, requested: int | None = None) -> int:
    """The expert-parallel size of each GPU engine of the job.

    Args:
        cfg: the loaded recipe (``model.path``, else ``model.hf_config_path``, names the config.json).
        rollout_tp_size: ROLLOUT_TP_SIZE, GPUs per engine.
        rollout_backend: ``sglang`` or ``vllm``.
        requested: ROLLOUT_EP_SIZE; None = ``rollout_tp_size`` for a Mixture-of-Experts model (its
            config.json names routed experts), else 1 (`megatron_rl.rollout.launcher.engine_ep_size`).

    Raises:
        JobConfigError: an EP size that does not divide ROLLOUT_TP_SIZE (SGLang), that is neither
            1 nor ROLLOUT_TP_SIZE (vLLM), that does not divide the experts, or > 1 for a dense model.
    """
    import json
    from pathlib import Path

    from megatron_rl.rollout.launcher import moe_num_experts, vllm_expert_parallel

    cands = [Path(str(cfg.model.path)) / "config.json"] if cfg.model.path else []
    if cfg.model.hf_config_path:
        cands.append(Path(str(cfg.model.hf_config_path)))
    src = next((c for c in cands if c.is_file()), None)
    try:
        experts = moe_num_experts(json.loads(src.read_text())) if src is not None else 0
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise JobConfigError(f"{src}: {e}") from None
    if requested is None:
        if not experts or rollout_tp_size == 1:
            return 1
        if experts % rollout_tp_size:
            raise JobConfigError(f"ROLLOUT_TP_SIZE={rollout_tp_size}: the model's {experts} experts ({src}) do not "
                                 "divide over an engine's GPUs (expert parallelism); choose a TP size dividing them, or "
                                 "set ROLLOUT_EP_SIZE")
        return rollout_tp_size
    if requested < 1 or rollout_tp_size % requested:
        raise JobConfigError(f"ROLLOUT_EP_SIZE={requested} must be >= 1 and divide ROLLOUT_TP_SIZE={rollout_tp_size} "
                             "(an engine's expert parallelism splits its own GPUs)")
    if requested > 1 and not experts:
        raise JobConfigError(f"ROLLOUT_EP_SIZE={requested}: the model ({src or 'no config.json found'}) has no routed "
                             "experts; expert parallelism is for Mixture-of-Experts models (unset it)")
    if requested > 1 and experts % requested:
        raise JobConfigError(f"ROLLOUT_EP_SIZE={requested} does not divide the model's {experts} experts ({src})")
    if rollout_backend == "vllm":
        try:
            vllm_expert_parallel(requested, rollout_tp_size)
        except ValueError as e:
            raise JobConfigError(f"{e} (ROLLOUT_EP_SIZE / ROLLOUT_TP_SIZE)") from None
    return requested


def vllm_command(python: str, model: str, *, host: str, port: int, tp_size: int, gpu_memory_utilization: float,
                 seed: int, extra_args: Sequence[str] = (), ep_size: int = 1,
                 enable_return_routed_experts: bool = False) -> list[str]:
    """The ``vllm serve`` command line of one Slurm engine: `megatron_rl.rollout.launcher.build_vllm_command`
    (the line ``rollout.backend: vllm`` starts), each string of ``extra_args`` split as a shell would.
    ``ep_size`` (ROLLOUT_EP_SIZE: 1 or ``tp_size``) > 1 adds ``--enable-expert-parallel``;
    ``enable_return_routed_experts`` (``actor.router_replay``) adds ``--enable-return-routed-experts``.

    Raises:
        JobConfigError: ``tp_size``, ``ep_size`` or ``gpu_memory_utilization`` out of range, or an
            extra-args string with unbalanced quotes.
    """
    import shlex

    from megatron_rl.rollout.launcher import build_vllm_command, vllm_expert_parallel

    try:
        extra = [a for text in extra_args for a in shlex.split(text)]
    except ValueError as e:
        raise JobConfigError(f"VLLM_EXTRA_ARGS / rollout.vllm_extra_args: {e}: {list(extra_args)}") from None
    try:
        return build_vllm_command(model, python=python, host=host, port=port, tp_size=tp_size,
                                  gpu_memory_utilization=gpu_memory_utilization, seed=seed, extra_args=extra,
                                  enable_expert_parallel=vllm_expert_parallel(ep_size, tp_size),
                                  enable_return_routed_experts=enable_return_routed_experts)
    except ValueError as e:
        raise JobConfigError(f"{e} (ROLLOUT_TP_SIZE / ROLLOUT_EP_SIZE / ROLLOUT_MEM_FRACTION)") from None


def wait_health(urls: Sequence[str], timeout_s: float) -> None:
    """Poll ``GET url/health`` of every server until all answer 200.

    Raises:
        TimeoutError: a server did not answer within ``timeout_s`` seconds (it is named).
    """
    import requests

    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        still = []
        for u in pending:
            try:
                ok = requests.get(u.rstrip("/") + "/health", timeout=5).status_code == 200
            except requests.RequestException:
                ok = False
            if not ok:
                still.append(u)
        pending = still
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server(s) {', '.join(pending)} not healthy after {timeout_s:.0f} s")
            time.sleep(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI of this module (see the module docstring). Exit code 2 and one line on stderr on errors."""
    p = argparse.ArgumentParser(prog="slurm/jobtool.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ipv4", help="this node's IPv4 on --iface")
    a.add_argument("--iface", required=True)
    a = sub.add_parser("ports", help="free ports of one engine slot on this node")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--base", type=int, required=True)
    a.add_argument("--slot", type=int, default=0)
    a.add_argument("--count", type=int, default=1)
    a.add_argument("--job", default=None,
                   help="Slurm job id: claim the ports for it so that other jobs on the node skip them")
    a = sub.add_parser("check", help="static checks of a job (node split, layout, model path, data)")
    a.add_argument("--config", required=True)
    for name in ("total-nodes", "trainer-nodes", "rollout-nodes", "gpus-per-node", "rollout-tp-size",
                 "engines-per-node"):
        a.add_argument(f"--{name}", type=int, required=True)
    a.add_argument("--device", required=True)
    a.add_argument("--rollout-backend", default="", help="ROLLOUT_BACKEND: sglang | vllm (empty: the recipe's)")
    a.add_argument("--rollout-ep-size", default="",
                   help="ROLLOUT_EP_SIZE: expert-parallel size of each engine (empty: the engine TP for MoE, else 1)")
    a.add_argument("overrides", nargs="*")
    a = sub.add_parser("vllm-cmd", help="the `vllm serve` line of one engine, shell-quoted")
    a.add_argument("--python", required=True, help="interpreter of vLLM's environment")
    a.add_argument("--model", required=True)
    a.add_argument("--host", required=True)
    a.add_argument("--port", type=int, required=True)
    a.add_argument("--tp-size", type=int, required=True)
    a.add_argument("--gpu-memory-utilization", type=float, required=True)
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--ep-size", type=int, default=1, help="ROLLOUT_EP_SIZE: 1, or the TP size (--enable-expert-parallel)")
    a.add_argument("--enable-return-routed-experts", action="store_true", help="actor.router_replay of the recipe")
    a.add_argument("--extra-args", action="append", default=[], help="more flags, split as a shell would")
    a = sub.add_parser("wait-health", help="wait until every URL's /health answers 200")
    a.add_argument("--timeout", type=float, default=600)
    a.add_argument("urls", nargs="+")
    args = p.parse_args(argv)
    try:
        if args.cmd == "ipv4":
            print(resolve_ipv4(args.iface, interface_table(), socket.gethostname()))
        elif args.cmd == "ports":
            if args.job:
                ports = claim_ports(args.base, args.slot, args.count, job=args.job, host=args.host)
            else:
                ports = slot_ports(args.base, args.slot, args.count, host=args.host)
            print(" ".join(map(str, ports)))
        elif args.cmd == "check":
            ep = args.rollout_ep_size.strip()
            if ep and not ep.isdigit():
                raise JobConfigError(f"ROLLOUT_EP_SIZE={ep}: expected a positive integer (or unset)")
            out = check_job(
                args.config, args.overrides, total_nodes=args.total_nodes, trainer_nodes=args.trainer_nodes,
                rollout_nodes=args.rollout_nodes, gpus_per_node=args.gpus_per_node,
                rollout_tp_size=args.rollout_tp_size, engines_per_node=args.engines_per_node, device=args.device,
                rollout_backend=args.rollout_backend, rollout_ep_size=int(ep) if ep else None,
            )
            # shell assignments for `eval` in slurm/train.sbatch
            import shlex

            print("\n".join(f"JOB_{k.upper()}={shlex.quote(str(v))}" for k, v in out.items()))
        elif args.cmd == "vllm-cmd":
            import shlex

            print(shlex.join(vllm_command(args.python, args.model, host=args.host, port=args.port,
                                          tp_size=args.tp_size, gpu_memory_utilization=args.gpu_memory_utilization,
                                          seed=args.seed, extra_args=args.extra_args, ep_size=args.ep_size,
                                          enable_return_routed_experts=args.enable_return_routed_experts)))
        else:
            wait_health(args.urls, args.timeout)
    except (JobConfigError, TimeoutError) as e:
        print(f"jobtool {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
