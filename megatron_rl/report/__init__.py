"""`megatron-rl report`: PNG plots and one self-contained HTML page of runs' metrics.jsonl.

Each panel is one PNG (a grid of small plots, one per metric, every run overlaid in its own
colour); the HTML page embeds them as base64 images, so it is a single file to copy or attach.
Training curves show the raw values faintly and a moving average on top; evaluation rows
(`eval/*`, written at step 0, every `eval.interval` and at the last step) are drawn with markers.
Metrics absent from every run are left out, and so is a panel with none of its metrics.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

# (panel title, file stem, [(metric key, "prefix*" or "a|b" (first present), subplot title, y-axis label)])
PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("Reward and accuracy (training batches)", "reward", [
        ("train/score", "reward (score)", "mean reward"), ("train/acc", "accuracy", "share of responses"),
        ("train/format_valid", "format-valid share", "share of responses"),
        ("reward/overlong_penalty_mean", "overlong penalty (mean)", "penalty")]),
    ("Evaluation (held-out set)", "eval", [
        ("eval/avg@*", "avg@n (mean accuracy of n samples)", "accuracy"),
        ("eval/pass@*", "pass@n (unbiased)", "share of problems"),
        ("eval/greedy_acc", "greedy accuracy", "share of problems"),
        ("eval/format_valid", "format-valid share", "share of responses")]),
    ("Policy", "policy", [
        ("train/entropy", "entropy", "nats / token"), ("train/ppo_kl", "PPO KL (old vs new)", "nats / token"),
        ("train/grad_norm", "grad norm (before clipping)", "L2 norm"), ("train/loss", "policy loss", "loss"),
        ("train/lr", "learning rate", "lr"),
        ("train/kl_loss", "KL loss (vs reference)", "nats / token"),
        ("train/rollout_logprob_abs_diff", "|rollout - trainer| log-prob", "nats / token")]),
    ("Clipping", "clipping", [
        ("train/pg_clipfrac", "PPO clip fraction (either bound)", "share of tokens"),
        ("train/pg_clipfrac_at_high_bound", "clipped at 1 + eps_high", "share of tokens"),
        ("train/pg_clipfrac_at_low_bound", "clipped at 1 - eps_low", "share of tokens"),
        ("train/pg_clipfrac_lower", "dual-clip fraction (A < 0)", "share of tokens"),
        ("response_length/clip_ratio", "responses cut at max length", "share of responses")]),
    ("Response length", "length", [
        ("response_length/mean", "mean response length", "tokens"),
        ("response_length/max", "longest response", "tokens")]),
    ("Dynamic sampling and DAA", "sampling", [
        ("train/num_gen_batches", "generation batches / step", "batches"),
        ("train/kept_groups", "groups trained on / step", "groups"),
        ("train/mixed_groups", "of which mixed correct/wrong", "groups"),
        ("train/solve_all_frac|train/solve_all", "groups all correct (of generated)", "share of groups"),
        ("train/solve_none_frac|train/solve_none", "groups all wrong (of generated)", "share of groups"),
        ("train/daa_amplified_frac", "DAA: responses amplified", "share of responses"),
        ("train/daa_factor_mean", "DAA: mean factor (amplified responses)", "factor"),
        ("train/daa_hard_group_frac", "DAA: hard groups (of trained)", "share of groups")]),
    ("Timings", "timings", [
        ("timing/step_s", "step", "s"), ("timing/generate_s", "generate", "s"), ("timing/update_s", "update", "s"),
        ("timing/old_logprob_s", "old log-probs", "s"), ("timing/weight_sync_s", "weight sync", "s"),
        ("perf/generate_tokens_per_s", "generation throughput", "tokens / s")]),
    ("GPU", "gpu", [
        ("gpu/util_pct", "GPU utilisation", "%"), ("gpu/mem_used_gib", "GPU memory used", "GiB")]),
]

_COUNT_KEYS = {"train/num_gen_batches", "train/kept_groups", "train/mixed_groups", "train/solve_all", "train/solve_none"}
"""Integer counts: integer ticks, axis from 0."""
_NO_SMOOTH = {"train/lr"}
"""Schedules: drawn as they are (a moving average would stretch the warm-up)."""
_FEATURE_OF = {"train/daa_amplified_frac": "DAA", "train/daa_factor_mean": "DAA", "train/daa_hard_group_frac": "DAA"}
"""Metrics that mean nothing for a run with the feature off (config.yaml says so): not drawn for it."""

LEVEL_PANEL = ("Evaluation by difficulty level (held-out avg@n)", "eval_levels")
"""Drawn after the evaluation panel when eval rows carry `eval/level_{L}/avg@{n}` keys (one plot per level)."""
_LEVEL_KEY = re.compile(r"^eval/level_([^/]+)/avg@\d+$")


def _level_sort_key(level: str):
    try:
        return (0, float(level), level)
    except ValueError:
        return (1, 0.0, level)


def level_metrics(runs: Sequence["Run"]) -> list[tuple[str, str, str]]:
    """`[(pattern, subplot title, y label)]` for the per-level evaluation panel: one `eval/level_{L}/avg@*`
    pattern per level found in any run, levels in numeric order (non-numeric names last)."""
    levels = {m.group(1) for r in runs for k in r.series if (m := _LEVEL_KEY.match(k))}
    return [(f"eval/level_{lv}/avg@*", f"level {lv}", "avg@n") for lv in sorted(levels, key=_level_sort_key)]


@dataclass
class Run:
    """One run's metrics: `series[key] = (steps, values)` (non-null numeric values only);
    `features["DAA" | "dynamic sampling"]` = on/off from the run's config.yaml (absent: unknown)."""

    name: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    features: dict[str, bool] = field(default_factory=dict)


