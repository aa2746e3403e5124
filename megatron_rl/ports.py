"""Free TCP ports for the processes this project starts (rollout servers, weight-sync groups,
trainer rendezvous)."""

from __future__ import annotations

import socket
import threading

__all__ = ["find_free_port"]

_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and not handed out before by this process.

    Raises:
        RuntimeError: no such port after 100 tries.
    """
    with _ports_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port found on {host}")
