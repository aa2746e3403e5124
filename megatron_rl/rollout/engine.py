"""The `RolloutEngine` interface every rollout backend implements, and the backend registry.

The loop, the rollout manager, the fleet and the weight publisher talk to engines only through
this interface (DESIGN.md "Stages and engines"); they never ask which backend they have. A
backend is registered in `ENGINE_BACKENDS` with how to start one engine (its command line and
the ports it needs) and how to talk to it (its client class).

Backends today: `embedded` (this project's server, `python -m megatron_rl.engine`) and `sglang`
(`python -m sglang.launch_server`) speak SGLang's HTTP API, so `RolloutClient` is the client of
both; `vllm` (`vllm serve`: `python -m vllm.entrypoints.cli.main serve`) and `vllm-embedded` (the embedded
server with `--api-dialect vllm`, a CPU stand-in) speak vLLM's, with `VLLMClient`
(`megatron_rl.rollout.vllm_client`). Method names follow SGLang's endpoints (docs/SGLANG_API.md);
VLLMClient maps them onto vLLM's (docs/VLLM_API.md).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from megatron_rl.registry import Registry

__all__ = ["EngineBackend", "ENGINE_BACKENDS", "RolloutEngine", "check_batch", "engine_backend"]


def check_batch(input_ids: Sequence[list[int]], sampling_params: Sequence[dict[str, Any]], rids: Sequence[str]) -> None:
    """The arguments of `RolloutEngine.generate_batch`: K prompts, K sampling_params, K rids, K > 0.

    Raises:
        ValueError: the lengths differ or are 0.
    """
    k = len(input_ids)
    if not (k == len(sampling_params) == len(rids)) or k == 0:
        raise ValueError(f"generate_batch: {k} prompts, {len(sampling_params)} sampling_params, {len(rids)} rids")


class RolloutEngine(abc.ABC):
    """One rollout engine (a server process, possibly with several TP workers).

    Every method raises `megatron_rl.errors.RolloutServerError` when the engine cannot be reached
    or refuses, and `ValueError` for bad arguments.
    """

    base_url: str

    # ---- generation -------------------------------------------------------------------------
    supports_batch_generate: bool = False
    """True when `generate_batch` sends several prompts in one call (SGLang's batch `/generate`);
    the rollout manager groups a prompt's responses into one call only then."""

    def takes_as_one_call(self, input_ids: Sequence[list[int]], sampling_params: Sequence[dict[str, Any]]) -> bool:
        """Whether `generate_batch` of these entries is one call to the engine (the rollout manager
        sends a prompt's responses as one task only then): `supports_batch_generate` here; vLLM's
        client only for a parallel-sampling group (`vllm_group.parallel_group`)."""
        return self.supports_batch_generate

    def generate_batch(self, input_ids: Sequence[list[int]], sampling_params: Sequence[dict[str, Any]],
                       rids: Sequence[str], return_logprob: bool = True, *,
                       eos_token_ids: Iterable[int] | None = None, timeout_s: float | None = None,
                       routed_experts=None) -> list:
        """`generate` for K prompts: entry k is `input_ids[k]` with `sampling_params[k]` and request
        id `rids[k]`; K `GenerateResult`s in that order. This default sends K `generate` calls side
        by side (engines with a batch call override it and set `supports_batch_generate`).
        `routed_experts`: as `generate` (passed on only when set).

        Raises:
            ValueError: the three lists differ in length or are empty.
            RolloutServerError: the first failed call's (after the others end).
        """
        from concurrent.futures import ThreadPoolExecutor

        check_batch(input_ids, sampling_params, rids)
        k = len(input_ids)
        eos = None if eos_token_ids is None else list(eos_token_ids)
        extra = {} if routed_experts is None else {"routed_experts": routed_experts}
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="generate-batch") as pool:
            futures = [pool.submit(self.generate, ids, sp, rid, return_logprob, eos_token_ids=eos, timeout_s=timeout_s,
                                   **extra)
                       for ids, sp, rid in zip(input_ids, sampling_params, rids)]
            return [f.result() for f in futures]

    @abc.abstractmethod
    def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, return_logprob: bool = True,
                 *, eos_token_ids: Iterable[int] | None = None, timeout_s: float | None = None,
                 routed_experts=None):
        """Token ids in -> a `GenerateResult` (output ids, per-token log-probs, finish reason,
        weight version, and the per-token version spans where the engine reports them:
        `GenerateResult.weight_versions`). `sampling_params["sampling_seed"]` seeds the request.
        `routed_experts` (a `megatron_rl.rollout.result.RoutedExpertsSpec`, Mixture-of-Experts
        policies): also return the experts every processed position was routed to
        (`GenerateResult.routed_experts`, checked against the spec); None: not asked for. Callers
        pass it only when set, so engines without routing keep the narrower signature."""

    @abc.abstractmethod
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the running requests whose id starts with `rid` (or all of them)."""

    @abc.abstractmethod
    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> dict:
        """Stop scheduling; returns once no step runs. `abort` finishes the requests in flight with
        finish type `abort` (their tokens so far); `in_place` freezes them with their KV cache (they
        continue on whatever weights are loaded meanwhile); `retract` requeues them (KV recomputed).
        A weight update waiting for running requests goes ahead once the engine is paused.
        SGLang: `POST /pause_generation {"mode"}`; vLLM: `POST /pause?mode=abort|keep` (`retract`
        and `in_place` are both `keep`)."""

    @abc.abstractmethod
    def continue_generation(self) -> dict:
        """Resume after `pause_generation`. The embedded server answers only once no weight-update
        session is open, so generation never resumes on half-updated weights (case N10 C).
        SGLang: `POST /continue_generation {}`; vLLM: `POST /resume`."""

    # ---- health and identity ----------------------------------------------------------------
    @abc.abstractmethod
    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the engine answers its health check within `timeout_s` seconds (never raises)."""

    @abc.abstractmethod
    def wait_healthy(self, timeout_s: float) -> None:
        """Block until healthy; raises `RolloutServerError` after `timeout_s` seconds."""

    @abc.abstractmethod
    def model_info(self) -> dict:
        """The engine's model description (`weight_version`, `dtype` where reported)."""

    @abc.abstractmethod
    def weight_version(self) -> str:
        """Label of the weights the engine samples from."""

    @abc.abstractmethod
    def transfer_world_size(self) -> int:
        """Ranks the engine adds to a weight-transfer group: every worker that receives the weights
        (SGLang: its TP workers; vLLM: TP x PP x DP, `/get_world_size` with `include_dp`)."""

    def context_length(self) -> int | None:
        """Tokens one sequence (prompt + response) may hold on this engine; None when the engine
        does not say (this default). SGLang: `/server_info`; vLLM: `/v1/models` `max_model_len`."""
        return None

    def score_tokens(self, prompt_ids: list[int], continuation_ids: list[int], *,
                     timeout_s: float | None = None) -> list[float]:
        """The engine's log-probs of `continuation_ids` ([C] token ids) read as prompt tokens after
        `prompt_ids` ([P] token ids): [C] floats, nats, of the unscaled policy (prompt log-probs pass
        no sampling step in either engine). Used by the start-up check of the reported log-probs
        (`megatron_rl.rollout.engine_checks`).

        Raises:
            RolloutServerError: this default, for an engine that returns no prompt log-probs (the
                SGLang and vLLM clients override it): the start-up check cannot run on it, and the
                message says how to skip the check.
        """
        from megatron_rl.errors import RolloutServerError

        url = getattr(self, "base_url", None)
        raise RolloutServerError(f"rollout engine {url or type(self).__name__} ({type(self).__name__}) returns no "
                                 "prompt log-probs, so the start-up log-prob check cannot run on it; set "
                                 "rollout.check_logprob_semantics=false to trust its log-probs unchecked", url=url)

    # ---- the weight-update session -----------------------------------------------------------
    @abc.abstractmethod
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo", *,
                                  timeout_s: float | None = None) -> dict:
        """Join a trainer's broadcast group at ranks `rank_offset ..`."""

    @abc.abstractmethod
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        """Leave and destroy the named group."""

    @abc.abstractmethod
    def begin_weight_update(self, selector: Literal["all", "target", "draft"] = "all", *,
                            timeout_s: float | None = None) -> dict:
        """Open the update session (after `pause_generation`)."""

    @abc.abstractmethod
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        group_name: str = "weight_update_group", flush_cache: bool = False,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        timeout_s: float | None = None) -> dict:
        """Receive one bucket by broadcast from rank 0 of `group_name` while the trainer sends it."""

    @abc.abstractmethod
    def end_weight_update(self, *, weight_version: str | None = None, timeout_s: float | None = None) -> dict:
        """Close the update session. `weight_version` labels the weights now held where the engine
        takes the label here (vLLM's `/finish_weight_update`); SGLang's dialect takes it with the
        last bucket instead and ignores it here. None: no new label (e.g. closing after an error)."""

    @abc.abstractmethod
    def flush_cache(self, timeout_s: float = 0.0) -> str:
        """Drop cached KV / prefixes computed with the old weights."""

    @abc.abstractmethod
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of a weight, for checks."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the client's connections (the engine keeps running)."""


