"""Off-policy correction (ALGORITHMS.md section 8): token_tis, seq_tis, mask, none; actor.tis as
token_tis at eta = 0; actor.old_logprob_source; the config keys, their checks and verl's aliases.

The worked example (B = 2, S = 4; nats), used throughout:

    prox (old_logprobs)     [[-1.0, -0.5, -2.0, 0.0], [-0.5, -0.7, 0.0, 0.0]]
    behav (rollout_logprobs)[[-1.0, -1.5, -1.5, 50.], [-1.0, -1.0, 50., 50.]]
    mask                    [[  T,    T,    T,   F ], [  T,    T,   F,   F ]]

    log w = prox - behav on valid tokens: row 0 [0, 1, -0.5], row 1 [0.5, 0.3]
    w = exp(log w):  row 0 [1, 2.7182818, 0.6065307], row 1 [1.6487213, 1.3498588]
    (masked positions hold 50 - 0 = -50 log w: if used, exp(-50) ~ 0 or exp(50) overflows the clamp)
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.losses import POLICY_LOSSES
from megatron_rl.algorithms.options import ResolvedCorrection, resolve_rollout_correction
from megatron_rl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, rollout_correction, tis_weights
from megatron_rl.config import load_config, validate_config
from megatron_rl.config.schema import ActorConfig, RolloutCorrectionConfig, TISConfig
from megatron_rl.config.validate import rollout_correction_of
from megatron_rl.errors import ConfigError
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.policy import PolicyTrainer

BASE = ["model.path=/models/x"]
E1, W2, W3 = math.e, 0.6065307, 1.6487213  # exp(1), exp(-0.5), exp(0.5)
W5 = 1.3498588  # exp(0.3)


def _example():
    prox = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.5, -0.7, 0.0, 0.0]])
    behav = torch.tensor([[-1.0, -1.5, -1.5, 50.0], [-1.0, -1.0, 50.0, 50.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    return prox, behav, mask


def _close(t: torch.Tensor, expected) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the four modes, by hand
def test_token_tis_hand_values():
    prox, behav, mask = _example()
    c = rollout_correction(prox, behav, mask, "token_tis", tis_cap=2.0)
    # min(w, 2): row 0 [1, 2 (e truncated), 0.6065307], row 1 [1.6487213, 1.3498588]; 0 where masked
    _close(c.weights, [[1.0, 2.0, W2, 0.0], [W3, W5, 0.0, 0.0]])
    assert torch.equal(c.loss_mask, mask)
    # 5 valid tokens; w sum 1 + 2.7182818 + 0.6065307 + 1.6487213 + 1.3498588 = 7.3233926;
    # applied 1 + 2 + 0.6065307 + 1.6487213 + 1.3498588 = 6.6051108; 1 truncated
    assert c.sums["valid"].item() == 5
    assert c.sums["behav_weight"].item() == pytest.approx(7.3233926, abs=1e-5)
    assert c.sums["is_weight"].item() == pytest.approx(6.6051108, abs=1e-5)
    assert c.sums["truncated"].item() == 1


def test_seq_tis_hand_values():
    prox, behav, mask = _example()
    c = rollout_correction(prox, behav, mask, "seq_tis", tis_cap=2.0)
    # row 0: sum log w = 0 + 1 - 0.5 = 0.5 -> exp = 1.6487213 (< 2) on its 3 tokens;
    # row 1: 0.5 + 0.3 = 0.8 -> exp = 2.2255409 -> capped to 2 on its 2 tokens
    _close(c.weights, [[W3, W3, W3, 0.0], [2.0, 2.0, 0.0, 0.0]])
    assert torch.equal(c.loss_mask, mask)
    # applied sum 3 * 1.6487213 + 2 * 2 = 8.9461639; truncated tokens: row 1's 2
    assert c.sums["is_weight"].item() == pytest.approx(8.9461639, abs=1e-5)
    assert c.sums["truncated"].item() == 2


def test_mask_token_and_sequence_levels_hand_values():
    prox, behav, mask = _example()
    # [0.5, 2]: only row 0's e = 2.718 leaves the band
    c = rollout_correction(prox, behav, mask, "mask", mask_low=0.5, mask_high=2.0, level="token")
    assert c.weights is None
    assert c.loss_mask.tolist() == [[True, False, True, False], [True, True, False, False]]
    assert c.sums["masked"].item() == 1 and c.sums["valid"].item() == 5
    # [0.7, 2]: 0.6065 < 0.7 leaves too
    c = rollout_correction(prox, behav, mask, "mask", mask_low=0.7, mask_high=2.0, level="token")
    assert c.loss_mask.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert c.sums["masked"].item() == 2
    # mask_low unset = 1 / 1.5 = 0.6667: row 0's 2.718 and 0.6065, row 1's 1.6487 leave
    c = rollout_correction(prox, behav, mask, "mask", mask_low=None, mask_high=1.5, level="token")
    assert c.loss_mask.tolist() == [[True, False, False, False], [False, True, False, False]]
    assert c.sums["masked"].item() == 3
    # level sequence, [0.5, 2]: row 0 holds a token outside, so all 3 of its tokens go; row 1 stays
    c = rollout_correction(prox, behav, mask, "mask", mask_low=0.5, mask_high=2.0, level="sequence")
    assert c.loss_mask.tolist() == [[False, False, False, False], [True, True, False, False]]
    assert c.sums["masked"].item() == 3


def test_none_changes_nothing():
    prox, behav, mask = _example()
    c = rollout_correction(prox, behav, mask, "none")
    assert c.weights is None and torch.equal(c.loss_mask, mask) and set(c.sums) == {"valid", "nonfinite", "behav_weight"}


def test_registered_modes_and_bad_options():
    assert ROLLOUT_CORRECTIONS.names() == ["mask", "none", "seq_tis", "token_tis"]
    prox, behav, mask = _example()
    with pytest.raises(ValueError, match="tis_cap"):
        rollout_correction(prox, behav, mask, "token_tis", tis_cap=0.0)
    with pytest.raises(ValueError, match="mask_low < 1 < mask_high"):
        rollout_correction(prox, behav, mask, "mask", mask_low=0.5, mask_high=1.0)
    with pytest.raises(TypeError):
        rollout_correction(prox, behav, mask, "token_tis", tis_cap=2.0, mask_high=3.0)
    with pytest.raises(KeyError, match="valid names"):
        rollout_correction(prox, behav, mask, "auto")


def test_weights_carry_no_gradient():
    prox, behav, mask = _example()
    prox.requires_grad_(True)
    behav.requires_grad_(True)
    for mode, opts in (("token_tis", {"tis_cap": 2.0}), ("seq_tis", {"tis_cap": 2.0})):
        c = rollout_correction(prox, behav, mask, mode, **opts)
        assert not c.weights.requires_grad
    # the weighted loss: logp = prox (ratio 1), A = 1, vanilla -> pg = -1 a token; d(pg * w)/dlogp = -w
    logp = prox.detach().clone().requires_grad_(True)
    w = rollout_correction(prox, behav, mask, "token_tis", tis_cap=2.0).weights
    out = POLICY_LOSSES.get("vanilla")(logp, prox, torch.ones(2), mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    (out.token_loss * w).sum().backward()
    _close(logp.grad, [[-1.0, -2.0, -W2, 0.0], [-W3, -W5, 0.0, 0.0]])
    assert prox.grad is None and behav.grad is None


@pytest.mark.parametrize("mode,opts", [("token_tis", {"tis_cap": 2.0}), ("seq_tis", {"tis_cap": 2.0}),
                                       ("mask", {"mask_low": 0.5, "mask_high": 2.0, "level": "sequence"}),
                                       ("mask", {"mask_low": 0.5, "mask_high": 2.0, "level": "token"}),
                                       ("none", {})])
def test_padding_never_gives_nan_or_inf(mode, opts):
    """NaN, +-inf and huge values at masked positions, extreme but finite gaps at valid ones."""
    prox = torch.tensor([[-1e4, float("nan"), 0.0], [-0.1, float("inf"), -1e30]])
    behav = torch.tensor([[0.0, 1.0, float("-inf")], [-1e4, float("nan"), 1e30]])
    mask = torch.tensor([[True, False, False], [True, False, False]])
    c = rollout_correction(prox, behav, mask, mode, **opts)
    if c.weights is not None:
        assert torch.isfinite(c.weights).all() and (c.weights[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in c.sums.values())
    assert not (c.loss_mask & ~mask).any()
    # log w clamped to [-20, 20]: row 0 exp(-20), row 1 exp(20)
    assert c.sums["behav_weight"].item() == pytest.approx(math.exp(-20) + math.exp(20), rel=1e-6)


def test_tis_weights_is_token_tis():
    prox, behav, mask = _example()
    w, stats = tis_weights(prox, behav, mask, clip=2.0)
    assert torch.equal(w, rollout_correction(prox, behav, mask, "token_tis", tis_cap=2.0).weights)
    assert stats["tis/raw_ratio_mean"].item() == pytest.approx(7.3233926 / 5, abs=1e-6)
    assert stats["tis/weight_mean"].item() == pytest.approx(6.6051108 / 5, abs=1e-6)


# ---------------------------------------------------------------- the trainer's loss function
def _trainer(actor: ActorConfig, correction: ResolvedCorrection | None = None) -> PolicyTrainer:
    return PolicyTrainer(None, None, None, vocab_size=7, micro_batch_size=4, actor=actor, rollout_correction=correction)


def _micro_batch(log_w: torch.Tensor, mask: torch.Tensor, *, seed: int = 0):
    """Logits, and a micro-batch whose old log-probs are exactly the logits' (ratio 1) and whose
    rollout log-probs are `old - log_w` (so the behaviour weights are exp(log_w))."""
    g = torch.Generator().manual_seed(seed)
    b, s = mask.shape
    logits = torch.randn(b, s, 7, generator=g)
    labels = torch.randint(7, (b, s), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    mb = TrainBatch(input_ids=labels, position_ids=torch.arange(s).expand(b, s), labels=labels, loss_mask=mask,
                    advantages=torch.ones(b), rollout_logprobs=old - log_w, old_logprobs=old)
    return logits.requires_grad_(True), mb


def _example_log_w():
    _, _, mask = _example()
    return torch.tensor([[0.0, 1.0, -0.5, 0.0], [0.5, 0.3, 0.0, 0.0]]), mask


def test_trainer_token_tis_loss_and_metrics_by_hand():
    log_w, mask = _example_log_w()
    logits, mb = _micro_batch(log_w, mask)
    trainer = _trainer(ActorConfig(), ResolvedCorrection("token_tis", {"tis_cap": 2.0}))
    num, count, sums = trainer._loss_func(mb, logits)
    # ratio 1 and A = 1: pg = -1 a token, times min(w, 2): -(1 + 2 + 0.6065307 + 1.6487213 + 1.3498588)
    assert num.item() == pytest.approx(-6.6051108, abs=1e-5) and count.item() == 5
    rec = trainer._correction_metrics(sums)
    assert rec == pytest.approx({"train/rollout_corr/behav_weight_mean": 7.3233926 / 5,
                                 "train/rollout_corr/rollout_is_mean": 6.6051108 / 5,
                                 "train/rollout_corr/rollout_is_ratio_fraction_high": 0.2,
                                 "train/rollout_corr/nonfinite_fraction": 0.0}, abs=1e-6)


def test_trainer_mask_leaves_the_denominator_like_verl():
    """A rejected token is not trained and not counted: token-mean over the 4 tokens kept."""
    log_w, mask = _example_log_w()
    logits, mb = _micro_batch(log_w, mask)
    trainer = _trainer(ActorConfig(), ResolvedCorrection("mask", {"mask_low": 0.5, "mask_high": 2.0,
                                                                  "level": "token"}))
    num, count, sums = trainer._loss_func(mb, logits)
    assert num.item() == pytest.approx(-4.0, abs=1e-6) and count.item() == 4 and sums["tokens"].item() == 4
    assert trainer._correction_metrics(sums) == pytest.approx(
        {"train/rollout_corr/behav_weight_mean": 7.3233926 / 5, "train/rollout_corr/rollout_is_masked_fraction": 0.2,
         "train/rollout_corr/nonfinite_fraction": 0.0},
        abs=1e-6)
    num.backward()
    assert (logits.grad[0, 1] == 0).all() and (logits.grad[0, 0] != 0).any()  # the rejected token has no gradient
    # seq-mean-token-mean with level sequence: row 0 goes whole, N = 1 sample
    trainer = _trainer(ActorConfig(loss_agg_mode="seq-mean-token-mean"),
                       ResolvedCorrection("mask", {"mask_low": 0.5, "mask_high": 2.0, "level": "sequence"}))
    num, count, _ = trainer._loss_func(mb, logits.detach())
    assert num.item() == pytest.approx(-1.0, abs=1e-6) and count.item() == 1


def test_actor_tis_is_token_tis_bit_for_bit():
    log_w, mask = _example_log_w()
    spec = resolve_rollout_correction(RolloutCorrectionConfig(), tis_enable=True, tis_clip=1.5)
    assert spec == ResolvedCorrection("token_tis", {"tis_cap": 1.5})
    runs = []
    for actor, corr in ((ActorConfig(tis=TISConfig(enable=True, clip=1.5)), None),
                        (ActorConfig(), ResolvedCorrection("token_tis", {"tis_cap": 1.5})),
                        (ActorConfig(), resolve_rollout_correction(RolloutCorrectionConfig(tis_cap=1.5),
                                                                   tis_enable=False, tis_clip=2.0, max_staleness=1))):
        logits, mb = _micro_batch(log_w, mask, seed=3)
        num, count, sums = _trainer(actor, corr)._loss_func(mb, logits)
        num.backward()
        runs.append((num.detach(), count, logits.grad))
    for num, count, grad in runs[1:]:
        assert torch.equal(num, runs[0][0]) and torch.equal(count, runs[0][1]) and torch.equal(grad, runs[0][2])
    # section 5's metric names stay with actor.tis.enable
    trainer = _trainer(ActorConfig(tis=TISConfig(enable=True, clip=1.5)))
    _, _, sums = trainer._loss_func(*reversed(_micro_batch(log_w, mask)))
    rec = trainer._correction_metrics(sums)
    assert rec["train/tis_raw_ratio_mean"] == rec["train/rollout_corr/behav_weight_mean"]
    assert rec["train/tis_weight_mean"] == rec["train/rollout_corr/rollout_is_mean"]


def test_default_trainer_has_no_correction_and_no_new_metrics():
    trainer = _trainer(ActorConfig())
    assert trainer.correction == ResolvedCorrection("none", {})
    log_w, mask = _example_log_w()
    logits, mb = _micro_batch(log_w, mask)
    _, _, sums = trainer._loss_func(mb, logits)
    assert not any(k.startswith("rc_") for k in sums) and trainer._correction_metrics(sums) == {}


def test_old_logprob_source_rollout_skips_the_recompute(monkeypatch):
    log_w, mask = _example_log_w()
    logits, mb = _micro_batch(log_w, mask)
    trainer = _trainer(ActorConfig(old_logprob_source="rollout", clip_ratio_low=0.9, clip_ratio_high=10.0))

    def no_recompute(*args, **kwargs):
        raise AssertionError("compute_logprobs must not run with actor.old_logprob_source=rollout")

    monkeypatch.setattr(trainer, "compute_logprobs", no_recompute)
    mb.old_logprobs = trainer.old_logprobs(mb, mini_batch_sequences=2)
    assert mb.old_logprobs is mb.rollout_logprobs
    # ratio = exp(logp - behav) = exp(log_w): with A = 1 and no clip active in [0.1, 11], pg = -ratio;
    # -(1 + 2.7182818 + 0.6065307 + 1.6487213 + 1.3498588) = -7.3233926
    num, count, sums = trainer._loss_func(mb, logits)
    assert num.item() == pytest.approx(-7.3233926, abs=1e-5) and count.item() == 5
    # approx_kl = old - logp = behav - logp = -log_w: -(0 + 1 - 0.5 + 0.5 + 0.3) = -1.3
    assert sums["approx_kl"].item() == pytest.approx(-1.3, abs=1e-6)
    # recompute (the default) calls compute_logprobs
    trainer = _trainer(ActorConfig())
    monkeypatch.setattr(trainer, "compute_logprobs", lambda batch, mini_batch_sequences=None: "recomputed")
    assert trainer.old_logprobs(mb, mini_batch_sequences=2) == "recomputed"


# ---------------------------------------------------------------- config
def test_resolution_rule():
    assert rollout_correction_of(load_config(None, BASE)) == ResolvedCorrection("none", {})
    cfg = load_config(None, BASE + ["actor.tis.enable=true", "actor.tis.clip=3"])
    assert rollout_correction_of(cfg) == ResolvedCorrection("token_tis", {"tis_cap": 3.0})
    cfg = load_config(None, BASE)
    cfg.trainer.max_staleness = 1  # the asynchronous loop's key, not in this schema yet
    assert rollout_correction_of(cfg) == ResolvedCorrection("token_tis", {"tis_cap": 2.0})
    cfg = load_config(None, BASE + ["algorithm.rollout_correction.mode=mask",
                                    "algorithm.rollout_correction.mask_high=4"])
    assert rollout_correction_of(cfg) == ResolvedCorrection("mask", {"mask_low": 0.25, "mask_high": 4.0,
                                                                     "level": "token"})
    cfg = load_config(None, BASE + ["algorithm.rollout_correction.mode=seq_tis",
                                    "algorithm.rollout_correction.tis_cap=5"])
    assert rollout_correction_of(cfg) == ResolvedCorrection("seq_tis", {"tis_cap": 5.0})


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.rollout_correction.mode=tis"], "algorithm.rollout_correction.mode"),
    (["algorithm.rollout_correction.tis_cap=0"], "algorithm.rollout_correction.tis_cap"),
    (["algorithm.rollout_correction.tis_cap=-1"], "algorithm.rollout_correction.tis_cap"),
    (["algorithm.rollout_correction.mask_low=1.0"], "algorithm.rollout_correction.mask_low"),
    (["algorithm.rollout_correction.mask_low=-0.1"], "algorithm.rollout_correction.mask_low"),
    (["algorithm.rollout_correction.mask_high=1.0"], "algorithm.rollout_correction.mask_high"),
    (["algorithm.rollout_correction.level=geometric"], "algorithm.rollout_correction.level"),
    (["actor.old_logprob_source=engine"], "actor.old_logprob_source"),
    (["actor.tis.enable=true", "algorithm.rollout_correction.mode=seq_tis"], "actor.tis.enable"),
    (["actor.tis.enable=true", "algorithm.rollout_correction.tis_cap=3"], "algorithm.rollout_correction.tis_cap"),
    (["algorithm.rollout_correction.rollout_rs=sequence"], "algorithm.rollout_correction.rollout_rs"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token"],
     "algorithm.rollout_correction.mode"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, BASE + overrides)


def test_rollout_source_refused_with_staleness():
    cfg = load_config(None, BASE + ["actor.old_logprob_source=rollout"])
    cfg.trainer.max_staleness = 2
    with pytest.raises(ConfigError, match=r"actor\.old_logprob_source.*trainer\.max_staleness"):
        validate_config(cfg)
    cfg.trainer.max_staleness = 0
    validate_config(cfg)


def test_verl_aliases_resolve():
    rc = "algorithm.rollout_correction."
    cfg = load_config(None, BASE + [rc + "rollout_is=token", rc + "rollout_is_threshold=3.0"])
    assert (cfg.algorithm.rollout_correction.mode, cfg.algorithm.rollout_correction.tis_cap) == ("token_tis", 3.0)
    cfg = load_config(None, BASE + [rc + "rollout_is=sequence"])
    assert cfg.algorithm.rollout_correction.mode == "seq_tis"
    cfg = load_config(None, BASE + [rc + "rollout_is=null", rc + "rollout_rs=token", rc + "rollout_rs_threshold=1.5",
                                    rc + "rollout_rs_threshold_lower=0.8"])
    c = cfg.algorithm.rollout_correction
    assert (c.mode, c.level, c.mask_high, c.mask_low) == ("mask", "token", 1.5, 0.8)
    cfg = load_config(None, BASE + [rc + "bypass_mode=true"])
    assert cfg.actor.old_logprob_source == "rollout"
    assert load_config(None, BASE + [rc + "bypass_mode=false"]).actor.old_logprob_source == "recompute"
    assert load_config(None, BASE + [rc + "rollout_is=null"]).algorithm.rollout_correction.mode == "auto"


@pytest.mark.parametrize("mode,opts", [("token_tis", {"tis_cap": 2.0}), ("seq_tis", {"tis_cap": 2.0}),
                                       ("mask", {"mask_high": 2.0})])
def test_a_nan_behaviour_weight_leaves_the_token_out_instead_of_turning_the_loss_nan(mode, opts):
    # token (0, 1): both log-probs -inf (-inf - -inf = NaN); token (1, 0): the engine sent NaN
    prox = torch.tensor([[-1.0, float("-inf"), -0.5], [-0.2, -0.3, -0.4]])
    behav = torch.tensor([[-1.0, float("-inf"), -0.5], [float("nan"), -0.3, -0.4]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    c = rollout_correction(prox, behav, mask, mode, **opts)
    assert c.loss_mask.tolist() == [[True, False, True], [False, True, True]]
    assert float(c.sums["nonfinite"]) == 2.0 and float(c.sums["valid"]) == 6.0
    assert torch.isfinite(c.sums["behav_weight"])
    if c.weights is not None:
        assert torch.isfinite(c.weights).all()
        assert c.weights[c.loss_mask].tolist() == [1.0, 1.0, 1.0, 1.0]  # the other tokens have w = 1