def _read_config(path: Path) -> dict:
    cfile = path / "config.yaml"
    if not cfile.is_file():
        return {}
    import yaml

    try:
        cfg = yaml.safe_load(cfile.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError, RecursionError) as e:
        logger.warning("%s: not read (%s); features and derived series that need it are left out",
                       cfile, type(e).__name__)
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get(part)
    return cfg


def _add_solve_shares(run: Run, cfg: dict) -> None:
    """`train/solve_{none,all}_frac` = count / generated groups of the step (`train/generated_groups`,
    else generation batches x `data.gen_batch_size` or `data.train_batch_size` from config.yaml)."""
    if "train/generated_groups" in run.series:
        denom = dict(zip(*run.series["train/generated_groups"]))
    else:
        per_batch = _get(cfg, "data.gen_batch_size") or _get(cfg, "data.train_batch_size")
        if (not isinstance(per_batch, int) or isinstance(per_batch, bool) or not 0 < per_batch < 2**53
                or "train/num_gen_batches" not in run.series):
            return
        denom = {s: v * per_batch for s, v in zip(*run.series["train/num_gen_batches"])}
    for name in ("solve_none", "solve_all"):
        if f"train/{name}" not in run.series:
            continue
        pts = [(s, v / denom[s]) for s, v in zip(*run.series[f"train/{name}"]) if denom.get(s)]
        if pts:
            run.series[f"train/{name}_frac"] = ([s for s, _ in pts], [v for _, v in pts])


def _add_mixed_groups(run: Run, cfg: dict) -> None:
    """`train/mixed_groups`: groups trained on whose responses are not all correct or all wrong (the
    ones with a non-zero binary-reward advantage). Dynamic sampling on `acc` keeps only such groups
    (= kept groups); without it every generated group is trained on (= kept - solve_all - solve_none)."""
    kept = run.series.get("train/kept_groups")
    ds = run.features.get("dynamic sampling")
    if not kept or ds is None:
        return
    if ds:
        if _get(cfg, "algorithm.filter_groups.metric") == "acc":
            run.series["train/mixed_groups"] = (list(kept[0]), list(kept[1]))
        return
    solved = {}
    for name in ("solve_none", "solve_all"):
        if f"train/{name}" not in run.series:
            return
        for s, v in zip(*run.series[f"train/{name}"]):
            solved[s] = solved.get(s, 0.0) + v
    pts = [(s, v - solved[s]) for s, v in zip(*kept) if s in solved]
    run.series["train/mixed_groups"] = ([s for s, _ in pts], [v for _, v in pts])


