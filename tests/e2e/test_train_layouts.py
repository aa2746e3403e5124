"""The main job launched as several local trainer processes (`trainer.nproc_per_node`): TP=2,
PP=2, DP=2 and TP=2 x PP=2 runs of the CI recipe give the same per-step metrics as one process
(rollouts are seeded and batch-invariant with `rollout.enable_deterministic_inference`, and start
from the same weights; the update is equal up to fp32 reduction order, see
tests/distributed/test_layouts.py). Only rank 0 talks to the rollout server.

The tiny DA3PO recipe itself (examples/tiny/da3po.yaml, its batch sizes, 5 steps, eval cut to 8
problems x 2 samples) with TP=2 and with PP=2 (two processes each) samples the same tokens as
the TP=1 run in every step (`rollout/token_checksum`, a hash of every sampled response) and its
loss, reward and gradient-norm metrics agree within 1e-4 relative."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
STEPS = 3
EXACT = ("train/acc", "train/score", "train/kept_groups", "train/num_gen_batches", "response_length/mean",
         "weight_sync/version", "weight_sync/num_tensors")
CLOSE = ("train/loss", "train/grad_norm", "train/entropy", "train/pg_clipfrac", "train/ppo_kl")


def _run(run_dir: Path, *overrides: str) -> dict[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={run_dir}", f"trainer.total_training_steps={STEPS}", "trainer.progress_bar=false",
         "eval.max_problems=16", "eval.n=2", "rollout.enable_deterministic_inference=true",
         "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
         *overrides],
        capture_output=True, text=True, timeout=840, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/acc" in r}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ws1") / "run"
    return _run(run_dir), run_dir


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run[0]


@pytest.mark.parametrize("nproc, tp, pp", [(2, 2, 1), (2, 1, 2), (2, 1, 1), (4, 2, 2)],
                         ids=["tp2", "pp2", "dp2", "tp2xpp2"])
def test_layout_matches_one_process(one_process, tmp_path, nproc, tp, pp):
    run_dir = tmp_path / "run"
    got = _run(run_dir, f"trainer.nproc_per_node={nproc}", f"trainer.tensor_model_parallel_size={tp}",
               f"trainer.pipeline_model_parallel_size={pp}")
    assert sorted(got) == sorted(one_process) == list(range(1, STEPS + 1))
    for step, want in one_process.items():
        for key in EXACT:
            assert got[step][key] == want[key], (step, key)
        for key in CLOSE:
            assert got[step][key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (step, key)
    # only the controller writes the run's files; the other ranks log to their own files
    assert (run_dir / "summary.json").is_file()
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == [f"train_rank{r}.log" for r in range(1, nproc)]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)


def test_resume_into_another_layout(one_process_run, tmp_path):
    """The one-process run's checkpoint of step 2 (ci.yaml saves every 2 steps) resumed with
    PP=2 x DP=2 on 4 ranks: megatron-core reshards weights and optimizer state; step 3 matches.
    A TP change changes the padded vocabulary (make_vocab_size_divisible_by x TP, case B29), so
    resuming at TP=2 is refused with an error that names the tensor, both shapes and the cause."""
    import shutil

    ref, ref_dir = one_process_run

    def seeded_run_dir(name):
        run_dir = tmp_path / name
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(ref_dir / "checkpoints" / "iter_0000002", run_dir / "checkpoints" / "iter_0000002")
        (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
        rows = [line for line in (ref_dir / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
        (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
        return run_dir

    run_dir = seeded_run_dir("pp2dp2")
    got = _run(run_dir, "trainer.nproc_per_node=4", "trainer.pipeline_model_parallel_size=2")
    assert "resuming from step 2" in (run_dir / "train.log").read_text()
    for key in EXACT:
        assert got[3][key] == ref[3][key], key
    for key in CLOSE:
        assert got[3][key] == pytest.approx(ref[3][key], rel=1e-3, abs=1e-6), key

    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/ci.yaml"),
         f"run_dir={seeded_run_dir('tp2')}", "trainer.nproc_per_node=2", "trainer.tensor_model_parallel_size=2",
         "trainer.progress_bar=false"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 1
    assert "embedding.word_embeddings.weight' has shape (128, 128), the model expects (256, 128)" in out.stderr
    assert "make_vocab_size_divisible_by x TP" in out.stderr


DA3PO_STEPS = 5


def _run_da3po(run_dir: Path, *overrides: str) -> tuple[dict[int, dict], dict]:
    # the thread settings the reference below was recorded with: torch's default on this 2-core
    # machine (2 threads) for the rollout server; since issue 21 each process takes a share of the
    # cores instead, and a different thread count changes fp32 rounding (and a near-tie token).
    # MKL_CBWR=AVX2 (MKL's conditional numerical reproducibility): MKL picks its sgemm kernels by
    # the CPU (AVX2 or AVX-512), which changes rounding the same way; the reference was recorded on
    # MKL's AVX2 path, and CI machines differ in their CPUs (an AVX-512 one drew a different token
    # at step 1 without it)
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_CBWR="AVX2")
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(ROOT / "examples/tiny/da3po.yaml"),
         f"run_dir={run_dir}", f"trainer.total_training_steps={DA3PO_STEPS}", "trainer.progress_bar=false",
         "trainer.save_last=false", "eval.max_problems=8", "eval.n=2", "rollout.enable_deterministic_inference=true",
         *overrides],
        capture_output=True, text=True, timeout=2400, cwd=ROOT, env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {r["step"]: r for r in rows if "train/acc" in r}, summary


@pytest.fixture(scope="module")
def da3po_one_process(tmp_path_factory):
    return _run_da3po(tmp_path_factory.mktemp("da3po_tp1") / "run")


BEFORE = json.loads((ROOT / "tests/data/da3po_5step_before_redesign.json").read_text())


def _assert_like_before(got: dict[int, dict], summary: dict, rel: float) -> None:
    """The same tokens, loss and gradient norm per step as the trainer before the stages redesign."""
    for step, want in BEFORE["steps"].items():
        row = got[int(step)]
        for key in ("rollout/token_checksum", "train/acc", "perf/generated_tokens"):
            assert row[key] == want[key], (step, key)
        for key in ("train/loss", "train/grad_norm"):
            assert row[key] == pytest.approx(want[key], rel=rel), (step, key)
    assert summary["eval_after"]["avg@2"] == BEFORE["eval_after"]["avg@2"]


def test_da3po_recipe_matches_the_trainer_before_the_redesign(da3po_one_process):
    got, summary = da3po_one_process
    # the same tokens every step; loss and grad norm within 1e-5 (was 1e-6 on the recording machine:
    # ATen's own vectorised fp32 kernels still follow the CPU, AVX-512 here, 5.7e-6 at step 4 seen)
    _assert_like_before(got, summary, rel=1e-5)


DA3PO_SAME = ("rollout/token_checksum", "perf/generated_tokens", "train/acc", "train/score", "reward/failed",
              "reward/overlong_penalty_mean", "train/kept_groups", "train/num_gen_batches", "train/num_updates",
              "train/daa_amplified_frac")
DA3PO_CLOSE = ("train/loss", "train/grad_norm")


@pytest.mark.slow  # ~3.5 min each on 2 cores; CI covers tp2 and pp2 with the CI recipe (DA3PO, 3 steps):
@pytest.mark.timeout(5400)  # test_layout_matches_one_process
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_da3po_recipe_matches_one_process(da3po_one_process, tmp_path, tp, pp):
    want, want_summary = da3po_one_process
    got, summary = _run_da3po(tmp_path / "run", "trainer.nproc_per_node=2",
                              f"trainer.tensor_model_parallel_size={tp}", f"trainer.pipeline_model_parallel_size={pp}")
    assert sorted(got) == sorted(want) == list(range(1, DA3PO_STEPS + 1))
    for step in want:
        assert want[step]["rollout/token_checksum"] > 0
        for key in DA3PO_SAME:
            assert got[step][key] == want[step][key], (step, key)
        for key in DA3PO_CLOSE:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4), (step, key)
    # the eval after five updates samples the same tokens too
    assert summary["eval_after"]["avg@2"] == want_summary["eval_after"]["avg@2"]
    _assert_like_before(got, summary, rel=1e-4)
    assert summary["eval_after"]["greedy_acc"] == want_summary["eval_after"]["greedy_acc"]
