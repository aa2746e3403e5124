"""Request bodies and the client-error answer of the embedded server's HTTP API (SGLang's shapes).

Control bodies ignore unknown keys; a missing body or a missing required field is a 400
(SGLang's ``{}``-body rule). ``GenerateBody`` checks only the top-level keys of ``/generate``;
its ``sampling_params`` go through ``megatron_rl.engine.sampling.parse_sampling_params``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "AbortBody",
    "BeginBody",
    "ContinueBody",
    "DestroyGroupBody",
    "EmptyBody",
    "GenerateBody",
    "InitGroupBody",
    "PauseBody",
    "RequestError",
    "UpdateDistBody",
    "UpdateVersionBody",
    "WeightsByNameBody",
    "validation_text",
]


class RequestError(Exception):
    """A client error answered with HTTP ``status_code`` and JSON ``body`` (SGLang's shapes)."""

    def __init__(self, body: Any, status_code: int = 400) -> None:
        super().__init__(str(body))
        self.body = body
        self.status_code = status_code


def validation_text(e: ValidationError) -> str:
    """pydantic's errors in one line, as SGLang words them: ``N validation error(s): loc: 'msg'; ...``."""
    n = e.error_count()
    parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']!r}" for err in e.errors(include_url=False)]
    return f"{n} validation error{'s' if n != 1 else ''}: " + "; ".join(parts)


class _Body(BaseModel):
    """Control bodies: unknown keys are ignored; a missing body or field is a 400."""

    model_config = ConfigDict(extra="ignore")
    rid: Any = None
    http_worker_ipc: Any = None


class InitGroupBody(_Body):
    """Body of ``POST /init_weights_update_group`` (SGLANG_API.md 2.1)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupBody(_Body):
    """Body of ``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


class BeginBody(_Body):
    """Body of ``POST /begin_weight_update``."""

    selector: Literal["all", "target", "draft"] = "all"


class EmptyBody(_Body):
    """A control body with no fields of its own (``{}``): ``/end_weight_update``, ``/flush_cache``."""

    pass


class UpdateDistBody(_Body):
    """Body of ``POST /update_weights_from_distributed`` (SGLANG_API.md 2.3)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["all", "target", "draft"] = "all"
    torch_empty_cache: bool = False


class PauseBody(_Body):
    """Body of ``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    """Body of ``POST /continue_generation``."""

    torch_empty_cache: bool = True


class AbortBody(_Body):
    """Body of ``POST /abort_request`` (rid prefix match, or all)."""

    rid: str = ""
    abort_all: bool = False


class UpdateVersionBody(_Body):
    """Body of ``POST /update_weight_version``."""

    new_version: str
    abort_all_requests: bool = True


class WeightsByNameBody(_Body):
    """Body of ``POST /get_weights_by_name``."""

    name: str
    truncate_size: int = Field(100, ge=0)


class GenerateBody(BaseModel):
    """Body of ``POST /generate`` (top-level keys; ``sampling_params`` is checked by ``parse_sampling_params``)."""

    model_config = ConfigDict(extra="ignore")
    text: Any = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: Any = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    """SGLang 0.5.23 (``GenerateReqInput``): answer ``meta_info.routed_experts`` (one flag for the whole batch)."""
    routed_experts_start_len: int = 0
    """SGLang 0.5.23: the first position reported (0 <= it <= the prompt's tokens)."""
