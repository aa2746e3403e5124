"""DA3PO's Direct Advantage Amplification (DAA) and the per-prompt difficulty tracker.

ALGORITHMS.md section 4. Dynamic sampling (DAPO, arXiv 2503.14476) keeps a response only when its
group is mixed (1 <= k <= G-1 correct); on hard prompts this amplifies incorrect responses' advantages
more than correct ones'. DAA multiplies the advantage of every correct response with positive
advantage, in a kept group whose difficulty estimate `q_hat < hard_threshold`, by a factor:

- `constant` (section 4.1, the DA3PO recipes' default): `lambda = amplification` (default 2.0)
  with `q_hat = k / G`: the DA3PO paper's rule as reported by summaries of the paper (the paper's
  full text is not available to us; they report lambda = 2 best at G = 16).
- `balanced` (section 4.2, our extension): `clamp(beta(q_hat), 1, max_factor)` with
  `beta(q) = (1 - q^(G-1)) / (1 - (1-q)^(G-1))`, how much more incorrect responses are amplified
  than correct ones by the keep rule.
- `power` (section 4.2): `clamp((hard_threshold / q_hat) ** gamma, 1, max_factor)`.

Incorrect responses are never changed; with DAA disabled the advantages are DAPO's.

Difficulty `q_hat` (section 4.3), closed-form posterior means under a Beta(a0, b0) prior:
- group: `k / G`.
- posterior: `(a0 + k) / (a0 + b0 + G)`. Keeping a group depends only on k, so P(q | k, kept) =
  P(q | k); the removed `conditional` mode divided by the keep probability again (2x low).
- history: `(a0 + S) / (a0 + b0 + S + F)`, S/F the correct/incorrect responses of every completed
  group of the prompt so far (this one included, kept or dropped), a group observed s steps ago
  weighted `history_decay ** s`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable
from typing import Any

import torch

from megatron_rl.algorithms.options import CONDITIONAL_REMOVED, DAA_DIFFICULTY_MODES, DAA_FACTOR_OPTIONS

logger = logging.getLogger(__name__)

DIFFICULTY_MODES = DAA_DIFFICULTY_MODES
FACTOR_KINDS = tuple(DAA_FACTOR_OPTIONS.names())
"""The registered factors (options: `options.ConstantFactorOptions`, `BalancedFactorOptions`,
`PowerFactorOptions`)."""
STATE_VERSION = 2
"""`DifficultyTracker.state_dict` format: 2 = decayed counts with the step of the last observation."""


def balanced_beta(q: float | torch.Tensor, G: int) -> float | torch.Tensor:
    """`beta(q) = (1 - q^(G-1)) / (1 - (1-q)^(G-1))` (ALGORITHMS section 4.2).

    Args:
        q: success rate in [0, 1], a float or a float tensor of any shape.
        G: group size (`rollout.n`), >= 2.

    Returns:
        Same type as `q` (float64 tensor for tensor input); `inf` at `q = 0`, 0 at `q = 1`.
        Computed with `expm1/log1p` so small `q` keeps full precision.

    Raises:
        ValueError: `G < 2`.
    """
    if G < 2:
        raise ValueError(f"group size G must be >= 2, got {G}")
    as_float = not isinstance(q, torch.Tensor)
    qt = torch.as_tensor(q, dtype=torch.float64)
    num = 1.0 - qt ** (G - 1)
    den = -torch.expm1((G - 1) * torch.log1p(-qt))
    out = torch.where(den > 0, num / den.clamp(min=torch.finfo(torch.float64).tiny), torch.full_like(qt, math.inf))
    return float(out) if as_float else out


def daa_factor(
    q_hat: float | torch.Tensor,
    *,
    group_size: int | None = None,
    factor: str = "constant",
    hard_threshold: float = 0.5,
    amplification: float = 2.0,
    max_factor: float = 8.0,
    gamma: float = 1.0,
) -> float | torch.Tensor:
    """Amplification factor for correct responses of a group with difficulty `q_hat`.

    Args:
        q_hat: estimated success rate, float or float tensor `[P]`.
        group_size: G, required for `factor="balanced"`.
        factor: `"constant"` -> `amplification`; `"balanced"` -> `clamp(beta(q_hat), 1, max_factor)`;
            `"power"` -> `clamp((hard_threshold / q_hat) ** gamma, 1, max_factor)`.
        hard_threshold: groups with `q_hat >= hard_threshold` get factor 1.
        amplification: lambda of the constant factor (>= 1; `max_factor` does not cap it).
        max_factor: cap of the balanced and power factors (>= 1).
        gamma: exponent of the power factor (> 0).

    Returns:
        Same type as `q_hat` (float64 tensor for tensor input), values >= 1.

    Raises:
        ValueError: unknown `factor`, `amplification < 1`, `max_factor < 1`, `gamma <= 0`,
        `hard_threshold` outside (0, 1], or a missing `group_size` for the balanced factor.
    """
    if factor not in FACTOR_KINDS:
        raise ValueError(f"daa.factor must be one of {FACTOR_KINDS}, got {factor!r}")
    if not amplification >= 1.0:
        raise ValueError(f"daa.amplification must be >= 1, got {amplification}")
    if not max_factor >= 1.0:
        raise ValueError(f"daa.max_factor must be >= 1, got {max_factor}")
    if not gamma > 0:
        raise ValueError(f"daa.gamma must be > 0, got {gamma}")
    if not 0.0 < hard_threshold <= 1.0:
        raise ValueError(f"daa.hard_threshold must be in (0, 1], got {hard_threshold}")
    as_float = not isinstance(q_hat, torch.Tensor)
    q = torch.as_tensor(q_hat, dtype=torch.float64)
    if factor == "constant":
        raw = torch.full_like(q, float(amplification))
    elif factor == "balanced":
        if group_size is None:
            raise ValueError("daa.factor='balanced' needs group_size (rollout.n)")
        raw = balanced_beta(q, group_size).clamp(min=1.0, max=max_factor)
    else:
        raw = ((hard_threshold / q) ** gamma).clamp(min=1.0, max=max_factor)  # q = 0 gives inf, capped
    f = torch.where(q < hard_threshold, raw, torch.ones_like(q))
    return float(f) if as_float else f


class DifficultyTracker:
    """Per-prompt Beta counts of the success rate, part of the training state (saved, resumed).

    Stores, per `prompt_key`, the decayed correct and incorrect counts `S, F` of every completed
    group recorded so far (kept or dropped by dynamic sampling) and the step of the last one: a
    group recorded at step `t` counts `history_decay ** (now - t)`, so the counts are multiplied by
    `history_decay ** (now - last_step)` when they are next read or added to. Call `estimate` for
    a group before `record`ing it (the estimate adds the group itself once).

    Args:
        a0, b0: Beta prior (default Jeffreys, 0.5/0.5), both > 0.
        history_decay: weight a step of age of an earlier group, in (0, 1]; 1.0 = no decay.
    """

    def __init__(self, a0: float = 0.5, b0: float = 0.5, history_decay: float = 1.0) -> None:
        if not (a0 > 0 and b0 > 0):
            raise ValueError(f"Beta prior needs a0 > 0 and b0 > 0, got a0={a0}, b0={b0}")
        if not 0.0 < history_decay <= 1.0:
            raise ValueError(f"history_decay must be in (0, 1], got {history_decay}")
        self.a0, self.b0, self.history_decay = float(a0), float(b0), float(history_decay)
        self._counts: dict[str, list] = {}
        """key -> [S, F, last_step]: decayed counts as of `last_step` (floats; ints without decay)."""

    @staticmethod
    def _key(prompt_key: Hashable) -> str:
        return prompt_key if isinstance(prompt_key, str) else repr(prompt_key)

    def history(self, prompt_key: Hashable, step: int | None = None) -> tuple[float, float]:
        """`(S, F)`: the decayed correct and incorrect counts of `prompt_key` at `step` (None = as of
        its last observation), (0, 0) if never seen."""
        c = self._counts.get(self._key(prompt_key))
        if not c:
            return (0.0, 0.0)
        w = 1.0 if step is None or self.history_decay == 1.0 else self.history_decay ** (step - c[2])
        return (c[0] * w, c[1] * w)

    def estimate(self, prompt_key: Hashable, k: int, G: int, mode: str = "history", *, step: int = 0) -> float:
        """Difficulty estimate `q_hat` for a kept group with `k` correct out of `G`.

        Args:
            prompt_key: stable prompt identity (dataset name + row index); str or hashable
                (non-str keys are stored by `repr`).
            k: number of correct responses, `1 <= k <= G-1` (an eligible, mixed group).
            G: number of responses in the group.
            mode: `group`, `posterior` or `history` (ALGORITHMS section 4.3).
            step: the RL step the group was scored in (ages the history with `history_decay`).

        Returns:
            The posterior mean of q (float; `k / G` for `group`).

        Raises:
            ValueError: an unknown mode (`conditional`: why it was removed), k outside [1, G-1].
        """
        if mode == "conditional":
            raise ValueError(CONDITIONAL_REMOVED)
        if mode not in DIFFICULTY_MODES:
            raise ValueError(f"daa.difficulty must be one of {DIFFICULTY_MODES}, got {mode!r}")
        if G < 2 or not 1 <= k <= G - 1:
            raise ValueError(f"estimate needs a mixed group, 1 <= k <= G-1; got k={k}, G={G}")
        if mode == "group":
            return k / G
        succ, fail = self.history(prompt_key, step) if mode == "history" else (0.0, 0.0)
        s, f = succ + k, fail + (G - k)
        return (self.a0 + s) / (self.a0 + self.b0 + s + f)

    def record(self, prompt_key: Hashable, k: int, G: int, *, step: int = 0) -> None:
        """Record a completed group (kept or dropped) with `k` correct out of `G` valid responses,
        scored at RL step `step` (never earlier than the key's previous record).

        Aborted or partial groups must not be recorded. A group with no valid response (G = 0:
        every reward call failed or timed out) carries no evidence and is a no-op.
        Raises `ValueError` unless 0 <= k <= G, or for a step before the key's last record.
        """
        if G < 0 or not 0 <= k <= G:
            raise ValueError(f"record needs 0 <= k <= G; got k={k}, G={G}")
        if G == 0:
            return
        key = self._key(prompt_key)
        c = self._counts.get(key)
        if c is not None and step < c[2]:
            raise ValueError(f"record of {key!r} at step {step}, before its last record at step {c[2]}")
        succ, fail = self.history(prompt_key, step)
        self._counts[key] = [succ + k, fail + (G - k), int(step)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: prior, decay and per-key `[S, F, last_step]` (floats survive a
        JSON round trip exactly, so a resumed run estimates bit for bit what it would have)."""
        return {
            "version": STATE_VERSION,
            "a0": self.a0,
            "b0": self.b0,
            "history_decay": self.history_decay,
            "counts": {k: list(v) for k, v in self._counts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counts of `state_dict()` output (replaces the current ones). The prior and
        the decay stay the tracker's own (the config's); a difference is logged.

        A version-1 state (before the closed forms: integer `[correct, incorrect]` totals and a
        `grid_size`) loads exactly with `history_decay` 1 (its totals are the same counts).

        Raises:
            ValueError: a version-1 state with `history_decay` < 1 (it has no step per observation).
        """
        version = int(state.get("version", 1))
        for name in ("a0", "b0", "history_decay"):
            saved = float(state.get(name, 1.0 if name == "history_decay" else getattr(self, name)))
            if saved != getattr(self, name):
                logger.warning("difficulty tracker: checkpoint has %s=%s, the config %s; using the config's",
                               name, saved, getattr(self, name))
        if version == 1:
            if self.history_decay != 1.0:
                raise ValueError(
                    "the checkpoint's difficulty tracker predates algorithm.daa.history_decay (it stores totals "
                    "without the step of each group), so it cannot be aged; resume it with "
                    f"algorithm.daa.history_decay=1.0 (got {self.history_decay}) or start a new run_dir")
            self._counts = {str(k): [float(v[0]), float(v[1]), 0] for k, v in state["counts"].items()}
        elif version == STATE_VERSION:
            self._counts = {str(k): [float(v[0]), float(v[1]), int(v[2])] for k, v in state["counts"].items()}
        else:
            raise ValueError(f"difficulty tracker state version {version} is not supported "
                             f"(this code: {STATE_VERSION})")

    def __len__(self) -> int:
        return len(self._counts)


def apply_daa(
    advantages: torch.Tensor,
    correct: torch.Tensor,
    group_index: torch.Tensor,
    q_hat: torch.Tensor,
    eligible: torch.Tensor,
    *,
    factor: str = "constant",
    hard_threshold: float = 0.5,
    amplification: float = 2.0,
    max_factor: float = 8.0,
    gamma: float = 1.0,
    group_size: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Multiply the advantages of correct responses in hard eligible groups (ALGORITHMS 4).

    Args:
        advantages: `[N] float`, group-relative advantages (`grpo` or `rloo`).
        correct: `[N] bool`, verifier `acc` (False also for failed rewards).
        group_index: `[N] int64` in `[0, P)`, from `group_ids_to_index`.
        q_hat: `[P] float`, difficulty estimate per group (ignored where not eligible).
        eligible: `[P] bool`, True = kept group with 1 <= k <= G-1.
        factor, hard_threshold, amplification, max_factor, gamma: see `daa_factor`.
        group_size: G for the balanced factor: an int, a `[P]` tensor, or None to use the
            number of rows of each group in `group_index`.

    Returns:
        `(advantages [N] same dtype, stats)`; only rows with `correct & advantage > 0` in an
        eligible group with `q_hat < hard_threshold` change. `stats`: `amplified_frac` = share of
        the N rows whose advantage was multiplied by a factor > 1; `factor_mean` = mean factor
        over those rows (1.0 if none); `hard_group_frac` = share of the P groups that are eligible
        with `q_hat < hard_threshold` (0.0 if P = 0).
    """
    n = advantages.shape[0]
    if correct.shape != (n,) or group_index.shape != (n,):
        raise ValueError("advantages, correct and group_index must all be [N]")
    p = q_hat.shape[0]
    if eligible.shape != (p,):
        raise ValueError(f"eligible must be [P]=[{p}], got {tuple(eligible.shape)}")
    dev = advantages.device
    q = q_hat.detach().to(device=dev, dtype=torch.float64)
    opts = dict(factor=factor, hard_threshold=hard_threshold, amplification=amplification,
                max_factor=max_factor, gamma=gamma)
    if factor == "balanced":
        if group_size is None:
            gs = torch.bincount(group_index.to(dev), minlength=p)[:p]
        else:
            gs = torch.as_tensor(group_size, device=dev).expand(p)
        f = torch.ones(p, dtype=torch.float64, device=dev)
        for g in torch.unique(gs).tolist():
            sel = gs == g
            if g >= 2:
                f[sel] = daa_factor(q[sel], group_size=int(g), **opts)
    else:
        f = daa_factor(q, **opts)
    hard = eligible.to(dev) & (q < hard_threshold)  # [P]
    f = torch.where(eligible.to(dev), f, torch.ones_like(f))
    row_f = f[group_index.to(dev)]
    amplify = correct.to(dev).bool() & (advantages > 0) & (row_f > 1.0)
    out = torch.where(amplify, (advantages.to(torch.float64) * row_f).to(advantages.dtype), advantages)
    n_amp = int(amplify.sum())
    stats = {
        "amplified_frac": n_amp / n if n else 0.0,
        "factor_mean": float(row_f[amplify].mean()) if n_amp else 1.0,
        "hard_group_frac": float(hard.sum()) / p if p else 0.0,
    }
    return out, stats
