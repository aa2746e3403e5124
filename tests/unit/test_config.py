"""Config schema, YAML recipes, overrides, verl aliases and validation errors."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import config_to_dict, load_config, save_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.path=/models/x"]


def test_overrides_and_types():
    cfg = load_config(None, BASE + ["rollout.n=4", "actor.optim.lr=3e-4", "algorithm.daa.enable=true",
                                    "data.val_files=[a.jsonl, b.jsonl]", "run_dir=/tmp/r1"])
    assert cfg.rollout.n == 4
    assert cfg.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.algorithm.daa.enable is True
    assert cfg.data.val_files == [str(Path.cwd() / "a.jsonl"), str(Path.cwd() / "b.jsonl")]
    assert cfg.run_dir == "/tmp/r1"
    # an int where a float is expected is accepted and converted
    cfg = load_config(None, BASE + ["actor.clip_ratio_high=1"])
    assert isinstance(cfg.actor.clip_ratio_high, float)


def test_verl_aliases():
    cfg = load_config(None, BASE + ["actor_rollout_ref.actor.clip_ratio_high=0.28",
                                    "reward_model.overlong_buffer.len=8",
                                    "actor_rollout_ref.rollout.n=16",
                                    "actor_rollout_ref.actor.optim.lr=2e-6"])
    assert cfg.actor.clip_ratio_high == pytest.approx(0.28)
    assert cfg.reward.overlong_buffer.len == 8
    assert cfg.rollout.n == 16
    assert cfg.actor.optim.lr == pytest.approx(2e-6)


def test_verl_micro_batch_alias():
    cfg = load_config(None, BASE + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert cfg.actor.ppo_micro_batch_size == 4
    assert load_config(None, BASE + ["actor.ppo_micro_batch_size_per_gpu=2"]).actor.ppo_micro_batch_size == 2


def test_alias_and_canonical_key_conflict(tmp_path):
    """verl's spelling and this project's spelling of one key, with different values, in one place:
    an error naming both, not a silent last-wins; the same value twice is harmless."""
    with pytest.raises(ValueError) as err:
        load_config(None, BASE + ["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor.clip_ratio_high=0.2"])
    assert str(err.value) == ("overrides: actor_rollout_ref.actor.clip_ratio_high=0.28 and actor.clip_ratio_high=0.2 "
                              "set the same key actor.clip_ratio_high (verl's name and this project's); keep one")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: /models/x}\ntrainer: {save_freq: 5, save_interval: 10}\n")
    with pytest.raises(ValueError, match=rf"^{recipe}: trainer.save_freq=5 and trainer.save_interval=10 set the same "
                                         r"key trainer.save_interval"):
        load_config(recipe)
    recipe.write_text("model: {path: /models/x}\ntrainer: {save_freq: 5, save_interval: 5}\n")
    assert load_config(recipe).trainer.save_interval == 5
    # the command line still overrides the recipe, in either spelling
    assert load_config(recipe, ["trainer.save_freq=7"]).trainer.save_interval == 7
    assert load_config(None, BASE + ["rollout.n=4", "rollout.n=6"]).rollout.n == 6


def test_unknown_key_names_nearest():
    with pytest.raises(ValueError, match=r"unknown config key 'actor.clip_ratio_hihg'.*'actor.clip_ratio_high'"):
        load_config(None, BASE + ["actor.clip_ratio_hihg=0.3"])
    with pytest.raises(ValueError, match="unknown config key 'rolout'"):
        load_config(None, BASE + ["rolout.n=3"])


def test_enum_lists_allowed_values():
    with pytest.raises(ValueError, match=r"actor.loss_agg_mode.*'token-mean', 'seq-mean-token-mean'"):
        load_config(None, BASE + ["actor.loss_agg_mode=mean"])
    with pytest.raises(ValueError, match=r"algorithm.daa.difficulty"):
        load_config(None, BASE + ["algorithm.daa.difficulty=magic"])


def test_daa_options_refused():
    # the removed selection-corrected estimate: the error says why and names its replacement
    with pytest.raises(ValueError, match=r"difficulty: 'conditional' was removed.*counted the selection twice.*"
                                         r"2x low.*Use 'posterior'"):
        load_config(None, BASE + ["algorithm.daa.difficulty=conditional"])
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match=r"algorithm.daa.history_decay: .* must be in \(0, 1\]"):
            load_config(None, BASE + [f"algorithm.daa.history_decay={bad}"])
    with pytest.raises(ValueError, match=r"algorithm.daa.amplification: 0.9 must be a finite number >= 1"):
        load_config(None, BASE + ["algorithm.daa.amplification=0.9"])
    cfg = load_config(None, BASE + ["algorithm.daa.enable=true", "algorithm.daa.difficulty=posterior",
                                    "algorithm.daa.history_decay=0.9"])
    assert (cfg.algorithm.daa.difficulty, cfg.algorithm.daa.history_decay) == ("posterior", 0.9)


def test_daa_defaults_are_the_papers_rule():
    # enabling DAA on any recipe means DA3PO as reported (ALGORITHMS.md 4.1), like the DA3PO recipes
    daa = load_config(None, BASE + ["algorithm.daa.enable=true"]).algorithm.daa
    assert (daa.factor, daa.difficulty, daa.amplification, daa.hard_threshold) == ("constant", "group", 2.0, 0.5)
    for recipe in ("examples/tiny/da3po.yaml", "examples/qwen2.5-32b/da3po.yaml"):
        daa = load_config(ROOT / recipe, []).algorithm.daa
        assert (daa.enable, daa.factor, daa.difficulty, daa.amplification) == (True, "constant", "group", 2.0)


def test_wrong_type():
    with pytest.raises(ValueError, match=r"config key 'rollout.n': 'abc' is not an int$"):
        load_config(None, BASE + ["rollout.n=abc"])
    # optional keys say what they take in words, not "Optional"
    with pytest.raises(ValueError, match=r"'actor.max_tokens_per_micro_batch': 1.5 is not an int or null$"):
        load_config(None, BASE + ["actor.max_tokens_per_micro_batch=1.5"])
    with pytest.raises(ValueError, match=r"'trainer.fp8': True is not a string or null$"):
        load_config(None, BASE + ["trainer.fp8=true"])


def test_cross_section_checks():
    # B11 run 3: filtering with one sample a prompt can never fill a batch
    with pytest.raises(ValueError, match="filter_groups"):
        load_config(None, BASE + ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus_baseline",
                                  "algorithm.filter_groups.enable=true"])
    with pytest.raises(ValueError, match=r"rollout.n \(1\) must be >= 2"):
        load_config(None, BASE + ["rollout.n=1"])
    # B14 (b): a buffer longer than the maximum response length is a config error
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        load_config(None, BASE + ["data.max_response_length=4096", "reward.overlong_buffer.enable=true",
                                  "reward.overlong_buffer.len=5000"])
    # B08: clip_ratio_c must be > 1
    with pytest.raises(ValueError, match="clip_ratio_c"):
        load_config(None, BASE + ["actor.clip_ratio_c=1.0"])
    # eps_low >= 1 would make the lower clip bound 1 - eps_low <= 0
    with pytest.raises(ValueError, match=r"actor.clip_ratio_low: 1.5 must be in \(0, 1\)"):
        load_config(None, BASE + ["actor.clip_ratio_low=1.5"])
    with pytest.raises(ValueError, match="daa.enable needs a group-relative"):
        load_config(None, BASE + ["algorithm.daa.enable=true", "algorithm.adv_estimator=reinforce_plus_plus_baseline"])
    with pytest.raises(ValueError, match="gspo"):
        load_config(None, BASE + ["actor.policy_loss=gspo"])
    with pytest.raises(ValueError, match="multiple of actor.ppo_mini_batch_size"):
        load_config(None, BASE + ["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"])
    with pytest.raises(ValueError, match="fp8"):
        load_config(None, BASE + ["trainer.fp8=hybrid"])


def test_secrets_never_saved(tmp_path):
    cfg = load_config(None, BASE + ["rollout.api_key=sk-secret", "rollout.admin_api_key=adm-secret"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "sk-secret" not in text and "adm-secret" not in text
    assert yaml.safe_load(text)["rollout"]["api_key"] == "***"
    assert config_to_dict(cfg, redact=False)["rollout"]["api_key"] == "sk-secret"


def test_recipe_paths_resolve_against_recipe(tmp_path):
    (tmp_path / "r.yaml").write_text("model:\n  path: m\ndata:\n  train_files: [d/train.jsonl]\n")
    cfg = load_config(tmp_path / "r.yaml")
    assert cfg.model.path == str(tmp_path / "m")
    assert cfg.data.train_files == [str(tmp_path / "d" / "train.jsonl")]


@pytest.mark.parametrize("recipe", ["grpo", "dapo", "da3po"])
def test_32b_recipes_dry_run(recipe):
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config",
                          str(ROOT / "examples" / "qwen2.5-32b" / f"{recipe}.yaml"), "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "# static checks: passed" in out.stdout
    assert "deferred to launch: Transformer Engine" in out.stdout
    resolved = yaml.safe_load(out.stdout)
    assert resolved["rollout"]["n"] == 16
    assert resolved["actor"]["optim"]["lr"] == pytest.approx(1e-6)
    if recipe in ("dapo", "da3po"):
        assert resolved["data"]["gen_batch_size"] == 1536
        assert resolved["actor"]["clip_ratio_high"] == pytest.approx(0.28)
        assert resolved["reward"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0}
        assert resolved["algorithm"]["filter_groups"]["enable"] is True
    assert resolved["algorithm"]["daa"]["enable"] is (recipe == "da3po")


def test_dry_run_bad_key_exits_2():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config",
                          str(ROOT / "examples" / "qwen2.5-32b" / "dapo.yaml"), "--dry-run", "actor.bogus=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown config key 'actor.bogus'" in out.stderr


def test_data_parallel_split_is_a_clear_launch_error(monkeypatch):
    from megatron_rl.trainer.preflight import environment_checks

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # world 4, TP 1 -> DP 4; 3 prompts x 2 responses = 6 sequences a mini-batch do not split over 4
    cfg = load_config(None, BASE + ["trainer.nproc_per_node=4", "actor.ppo_mini_batch_size=3", "rollout.n=2",
                                    "data.train_batch_size=6"])
    check = environment_checks(cfg)["data_parallel_split"]
    with pytest.raises(RuntimeError, match="= 6 sequences per mini-batch do not split over 4 data-parallel ranks"):
        check()
    ok = load_config(None, BASE + ["trainer.nproc_per_node=4", "trainer.tensor_model_parallel_size=2",
                                   "actor.ppo_mini_batch_size=3", "rollout.n=2", "data.train_batch_size=6"])
    assert environment_checks(ok)["data_parallel_split"]() is None


@pytest.mark.parametrize("override, message", [
    ("actor.optim.lr=.nan", "actor.optim.lr: nan must be a finite number"),
    ("actor.kl_loss_coef=.inf", "actor.kl_loss_coef: inf must be a finite number"),
    ("eval.top_p=5", r"eval.top_p: 5(\.0)? must be in \(0, 1\]"),
    ("eval.temperature=-1", "eval.temperature: -1(.0)? must be >= 0"),
    ("eval.max_response_length=-5", "eval.max_response_length: -5 must be > 0"),
    ("rollout.startup_timeout_s=-5", "rollout.startup_timeout_s: -5(.0)? must be > 0"),
    ("weight_sync.master_port=-1", r"weight_sync.master_port: -1 must be a TCP port"),
    ("weight_sync.timeout_s=-1", "weight_sync.timeout_s: -1(.0)? must be > 0"),
    ("trainer.num_threads=-1", "trainer.num_threads: -1 must be >= 0"),
    ("trainer.distributed_timeout_s=0.5", "trainer.distributed_timeout_s: 0.5 must be >= 1"),
    ("reward.reward_fn=nope", "reward.reward_fn: 'nope' is not registered; choose one of 'dapo_math', 'gsm8k', 'math_auto', 'math_boxed', 'math_verify'"),
    ("data.train_adapter=nope", "data.train_adapter: 'nope' is not a dataset adapter; choose one of"),
    ("run_dir=", "run_dir: must not be empty"),
    ("model.tokenizer_path=", "model.tokenizer_path: must not be empty"),
    ("rollout.temperature=0", "filter_groups.enable with rollout.temperature=0"),
    ("rollout.pause_mode=retract", "rollout.pause_mode: 'retract' is not allowed; choose one of 'abort', 'in_place'"),
    ("actor.optim.lr=[1", "the value is not valid YAML"),
])
def test_bad_values_are_refused_statically(override, message):
    overrides = BASE + ["algorithm.filter_groups.enable=true", override]
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n data: [\n")
    with pytest.raises(ValueError, match=r"bad.yaml: line 3, column \d+: not valid YAML"):
        load_config(bad)


def test_sequence_longer_than_the_model_is_refused():
    base_model = ROOT / "examples/tiny/base_model"
    max_pos = __import__("json").loads((base_model / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"exceeds the model's max_position_embeddings {max_pos}"):
        load_config(None, [f"model.path={base_model}", f"data.max_prompt_length={max_pos}",
                           "data.max_response_length=8"])


def test_resume_mode_disable_check_and_auto_skip(tmp_path):
    from megatron_rl.trainer.preflight import environment_checks

    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints" / "iter_0000004"
    (ck / "model_optim").mkdir(parents=True)
    (ck / "run_state.json").write_text("{}")
    (ck / "model_optim" / "metadata.json").write_text("{}")
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    auto = environment_checks(load_config(None, BASE + [f"run_dir={run_dir}"]))
    check = auto["run_dir"]
    assert check().startswith("not applicable")
    off = environment_checks(load_config(None, BASE + [f"run_dir={run_dir}", "trainer.resume_mode=disable"]))
    check = off["run_dir"]
    with pytest.raises(RuntimeError, match=r"holds checkpoints of an earlier run \(latest step 4\)"):
        check()


def test_sequence_parallel_passes_the_launch_checks_with_or_without_te():
    # without TE the local spec runs it with models.sp_norm (tests/distributed/test_layouts.py: tp2-sequence-parallel)
    from megatron_rl.trainer.preflight import environment_checks

    cfg = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2", "trainer.sequence_parallel=true"])
    assert environment_checks(cfg)["sequence_parallel"]() is None
    off = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2"])
    assert environment_checks(off)["sequence_parallel"]().startswith("not applicable")
    local = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2", "trainer.sequence_parallel=true",
                                      "trainer.transformer_impl=local"])  # was refused before models/sp_norm.py
    assert environment_checks(local)["sequence_parallel"]() is None


@pytest.mark.parametrize("over, words", [
    (["trainer.nproc_per_node=3", "trainer.tensor_model_parallel_size=2"],
     "world size 3 (trainer.nproc_per_node) is not divisible by trainer.tensor_model_parallel_size x "
     "trainer.pipeline_model_parallel_size x trainer.context_parallel_size = 2 x 1 x 1 = 2"),
    (["trainer.nproc_per_node=3", "actor.ppo_mini_batch_size=1", "rollout.n=4"],
     "actor.ppo_mini_batch_size x rollout.n = 4 sequences per mini-batch do not split over 3 data-parallel ranks"),
])
def test_bad_layout_refused_before_ranks_start(tmp_path, over, words):
    """`megatron-rl train` checks the layout in the launching process: exit 2, one message, and no
    rank started (no run_dir written, no train.log)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", "examples/tiny/grpo.yaml",
                          f"run_dir={run_dir}", *over], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("megatron-rl train: config error: " + words), out.stderr
    assert not run_dir.exists()


