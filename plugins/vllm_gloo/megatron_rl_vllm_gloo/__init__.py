"""megatron-rl's ``gloo`` weight-transfer engine for vLLM (the ``vllm.general_plugins`` entry point).

vLLM calls `register` in every process it starts (API server, engine core, workers), possibly more
than once; it registers `megatron_rl_vllm_gloo.engine.GlooWeightTransferEngine` under the backend
name ``gloo`` with ``WeightTransferEngineFactory`` (lazily: the engine module is imported only
where a worker creates the engine). Nothing here imports megatron-rl: this package lives in vLLM's
own environment.
"""

import os

__all__ = ["BACKEND", "SHM_BUSY_LOOP_ENV", "SHM_RECHECK_MS", "register", "shorten_shm_busy_loop"]

BACKEND = "gloo"
"""The name to give ``--weight-transfer-config '{"backend": "gloo"}'``."""


SHM_RECHECK_MS = 20
"""Recheck interval of an idle reader (ms) while the busy-loop cap is on (vLLM: 5000, fixed)."""

SHM_BUSY_LOOP_ENV = "MEGATRON_RL_VLLM_SHM_BUSY_LOOP_S"
"""Seconds a vLLM worker keeps spinning on its shared-memory queue after a message (vLLM: 1 s, fixed);
megatron-rl's launcher sets it for CPU engines (`shorten_shm_busy_loop`)."""


def shorten_shm_busy_loop() -> float | None:
    """Cap the busy loop of vLLM's shared-memory message queue readers (``shm_broadcast.SpinCondition``,
    1 s after every message, hard-coded in vLLM 0.32) at `SHM_BUSY_LOOP_ENV` seconds, when that is set;
    returns the cap (None: unset, nothing changed).

    On a CPU machine the worker's spin after each engine step took a core for the second after every
    generation (measured: 0.96 of a core, against 0.01 idle), i.e. while the trainer computes its
    log-probs and update on the same cores. A reader past the cap waits on the queue's zmq notification
    instead, which the writer sends with every message, so nothing is lost but a few microseconds.

    Raises:
        ValueError: the variable is not a number >= 0.
    """
    raw = os.environ.get(SHM_BUSY_LOOP_ENV, "").strip()
    if not raw:
        return None
    cap = float(raw)
    if cap < 0:
        raise ValueError(f"{SHM_BUSY_LOOP_ENV}={raw!r}: must be >= 0")
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_megatron_rl_busy_loop_cap", None) is None:
        original = cls.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.busy_loop_s = min(self.busy_loop_s, cls._megatron_rl_busy_loop_cap)

        cls.__init__ = __init__
    cls._megatron_rl_busy_loop_cap = cap
    # read by ReadTimeoutWithWarnings.timeout_ms() at every wait, from the module's globals
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, SHM_RECHECK_MS)
    return cap


def register() -> None:
    """Register the ``gloo`` engine with vLLM's factory (a second call does nothing), and apply
    `shorten_shm_busy_loop`."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    shorten_shm_busy_loop()

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "megatron_rl_vllm_gloo.engine",
                                                    "GlooWeightTransferEngine")
    except ValueError:  # already registered (plugins load once per process, but be safe)
        pass
