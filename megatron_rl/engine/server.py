"""Entry point of the embedded rollout server process: flags, model loading, parent watchdog, ``main()``.

``python -m megatron_rl.engine`` (or ``megatron-rl rollout-server``) runs ``main``; the flags are
SGLang's names where SGLang has the flag. What the server does is described in
``megatron_rl.engine`` (the package docstring).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_rl.engine.app import ServerState, build_app
from megatron_rl.engine.batching import GenerationEngine
from megatron_rl.weight_sync.session import UpdateSession
from megatron_rl.engine.test_hooks import (FAULT_REFUSE_UPDATES_ENV, forward_recorder, processed_logprobs, refuse_flush,
                                           refused_update_calls, step_delay_s)
from megatron_rl.weight_sync.buckets import dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["build_arg_parser", "main"]

DESCRIPTION = "Embedded rollout server: an HF transformers model on CPU behind SGLang 0.5.23's HTTP API."
"""The ``--help`` description."""


def build_arg_parser() -> argparse.ArgumentParser:
    """Command-line flags of the embedded server (SGLang's names where SGLang has the flag)."""
    p = argparse.ArgumentParser(prog="megatron-rl rollout-server", description=DESCRIPTION)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight dtype; auto = the checkpoint's torch_dtype, float32 when unset",
    )
    p.add_argument(
        "--api-key", default=None, help="Bearer key for /generate (and control endpoints without --admin-api-key)"
    )
    p.add_argument("--admin-api-key", default=None, help="Bearer key required by the control endpoints")
    p.add_argument("--weight-version", default="default", help="initial weight version label")
    p.add_argument("--max-batch-size", type=int, default=256, help="most sequences decoded together")
    p.add_argument(
        "--context-length", "--max-model-len", dest="context_length", type=int, default=None,
        help="tokens a sequence (prompt + output) may hold (SGLang's --context-length, vLLM's --max-model-len; "
        "reported by /server_info context_length and /v1/models max_model_len); default the model's "
        "max_position_embeddings, which it may not exceed",
    )
    p.add_argument("--random-seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="run every request in a batch of its own (results bitwise independent of other requests)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="Mixture-of-Experts models: with --api-dialect vllm, answer every completion's routed experts "
        "(vLLM's flag: choices[0].routed_experts); the sglang dialect answers them per request "
        "(return_routed_experts) with or without it, as SGLang started with this flag does",
    )
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument(
        "--weight-sync-timeout-s",
        type=float,
        default=600.0,
        help="rendezvous and broadcast timeout of weight-update groups",
    )
    p.add_argument(
        "--api-dialect",
        default="sglang",
        choices=["sglang", "vllm"],
        help="HTTP API to serve: sglang (SGLang 0.5.23's, default) or vllm (vLLM 0.33.x's paths and bodies: a CPU "
        "stand-in for a vLLM server, the `vllm-embedded` rollout backend; docs/VLLM_API.md)",
    )
    p.add_argument(
        "--stand-in-data-parallel-size",
        type=int,
        default=1,
        help="with --api-dialect vllm: count as N data-parallel replicas of one worker each, as vLLM's "
        "--data-parallel-size (/get_world_size answers N; the server joins the weight-transfer group at N ranks, "
        "megatron_rl.engine.dp_replicas)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process dies (the trainer that launched the server; SGLang's watchdog does the same)",
    )
    p.add_argument("--run-dir", default=None,
                   help="the training run this server serves (logged; lets process listings tell servers apart)")
    return p


def _watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Daemon thread: once `parent_pid` is gone (killed with SIGKILL, so it could not stop us),
    send ourselves SIGTERM for a clean shutdown, and exit hard 10 s later if that hangs."""
    import signal

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                os.kill(parent_pid, 0)
                alive = os.getppid() == parent_pid
            except ProcessLookupError:
                alive = False
            except PermissionError:  # exists, owned by someone else: not our parent any more
                alive = os.getppid() == parent_pid
            if not alive:
                logger.warning("parent process %d is gone; shutting down", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
                os._exit(1)

    threading.Thread(target=run, name="parent-watchdog", daemon=True).start()


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail in milliseconds, before the model loads: exits 2 with a usage message naming the flag."""
    import socket

    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: not a Hugging Face model folder (no config.json)")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 1-65535")
    if args.max_batch_size < 1:
        parser.error(f"--max-batch-size {args.max_batch_size}: must be >= 1")
    if args.context_length is not None and args.context_length < 2:
        parser.error(f"--context-length {args.context_length}: must be >= 2 (a prompt token and an output token)")
    if args.weight_sync_timeout_s <= 0:
        parser.error(f"--weight-sync-timeout-s {args.weight_sync_timeout_s}: must be > 0")
    if args.stand_in_data_parallel_size < 1 or (args.stand_in_data_parallel_size > 1 and args.api_dialect != "vllm"):
        parser.error(f"--stand-in-data-parallel-size {args.stand_in_data_parallel_size}: must be >= 1, and > 1 only "
                     "with --api-dialect vllm")
    with socket.socket() as sock:  # the port is free now (uvicorn binds it after the model loads)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            parser.error(f"--host {args.host} --port {args.port}: cannot bind ({e.strerror})")


