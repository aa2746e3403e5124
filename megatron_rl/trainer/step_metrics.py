"""One row of `metrics.jsonl` per RL step: rewards, lengths, dynamic sampling, DAA, losses, timings."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_rl.trainer.producer import ProducedStep

__all__ = ["CHECKSUM_PRIME", "staleness_metrics", "token_checksum", "step_metrics"]

CHECKSUM_PRIME = 2_147_483_647  # 2^31 - 1: sums stay exact in a float64 metric


def token_checksum(tokens) -> int:
    """A position-sensitive hash of one response's token ids, in [0, 2^31 - 1): the step's
    `rollout/token_checksum` is the sum over every sampled response (kept or filtered out) modulo
    the same prime, so two runs that sampled the same tokens log the same integer."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % CHECKSUM_PRIME
    return h


def _sample_metrics(samples, kept, ds_stats: dict, daa_stats: dict) -> dict:
    lengths = [len(s.response_ids) for s in samples]
    n = max(len(samples), 1)
    return _episode_metrics(samples, n) | {
        "train/score": sum(s.score for s in samples) / n,
        "train/acc": sum(s.acc for s in samples) / n,
        "train/format_valid": sum(s.format_valid for s in samples) / n,
        "reward/failed": sum(s.failed for s in samples),
        "reward/overlong_penalty_mean": sum(s.overlong_penalty for s in samples) / n,
        "response_length/mean": sum(lengths) / n,
        "response_length/max": max(lengths) if lengths else 0,
        "response_length/clip_ratio": sum(s.truncated for s in samples) / n,
        "train/num_gen_batches": ds_stats.get("num_gen_batches", 1),
        "train/kept_groups": ds_stats.get("kept_groups", len(kept)),
        "train/generated_groups": ds_stats.get("generated_groups", len(kept)),  # solve_* counts are over these
        "train/solve_none": ds_stats.get("solve_none", 0),
        "train/solve_all": ds_stats.get("solve_all", 0),
        "train/daa_amplified_frac": float(daa_stats.get("amplified_frac", 0.0)),
        "train/daa_factor_mean": float(daa_stats.get("factor_mean", 1.0)),
        "train/daa_hard_group_frac": float(daa_stats.get("hard_group_frac", 0.0)),
    }


def _episode_metrics(samples, n: int) -> dict:
    """Multi-turn runs (`rollout.multi_turn`): per trained sample, tool calls, the share with a
    call, turns, tool errors, the model's own tokens; {} when no sample is an episode."""
    eps = [s.episode for s in samples if s.episode]
    if not eps:
        return {}
    return {"train/tool_calls_per_sample": sum(e["tool_calls"] for e in eps) / n,
            "train/tool_use_rate": sum(e["tool_calls"] > 0 for e in eps) / n,
            "train/tool_errors_per_sample": sum(e["tool_errors"] for e in eps) / n,
            "train/turns_mean": sum(e["turns"] for e in eps) / n,
            "response_length/model_tokens_mean": sum(sum(s.response_mask) if s.response_mask is not None
                                                     else len(s.response_ids) for s in samples) / n}


def _update_metrics(history: list[dict]) -> dict:
    """Means over the step's mini-batch updates, NaN/None left out; NaN when there were none."""
    m: dict = {"train/num_updates": len(history)}
    if not history:
        m.update({"train/loss": float("nan"), "train/grad_norm": float("nan")})
        return m
    for key in history[0]:
        vals = [h[key] for h in history
                if h.get(key) is not None and not (isinstance(h[key], float) and math.isnan(h[key]))]
        m[key] = sum(vals) / len(vals) if vals else float("nan")
    return m