def test_layout_hints_name_the_memory_savers_left_off():
    from megatron_rl.trainer.setup import layout_hints as _layout_hints

    t = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2", "trainer.nproc_per_node=8"]).trainer
    hints = _layout_hints(t, dp_size=4, use_te=True)
    assert len(hints) == 2
    assert hints[0].startswith("trainer.sequence_parallel is off with tensor_model_parallel_size=2")
    assert hints[1].startswith("trainer.use_distributed_optimizer is off with 4 data-parallel ranks")
    # without TE, sequence parallelism is not possible (refused), so no hint; one DP rank: nothing to shard
    assert _layout_hints(t, dp_size=1, use_te=False) == []
    on = load_config(None, BASE + ["trainer.tensor_model_parallel_size=2", "trainer.sequence_parallel=true",
                                   "trainer.use_distributed_optimizer=true"]).trainer
    assert _layout_hints(on, dp_size=4, use_te=True) == []


def test_null_choice_is_spelled_null():
    with pytest.raises(ValueError, match=r"^weight_sync.load_format: 'flat' is not allowed; choose one of "
                                         r"'flattened_bucket', null$"):
        load_config(None, BASE + ["weight_sync.load_format=flat"])
    assert load_config(None, BASE + ["weight_sync.load_format=null"]).weight_sync.load_format is None


def test_pause_mode_and_partial_rollout():
    cfg = load_config(None, BASE)
    assert (cfg.rollout.pause_mode, cfg.rollout.partial_rollout) == ("abort", False)
    cfg = load_config(None, BASE + ["rollout.partial_rollout=true"])
    assert cfg.rollout.partial_rollout is True
    assert load_config(None, BASE + ["rollout.pause_mode=in_place"]).rollout.pause_mode == "in_place"
    with pytest.raises(ValueError, match="rollout.partial_rollout: true needs rollout.pause_mode: abort"):
        load_config(None, BASE + ["rollout.pause_mode=in_place", "rollout.partial_rollout=true"])
