"""Names and options of every algorithm variant, importable without torch (the config's choices).

Each policy loss, advantage estimator and DAA factor registers here, by name, a small kw_only
dataclass of its options: field names are the config keys (`actor.gspo_clip_low`, verl's names
where verl has one) and, for the policy losses, the keyword arguments of the implementation, so
`fn(..., **options_of(GSPOOptions, cfg.actor))` needs no hand-written mapping. An entry also
declares what the rest of the code needs to know about it (`EstimatorSpec.needs_response_mask`,
`group_relative`, `daa`), so no caller switches on a name.

Why a torch-free module beside the implementations rather than the dataclasses inside them:
`megatron_rl.config` lists the allowed names and checks the options at load time without torch
(DESIGN.md Layout; `--dry-run` on a laptop), and `losses.py`, `advantages.py`, `daa.py` import
torch at the top. The implementations register their functions under the same names in their own
registries (`POLICY_LOSSES`, `ADV_ESTIMATORS`), check at import that the two sets agree, and
`tests/unit/test_registries.py` pins both. Adding a policy loss = its options here + its function
in `losses.py` + the pinned names; the schema, the trainer and the loop pick it up by name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from megatron_rl.errors import ConfigError
from megatron_rl.registry import Registry


def check_choice(key: str, value: Any, allowed) -> None:
    """Raise `ConfigError` naming `key` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(
            f"{key}: {value!r} is not allowed; choose one of "
            f"{', '.join('null' if a is None else repr(a) for a in allowed)}"
        )


def check_positive(key: str, value: Any, *, allow_zero: bool = False) -> None:
    """Raise `ConfigError` naming `key` unless `value` is None or a finite number > 0 (>= 0)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} must be a finite number")
    if (value < 0) if allow_zero else (value <= 0):
        raise ConfigError(f"{key}: {value!r} must be {'>= 0' if allow_zero else '> 0'}")


class Options:
    """Base of every options dataclass. `__post_init__` runs the `_check` of each class in the
    MRO once, so a config section built from several options classes checks all of them."""

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)


def options_of(options_cls: type, section: Any) -> dict[str, Any]:
    """The fields of `options_cls` read from a config section that holds them (e.g. `cfg.actor`):
    the keyword arguments of the registered implementation."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(options_cls)}


def option_bases(*classes: type) -> tuple[type, ...]:
    """`classes` without duplicates and without classes another one already derives from, in
    order: the bases of a config section that carries the options of every registered entry."""
    unique = list(dict.fromkeys(classes))
    return tuple(c for c in unique if not any(o is not c and issubclass(o, c) for o in unique))


# ---- policy losses (implementations: losses.py) -----------------------------------------------

POLICY_LOSS_OPTIONS: Registry[type] = Registry("policy loss")
"""`actor.policy_loss` name -> options dataclass (its fields are the loss function's keywords)."""