def _stop_string_decoder(model_path: str):
    """``ids -> text`` with the model folder's tokenizer (for ``sampling_params.stop``), or None when
    the folder has none (the server stays ids-in / ids-out and refuses stop strings)."""
    folder = Path(model_path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - an unreadable tokenizer only disables stop strings
        logger.warning("stop strings disabled: cannot load the tokenizer of %s: %s", model_path, e)
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def _load_model(model_path: str, dtype: str, attn_implementation: str):
    """Load the HF causal LM in eval mode on CPU; returns ``(model, torch_dtype, eos_token_ids)``
    (EOS ids from generation_config.json and config.json, sorted, without repeats)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_path)
    if dtype == "auto":
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        torch_dtype = (
            cfg_dtype
            if isinstance(cfg_dtype, torch.dtype)
            else (dtype_from_name(cfg_dtype) if isinstance(cfg_dtype, str) else torch.float32)
        )
    else:
        torch_dtype = dtype_from_name(dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.eval()
    eos: list[int] = []
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        gen_eos = None
    for src in (gen_eos, getattr(config, "eos_token_id", None)):
        if src is not None:
            eos += [src] if isinstance(src, int) else list(src)
    return model, torch_dtype, sorted(set(eos))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM. Returns the process exit code."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [rollout-server:%(process)d] %(name)s: %(message)s",
    )
    import uvicorn

    import faulthandler

    faulthandler.enable()  # a crash in native code leaves its stack in the log
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    from megatron_rl.parallel.threads import apply_torch_threads

    apply_torch_threads(torch.get_num_threads())  # the inter-op pool as the intra-op one (OMP_NUM_THREADS)
    logger.info("torch threads %d (OMP_WAIT_POLICY=%s)", torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY"))
    torch.manual_seed(args.random_seed)
    from megatron_rl.models.hub import resolve_model_path

    given = args.model_path
    args.model_path = resolve_model_path(given, what="rollout server --model-path")  # hub id -> the HF cache
    if args.model_path != given:
        logger.info("model %s resolved to %s", given, args.model_path)
    logger.info("loading %s (dtype=%s)", args.model_path, args.dtype)
    model, torch_dtype, eos = _load_model(args.model_path, args.dtype, args.attn_implementation)
    engine = GenerationEngine(
        model,
        eos_token_ids=eos,
        max_batch_size=args.max_batch_size,
        random_seed=args.random_seed,
        deterministic=args.enable_deterministic_inference,
        weight_version=args.weight_version,
        on_forward=forward_recorder(model),
        step_delay_s=step_delay_s(),
        context_length=args.context_length,
        processed_logprobs=processed_logprobs(),
        decode=_stop_string_decoder(args.model_path),
    )
    if args.enable_return_routed_experts and not engine.routers.supported:
        logger.warning("--enable-return-routed-experts: the model (%s) has no Mixture-of-Experts router; no "
                       "routing will be returned", type(model).__name__)
    session = UpdateSession(engine, group_timeout_s=args.weight_sync_timeout_s, refused_calls=refused_update_calls(),
                            refused_by=FAULT_REFUSE_UPDATES_ENV)
    state = ServerState(engine=engine, session=session, model_path=args.model_path, dtype=torch_dtype, args=args,
                        refuse_flush=refuse_flush())
    if args.api_dialect == "vllm":
        from megatron_rl.engine.vllm_dialect import build_vllm_app

        app = build_vllm_app(state)
    else:
        app = build_app(state)
    logger.info(
        "serving on http://%s:%d (%s dialect, eos ids %s, weight_version %s, context %d tokens)", args.host, args.port,
        args.api_dialect, eos, args.weight_version, engine.max_context_len
    )
    if engine.processed_logprobs:
        logger.warning("%s=1: reporting temperature-scaled log-probs (a stand-in for a misconfigured engine, "
                       "tests only)", "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS")
    # keep idle connections longer than clients keep them (KEEPALIVE_EXPIRY_S) so the server is
    # never the side that closes a connection a client is about to reuse
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_keep_alive=75)
    logger.info("shut down (signal or parent exit)")
    engine.close()
