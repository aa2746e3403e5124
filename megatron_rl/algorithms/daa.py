"""DA3PO's Direct Advantage Amplification (DAA) and the per-prompt difficulty tracker.

ALGORITHMS section 4 (our derivation; the DA3PO paper's exact formula is not available).
Dynamic sampling (DAPO, arXiv 2503.14476) keeps a response only when its group is mixed, so on
a prompt with success rate `q` and group size `G` a correct response is kept with probability
`1 - q^(G-1)`, an incorrect one with `1 - (1-q)^(G-1)`. Their ratio

    beta(q) = (1 - q^(G-1)) / (1 - (1-q)^(G-1))

is how much more incorrect responses are amplified than correct ones. DAA multiplies the
advantage of every correct response with positive advantage, in an eligible group whose
difficulty estimate `q_hat < hard_threshold`, by
`clamp(beta(q_hat), 1, max_factor)` (balanced) or `clamp((hard_threshold/q_hat)^gamma, 1, max_factor)`
(power). Incorrect responses are never changed; with DAA disabled the advantages are DAPO's.

Difficulty `q_hat`: posterior mean of `q` under a Beta(a0, b0) prior, evaluated on a fixed grid.
- group: `k / G`.
- conditional: likelihood `q^k (1-q)^(G-k) / (1 - (1-q)^G - q^G)` (the group was kept).
- history: conditional times `q^k' (1-q)^(G'-k')` of every earlier completed group of the same
  prompt key (kept or dropped; a dropped all-wrong group contributes `(1-q)^G'`).

Deliberate choice (grid): a uniform midpoint grid `q_j = (j + 1/2) / grid_size`, default 3500
cells. The Beta(1/2, 1/2) prior has an integrable singularity at q = 0 which the k = 1 likelihood
does not cancel (it tends to 1/G), so a uniform grid under-weights the mass near 0 and the
posterior mean converges slowly (~1/sqrt(grid_size)). The numbers in ALGORITHMS section 4
(k=1 of 16: 0.047; after 1/3/6 all-wrong groups: 0.020, 0.0092, 0.0051; factors 1.95, 3.8, 7.8,
13.6) are those of this grid; they are reproduced to the stated digits only for midpoint grids
of about 3400 to 3700 cells. The converged integral gives 0.0461, 0.0195, 0.00876, 0.00477
(factors 1.97, 3.91, 8.08, 14.4), i.e. the documented grid is slightly conservative.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable
from typing import Any

import torch

from megatron_rl.algorithms.options import DAA_DIFFICULTY_MODES, DAA_FACTOR_OPTIONS

logger = logging.getLogger(__name__)

DIFFICULTY_MODES = DAA_DIFFICULTY_MODES
FACTOR_KINDS = tuple(DAA_FACTOR_OPTIONS.names())
"""The registered factors (options: `options.BalancedFactorOptions`, `options.PowerFactorOptions`)."""
DEFAULT_GRID_SIZE = 3500


def balanced_beta(q: float | torch.Tensor, G: int) -> float | torch.Tensor:
    """`beta(q) = (1 - q^(G-1)) / (1 - (1-q)^(G-1))` (ALGORITHMS section 4).

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
    factor: str = "balanced",
    hard_threshold: float = 0.5,
    max_factor: float = 8.0,
    gamma: float = 1.0,
) -> float | torch.Tensor:
    """Amplification factor for correct responses of a group with difficulty `q_hat`.

    Args:
        q_hat: estimated success rate, float or float tensor `[P]`.
        group_size: G, required for `factor="balanced"`.
        factor: `"balanced"` -> `clamp(beta(q_hat), 1, max_factor)`;
            `"power"` -> `clamp((hard_threshold / q_hat) ** gamma, 1, max_factor)`.
        hard_threshold: groups with `q_hat >= hard_threshold` get factor 1.
        max_factor: cap (>= 1).
        gamma: exponent of the power factor (> 0).

    Returns:
        Same type as `q_hat` (float64 tensor for tensor input), values in `[1, max_factor]`.

    Raises:
        ValueError: unknown `factor`, `max_factor < 1`, `gamma <= 0`, `hard_threshold` outside
        (0, 1], or a missing `group_size` for the balanced factor.
    """
    if factor not in FACTOR_KINDS:
        raise ValueError(f"daa.factor must be one of {FACTOR_KINDS}, got {factor!r}")
    if not max_factor >= 1.0:
        raise ValueError(f"daa.max_factor must be >= 1, got {max_factor}")
    if not gamma > 0:
        raise ValueError(f"daa.gamma must be > 0, got {gamma}")
    if not 0.0 < hard_threshold <= 1.0:
        raise ValueError(f"daa.hard_threshold must be in (0, 1], got {hard_threshold}")
    as_float = not isinstance(q_hat, torch.Tensor)
    q = torch.as_tensor(q_hat, dtype=torch.float64)
    if factor == "balanced":
        if group_size is None:
            raise ValueError("daa.factor='balanced' needs group_size (rollout.n)")
        raw = balanced_beta(q, group_size)
    else:
        raw = (hard_threshold / q) ** gamma  # q = 0 gives inf, capped below
    f = torch.where(q < hard_threshold, raw.clamp(min=1.0, max=max_factor), torch.ones_like(q))
    return float(f) if as_float else f