def _as_float(v) -> Optional[float]:
    """`v` as a finite float; None for anything else (null, bool, str, NaN/inf, an int beyond float range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _read_metrics(mfile: Path, run: Run) -> None:
    """Fill `run.series` from metrics.jsonl; see `load_run` for what is skipped and what is raised."""
    lines = mfile.read_bytes().splitlines()
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if i == last and e.reason == "unexpected end of data":  # cut inside a character
                continue
            raise ValueError(f"{mfile}:{i}: not UTF-8 text ({e.reason} at byte {e.start + 1} of the line)") from None
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            if i == last:  # a run killed while writing
                continue
            reason = e if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(f"{mfile}:{i}: invalid JSON: {reason}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{mfile}:{i}: expected a JSON object per line, got {type(row).__name__}")
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or _as_float(step) is None:
            raise ValueError(f"{mfile}:{i}: expected an integer 'step', got {step!r:.60}")
        for k, v in row.items():
            if k == "step" or (f := _as_float(v)) is None:
                continue
            steps, vals = run.series.setdefault(k, ([], []))
            steps.append(step)
            vals.append(f)


_SUMMARY_EVAL_KEYS = ("eval_before", "eval_after")


def _read_summary(sfile: Path) -> dict:
    """summary.json's keys the report uses, checked: `steps` (int), `wall_s` (finite number >= 0),
    `eval_before` / `eval_after` (objects). A file that cannot be read or is not a JSON object, and
    a key of the wrong type, are left out with a warning (a summary is optional, so the report is
    still written)."""
    try:
        summary = json.loads(sfile.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = "not UTF-8" if isinstance(e, UnicodeDecodeError) else (
            "nested too deeply" if isinstance(e, RecursionError) else str(e))
        logger.warning("%s: ignored (%s)", sfile, reason)
        return {}
    if not isinstance(summary, dict):
        logger.warning("%s: ignored (expected a JSON object, got %s)", sfile, type(summary).__name__)
        return {}
    checks = {"steps": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "wall_s": lambda v: (f := _as_float(v)) is not None and f >= 0,
              **{k: lambda v: isinstance(v, dict) for k in _SUMMARY_EVAL_KEYS}}
    expected = {"steps": "an integer >= 0", "wall_s": "a number >= 0", **{k: "an object" for k in _SUMMARY_EVAL_KEYS}}
    for key, ok in checks.items():
        if key not in summary:
            continue
        if summary[key] is not None and not ok(summary[key]):
            logger.warning("%s: %r ignored (expected %s, got %s)", sfile, key, expected[key], f"{summary[key]!r:.60}")
        if summary[key] is None or not ok(summary[key]):
            del summary[key]  # null: as if absent
    return summary


def load_run(run_dir: str | os.PathLike, name: Optional[str] = None) -> Run:
    """Read `<run_dir>/metrics.jsonl` (and summary.json and config.yaml when present).

    The run's name (default) is the folder's name, of the absolute path (so `.` is named too).
    In metrics.jsonl, values that are not finite numbers (null, strings, NaN, an integer beyond float
    range) are skipped, and so is a cut last line (a run killed while writing; blank lines after it
    do not count). summary.json and config.yaml are optional: when unreadable or of the wrong shape
    they (or their bad keys) are left out with a warning, see `_read_summary`.

    Adds `train/solve_none_frac` and `train/solve_all_frac` (shares of the generated groups, see
    `_add_solve_shares`), `train/mixed_groups` (`_add_mixed_groups`) and `Run.features` from config.yaml.

    Raises:
        FileNotFoundError: no metrics.jsonl in run_dir.
        ValueError: a line of metrics.jsonl that is not UTF-8, not JSON, not a JSON object or
            without an integer 'step' (names the file and line).
        OSError: metrics.jsonl cannot be read.
    """
    path = Path(run_dir)
    mfile = path / "metrics.jsonl"
    if not mfile.is_file():
        raise FileNotFoundError(f"{mfile}: no metrics.jsonl (is {path} a run dir?)")
    abs_path = Path(os.path.abspath(path))
    run = Run(name or abs_path.name or str(abs_path), path)
    _read_metrics(mfile, run)
    if (path / "summary.json").is_file():
        run.summary = _read_summary(path / "summary.json")
    cfg = _read_config(path)
    for feature, key in (("DAA", "algorithm.daa.enable"), ("dynamic sampling", "algorithm.filter_groups.enable")):
        if isinstance(_get(cfg, key), bool):
            run.features[feature] = _get(cfg, key)
    _add_solve_shares(run, cfg)
    _add_mixed_groups(run, cfg)
    return run


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _expand(pattern: str, runs: Sequence[Run]) -> list[str]:
    if "|" in pattern:  # alternatives: the first one any run has
        return next((keys for alt in pattern.split("|") if (keys := _expand(alt, runs))), [])
    if not pattern.endswith("*"):
        return [pattern] if any(pattern in r.series for r in runs) else []
    keys = sorted({k for r in runs for k in r.series if k.startswith(pattern[:-1])})
    return keys


def _unique_names(runs: Sequence[Run]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        if r.name in seen:
            seen[r.name] += 1
            r.name = f"{r.name} ({seen[r.name]})"
        else:
            seen[r.name] = 1


def plot_panel(runs: Sequence[Run], title: str, metrics: list[tuple[str, str, str]], out_png: Path,
               smooth: Optional[int] = None) -> bool:
    """Draw one panel to `out_png`; False (nothing written) when no run has any of its metrics.

    Args:
        metrics: `(pattern, subplot title, y-axis label)`; a pattern is a key, `prefix*` (every
            matching key in one plot, e.g. `eval/avg@*` for each n) or `a|b` (the first present).
        smooth: moving-average window in steps (None: about 1/15 of the points, 1 below 30).
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    is_eval = title.startswith("Evaluation")
    subplots, all_zero, feature_off = [], [], {}
    for pattern, sub_title, ylabel in metrics:
        keys = _expand(pattern, runs)
        if not keys:
            continue
        feature = _FEATURE_OF.get(keys[0])
        drawn = [r for r in runs if not (feature and r.features.get(feature) is False)]
        if feature and len(drawn) < len(runs):
            feature_off[feature] = [r.name for r in runs if r not in drawn]
        values = [v for r in drawn for k in keys if k in r.series for v in r.series[k][1]]
        if not values:
            continue
        if all(v == 0 for v in values):
            all_zero.append(keys[0] if len(keys) == 1 else pattern)
            continue
        subplots.append((keys, sub_title, ylabel, drawn))
    if not subplots:
        return False
    ncols = 2 if len(subplots) == 4 else min(3, len(subplots))
    nrows = math.ceil(len(subplots) / ncols)
    fig_w = max(5.2 * ncols, 8.0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {id(r): colors[i % len(colors)] for i, r in enumerate(runs)}

    notes, windows = [], set()
    if not is_eval:
        notes.append("")  # smoothing note, filled in below
    if all_zero:
        notes.append("zero throughout in every run (not drawn): " + ", ".join(all_zero))
    for feature, names in feature_off.items():
        notes.append(f"{feature} off (not drawn): " + ", ".join(names))
    wrap = int(fig_w * 16)
    legend_rows = math.ceil(len(runs) / 4)
    head_in = 0.3 + 0.22 * legend_rows
    fig_h = 3.3 * nrows + head_in + 0.2
    fig, axes = plt.subplots(nrows, ncols, figsize=(fig_w, fig_h), squeeze=False)
    last_step = max((st[-1] for r in runs for st, _ in r.series.values() if st), default=1) or 1
    for ax, (keys, label, ylabel, drawn) in zip(axes.flat, subplots):
        lo = hi = None
        for run in drawn:
            c = color_of[id(run)]
            mine = [k for k in keys if k in run.series]
            for j, key in enumerate(mine):
                steps, vals = run.series[key]
                lo = min(vals) if lo is None else min(lo, min(vals))
                hi = max(vals) if hi is None else max(hi, max(vals))
                name = run.name if len(keys) == 1 else f"{run.name} ({key.split('/')[-1]})"
                style = ["-", "--", ":", "-."][j % 4]
                if is_eval or len(vals) <= 3:
                    if is_eval and len(vals) > 1:
                        name += f": {vals[0]:.3f} \u2192 {vals[-1]:.3f}"
                    elif is_eval:
                        name += f": {vals[0]:.3f}"
                    ax.plot(steps, vals, marker="o", ls=style, color=c, lw=1.8, ms=5, label=name)
                    continue
                w = 1 if key in _NO_SMOOTH else smooth or max(1, len(vals) // 15)
                if w > 1:
                    windows.add(w)
                    ax.plot(steps, vals, color=c, lw=0.8, alpha=0.3)
                    ax.plot(steps, _moving_average(vals, w), ls=style, color=c, lw=2.0, label=name)
                else:
                    ax.plot(steps, vals, ls=style, color=c, lw=1.8, label=name)
        same = _identical_runs(drawn, keys)  # a line hidden under another: say so, rather than look missing
        same_note = ("\nidentical: " + "; ".join(" = ".join(g) for g in same)) if same else ""
        if lo is not None:
            if ylabel.startswith("share") and "format-valid" in label:  # near 1: do not magnify 0.999 vs 1.0
                ax.set_ylim(min(0.9, lo - 0.01), 1.005)
            elif is_eval and ylabel in ("accuracy", "share of problems", "avg@n"):
                ax.set_ylim(0, 1)  # same scale for every run and level
            elif keys[0] in _COUNT_KEYS:
                ax.set_ylim(0, max(1.0, hi) * 1.15)
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            elif hi - lo <= 1e-12 * max(1.0, abs(hi)):  # constant: no magnified noise axis
                ax.set_ylim(min(0.0, lo), max(0.0, hi) * 1.25 or 1.0)
        shown_key = keys[0] if len(keys) == 1 else "|".join(sorted({k.rsplit("@", 1)[0] + "@*" for k in keys}))
        ax.set_title(label, fontsize=10.5)
        ax.set_xlabel(f"RL step    [{shown_key}]{same_note}", fontsize=8.5)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xlim(-0.02 * last_step, 1.02 * last_step)  # every panel spans the runs' steps
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if is_eval or len(keys) > 1:
            ax.legend(fontsize=7.5, frameon=False, loc="best")
    for ax in list(axes.flat)[len(subplots):]:
        ax.axis("off")
    if not is_eval:
        notes[0] = ("faint: per step; bold: moving average over " + "/".join(map(str, sorted(windows))) + " steps"
                    if windows else "per step (no smoothing)")
    note = textwrap.fill("; ".join(n for n in notes if n), wrap)
    note_in = 0.2 * (note.count("\n") + 1) if note else 0.0
    fig.set_size_inches(fig_w, fig_h + note_in)
    fig_h += note_in

    shown = [r for r in runs if any(r in drawn and any(k in r.series for k in keys) for keys, _, _, drawn in subplots)]
    handles = [Line2D([], [], color=color_of[id(r)], lw=2.5) for r in shown]
    labels = [_legend_name(r, title) for r in shown]
    # layout the plots first (tight_layout would also make room for a suptitle), then title, legend, note
    fig.tight_layout(rect=(0, (note_in + 0.05) / fig_h, 1, 1 - head_in / fig_h))
    fig.suptitle(title, fontsize=13, fontweight="bold", y=1 - 0.06 / fig_h, va="top")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.28 / fig_h), ncol=min(len(labels), 4),
               fontsize=9.5, frameon=False, borderaxespad=0.0, borderpad=0.2)
    if note:
        fig.text(0.01, 0.008, note, fontsize=8, color="dimgray", va="bottom")
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return True


