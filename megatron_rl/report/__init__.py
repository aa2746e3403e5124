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
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

# (panel title, file stem, [(metric key or "prefix*", subplot title)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Reward and accuracy (training batches)", "reward", [
        ("train/score", "reward (score)"), ("train/acc", "accuracy"), ("train/format_valid", "format-valid share"),
        ("reward/overlong_penalty_mean", "overlong penalty (mean)")]),
    ("Evaluation (held-out set)", "eval", [
        ("eval/avg@*", "avg@n"), ("eval/pass@*", "pass@n"), ("eval/greedy_acc", "greedy accuracy"),
        ("eval/format_valid", "format-valid share")]),
    ("Policy", "policy", [
        ("train/entropy", "entropy (nats/token)"), ("train/ppo_kl", "PPO KL (old vs new)"),
        ("train/grad_norm", "grad norm"), ("train/loss", "policy loss"), ("train/kl_loss", "KL loss"),
        ("train/rollout_logprob_abs_diff", "|rollout - trainer| log-prob")]),
    ("Clipping", "clipping", [
        ("train/pg_clipfrac", "PPO clip fraction (upper)"), ("train/pg_clipfrac_lower", "dual-clip fraction (lower)"),
        ("response_length/clip_ratio", "responses cut at max length")]),
    ("Response length (tokens)", "length", [
        ("response_length/mean", "mean"), ("response_length/max", "max")]),
    ("Dynamic sampling and DAA", "sampling", [
        ("train/num_gen_batches", "generation batches / step"), ("train/kept_groups", "kept groups"),
        ("train/solve_all", "groups all correct"), ("train/solve_none", "groups all wrong"),
        ("train/daa_amplified_frac", "DAA: amplified share"), ("train/daa_factor_mean", "DAA: mean factor")]),
    ("Timings", "timings", [
        ("timing/step_s", "step (s)"), ("timing/generate_s", "generate (s)"), ("timing/update_s", "update (s)"),
        ("timing/old_logprob_s", "old log-probs (s)"), ("timing/weight_sync_s", "weight sync (s)"),
        ("perf/generate_tokens_per_s", "generation (tokens/s)")]),
    ("GPU", "gpu", [
        ("gpu/util_pct", "GPU utilisation (%)"), ("gpu/mem_used_gib", "GPU memory used (GiB)")]),
]


LEVEL_PANEL = ("Evaluation by difficulty level (held-out avg@n)", "eval_levels")
"""Drawn after the evaluation panel when eval rows carry `eval/level_{L}/avg@{n}` keys (one plot per level)."""
_LEVEL_KEY = re.compile(r"^eval/level_([^/]+)/avg@\d+$")


def _level_sort_key(level: str):
    try:
        return (0, float(level), level)
    except ValueError:
        return (1, 0.0, level)


def level_metrics(runs: Sequence["Run"]) -> list[tuple[str, str]]:
    """`[(pattern, subplot title)]` for the per-level evaluation panel: one `eval/level_{L}/avg@*`
    pattern per level found in any run, levels in numeric order (non-numeric names last)."""
    levels = {m.group(1) for r in runs for k in r.series if (m := _LEVEL_KEY.match(k))}
    return [(f"eval/level_{lv}/avg@*", f"level {lv}") for lv in sorted(levels, key=_level_sort_key)]


@dataclass
class Run:
    """One run's metrics: `series[key] = (steps, values)` (non-null numeric values only)."""

    name: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def load_run(run_dir: str | os.PathLike, name: Optional[str] = None) -> Run:
    """Read `<run_dir>/metrics.jsonl` (and summary.json when present).

    Raises:
        FileNotFoundError: no metrics.jsonl in run_dir.
        ValueError: a line that is not JSON (names the file and line; a cut last line is skipped).
    """
    path = Path(run_dir)
    mfile = path / "metrics.jsonl"
    if not mfile.is_file():
        raise FileNotFoundError(f"{mfile}: no metrics.jsonl (is {path} a run dir?)")
    run = Run(name or path.name, path)
    lines = mfile.read_text().splitlines()
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):  # a run killed while writing
                continue
            raise ValueError(f"{mfile}:{i}: invalid JSON: {e}") from None
        step = row.get("step")
        if not isinstance(step, int):
            raise ValueError(f"{mfile}:{i}: expected an integer 'step', got {step!r}")
        for k, v in row.items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            steps, vals = run.series.setdefault(k, ([], []))
            steps.append(step)
            vals.append(float(v))
    if (path / "summary.json").is_file():
        try:
            run.summary = json.loads((path / "summary.json").read_text())
        except json.JSONDecodeError:
            run.summary = {}
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


