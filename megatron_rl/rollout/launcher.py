"""Start and stop the embedded rollout server as a subprocess (``python -m megatron_rl.rollout.server``)."""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_rl.ports import find_free_port
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.errors import RolloutServerError

logger = logging.getLogger(__name__)

__all__ = ["ServerProcess", "find_free_port", "launch_rollout_server"]

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

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (SIGTERM), then kill after ``timeout_s``; idempotent."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("rollout server pid %d ignored SIGTERM; killing it", self.process.pid)
                self.process.kill()
                self.process.wait(timeout=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
    """Start ``python -m megatron_rl.rollout.server`` and wait until ``/health`` answers.

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
    api_key = _flag_value(extra_args, "--api-key")
    admin_api_key = _flag_value(extra_args, "--admin-api-key")
    attempts = 3 if port is None else 1
    for attempt in range(attempts):
        chosen = port if port is not None else find_free_port(host)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"rollout-server-{chosen}-", suffix=".log")
            os.close(fd)
            path = Path(name)
        else:
            path = Path(log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "megatron_rl.rollout.server",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(chosen),
            "--parent-pid",
            str(os.getpid()),
            *extra_args,
        ]
        logger.info("starting rollout server on %s:%d (log %s)", host, chosen, path)
        with open(path, "ab") as log:
            proc = subprocess.Popen(
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
        server = ServerProcess(proc, host, chosen, path, api_key, admin_api_key)
        probe = RolloutClient(server.base_url, timeout_s=5.0, max_retries=0)
        deadline = time.monotonic() + startup_timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    tail = server.log_tail()
                    if "address already in use" in tail.lower() and attempt + 1 < attempts:
                        logger.warning("port %d was taken; retrying with another port", chosen)
                        break
                    raise RolloutServerError(
                        f"rollout server exited with code {proc.returncode} during startup; "
                        f"last lines of {path}:\n{tail}"
                    )
                if probe.is_healthy(timeout_s=2.0):
                    return server
                if time.monotonic() > deadline:
                    raise RolloutServerError(
                        f"rollout server not healthy after {startup_timeout_s:.0f} s; last lines of {path}:\n"
                        f"{server.log_tail()}"
                    )
                time.sleep(0.2)
        except BaseException:
            server.stop(timeout_s=5.0)
            raise
        finally:
            probe.close()
        server.stop(timeout_s=5.0)
    raise RolloutServerError(f"could not start the rollout server after {attempts} attempts (ports taken)")


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