@dataclass(frozen=True)
class EngineBackend:
    """How to start and reach one kind of engine.

    Attributes:
        name: `rollout.backend` value.
        ports_per_server: TCP ports one engine needs (HTTP first).
        build_command: `build_command(spec, ports) -> argv` for one engine (`spec`: a
            `rollout.launcher.LaunchSpec`).
        client: `client(base_url, **keys_and_timeouts) -> RolloutEngine`.
        watchdog: wrap the command in the parent-death watchdog (engines without `--parent-pid`).
        env: environment variables the engine needs on top of the launcher's (e.g. vLLM's
            `VLLM_SERVER_DEV_MODE=1`).
    """

    name: str
    ports_per_server: int
    build_command: Callable[[Any, Sequence[int]], list[str]]
    client: Callable[..., RolloutEngine]
    watchdog: bool = False
    env: tuple[tuple[str, str], ...] = ()


ENGINE_BACKENDS: Registry[EngineBackend] = Registry("rollout backend")
"""`rollout.backend` -> `EngineBackend`; registered in `megatron_rl.rollout.launcher`."""


def engine_backend(name: str) -> EngineBackend:
    """The registered backend `name` (`rollout.backend`), the built-in ones registered first.

    Raises:
        KeyError: unknown name (lists the valid ones).
    """
    import megatron_rl.rollout.launcher  # noqa: F401  (registers the built-in backends)

    return ENGINE_BACKENDS.get(name)