def plot_panel(runs: Sequence[Run], title: str, metrics: list[tuple[str, str]], out_png: Path,
               smooth: Optional[int] = None) -> bool:
    """Draw one panel to `out_png`; False (nothing written) when no run has any of its metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subplots, all_zero = [], []
    for pattern, sub_title in metrics:
        keys = _expand(pattern, runs)  # a `prefix*` pattern (eval/avg@*): every n in one plot
        if not keys:
            continue
        values = [v for r in runs for k in keys if k in r.series for v in r.series[k][1]]
        if values and all(v == 0 for v in values):
            all_zero.append(pattern)
            continue
        subplots.append((keys, sub_title, pattern))
    if not subplots:
        return False
    ncols = 2 if len(subplots) == 4 else min(3, len(subplots))
    nrows = math.ceil(len(subplots) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.3 * nrows + 0.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    is_eval = title.startswith("Evaluation")
    for ax, (keys, label, pattern) in zip(axes.flat, subplots):
        lo = None
        for i, run in enumerate(runs):
            c = colors[i % len(colors)]
            mine = [k for k in keys if k in run.series]
            for j, key in enumerate(mine):
                steps, vals = run.series[key]
                lo = min(vals) if lo is None else min(lo, min(vals))
                name = run.name if len(keys) == 1 else f"{run.name} ({key.split('/')[-1]})"
                style = ["-", "--", ":", "-."][j % 4]
                if is_eval or len(vals) <= 3:
                    ax.plot(steps, vals, marker="o", ls=style, color=c, lw=1.8, ms=5, label=name)
                    if is_eval and vals:
                        ax.annotate(f"{vals[-1]:.3f}", (steps[-1], vals[-1]), textcoords="offset points",
                                    xytext=(4, 4), fontsize=8, color=c)
                    continue
                w = smooth or max(1, len(vals) // 15)
                if w > 1:
                    ax.plot(steps, vals, color=c, lw=0.8, alpha=0.25)
                    ax.plot(steps, _moving_average(vals, w), ls=style, color=c, lw=2.0, label=name)
                else:
                    ax.plot(steps, vals, ls=style, color=c, lw=1.8, label=name)
        if "format_valid" in pattern and lo is not None:  # a share near 1: do not magnify 0.999 vs 1.0
            ax.set_ylim(min(0.9, lo - 0.01), 1.005)
        ax.set_title(f"{label}\n[{pattern}]", fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7, frameon=False)
    for ax in list(axes.flat)[len(subplots):]:
        ax.axis("off")
    from matplotlib.lines import Line2D

    shown = [i for i, r in enumerate(runs) if any(k in r.series for keys, _, _ in subplots for k in keys)]
    handles = [Line2D([], [], color=colors[i % len(colors)], lw=2.5) for i in shown]
    labels = [runs[i].name for i in shown]
    fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.legend(handles, labels, loc="upper right", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    note = "" if is_eval else f"faint: per step; bold: moving average ({'auto' if not smooth else smooth} steps)"
    if all_zero:
        note += ("; " if note else "") + "zero throughout (not drawn): " + ", ".join(all_zero)
    if note:
        fig.text(0.01, 0.005, note, fontsize=8, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1 - 0.45 / (3.3 * nrows + 0.6)))
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return True


def _summary_table(runs: Sequence[Run]) -> str:
    head = ["run", "steps", "wall (min)", "eval before", "eval after", "path"]
    rows = []
    for r in runs:
        steps = max((s[-1] for s, _ in r.series.values() if s), default=0)
        wall = r.summary.get("wall_s")
        evs = []
        for k in ("eval_before", "eval_after"):
            ev = r.summary.get(k) or {}
            evs.append(", ".join(f"{m} {ev[m]:.3f}" for m in ev if isinstance(ev[m], float) and m != "wall_s"
                                 and not m.startswith("num")) or "-")
        rows.append([r.name, str(r.summary.get("steps", steps)), f"{wall / 60:.1f}" if wall else "-", *evs, str(r.path)])
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    tr = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{tr}</table>"


def make_report(run_dirs: Sequence[str | os.PathLike], out_dir: Optional[str | os.PathLike] = None, *,
                smooth: Optional[int] = None) -> Path:
    """Write `<out>/<panel>.png` and `<out>/report.html` for one or more runs (overlaid).

    Args:
        run_dirs: run folders holding metrics.jsonl (names in legends: the folder names).
        out_dir: output folder; default `<first run dir>/report`.
        smooth: moving-average window in steps for training curves (None: about 1/15 of the run).

    Returns:
        Path of report.html.

    Raises:
        ValueError: no run dirs, or no plottable metric in any run.
        FileNotFoundError: a run dir without metrics.jsonl.
    """
    if not run_dirs:
        raise ValueError("no run dirs given")
    runs = [load_run(d) for d in run_dirs]
    _unique_names(runs)
    out = Path(out_dir) if out_dir else Path(run_dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    panels = list(PANELS)
    if level_panel := level_metrics(runs):
        at = next(i for i, p in enumerate(panels) if p[1] == "eval") + 1
        panels.insert(at, (*LEVEL_PANEL, level_panel))
    for title, stem, metrics in panels:
        png = out / f"{stem}.png"
        if plot_panel(runs, title, metrics, png, smooth=smooth):
            data = base64.b64encode(png.read_bytes()).decode()
            sections.append(f'<h2>{html.escape(title)}</h2>\n<img alt="{html.escape(title)}" '
                            f'src="data:image/png;base64,{data}">')
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
img {{ max-width: 100%; border: 1px solid #eee; }}
h2 {{ margin-top: 28px; font-size: 18px; }}
</style></head><body>
<h1>megatron-rl report</h1>
{_summary_table(runs)}
{chr(10).join(sections)}
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path
