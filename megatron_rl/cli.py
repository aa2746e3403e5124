"""The `megatron-rl` command: train | rollout-server | convert | eval | report."""

from __future__ import annotations

import argparse
import os
import sys

import yaml


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl train",
        description="RL-train a policy (GRPO / DAPO / DA3PO) from a YAML recipe.",
        epilog="Overrides: key.sub=value (verl's dotted names are accepted too), e.g. run_dir=runs/x "
        "actor.optim.lr=1e-6 algorithm.daa.enable=true",
    )
    parser.add_argument("--config", help="YAML recipe, e.g. examples/tiny/da3po.yaml (required to train)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the static checks, print the resolved config, list deferred environment checks")
    parser.add_argument("--list-keys", action="store_true",
                        help="print every config key with its default and docstring, then exit (= megatron-rl config-keys)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    if args.list_keys:
        return _config_keys([])
    if args.config is None:
        parser.error("the following arguments are required: --config")

    from megatron_rl.config import config_to_dict, load_config
    from megatron_rl.trainer import preflight

    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-rl train: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        print("# static checks: passed")
        for check in preflight.CHECKS:
            print(f"# environment check deferred to launch: {check.description} [{check.name}]")
        return 0
    from megatron_rl.parallel.threads import size_run_threads

    # before torch is imported: OpenMP reads OMP_WAIT_POLICY / OMP_NUM_THREADS when it loads
    size_run_threads(int(os.environ.get("LOCAL_WORLD_SIZE", cfg.trainer.nproc_per_node)),
                     0 if cfg.rollout.server_urls else cfg.rollout.num_servers, cfg.trainer.num_threads,
                     alternate=cfg.trainer.max_staleness == 0)
    if cfg.trainer.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        try:  # the layout checks, before any rank starts
            preflight.run_preflight(cfg, ("world_size", "data_parallel_split"))
        except RuntimeError as e:
            print(f"megatron-rl train: config error: {e}", file=sys.stderr)
            return 2
        return _launch_local_ranks(cfg.trainer.nproc_per_node, argv)
    from megatron_rl.trainer.loop import TrainingInterrupted, run_training

    try:
        summary = run_training(cfg)
    except TrainingInterrupted as e:
        print(f"megatron-rl train: {e}", file=sys.stderr)
        return 75  # EX_TEMPFAIL: not finished, resumable
    except KeyboardInterrupt:  # Ctrl-C before the trainer's handler was installed, or with it off
        from megatron_rl.checkpoint.save import latest_checkpoint

        latest = latest_checkpoint(cfg.run_dir)
        where = (f"the newest checkpoint on disk is step {latest} in {cfg.run_dir}/checkpoints; rerun the same "
                 "command to resume from it" if latest is not None else
                 f"no checkpoint was written in {cfg.run_dir}; rerun the same command to start again from step 0")
        print(f"megatron-rl train: interrupted (Ctrl-C); {where}", file=sys.stderr)
        return 130
    except Exception as e:  # every error: one clear line here, the traceback in train.log
        import traceback
        from pathlib import Path

        rank = os.environ.get("RANK", "0")
        log = Path(cfg.run_dir) / ("train.log" if rank == "0" else f"train_rank{rank}.log")
        if log.parent.is_dir():
            with open(log, "a") as fh:
                fh.write(traceback.format_exc())
        print(f"megatron-rl train: error: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"(full traceback in {log})", file=sys.stderr)
        if os.environ.get("MEGATRON_RL_TRACEBACK"):
            raise
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0
    if summary.get("eval_before") and summary.get("eval_after"):
        from megatron_rl.eval.evaluate import format_before_after

        print(format_before_after(summary["eval_before"], summary["eval_after"]))
    else:
        for k in [k for k in ("eval_before", "eval_after") if summary.get(k)]:
            ev = summary[k]
            print(f"{k}: " + ", ".join(f"{m}={ev[m]:.3f}" for m in ev if isinstance(ev[m], float) and m != "wall_s"))
    print(f"summary: {cfg.run_dir}/summary.json")
    return 0


def _launch_local_ranks(nproc: int, argv: list[str]) -> int:
    """Re-run this command as `nproc` trainer processes on this machine, with torchrun's
    environment contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 is the
    controller. SIGTERM / SIGUSR1 / SIGINT go to every rank (they finish the step, checkpoint
    together and exit); when one rank fails the others are stopped. Returns rank 0's exit code
    (75 = stopped by a signal, resumable), or the first failing rank's."""
    import signal
    import subprocess
    import time

    from megatron_rl.ports import find_free_port

    port = find_free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # the threads were sized by `size_run_threads` (each rank's share of the cores, passive
        # OpenMP waiting); the rollout server started by rank 0 gets its own share (rollout_server_env)
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron-core's advice for TP comm overlap
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", *argv], env=env))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0, 75)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:  # the others wait on a dead peer
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [128 - c if c < 0 else c for c in (p.returncode for p in procs)]  # killed by signal N: 128 + N
    bad = [c for c in codes if c not in (0, 75)]
    if codes[0] not in (0, 75) or not bad:
        return codes[0]
    return bad[0]


def _config_keys(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl config-keys",
        description="Every config key of `megatron-rl train` with its type, default and docstring (verl's name where "
        "one exists). Keys also accepted under verl's spelling are listed at the end.",
    )
    parser.add_argument("prefix", nargs="?", default="", help="only keys starting with this, e.g. actor. or algorithm.daa")
    args = parser.parse_args(argv)
    from megatron_rl.config.keys import config_keys, format_keys
    from megatron_rl.config.loader import VERL_ALIASES, VERL_VALUE_ALIASES

    keys = [k for k in config_keys() if k.key.startswith(args.prefix)]
    if not keys:
        print(f"megatron-rl config-keys: no key starts with {args.prefix!r}", file=sys.stderr)
        return 2
    print(format_keys(keys))
    if not args.prefix:
        print("\nverl spellings (longest match wins; a trailing '.' maps a whole section):")
        for alias, target in VERL_ALIASES.items():
            print(f"  {alias} -> {target}")
        for alias, table in VERL_VALUE_ALIASES.items():
            for value, pairs in table.items():
                sets = ", ".join(f"{k}={v}" for k, v in pairs) or "nothing"
                shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
                print(f"  {alias}={shown} -> {sets}")
    return 0


def _rollout_server(argv: list[str]) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (before torch loads)
    from megatron_rl.engine.server import main as server_main

    return server_main(argv) or 0


def _convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl convert",
        description="Convert checkpoints between Hugging Face safetensors and megatron-core dist checkpoints.",
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="megatron checkpoint (a run dir, iter_NNNNNNN folder or dist checkpoint) -> HF")
    to_hf.add_argument("--checkpoint", required=True, help="run dir (latest checkpoint), iter folder or dist checkpoint")
    to_hf.add_argument("--out", required=True, help="HF folder to write")
    to_hf.add_argument("--hf-config-dir", default=None,
                       help="folder with config.json + tokenizer, or a cached hub id (default: the run's model.path)")
    to_hf.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    to_mg = sub.add_parser("to-megatron", help="HF folder -> model-only megatron dist checkpoint (any TP/PP loads it)")
    to_mg.add_argument("--hf", required=True,
                       help="Hugging Face model folder, or hub id ORG/NAME[@REVISION] from the local HF cache")
    to_mg.add_argument("--out", required=True, help="empty folder for the dist checkpoint")
    to_mg.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    to_mg.add_argument("--tensor-model-parallel-size", type=int, default=1,
                       help="TP size the checkpoint is for (the vocabulary is padded to a multiple of "
                            "make_vocab_size_divisible_by x TP; other tensors load at any TP/PP)")
    to_mg.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    for sub_parser in (to_hf, to_mg):
        sub_parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from megatron_rl.checkpoint.convert import export_to_hf, import_from_hf

    try:
        if args.direction == "to-hf":
            out = export_to_hf(args.checkpoint, args.out, hf_config_dir=args.hf_config_dir, dtype=args.dtype,
                               progress=not args.no_progress)
        else:
            out = import_from_hf(args.hf, args.out, dtype=args.dtype,
                                 tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                 progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"megatron-rl convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl eval",
        description="Evaluate a checkpoint or a running server on math benchmarks: avg@n, pass@k, maj@k with "
        "bootstrap CIs, per-problem JSONL, response lengths (DAPO's settings by default: T=1.0, top_p=0.7).",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="HF model folder, hub id ORG/NAME[@REVISION] (local HF cache), or megatron "
                     "run dir / iter_NNNNNNN folder")
    src.add_argument("--server-url", help="a running server speaking SGLang's HTTP API (or vLLM's: --server-backend vllm)")
    parser.add_argument("--server-backend", default="sglang", choices=["sglang", "vllm"],
                        help="with --server-url: its HTTP API, sglang (SGLang, the embedded server) or vllm "
                             "(rollout.backend's names)")
    parser.add_argument("--data", nargs="+", required=True,
                        help="benchmarks (aime24 aime25 amc23 math500 gsm8k) or verl-format files (PATH[:ADAPTER])")
    parser.add_argument("--out", required=True, help="output folder (results.json, per_problem/*.jsonl)")
    parser.add_argument("--data-dir", default=None, help="folder of the benchmark files (default: $MEGATRON_RL_DATA_DIR, else the copies "
                        "shipped in megatron_rl/eval/data)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--n", type=int, default=32, help="samples per problem (default 32, DAPO's avg@32)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=20480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-problems", type=int, default=0, help="first N problems of each dataset (0: all)")
    parser.add_argument("--verifier", default=None,
                        help="reward function for every row (default: routed by data_source)")
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=256,
                        help="requests in flight (default 256, as rollout.max_concurrency in training)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for the embedded server, e.g. --server-arg=--enable-deterministic-inference")
    parser.add_argument("--tool-config", default=None,
                        help="multi-turn with tools: a tool config YAML (rollout.multi_turn.tool_config_path, e.g. "
                             "examples/tools/python_tool.yaml); every sample becomes an episode (docs/MULTITURN.md)")
    parser.add_argument("--tool-format", default="code", choices=["code", "hermes"],
                        help="with --tool-config: how the model calls tools (rollout.multi_turn.format)")
    parser.add_argument("--max-assistant-turns", type=int, default=4, help="with --tool-config: turns an episode may take")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the embedded server's idle OpenMP threads sleep

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    from megatron_rl.eval.benchmark import EvalSettings, format_table, run_eval
    from megatron_rl.errors import ConfigError, RolloutServerError

    settings = EvalSettings(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, verifier=args.verifier,
                            max_problems=args.max_problems)
    try:
        results = run_eval(datasets=args.data, out_dir=args.out, checkpoint=args.checkpoint,
                           server_url=args.server_url, server_backend=args.server_backend,
                           tokenizer_path=args.tokenizer, data_dir=args.data_dir,
                           settings=settings, num_reward_workers=args.reward_workers,
                           server_args=[a for x in args.server_arg for a in x.split()],
                           max_concurrency=args.max_concurrency, multi_turn=_eval_multi_turn(args))
    except (ValueError, FileNotFoundError, KeyError, RolloutServerError, ConfigError) as e:
        print(f"megatron-rl eval: error: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    print(f"results: {args.out}/results.json")
    return 0


def _eval_multi_turn(args):
    """The `MultiTurnConfig` of `megatron-rl eval --tool-config ...`, or None without tools.

    Raises:
        ConfigError: a bad value (names the rollout.multi_turn key).
    """
    if args.tool_config is None:
        return None
    from megatron_rl.config.multi_turn import MultiTurnConfig

    return MultiTurnConfig(enable=True, tool_config_path=args.tool_config, format=args.tool_format,
                           max_assistant_turns=args.max_assistant_turns)


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl report",
        description="Plots (PNG) and one self-contained HTML page of one or more runs' metrics.jsonl, overlaid.",
    )
    parser.add_argument("run_dirs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: <first run dir>/report)")
    parser.add_argument("--smooth", type=int, default=0,
                        help="moving-average window in steps for training curves (0: automatic)")
    args = parser.parse_args(argv)
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"megatron-rl report: error: --out {args.out} is a file, expected a folder", file=sys.stderr)
        return 2
    if args.smooth < 0:
        print(f"megatron-rl report: error: --smooth {args.smooth}: expected a window >= 0 (0: automatic)",
              file=sys.stderr)
        return 2
    from megatron_rl.report import make_report

    try:
        skipped: list = []
        page = make_report(args.run_dirs, args.out, smooth=args.smooth or None, skipped=skipped)
    except (ValueError, OSError) as e:  # bad metrics, missing run dir, unwritable --out: one line, no traceback
        print(f"megatron-rl report: error: {e}", file=sys.stderr)
        return 1
    for d, reason in skipped:
        print(f"megatron-rl report: skipped {d}: {reason}", file=sys.stderr)
    drawn = [d for d in args.run_dirs if d not in {s for s, _ in skipped}]
    print(f"report: {page} (drew {len(drawn)} run{'s' if len(drawn) != 1 else ''}: {', '.join(drawn)})")
    return 0


COMMANDS = {
    "train": _train,
    "config-keys": _config_keys,
    "rollout-server": _rollout_server,
    "convert": _convert,
    "eval": _eval,
    "report": _report,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `megatron-rl` console script."""
    from megatron_rl.quiet import quiet_known_warnings

    quiet_known_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: megatron-rl {%s} ..." % " | ".join(COMMANDS), file=sys.stderr)
        print("  train           RL training from a YAML recipe (--config FILE [key=value ...] [--dry-run])",
              file=sys.stderr)
        print("  config-keys     every config key with its default and docstring ([PREFIX])", file=sys.stderr)
        print("  rollout-server  the embedded HF-transformers server speaking SGLang's HTTP API", file=sys.stderr)
        print("  convert         to-hf | to-megatron checkpoint conversion", file=sys.stderr)
        print("  eval            benchmark a checkpoint or server (avg@n, pass@k, maj@k, CIs)", file=sys.stderr)
        print("  report          plots + HTML page of run dirs' metrics (several runs overlaid)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