class DifficultyTracker:
    """Per-prompt posterior of the success rate, part of the training state (saved, resumed).

    Stores, per `prompt_key`, the total correct and incorrect counts of every completed group
    recorded so far (kept or dropped by dynamic sampling); the product of their likelihoods
    `q^k (1-q)^(G-k)` only depends on these sums. Call `estimate` for a group before `record`ing
    it, otherwise the group counts twice.

    Args:
        a0, b0: Beta prior (default Jeffreys, 0.5/0.5), both > 0.
        grid_size: number of uniform midpoint cells on (0, 1); see the module docstring for
            why the default is 3500.
    """

    def __init__(self, a0: float = 0.5, b0: float = 0.5, grid_size: int = DEFAULT_GRID_SIZE) -> None:
        if not (a0 > 0 and b0 > 0):
            raise ValueError(f"Beta prior needs a0 > 0 and b0 > 0, got a0={a0}, b0={b0}")
        if grid_size < 2:
            raise ValueError(f"grid_size must be >= 2, got {grid_size}")
        self.a0, self.b0, self.grid_size = float(a0), float(b0), int(grid_size)
        self._counts: dict[str, list[int]] = {}
        self._build_grid()

    def _build_grid(self) -> None:
        q = (torch.arange(self.grid_size, dtype=torch.float64) + 0.5) / self.grid_size  # (Q,)
        self._q = q
        self._log_q = torch.log(q)
        self._log_1mq = torch.log1p(-q)
        self._log_prior = (self.a0 - 1) * self._log_q + (self.b0 - 1) * self._log_1mq

    @staticmethod
    def _key(prompt_key: Hashable) -> str:
        return prompt_key if isinstance(prompt_key, str) else repr(prompt_key)

    def history(self, prompt_key: Hashable) -> tuple[int, int]:
        """`(correct, incorrect)` totals recorded for `prompt_key` (0, 0 if never seen)."""
        c = self._counts.get(self._key(prompt_key))
        return (c[0], c[1]) if c else (0, 0)

    def estimate(self, prompt_key: Hashable, k: int, G: int, mode: str = "history") -> float:
        """Difficulty estimate `q_hat` for a kept group with `k` correct out of `G`.

        Args:
            prompt_key: stable prompt identity (dataset name + row index); str or hashable
                (non-str keys are stored by `repr`).
            k: number of correct responses, `1 <= k <= G-1` (an eligible, mixed group).
            G: number of responses in the group.
            mode: `group`, `conditional` or `history` (ALGORITHMS section 4).

        Returns:
            Posterior mean of q (float). Raises `ValueError` for an unknown mode or k outside
            [1, G-1].
        """
        if mode not in DIFFICULTY_MODES:
            raise ValueError(f"daa.difficulty must be one of {DIFFICULTY_MODES}, got {mode!r}")
        if G < 2 or not 1 <= k <= G - 1:
            raise ValueError(f"estimate needs a mixed group, 1 <= k <= G-1; got k={k}, G={G}")
        if mode == "group":
            return k / G
        lq, l1q = self._log_q, self._log_1mq
        # log of the selection probability 1 - (1-q)^G - q^G, stable for q near 0 and 1
        keep = -torch.expm1(G * l1q) - torch.exp(G * lq)
        loglik = k * lq + (G - k) * l1q - torch.log(keep)
        if mode == "history":
            succ, fail = self.history(prompt_key)
            loglik = loglik + succ * lq + fail * l1q
        logw = loglik + self._log_prior
        w = torch.softmax(logw, dim=0)
        return float((w * self._q).sum())

    def record(self, prompt_key: Hashable, k: int, G: int) -> None:
        """Record a completed group (kept or dropped) with `k` correct out of `G` valid responses.

        Aborted or partial groups must not be recorded. A group with no valid response (G = 0:
        every reward call failed or timed out) carries no evidence and is a no-op.
        Raises `ValueError` unless 0 <= k <= G.
        """
        if G < 0 or not 0 <= k <= G:
            raise ValueError(f"record needs 0 <= k <= G; got k={k}, G={G}")
        if G == 0:
            return
        c = self._counts.setdefault(self._key(prompt_key), [0, 0])
        c[0] += int(k)
        c[1] += int(G - k)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: prior, grid size and per-key `[correct, incorrect]` totals."""
        return {
            "a0": self.a0,
            "b0": self.b0,
            "grid_size": self.grid_size,
            "counts": {k: list(v) for k, v in self._counts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output (replaces the current state)."""
        self.a0, self.b0, self.grid_size = float(state["a0"]), float(state["b0"]), int(state["grid_size"])
        self._counts = {str(k): [int(v[0]), int(v[1])] for k, v in state["counts"].items()}
        self._build_grid()

    def __len__(self) -> int:
        return len(self._counts)


