"""The vLLM client path end to end on CPU: the CI recipe with `rollout.backend: vllm-embedded` (the
embedded server speaking vLLM 0.33.x's API, docs/VLLM_API.md, driven by `VLLMClient`: completions,
pause/resume, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) samples the same tokens as the SGLang-dialect `embedded` run in every
step (`rollout/token_checksum`) and trains to the same loss and gradient norm: the loop cannot
tell the two dialects apart. The vLLM run sends a prompt's responses as one completion with `n`
(vLLM's parallel sampling, child j seeded seed + j), the SGLang run the same seeds one per entry."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
STEPS = 2
SAME = ("rollout/token_checksum", "train/loss", "train/grad_norm", "train/score", "train/kept_groups",
        "response_length/mean", "weight_sync/version", "weight_sync/num_tensors")


def _start(run_dir: Path, backend: str, *extra: str) -> subprocess.Popen:
    """One short run (deterministic inference: its tokens do not depend on timing, so two runs may
    share the CPUs at once)."""
    run_dir.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", f"rollout.backend={backend}", f"trainer.total_training_steps={STEPS}",
         "trainer.progress_bar=false", "trainer.save_interval=0", "eval.before_train=false",
         "eval.max_problems=8", "eval.n=2", "rollout.enable_deterministic_inference=true",
         "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2", *extra],
        stdout=subprocess.DEVNULL, stderr=open(run_dir.parent / f"{run_dir.name}.stderr", "w"), cwd=ROOT,
    )


def _result(proc: subprocess.Popen, run_dir: Path) -> tuple[dict[int, dict], dict]:
    try:
        code = proc.wait(timeout=840)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert code == 0, (run_dir.parent / f"{run_dir.name}.stderr").read_text()[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {r["step"]: r for r in rows if "train/acc" in r}, summary


def test_vllm_dialect_run_matches_sglang_dialect_run(tmp_path):
    # the vLLM run sends each prompt's 4 responses as one completion with n=4 (rollout.parallel_sampling,
    # on for vLLM backends); the SGLang run, with the same option, one batch /generate with seeds s..s+3
    procs = {"sglang": _start(tmp_path / "sglang", "embedded", "rollout.parallel_sampling=true"),
             "vllm": _start(tmp_path / "vllm", "vllm-embedded")}
    sglang, sglang_summary = _result(procs["sglang"], tmp_path / "sglang")
    vllm, vllm_summary = _result(procs["vllm"], tmp_path / "vllm")
    assert sorted(vllm) == sorted(sglang) == list(range(1, STEPS + 1))
    for step, want in sglang.items():
        for key in SAME:
            assert vllm[step][key] == want[key], (step, key, vllm[step][key], want[key])
    assert vllm_summary["eval_after"]["avg@2"] == sglang_summary["eval_after"]["avg@2"]
    # the stand-in really spoke vLLM's dialect (its log names it; the SGLang one does not)
    assert "vllm dialect" in (tmp_path / "vllm" / "rollout_server_0.log").read_text()
    assert "sglang dialect" in (tmp_path / "sglang" / "rollout_server_0.log").read_text()
