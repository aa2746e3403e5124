"""`megatron-rl train` on bad input: clear errors, no orphan servers (issue: main job, 'Done when')."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "tiny" / "data" / "tokenizer"
TRAIN = ROOT / "examples" / "tiny" / "data" / "train.jsonl"
TEST = ROOT / "examples" / "tiny" / "data" / "test.jsonl"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """A random 2-layer Qwen2 with the tiny task's tokenizer, saved in HF format."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("random_model")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _train(args, run_dir, timeout=420, env=None):
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples" / "tiny" / "ci.yaml"),
           f"run_dir={run_dir}", "trainer.progress_bar=false", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _no_server_left(run_dir: Path) -> bool:
    out = subprocess.run(["pgrep", "-f", f"megatron_rl.engine.*{run_dir}"], capture_output=True, text=True)
    return out.stdout.strip() == ""


def test_row_without_ground_truth_names_file_and_row(tmp_path, random_model):
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()[:3]]
    del rows[1]["reward_model"]["ground_truth"]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = _train([f"model.path={random_model}", f"data.train_files=[{bad}]"], tmp_path / "run")
    assert out.returncode == 1, out.stderr[-2000:]
    assert str(bad) in out.stderr
    assert ":2" in out.stderr or "line 2" in out.stderr or "row 2" in out.stderr
    assert "ground_truth" in out.stderr


def test_dynamic_sampling_that_keeps_nothing(tmp_path, random_model):
    # a random model never answers correctly: every group has reward variance 0 and is filtered
    run_dir = tmp_path / "run"
    out = _train([f"model.path={random_model}", "algorithm.filter_groups.enable=true",
                  "algorithm.filter_groups.max_num_gen_batches=2", "algorithm.filter_groups.on_exhausted=error",
                  "eval.before_train=false", "eval.after_train=false"], run_dir)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "DynamicSamplingExhausted" in out.stderr
    assert "after 2 generation batches" in out.stderr
    assert _no_server_left(run_dir)


def test_server_that_does_not_come_up_shows_its_log(tmp_path, random_model):
    run_dir = tmp_path / "run"
    out = _train([f"model.path={random_model}", "rollout.startup_timeout_s=0.5"], run_dir)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "RolloutServerError" in out.stderr
    assert "rollout_server_0.log" in out.stderr  # the message points at, and quotes, the server's log
    assert _no_server_left(run_dir)


def test_unknown_config_key_suggests(tmp_path):
    out = _train(["actor.clip_ratio_hgh=0.3"], tmp_path / "run")
    assert out.returncode == 2
    assert "did you mean 'actor.clip_ratio_high'" in out.stderr


def test_greedy_dynamic_sampling_is_a_config_error(tmp_path):
    out = _train(["rollout.temperature=0", "algorithm.filter_groups.enable=true"], tmp_path / "run")
    assert out.returncode == 2
    assert "greedy decoding gives n identical responses" in out.stderr


def test_overlong_prompt_fails_before_training(tmp_path):
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()[:30]]
    rows[24]["prompt"][0]["content"] = "1+1=" * 60
    bad = tmp_path / "long.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "run"
    out = _train([f"data.train_files=[{bad}]"], run_dir, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"{bad}: line 25" in out.stderr and "data.filter_overlong_prompts" in out.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # refused at launch, not at step 3
    assert _no_server_left(run_dir)


def test_engine_reporting_scaled_logprobs_stops_the_run_before_step_1(tmp_path):
    """Issue 32: an engine whose log-probs are not the policy's (the embedded server under its fault hook
    reports `log_softmax(logits / temperature)`, as SGLang does without SGLANG_RETURN_ORIGINAL_LOGPROB) is
    refused once the engines are up, before the weights are published or anything is trained, naming the
    engine and the setting that fixes it (the CI recipe's tiny SFT'd model; rollout.check_logprob_semantics
    defaults to true)."""
    run_dir = tmp_path / "run"
    out = _train(["eval.before_train=false"], run_dir, timeout=300,
                 env={**os.environ, "MEGATRON_RL_FAULT_PROCESSED_LOGPROBS": "1"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "RolloutServerError: rollout engine http://127.0.0.1:" in out.stderr
    assert "does not report the policy's log-probs" in out.stderr
    assert "Fix: set SGLANG_RETURN_ORIGINAL_LOGPROB=1 in the SGLang server's environment" in out.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # stopped before step 1
    assert _no_server_left(run_dir)
