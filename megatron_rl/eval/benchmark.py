"""Offline benchmark evaluation (`megatron-rl eval`): a checkpoint or a running server on math benchmarks.

Flow: resolve the model (a Hugging Face folder is served as is; a megatron run dir / `iter_NNNNNNN`
folder is first exported with `checkpoint.convert.export_to_hf`), start the embedded rollout server
on it (`rollout.launcher.launch_rollout_server`) unless a server URL is given, sample `n` responses
per problem through `RolloutManager.generate` (the same request and seeding code as training),
verify them in a `RewardPool` with the verifier routed by each row's `data_source`
(`rewards.math_answer.verifier_for_source`), and write:

    <out>/results.json               per dataset: avg@n, pass@k, maj@k (each with a 95% bootstrap
                                     CI over problems), format-valid share, response-length stats
    <out>/per_problem/<name>.jsonl   one row per problem: ground truth, every response with its
                                     extracted answer, correctness, length and stop reason

With tools (`--tool-config`: every sample an episode, docs/MULTITURN.md) each dataset also gets
`tool_calls_per_sample` and `tool_use_rate` (as the in-training evaluation, `eval.evaluate`), each
response its `tool_calls`, and results.json's `settings` the tool config, format and turn limit.

Defaults follow DAPO's evaluation (arXiv 2503.14476, section 4.1): temperature 1.0, top_p 0.7,
max 20480 new tokens; DAPO reports avg@32 on AIME, here `n` defaults to 32 as well.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_rl.data.dataset import PromptRow, load_rows
from megatron_rl.eval.evaluate import tool_calls_of, tool_use_stats
from megatron_rl.eval.metrics import avg_at_k, bootstrap_ci, length_stats, maj_at_k, pass_at_k
from megatron_rl.models.hub import looks_like_hub_id, resolve_model_path
from megatron_rl.rewards.math_answer import verifier_for_source
from megatron_rl.rewards.math_dapo import normalize_answer

logger = logging.getLogger(__name__)

BENCHMARKS: dict[str, tuple[str, str]] = {
    "aime24": ("aime24.jsonl", "aime"),
    "aime25": ("aime25.jsonl", "aime"),
    "amc23": ("amc23.jsonl", "amc"),
    "math500": ("math500.jsonl", "math500"),
    "gsm8k": ("gsm8k_test.jsonl", "gsm8k"),
}
"""Benchmark name -> (file in the data dir, dataset adapter)."""


PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"
"""The benchmark files shipped with the package (sources, licences and sha256 in its PROVENANCE.md)."""


def default_data_dir() -> Path:
    """`$MEGATRON_RL_DATA_DIR`, else the copies shipped in the package (`megatron_rl/eval/data`)."""
    env = os.environ.get("MEGATRON_RL_DATA_DIR")
    return Path(env) if env else PACKAGE_DATA_DIR


def load_benchmark(spec: str, data_dir: Optional[Path] = None) -> tuple[str, list[PromptRow]]:
    """Rows of a benchmark: a name in `BENCHMARKS` (read from `data_dir`) or a path to any
    verl-format .jsonl/.parquet file (`PATH` or `PATH:ADAPTER`).

    Returns:
        (dataset name, rows).

    Raises:
        FileNotFoundError: the file does not exist (names the path and the known benchmarks).
        ValueError: a malformed row (names file and line, from `load_rows`).
    """
    if spec in BENCHMARKS:
        fname, adapter = BENCHMARKS[spec]
        path = Path(data_dir or default_data_dir()) / fname
        name = spec
    else:
        path_s, _, adapter = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
        path, adapter = Path(path_s), adapter or "verl"
        name = path.stem
    if not path.is_file():
        where = (f"; the benchmark files are read from {path.parent} (--data-dir, or $MEGATRON_RL_DATA_DIR, "
                 "names the folder)") if spec in BENCHMARKS else ""
        raise FileNotFoundError(f"{path}: no such dataset file (benchmarks: {', '.join(BENCHMARKS)}; "
                                f"or give a verl-format .jsonl/.parquet path){where}")
    rows = load_rows(path, adapter=adapter, name=name)
    if not rows:
        raise ValueError(f"{path}: no problems in the file (empty or blank lines only)")
    return name, rows


def unique_names(datasets: Sequence[tuple[str, list]]) -> list[tuple[str, list]]:
    """Make dataset names unique (`test`, `test-2`, ...): results.json and per_problem/<name>.jsonl
    are keyed by name, so two files with one stem (`a/test.jsonl`, `b/test.jsonl`) must not collide."""
    seen: set[str] = set()
    out = []
    for name, rows in datasets:
        new, i = name, 2
        while new in seen:
            new, i = f"{name}-{i}", i + 1
        if new != name:
            logger.warning("dataset name %r is taken by an earlier --data entry: reported as %r", name, new)
        seen.add(new)
        out.append((new, rows))
    return out


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, plus n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@dataclass
class EvalSettings:
    """Sampling and reporting settings of `megatron-rl eval` (DAPO's evaluation by default).

    n: samples per problem. temperature, top_p: sampling. max_new_tokens: response limit in tokens
    (the server also stops at its context length). seed: mixed into every request's sampling seed.
    verifier: a reward-function name for every row, or None to route by `data_source`.
    max_problems: keep the first N problems of each dataset (0: all).
    bootstrap_resamples, confidence: the confidence intervals.
    """

    n: int = 32
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: int = 20480
    seed: int = 0
    verifier: Optional[str] = None
    max_problems: int = 0
    bootstrap_resamples: int = 1000
    confidence: float = 0.95
    extra: dict = field(default_factory=dict)


def summarise(name: str, rows: Sequence[PromptRow], texts: list[list[str]], rewards: list[list[dict]],
              lengths: list[list[int]], stops: list[list[str]], settings: EvalSettings,
              verifiers: Sequence[str], episodes: Optional[list[list[Optional[dict]]]] = None
              ) -> tuple[dict, list[dict]]:
    """Metrics of one dataset and its per-problem records (pure: no generation here).

    Args:
        texts, rewards, lengths, stops: [P][n] response texts, reward dicts (`acc`, `pred`,
            `failed`), token counts and stop reasons.
        verifiers: [P] verifier names used.
        episodes: [P][n] `GenerateResult.episode` statistics (None for single-turn samples): with any
            episode, the summary gets `tool_calls_per_sample` and `tool_use_rate` and every response
            its `tool_calls`.

    Returns:
        (summary dict, per-problem records).
    """
    n = settings.n
    correct = [[bool(r.get("acc")) and not r.get("failed") for r in g] for g in rewards]
    answers = [[normalize_answer(str(r["pred"])) if r.get("pred") is not None else None for r in g] for g in rewards]
    ci = dict(num_resamples=settings.bootstrap_resamples, confidence=settings.confidence, seed=settings.seed)
    summary: dict[str, Any] = {"num_problems": len(rows), "n": n, "verifiers": sorted(set(verifiers))}
    per_problem_acc = [sum(c) / len(c) for c in correct]
    summary[f"avg@{n}"] = {"value": avg_at_k(correct), "ci": bootstrap_ci(per_problem_acc, **ci)}
    pass_k, maj_k = {}, {}
    for k in ks_for(n):
        vals = [pass_at_k(len(c), sum(c), k) for c in correct]
        pass_k[k] = vals
        summary[f"pass@{k}"] = {"value": sum(vals) / len(vals), "ci": bootstrap_ci(vals, **ci)}
        mv = maj_at_k(answers, correct, k)
        maj_k[k] = mv
        summary[f"maj@{k}"] = {"value": sum(mv) / len(mv), "ci": bootstrap_ci(mv, **ci)}
    valid = [[r.get("pred") is not None for r in g] for g in rewards]
    summary["format_valid"] = avg_at_k(valid)
    summary["verifier_failed"] = sum(bool(r.get("failed")) for g in rewards for r in g)
    flat_len = [x for g in lengths for x in g]
    summary["response_length"] = length_stats(flat_len, [s == "length" for g in stops for s in g])
    calls = tool_calls_of(episodes) if episodes is not None else None
    if calls is not None:  # multi-turn with tools: how often the model used them
        summary.update(tool_use_stats(calls))
    records = []
    for i, row in enumerate(rows):
        records.append({
            "dataset": name, "prompt_key": row.prompt_key, "data_source": row.data_source,
            "ground_truth": row.ground_truth, "verifier": verifiers[i], "num_correct": sum(correct[i]), "n": n,
            **{f"pass@{k}": pass_k[k][i] for k in pass_k}, **{f"maj@{k}": maj_k[k][i] for k in maj_k},
            "extra_info": row.extra_info,
            "responses": [{"text": t, "pred": r.get("pred"), "acc": c, "length": ln, "stop_reason": s,
                           **({"tool_calls": calls[i][j]} if calls is not None else {}),
                           **({"error": r.get("error")} if r.get("failed") else {})}
                          for j, (t, r, c, ln, s) in enumerate(zip(texts[i], rewards[i], correct[i], lengths[i],
                                                                   stops[i]))],
        })
    return summary, records


def evaluate_datasets(manager, pool, tokenizer, datasets: Sequence[tuple[str, list[PromptRow]]],
                      settings: EvalSettings, out_dir: Path) -> dict:
    """Sample, verify and summarise every dataset; write results.json and per_problem/*.jsonl.

    Args:
        manager: a `RolloutManager` (its `generate` is used; scoring is done here, per row).
        pool: a `RewardPool`.
        tokenizer: decodes responses.
        datasets: (name, rows) pairs.
        settings: `EvalSettings`.
        out_dir: output folder (created).

    Returns:
        The results dict written to results.json.
    """
    out_dir = Path(out_dir)
    (out_dir / "per_problem").mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(settings).items() if k != "extra"} | settings.extra,
                               "datasets": {}}
    for name, rows in datasets:
        if settings.max_problems:
            rows = rows[: settings.max_problems]
        t0 = time.perf_counter()
        gen = manager.generate(rows, n=settings.n, tag=f"eval-{name}", seed_parts=(settings.seed, name),
                               sampling_params={"temperature": settings.temperature, "top_p": settings.top_p},
                               max_new_tokens=settings.max_new_tokens)
        t1 = time.perf_counter()
        verifiers = [settings.verifier or verifier_for_source(r.data_source) for r in rows]
        from megatron_rl.rollout.multiturn import model_token_ids

        # the verifier reads the model's own tokens (a tool's output is never scored as the answer)
        texts = [[tokenizer.decode(model_token_ids(res), skip_special_tokens=True) for res in g] for g in gen]
        flat = pool.map([(v, t, row.ground_truth) for v, row, g in zip(verifiers, rows, texts) for t in g])
        n = settings.n
        rewards = [flat[i * n : (i + 1) * n] for i in range(len(rows))]
        lengths = [[len(res.output_ids) for res in g] for g in gen]
        stops = [[res.stop_reason for res in g] for g in gen]
        episodes = [[res.episode for res in g] for g in gen]
        summary, records = summarise(name, rows, texts, rewards, lengths, stops, settings, verifiers, episodes)
        summary["generate_s"] = t1 - t0
        summary["verify_s"] = time.perf_counter() - t1
        results["datasets"][name] = summary
        with open(out_dir / "per_problem" / f"{name}.jsonl", "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        logger.info("%s: %s", name, format_row(name, summary))
        # after every dataset: a later failure keeps the finished datasets' results
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def format_row(name: str, s: dict) -> str:
    """One dataset's line of `format_table` (tool calls a sample and tool-use rate when present)."""
    n = s["n"]

    def f(key: str) -> str:
        v = s[key]
        return f"{v['value']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]"

    return (f"{name:<10} {s['num_problems']:>5} {f(f'avg@{n}'):>24} {f(f'pass@{n}'):>24} {f(f'maj@{n}'):>24} "
            f"{s['format_valid']:>6.3f} {s['response_length']['mean']:>8.1f} {s['response_length']['truncated']:>6.3f}"
            + (f" {s['tool_calls_per_sample']:>6.2f} {s['tool_use_rate']:>6.3f}" if "tool_use_rate" in s else ""))


def format_table(results: dict) -> str:
    """A plain-text table of results.json (one line per dataset)."""
    datasets = results["datasets"]
    if not datasets:
        return "(no datasets)"
    n = next(iter(datasets.values()))["n"]
    ci = int(round(results["settings"].get("confidence", 0.95) * 100))
    head = (f"{'dataset':<10} {'probs':>5} {f'avg@{n} [{ci}% CI]':>24} {f'pass@{n} [{ci}% CI]':>24} "
            f"{f'maj@{n} [{ci}% CI]':>24} {'format':>6} {'len':>8} {'trunc':>6}"
            + (f" {'calls':>6} {'tools':>6}" if any("tool_use_rate" in v for v in datasets.values()) else ""))
    return "\n".join([head] + [format_row(k, v) for k, v in datasets.items()])


def _is_hf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def tool_settings(multi_turn) -> dict:
    """results.json `settings` of the tools: `tool_config` (the path as given, relative to the working
    directory), `tool_format`, `max_assistant_turns`; all None without tools (`multi_turn` None)."""
    if multi_turn is None:
        return {"tool_config": None, "tool_format": None, "max_assistant_turns": None}
    return {"tool_config": multi_turn.tool_config_path, "tool_format": multi_turn.format,
            "max_assistant_turns": multi_turn.max_assistant_turns}


def warn_if_trained_with_tools(checkpoint: Path) -> Optional[str]:
    """Log a WARNING when `checkpoint` (a megatron run dir, its `checkpoints` folder, an `iter_NNNNNNN`
    folder or its `model_optim`) comes from a run trained with tools (`rollout.multi_turn.enable` in
    the nearest config.yaml) while the evaluation runs without them: such a model scores far lower
    single-turn (0.627 vs 0.938 for the tiny tool run). Behaviour is unchanged: it only warns.

    Returns:
        The warning text, or None (no config.yaml found, unreadable, or a run without tools).
    """
    import yaml

    p = Path(checkpoint)
    cfg_path = next((d / "config.yaml" for d in [p, *list(p.parents)[:3]] if (d / "config.yaml").is_file()), None)
    if cfg_path is None:
        return None
    try:
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        mt = (cfg.get("rollout") or {}).get("multi_turn") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if not isinstance(mt, dict) or not mt.get("enable"):
        return None
    msg = (f"{cfg_path}: the run was trained with tools (rollout.multi_turn.enable: true, tool config "
           f"{mt.get('tool_config_path')!r}, format {mt.get('format')!r}, max_assistant_turns "
           f"{mt.get('max_assistant_turns')!r}) but this evaluation runs without them, so its numbers are "
           f"single-turn and much lower; pass --tool-config {mt.get('tool_config_path')} (and --tool-format / "
           f"--max-assistant-turns as trained) to evaluate it as trained")
    logger.warning("%s", msg)
    return msg


def run_eval(*, datasets: Sequence[str], out_dir: str | os.PathLike, checkpoint: Optional[str] = None,
             server_url: Optional[str] = None, server_backend: str = "sglang", tokenizer_path: Optional[str] = None,
             data_dir: Optional[str] = None, settings: Optional[EvalSettings] = None,
             num_reward_workers: int = 2, reward_timeout_s: float = 30.0, server_args: Sequence[str] = (),
             startup_timeout_s: float = 300.0, max_concurrency: int = 256, multi_turn=None) -> dict:
    """`megatron-rl eval`: evaluate a checkpoint or a running server on datasets.

    Args:
        datasets: benchmark names (`BENCHMARKS`) or verl-format file paths.
        out_dir: output folder.
        checkpoint: HF model folder, or megatron run dir / `iter_NNNNNNN` folder (exported to HF
            under `<out_dir>/hf_model` first). Exactly one of `checkpoint` / `server_url`.
        server_url: a running server speaking SGLang's HTTP API, or vLLM's (`server_backend`).
        server_backend: the API of `server_url`: `sglang` (SGLang, the embedded server) or `vllm`
            (`VLLMClient`: `/v1/completions` with token ids).
        tokenizer_path: tokenizer folder (default: the checkpoint, or the server's `model_path`).
        data_dir: folder holding the benchmark files (default `default_data_dir()`).
        settings: `EvalSettings` (DAPO defaults).
        server_args: extra flags for the embedded server (e.g. `--dtype float32`).
        max_concurrency: requests in flight (as `rollout.max_concurrency` in training): the servers
            batch what is in flight, so fewer means smaller decode batches and a slower evaluation.
        multi_turn: a `MultiTurnConfig` (`megatron-rl eval --tool-config`): every sample an episode
            with tools (docs/MULTITURN.md); None: one completion a sample.

    Returns:
        The results dict (also in `<out_dir>/results.json`).

    Raises:
        ValueError: neither or both of checkpoint/server_url; no datasets; an unknown `server_backend`.
        FileNotFoundError: a missing checkpoint or dataset file.
        RolloutServerError: the server did not start (its log tail is in the message).
    """
    from transformers import AutoTokenizer

    from megatron_rl.rewards.pool import RewardPool
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.launcher import launch_rollout_server
    from megatron_rl.rollout.manager import RolloutManager

    settings = settings or EvalSettings()
    if (checkpoint is None) == (server_url is None):
        raise ValueError("give exactly one of a checkpoint (--checkpoint) or a server URL (--server-url)")
    if not datasets:
        raise ValueError("no datasets to evaluate")
    if settings.n < 1:
        raise ValueError(f"n must be >= 1, got {settings.n}")
    if settings.max_problems < 0:
        raise ValueError(f"max_problems must be >= 0 (0: all problems), got {settings.max_problems}")
    if settings.verifier is not None:
        import megatron_rl.rewards  # noqa: F401  (registers the reward functions)
        from megatron_rl.rewards.registry import REWARD_FNS

        if settings.verifier not in REWARD_FNS:
            raise ValueError(f"unknown verifier {settings.verifier!r}; known: {', '.join(REWARD_FNS.names())}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output folder {out}: cannot be created ({e.strerror}); expected a folder path") from None
    loaded = unique_names([load_benchmark(d, Path(data_dir) if data_dir else None) for d in datasets])
    settings.extra.update(tool_settings(multi_turn))
    with ExitStack() as stack:
        if checkpoint is not None:
            ckpt = Path(resolve_model_path(str(checkpoint), what="--checkpoint"))  # a hub id -> the HF cache
            if not ckpt.exists():
                raise FileNotFoundError(f"{ckpt}: no such checkpoint (an HF folder, a run dir or an iter_NNNNNNN folder)")
            if _is_hf_folder(ckpt):
                model_dir = ckpt
            else:
                if multi_turn is None:
                    warn_if_trained_with_tools(ckpt)
                from megatron_rl.checkpoint.convert import export_to_hf

                model_dir = export_to_hf(ckpt, out / "hf_model")
                logger.info("exported %s to %s", ckpt, model_dir)
            server = stack.enter_context(launch_rollout_server(
                model_dir, log_path=out / "rollout_server.log", extra_args=list(server_args),
                startup_timeout_s=startup_timeout_s))
            client = server.client()
            tok_path = resolve_model_path(tokenizer_path, what="--tokenizer", require="") or str(model_dir)
            settings.extra["model"] = str(checkpoint) if looks_like_hub_id(str(checkpoint)) and not Path(
                str(checkpoint)).exists() else str(ckpt)
        else:
            if server_backend not in ("sglang", "vllm"):
                raise ValueError(f"server_backend {server_backend!r}: expected 'sglang' or 'vllm'")
            if server_backend == "vllm":
                from megatron_rl.rollout.vllm_client import VLLMClient

                client = VLLMClient(server_url)
            else:
                client = RolloutClient(server_url)
            client.wait_healthy(timeout_s=startup_timeout_s)
            tok_path = tokenizer_path or client.model_info().get("tokenizer_path") or client.model_info().get("model_path")
            if not tok_path or not Path(tok_path).exists():
                raise ValueError(f"the server at {server_url} does not name a local tokenizer folder "
                                 f"(got {tok_path!r}); pass --tokenizer")
            settings.extra["server_url"] = server_url
        stack.callback(client.close)
        tokenizer = AutoTokenizer.from_pretrained(tok_path)
        pool = stack.enter_context(RewardPool(num_reward_workers, reward_timeout_s))
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        from megatron_rl.rollout.engine_checks import engine_context_limit

        from megatron_rl.rollout.multiturn import build_environment

        environment = None if multi_turn is None else build_environment(multi_turn, tokenizer)
        manager = RolloutManager([client], tokenizer, pool, reward_fn="math_auto", max_prompt_length=1 << 30,
                                 max_response_length=settings.max_new_tokens, seed=settings.seed,
                                 max_concurrency=max_concurrency, eos_token_ids=eos,
                                 context_limit=engine_context_limit([client]),  # refused, not cut, when too long
                                 environment=environment,  # vLLM: a prompt's n samples as one request with n
                                 consecutive_seeds=server_url is not None and server_backend == "vllm")
        stack.callback(manager.close)
        return evaluate_datasets(manager, pool, tokenizer, loaded, settings, out)