def apply_daa(
    advantages: torch.Tensor,
    correct: torch.Tensor,
    group_index: torch.Tensor,
    q_hat: torch.Tensor,
    eligible: torch.Tensor,
    *,
    factor: str = "balanced",
    hard_threshold: float = 0.5,
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
        factor, hard_threshold, max_factor, gamma: see `daa_factor`.
        group_size: G for the balanced factor: an int, a `[P]` tensor, or None to use the
            number of rows of each group in `group_index`.

    Returns:
        `(advantages [N] same dtype, stats)`; only rows with `correct & advantage > 0` in an
        eligible group with `q_hat < hard_threshold` change. `stats`: `amplified_frac` = share of
        the N rows whose advantage was multiplied by a factor > 1; `factor_mean` = mean factor
        over those rows (1.0 if none).
    """
    n = advantages.shape[0]
    if correct.shape != (n,) or group_index.shape != (n,):
        raise ValueError("advantages, correct and group_index must all be [N]")
    p = q_hat.shape[0]
    if eligible.shape != (p,):
        raise ValueError(f"eligible must be [P]=[{p}], got {tuple(eligible.shape)}")
    dev = advantages.device
    q = q_hat.detach().to(device=dev, dtype=torch.float64)
    if factor == "balanced":
        if group_size is None:
            gs = torch.bincount(group_index.to(dev), minlength=p)[:p]
        else:
            gs = torch.as_tensor(group_size, device=dev).expand(p)
        f = torch.ones(p, dtype=torch.float64, device=dev)
        for g in torch.unique(gs).tolist():
            sel = gs == g
            if g >= 2:
                f[sel] = daa_factor(q[sel], group_size=int(g), factor=factor, hard_threshold=hard_threshold,
                                    max_factor=max_factor, gamma=gamma)
    else:
        f = daa_factor(q, factor=factor, hard_threshold=hard_threshold, max_factor=max_factor, gamma=gamma)
    f = torch.where(eligible.to(dev), f, torch.ones_like(f))
    row_f = f[group_index.to(dev)]
    amplify = correct.to(dev).bool() & (advantages > 0) & (row_f > 1.0)
    out = torch.where(amplify, (advantages.to(torch.float64) * row_f).to(advantages.dtype), advantages)
    n_amp = int(amplify.sum())
    stats = {
        "amplified_frac": n_amp / n if n else 0.0,
        "factor_mean": float(row_f[amplify].mean()) if n_amp else 1.0,
    }
    return out, stats