def _int_version(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def staleness_metrics(produced: ProducedStep, trained_version: int) -> dict:
    """`train/staleness_mean` / `train/staleness_max` (ALGORITHMS.md section 8), weight versions:
    over the step's trained samples, `trained_version` (the weights the step trains, = step - 1)
    minus the oldest version that produced any token of the sample - from the sample's
    `weight_version_spans` [(version, first token index), ...] as the engine reported them, else
    the version published when the step's generation started (`produced.start_version`; the
    synchronous step: `trained_version`). `train/stale_discarded`: samples dropped for staleness,
    0 by construction (admission control, not discard; case N03). `rollout/weight_version_start`:
    the version published when the step's generation started."""
    start = getattr(produced, "start_version", None)
    fallback = trained_version if start is None else start
    ages = []
    for s in produced.samples:
        versions = [_int_version(v) for v, _ in (getattr(s, "weight_version_spans", None) or [])]
        versions = [v for v in versions if v is not None]
        ages.append(trained_version - (min(versions) if versions else fallback))
    return {"train/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "train/staleness_max": max(ages) if ages else 0, "train/stale_discarded": 0,
            "rollout/weight_version_start": fallback}


def step_metrics(produced: ProducedStep, batch, history: list[dict], times: dict[str, float],
                 sync_metrics: dict, weight_version: int, total_tokens: int) -> dict:
    """The controller's metrics row of one step.

    Args:
        produced: the producer's output of this step (samples, kept groups, stats, timings).
        batch: the `TrainBatch` trained on (`old_logprobs`, `rollout_logprobs`: [B, S] float32;
            `loss_mask`: [B, S] bool, True = trained). `train/rollout_logprob_abs_diff` is left out
            when `old_logprobs` is `rollout_logprobs` itself (nothing was recomputed).
        history: one dict per mini-batch update (`PolicyTrainer.update`).
        times: wall seconds of the trainer phases: `advantage`, `old_logprob`, `update`,
            `weight_sync`, `step`.
        sync_metrics: the weight publisher's metrics (`weight_sync/*`, `rollout/*`).
        weight_version: the version the engines hold after this step's sync.
        total_tokens: generated tokens since the run started (resumes included).
    """
    m = _sample_metrics(produced.samples, produced.kept, produced.ds_stats, produced.daa_stats)
    m.update(_update_metrics(history))
    if batch.old_logprobs is not batch.rollout_logprobs:  # the same tensor: actor.old_logprob_source rollout
        with torch.no_grad():  # mean |prox_logp - behav_logp| over valid tokens (ALGORITHMS.md 8)
            diff = (batch.old_logprobs - batch.rollout_logprobs).abs()[batch.loss_mask]
        m["train/rollout_logprob_abs_diff"] = float(diff.mean()) if diff.numel() else 0.0
    m.update(produced.timings)
    m.update(staleness_metrics(produced, weight_version - 1))
    m.update({
        "timing/advantage_s": times["advantage"], "timing/old_logprob_s": times["old_logprob"],
        "timing/update_s": times["update"], "timing/weight_sync_s": times["weight_sync"],
        "timing/step_s": times["step"],
        "perf/generated_tokens": produced.generated_tokens, "perf/total_generated_tokens": total_tokens,
        "rollout/token_checksum": produced.checksum,
        "perf/generate_tokens_per_s": produced.generated_tokens / max(produced.timings["timing/generate_s"], 1e-9),
        "perf/train_tokens_per_s": int(batch.loss_mask.sum()) / max(times["old_logprob"] + times["update"], 1e-9),
        "weight_sync/version": weight_version,
    })
    m.update({k: v for k, v in sync_metrics.items() if isinstance(v, (int, float))})
    return m


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m` (negative or unknown: `?`)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_progress(step: int, total: int, first_step: int, steps_elapsed_s: float, run_elapsed_s: float) -> str:
    """`step 5/80 elapsed 1m02s ETA 15m30s`: the ETA extrapolates the mean time of the steps this
    process ran (`first_step`..`step`, taking `steps_elapsed_s`) over the steps left; `elapsed` is the
    run's wall time (a resumed run counts its earlier part too)."""
    done = step - first_step + 1
    eta = steps_elapsed_s / done * (total - step) if done > 0 else float("nan")
    return f"step {step}/{total} elapsed {format_duration(run_elapsed_s)} ETA {format_duration(eta)}"