def _identical_runs(runs: Sequence[Run], keys: list[str]) -> list[list[str]]:
    """Names of runs whose series of `keys` are the same points (drawn on top of each other), in
    groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for r in runs:
        pts = tuple((k, tuple(r.series[k][0]), tuple(r.series[k][1])) for k in keys if k in r.series)
        if pts:
            groups.setdefault(pts, []).append(r.name)
    return [g for g in groups.values() if len(g) > 1]


def _legend_name(run: Run, title: str) -> str:
    """Run name; in the dynamic-sampling/DAA panel with the features that are off (from config.yaml)."""
    if not title.startswith("Dynamic sampling"):
        return run.name
    off = [f for f in ("dynamic sampling", "DAA") if run.features.get(f) is False]
    return f"{run.name} ({' off, '.join(off)} off)" if off else run.name


def _summary_table(runs: Sequence[Run]) -> str:
    """One row a run: steps, wall time, each held-out metric of summary.json as `before -> after`."""
    def ev_keys(r: Run) -> list[str]:
        return [m for k in ("eval_before", "eval_after") for m, v in (r.summary.get(k) or {}).items()
                if isinstance(v, float) and m != "wall_s"]
    order = {"avg": 0, "pas": 1, "gre": 2, "for": 3}
    metrics = sorted({m for r in runs for m in ev_keys(r)}, key=lambda m: (order.get(m[:3], 4), m))
    head = ["run", "steps", "wall (min)", *[f"held-out {m} (before \u2192 after)" for m in metrics], "path"]
    rows = []
    for r in runs:
        steps = max((s[-1] for s, _ in r.series.values() if s), default=0)
        wall = r.summary.get("wall_s")
        before, after = r.summary.get("eval_before") or {}, r.summary.get("eval_after") or {}
        cells = []
        for m in metrics:
            b, a = before.get(m), after.get(m)
            if not isinstance(b, float) and not isinstance(a, float):
                cells.append("-")
                continue
            cells.append(" \u2192 ".join(f"{v:.3f}" if isinstance(v, float) else "-" for v in (b, a))
                         + (f" ({a - b:+.3f})" if isinstance(a, float) and isinstance(b, float) else ""))
        rows.append([r.name, str(r.summary.get("steps", steps)), f"{wall / 60:.1f}" if wall else "-", *cells, str(r.path)])
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    tr = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{tr}</table>"


def _skipped_note(missing: list[tuple[str, str]]) -> str:
    if not missing:
        return ""
    items = "".join(f"<li>{html.escape(d)}: {html.escape(reason)}</li>" for d, reason in missing)
    return f"<p>Skipped (not drawn):</p><ul>{items}</ul>"


def make_report(run_dirs: Sequence[str | os.PathLike], out_dir: Optional[str | os.PathLike] = None, *,
                smooth: Optional[int] = None, skipped: Optional[list] = None) -> Path:
    """Write `<out>/<panel>.png` and `<out>/report.html` for one or more runs (overlaid).

    Run dirs without metrics.jsonl (runs not made yet) are skipped: named in a warning, on the page
    and appended to `skipped` as `(run_dir, reason)`; the others are drawn.

    Args:
        run_dirs: run folders holding metrics.jsonl (names in legends: the folder names).
        out_dir: output folder; default `<first drawn run dir>/report`.
        smooth: moving-average window in steps for training curves (None: about 1/15 of the run).

    Returns:
        Path of report.html.

    Raises:
        ValueError: no run dirs, no plottable metric in any run, or a bad metrics.jsonl (see `load_run`).
        FileNotFoundError: no run dir holds a metrics.jsonl (the message names each).
        NotADirectoryError: out_dir is a file.
        OSError: the output folder cannot be created or written, or a file cannot be read.
    """
    if not run_dirs:
        raise ValueError("no run dirs given")
    runs, missing = [], []
    for d in run_dirs:
        try:
            runs.append(load_run(d))
        except FileNotFoundError as e:  # a run not made (yet): skipped and named, the others drawn
            missing.append((str(d), str(e)))
    if not runs:
        raise FileNotFoundError("; ".join(reason for _, reason in missing) + " (nothing to draw)")
    if skipped is not None:
        skipped.extend(missing)
    else:
        for d, reason in missing:
            logger.warning("report: skipped %s: %s", d, reason)
    _unique_names(runs)
    out = Path(out_dir) if out_dir else runs[0].path / "report"
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, expected a folder for the report")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the report folder {out}: {e.strerror or e}") from None
    sections, nav = [], []
    panels = list(PANELS)
    if level_panel := level_metrics(runs):
        at = next(i for i, p in enumerate(panels) if p[1] == "eval") + 1
        panels.insert(at, (*LEVEL_PANEL, level_panel))
    for title, stem, metrics in panels:
        png = out / f"{stem}.png"
        if plot_panel(runs, title, metrics, png, smooth=smooth):
            data = base64.b64encode(png.read_bytes()).decode()
            sections.append(f'<img id="{stem}" alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
            nav.append(f'<a href="#{stem}">{html.escape(title)}</a>')
    if not sections:
        raise ValueError(f"no plottable metrics in {', '.join(map(str, run_dirs))}")
    names = ", ".join(r.name for r in runs)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>megatron-rl report: {html.escape(names)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1700px; }}
table {{ border-collapse: collapse; font-size: 13px; margin-bottom: 12px; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
img {{ display: block; max-width: 100%; border: 1px solid #eee; margin: 0 0 18px 0; }}
nav {{ font-size: 13px; margin: 0 0 16px 0; }}
nav a {{ margin-right: 12px; }}
</style></head><body>
<h1>megatron-rl report: {html.escape(names)}</h1>
{_summary_table(runs)}
{_skipped_note(missing)}
<nav>{" ".join(nav)}</nav>
{chr(10).join(sections)}
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path
