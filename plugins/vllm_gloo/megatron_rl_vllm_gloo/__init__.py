"""megatron-rl's ``gloo`` weight-transfer engine for vLLM (the ``vllm.general_plugins`` entry point).

vLLM calls `register` in every process it starts (API server, engine core, workers), possibly more
than once; it registers `megatron_rl_vllm_gloo.engine.GlooWeightTransferEngine` under the backend
name ``gloo`` with ``WeightTransferEngineFactory`` (lazily: the engine module is imported only
where a worker creates the engine). Nothing here imports megatron-rl: this package lives in vLLM's
own environment.
"""

__all__ = ["BACKEND", "register"]

BACKEND = "gloo"
"""The name to give ``--weight-transfer-config '{"backend": "gloo"}'``."""


def register() -> None:
    """Register the ``gloo`` engine with vLLM's factory; a second call does nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "megatron_rl_vllm_gloo.engine",
                                                    "GlooWeightTransferEngine")
    except ValueError:  # already registered (plugins load once per process, but be safe)
        pass