@POLICY_LOSS_OPTIONS.register("vanilla")
@dataclass(kw_only=True)
class VanillaOptions(Options):
    """Decoupled PPO clip with dual clip (arXiv 1707.06347, 2503.14476, 1912.09729)."""

    clip_ratio_low: float = 0.2
    """eps_low of the PPO clip: token ratios below 1 - clip_ratio_low are clipped; in (0, 1).
    Default 0.2. verl: `actor_rollout_ref.actor.clip_ratio_low`."""
    clip_ratio_high: float = 0.2
    """eps_high of the PPO clip: token ratios above 1 + clip_ratio_high are clipped; > 0. Default 0.2;
    DAPO's clip-higher uses 0.28. verl: `actor_rollout_ref.actor.clip_ratio_high`."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound c: where the advantage A < 0 the token loss is capped at -c*A; must be > 1.
    Default 3.0. verl: `actor_rollout_ref.actor.clip_ratio_c`."""

    def _check(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ConfigError(f"actor.clip_ratio_c: {self.clip_ratio_c!r} must be > 1 (dual-clip)")
        check_positive("actor.clip_ratio_low", self.clip_ratio_low)
        if self.clip_ratio_low >= 1.0:  # 1 - eps_low <= 0 would clip nothing from below
            raise ConfigError(f"actor.clip_ratio_low: {self.clip_ratio_low!r} must be in (0, 1)")
        check_positive("actor.clip_ratio_high", self.clip_ratio_high)


@POLICY_LOSS_OPTIONS.register("gspo")
@dataclass(kw_only=True)
class GSPOOptions(Options):
    """GSPO, sequence-level ratio (arXiv 2507.18071); defined with `seq-mean-token-mean`."""

    gspo_clip_low: float = 3e-4
    """Lower clip of GSPO's sequence ratio: ratios below 1 - gspo_clip_low are clipped; > 0.
    Default 3e-4 (the paper's). verl reuses `clip_ratio_low` for GSPO; here it has its own key."""
    gspo_clip_high: float = 4e-4
    """Upper clip of GSPO's sequence ratio: ratios above 1 + gspo_clip_high are clipped; > 0.
    Default 4e-4 (the paper's). verl reuses `clip_ratio_high` for GSPO; here it has its own key."""

    def _check(self) -> None:
        check_positive("actor.gspo_clip_low", self.gspo_clip_low)
        check_positive("actor.gspo_clip_high", self.gspo_clip_high)


@POLICY_LOSS_OPTIONS.register("cispo")
@dataclass(kw_only=True)
class CISPOOptions(Options):
    """CISPO, clipped importance-sampling weights (MiniMax-M1, arXiv 2506.13585)."""

    cispo_clip_low: Optional[float] = None
    """eps_low of CISPO: the detached importance weight is raised to at least 1 - cispo_clip_low;
    None (default, as the paper) = no lower bound. No verl name."""
    cispo_clip_high: float = 0.28
    """eps_high of CISPO: the detached importance weight is capped at 1 + cispo_clip_high; > 0.
    Default 0.28. No verl name."""

    def _check(self) -> None:
        check_positive("actor.cispo_clip_high", self.cispo_clip_high)


LOSS_AGG_MODE_NAMES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""`actor.loss_agg_mode` names (implementations: aggregation.py's `LOSS_AGG_MODES`)."""

KL_TYPE_NAMES = ("k1", "k2", "k3", "low_var_kl")
"""`actor.kl_loss_type` names (implementation: kl.py's `kl_penalty`; `low_var_kl` = `k3`)."""


# ---- advantage estimators (implementations: advantages.py) ------------------------------------


@dataclass(kw_only=True)
class GroupStdOptions(Options):
    """Options of an estimator that divides by a standard deviation."""

    grpo_std: str = "unbiased"
    """Variance convention of every std the estimator takes (GRPO's group std, REINFORCE++'s
    whitening): `unbiased` (Bessel, n - 1, as verl; default) | `population` (n)."""

    def _check(self) -> None:
        check_choice("algorithm.grpo_std", self.grpo_std, ("unbiased", "population"))


@dataclass(kw_only=True)
class GRPOOptions(GroupStdOptions):
    """GRPO (DeepSeekMath, arXiv 2402.03300); without std normalisation Dr. GRPO (arXiv 2503.20783)."""

    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO's centred rewards by the group std (default true). False + `actor.loss_agg_mode`
    seq-mean-token-sum-norm = Dr. GRPO. verl: `algorithm.norm_adv_by_std_in_grpo`."""


@dataclass(kw_only=True)
class RLOOOptions(Options):
    """RLOO (arXiv 2402.14740): leave-one-out mean baseline; no options."""


@dataclass(kw_only=True)
class ReinforcePlusPlusBaselineOptions(GroupStdOptions):
    """REINFORCE++ with a group-mean baseline and batch token whitening (arXiv 2501.03262)."""


@dataclass(frozen=True)
class EstimatorSpec:
    """What the rest of the code needs to know about an advantage estimator.

    Attributes:
        options: its options dataclass (fields live in `algorithm.*`).
        group_relative: it compares the responses of one prompt, so it needs `rollout.n >= 2`.
        needs_response_mask: it takes `response_mask [N, S]` (True = generated token).
        daa: DA3PO's amplification applies to its advantages (positive = better than the group).
    """

    options: type
    group_relative: bool
    needs_response_mask: bool = False
    daa: bool = False


ADV_ESTIMATOR_SPECS: Registry[EstimatorSpec] = Registry("advantage estimator")
"""`algorithm.adv_estimator` name -> `EstimatorSpec`."""
ADV_ESTIMATOR_SPECS.register("grpo")(EstimatorSpec(GRPOOptions, group_relative=True, daa=True))
ADV_ESTIMATOR_SPECS.register("rloo")(EstimatorSpec(RLOOOptions, group_relative=True, daa=True))
ADV_ESTIMATOR_SPECS.register("reinforce_plus_plus_baseline")(
    EstimatorSpec(ReinforcePlusPlusBaselineOptions, group_relative=True, needs_response_mask=True)
)


def check_group_size(*, rollout_n: int, adv_estimator: str | None = None, filter_groups: bool = False) -> None:
    """The one group-size check (config load, `advantages.check_group_size`,
    `dynamic_sampling.validate_dynamic_sampling`): dynamic sampling and a group-relative estimator
    both need at least 2 responses a prompt (CASES B02/B11). Raises `ConfigError` naming `rollout.n`."""
    if rollout_n >= 2:
        return
    if filter_groups:
        raise ConfigError(
            f"rollout.n ({rollout_n}) must be >= 2 with algorithm.filter_groups.enable=true: every group of "
            f"{rollout_n} response(s) has zero std, so no group would ever be kept; raise rollout.n or disable "
            "filtering"
        )
    if adv_estimator is not None and ADV_ESTIMATOR_SPECS.get(adv_estimator).group_relative:
        raise ConfigError(
            f"rollout.n ({rollout_n}) must be >= 2 for the group-relative estimator algorithm.adv_estimator="
            f"{adv_estimator!r} (it compares the responses of one prompt; with one every advantage is 0)"
        )


# ---- DA3PO amplification factors (implementation: daa.py) --------------------------------------


@dataclass(kw_only=True)
class DAAFactorOptions(Options):
    """Options every DAA factor shares: which groups count as hard."""

    hard_threshold: float = 0.5
    """tau: kept groups whose estimated success rate q_hat is below this are amplified; in (0, 1].
    Default 0.5 (the paper's, as reported)."""

    def _check(self) -> None:
        if not 0.0 < self.hard_threshold <= 1.0:
            raise ConfigError(f"algorithm.daa.hard_threshold: {self.hard_threshold!r} must be in (0, 1]")


@dataclass(kw_only=True)
class ConstantFactorOptions(DAAFactorOptions):
    """The DA3PO paper's rule as reported by summaries of the paper (ALGORITHMS.md section 4.1):
    every correct response with A > 0 in a kept hard group gets `A *= amplification`."""

    amplification: float = 2.0
    """lambda of `factor: constant`: the factor of correct responses' positive advantages in hard
    groups; >= 1 (1 = DAPO). Default 2.0 (reported best at G = 16). Not capped by max_factor."""

    def _check(self) -> None:
        if not (isinstance(self.amplification, (int, float)) and math.isfinite(self.amplification)
                and self.amplification >= 1.0):
            raise ConfigError(f"algorithm.daa.amplification: {self.amplification!r} must be a finite number >= 1")


@dataclass(kw_only=True)
class CappedFactorOptions(DAAFactorOptions):
    """Options of a factor that depends on q_hat (our extension, section 4.2): its cap."""

    max_factor: float = 8.0
    """Cap of the balanced and power factors; >= 1. Default 8.0."""

    def _check(self) -> None:
        if self.max_factor < 1.0:
            raise ConfigError(f"algorithm.daa.max_factor: {self.max_factor!r} must be >= 1")


@dataclass(kw_only=True)
class BalancedFactorOptions(CappedFactorOptions):
    """`clamp(beta(q_hat), 1, max_factor)`, beta from the group size (ALGORITHMS.md section 4.2)."""


@dataclass(kw_only=True)
class PowerFactorOptions(CappedFactorOptions):
    """`clamp((hard_threshold / q_hat) ** gamma, 1, max_factor)` (ALGORITHMS.md section 4.2)."""

    gamma: float = 1.0
    """Exponent of the power factor; > 0. Default 1.0 (used only with `factor: power`)."""

    def _check(self) -> None:
        check_positive("algorithm.daa.gamma", self.gamma)


DAA_FACTOR_OPTIONS: Registry[type] = Registry("DAA factor")
"""`algorithm.daa.factor` name -> options dataclass (keywords of `daa.daa_factor`)."""
DAA_FACTOR_OPTIONS.register("constant")(ConstantFactorOptions)
DAA_FACTOR_OPTIONS.register("balanced")(BalancedFactorOptions)
DAA_FACTOR_OPTIONS.register("power")(PowerFactorOptions)

DAA_DIFFICULTY_MODES = ("group", "posterior", "history")
"""`algorithm.daa.difficulty` names (daa.py's `DifficultyTracker.estimate`, ALGORITHMS.md 4.3)."""

CONDITIONAL_REMOVED = (
    "algorithm.daa.difficulty: 'conditional' was removed: it divided the likelihood of a kept group by "
    "the keep probability 1 - (1-q)^G - q^G, but keeping a group depends only on k, so P(q | k, kept) = "
    "P(q | k); the division counted the selection twice and biased q_hat about 2x low (k = 1 of 16 gave "
    "0.047 where the posterior mean is 1.5/17 = 0.088). Use 'posterior' (the mean of "
    "Beta(a0 + k, b0 + G - k)) or 'history' (ALGORITHMS.md section 4.3)"
)
"""The error for `difficulty: conditional` (config load and `DifficultyTracker.estimate`)."""


# ---- off-policy correction (implementations: rollout_correction.py) ----------------------------


@dataclass(kw_only=True)
class NoCorrectionOptions(Options):
    """`mode: none`: no correction (ablations); no options."""


@dataclass(kw_only=True)
class TISCapOptions(Options):
    """Options of the truncated importance-sampling modes (`token_tis`, `seq_tis`)."""

    tis_cap: Optional[float] = None
    """Cap C of the behaviour weight in `token_tis` (`min(w_t, C)`) and `seq_tis`
    (`min(exp(sum_t log w_t), C)`); > 0. None (default) = `actor.tis.clip` (2.0 unless set), so
    section 5's `actor.tis` and `token_tis` share one cap. verl: `algorithm.rollout_correction.rollout_is_threshold`."""

    def _check(self) -> None:
        check_positive("algorithm.rollout_correction.tis_cap", self.tis_cap)


@dataclass(kw_only=True)
class MaskOptions(Options):
    """Options of `mode: mask` (rejection: verl's `rollout_rs`, icepop's idea)."""

    mask_low: Optional[float] = None
    """Lower bound of the kept band of the behaviour weight w_t: tokens (samples, with
    `level: sequence`) with a w_t below it get loss mask 0; in [0, 1). None (default) =
    1 / mask_high (verl's rule). verl: `algorithm.rollout_correction.rollout_rs_threshold_lower`."""
    mask_high: float = 2.0
    """Upper bound of the kept band of w_t: tokens (samples) with a w_t above it get loss mask 0;
    > 1. Default 2.0. verl: `algorithm.rollout_correction.rollout_rs_threshold`."""
    level: str = "token"
    """token (default): each token whose w_t leaves [mask_low, mask_high] is masked | sequence: a
    sample with any such token is masked whole. verl: `rollout_rs: token` (verl's `sequence` tests
    the product of the weights instead and has no alias here)."""

    def _check(self) -> None:
        check_choice("algorithm.rollout_correction.level", self.level, ("token", "sequence"))
        if not (isinstance(self.mask_high, (int, float)) and math.isfinite(self.mask_high) and self.mask_high > 1.0):
            raise ConfigError(f"algorithm.rollout_correction.mask_high: {self.mask_high!r} must be a finite number > 1")
        if self.mask_low is not None and not (isinstance(self.mask_low, (int, float)) and 0.0 <= self.mask_low < 1.0):
            raise ConfigError(f"algorithm.rollout_correction.mask_low: {self.mask_low!r} must be in [0, 1) or null "
                              "(null = 1 / mask_high)")


ROLLOUT_CORRECTION_OPTIONS: Registry[type] = Registry("rollout correction")
"""`algorithm.rollout_correction.mode` name -> options dataclass (keywords of the implementation in
`rollout_correction.ROLLOUT_CORRECTIONS`); `auto` is resolved by `resolve_rollout_correction`."""
ROLLOUT_CORRECTION_OPTIONS.register("none")(NoCorrectionOptions)
ROLLOUT_CORRECTION_OPTIONS.register("token_tis")(TISCapOptions)
ROLLOUT_CORRECTION_OPTIONS.register("seq_tis")(TISCapOptions)
ROLLOUT_CORRECTION_OPTIONS.register("mask")(MaskOptions)

OLD_LOGPROB_SOURCES = ("recompute", "rollout")
"""`actor.old_logprob_source` names (`PolicyTrainer.old_logprobs`)."""


@dataclass(frozen=True)
class ResolvedCorrection:
    """The correction a run applies: `mode` (never `auto`) and the keyword arguments of its
    implementation (`rollout_correction.ROLLOUT_CORRECTIONS.get(mode)`), every value set."""

    mode: str
    options: dict


def resolve_rollout_correction(section: Any, *, tis_enable: bool, tis_clip: float,
                               max_staleness: int = 0) -> ResolvedCorrection:
    """`algorithm.rollout_correction` with `mode: auto` and the unset options resolved (ALGORITHMS.md 8).

    `auto` (the default) = `token_tis` with cap `actor.tis.clip` when `actor.tis.enable` (section 5's
    TIS is the eta = 0 case of token_tis), else `token_tis` when eta = `trainer.max_staleness` > 0
    (section 8's default), else `none`: with nothing set, today's behaviour exactly. `tis_cap` unset
    = `actor.tis.clip`; `mask_low` unset = 1 / `mask_high`.

    Args:
        section: the `algorithm.rollout_correction` section (`mode` and the options' fields).
        tis_enable, tis_clip: `actor.tis.enable`, `actor.tis.clip`.
        max_staleness: eta (0 = synchronous).

    Raises:
        ConfigError: `actor.tis.enable` with a mode other than auto/token_tis, or with a `tis_cap`
            that differs from `actor.tis.clip` (both keys named).
    """
    mode = section.mode
    if tis_enable:
        if mode not in ("auto", "token_tis"):
            raise ConfigError(
                f"actor.tis.enable=true is the eta = 0 case of algorithm.rollout_correction.mode=token_tis and "
                f"conflicts with algorithm.rollout_correction.mode={mode!r}: drop actor.tis.enable or set the mode "
                "to auto or token_tis")
        if section.tis_cap is not None and section.tis_cap != tis_clip:
            raise ConfigError(
                f"algorithm.rollout_correction.tis_cap ({section.tis_cap}) and actor.tis.clip ({tis_clip}) are the "
                "same cap with actor.tis.enable=true and disagree: set one (or drop actor.tis.enable and use "
                "algorithm.rollout_correction.mode=token_tis)")
        mode = "token_tis"
    elif mode == "auto":
        mode = "token_tis" if max_staleness > 0 else "none"
    values = {"tis_cap": tis_clip if section.tis_cap is None else section.tis_cap, "mask_high": section.mask_high,
              "mask_low": 1.0 / section.mask_high if section.mask_low is None else section.mask_low,
              "level": section.level}
    fields = [f.name for f in dataclasses.fields(ROLLOUT_CORRECTION_OPTIONS.get(mode))]
    return ResolvedCorrection(mode=mode, options={name: values[name] for name in fields})
