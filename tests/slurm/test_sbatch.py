"""The project's real sbatch scripts on a real one-node Slurm cluster (slurmctld + slurmd +
munged started by scripts/setup_slurm.sh): the CI recipe end to end (with SGLang's and with vLLM's
API, ROLLOUT_BACKEND), a job requeued mid-run
(`scontrol requeue`) resuming from its last checkpoint, the pre-emption signal path
(`scancel --signal=USR1 --batch`: checkpoint, exit 75, self-requeue, resume), and misconfigured
jobs failing in seconds before any step starts.

Skipped (with the reason) only where Slurm cannot be installed: not root or no apt-get. `.ci/run`
installs and starts it before pytest, so in CI these tests run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("jobtool", REPO / "slurm" / "jobtool.py")
jobtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jobtool)
CI = "slurm/tiny-ci.sbatch"
FAST = ["eval.before_train=false", "eval.after_train=false", "reward.num_workers=1"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def cluster():
    """A running one-node cluster: scripts/setup_slurm.sh start (installs slurm-wlm + munge if needed)."""
    proc = subprocess.run(["bash", str(REPO / "scripts/setup_slurm.sh"), "start"], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"Slurm cannot be installed here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"scripts/setup_slurm.sh start failed:\n{proc.stdout}\n{proc.stderr}"
    assert shutil.which("sbatch") and shutil.which("scontrol")
    yield
    # leave the cluster running (the next test session reuses it in 0.1 s); cancel our leftovers
    for job in _JOBS:
        subprocess.run(["scancel", job], capture_output=True)


_JOBS: list[str] = []


def submit(tmp_path: Path, *overrides: str, env: dict | None = None, script: str = CI,
           sbatch_args: list[str] | None = None) -> tuple[str, Path]:
    """sbatch the script from the repository root; returns (job id, batch output file)."""
    out = tmp_path / "job-%j.out"
    e = dict(os.environ)
    e.pop("MEGATRON_RL_IFACE", None)
    e.update(env or {})
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *(sbatch_args or []), script, *overrides],
                          cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    _JOBS.append(job)
    return job, tmp_path / f"job-{job}.out"


def job_info(job: str) -> dict:
    """`scontrol show job -o` as a dict (JobState, ExitCode, Restarts, ...)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_for(cond, timeout: float, what: str, out: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(1.0)
    log = out.read_text() if out is not None and out.exists() else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{log[-4000:]}")


def wait_state(job: str, states: set[str], timeout: float, out: Path) -> dict:
    return wait_for(lambda: (lambda i: i if i.get("JobState") in states else None)(job_info(job)),
                    timeout, f"job {job} to reach {states}", out)


def release(job: str, out: Path) -> None:
    """A requeued job waits ~2 min (Slurm's BeginTime after a requeue); the test starts it sooner.

    Not at once: slurmd revokes the credential of the run that was requeued, and a new allocation
    whose credential is dated in the same second is refused ("Killing non-startable batch JobId=N:
    Job credential revoked" in slurmctld.log: the job ends FAILED; seen in CI). So: wait until the
    previous run has left the node (no COMPLETING state), then start a few seconds later."""
    wait_state(job, {"PENDING"}, 180, out)
    wait_for(lambda: "COMPLETING" not in job_info(job).get("JobState", "") and not _node_completing(), 180,
             f"job {job}'s previous run to leave the node", out)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], check=True, capture_output=True)


def _node_completing() -> bool:
    out = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True).stdout
    return "COMPLETING" in out


def latest_ckpt(run: Path) -> int | None:
    f = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(f.read_text().strip())
    except (OSError, ValueError):
        return None


def metric_steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "train/acc" in r]


def resumed_from(run: Path) -> list[int]:
    return [int(m) for m in re.findall(r"resuming from step (\d+)", (run / "train.log").read_text())]


def test_ci_recipe_through_sbatch(cluster, tmp_path):
    """examples/tiny/ci.yaml through slurm/tiny-ci.sbatch: a rollout step of two embedded servers
    on the node and a torchrun trainer step, wired by rollout.server_urls; the head address comes from the
    interface resolver (MEGATRON_RL_IFACE, B31); metrics of every step and the checkpoints; then
    the conversion job on the result."""
    run = tmp_path / "run"
    # a real non-loopback interface when there is one, so the address can only come from the
    # resolver (Slurm's NodeAddr here is 127.0.0.1)
    table = jobtool.interface_table()
    iface = next((n for n, a in sorted(table.items()) if a and n != "lo" and not a[0].startswith("127.")), "lo")
    ip = table[iface][0]
    job, out = submit(tmp_path, f"run_dir={run}", "eval.max_problems=16",
                      env={"MEGATRON_RL_IFACE": iface, "ENGINES_PER_NODE": "2"})
    info = wait_state(job, ENDED, 600, out)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert metric_steps(run) == [1, 2, 3]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["train/acc"] <= 1.0 for r in rows if "train/acc" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and "eval_before" in summary and "eval_after" in summary
    assert latest_ckpt(run) == 3 and (run / "checkpoints" / "iter_0000002").is_dir()  # save_interval 2 + last
    jobdir = run / "slurm" / f"job-{job}"
    node = job_info(job)["NodeList"]
    assert (jobdir / "hosts").read_text().split() == [node, ip]
    args = (jobdir / "trainer.args").read_text().splitlines()
    # two engines on the node (B31): slot i takes the first free ports of its block 30000 + 16 i
    urls = [a for a in args if a.startswith("rollout.server_urls=")]
    m = re.fullmatch(rf"rollout.server_urls=\[http://{re.escape(ip)}:(\d+),http://{re.escape(ip)}:(\d+)\]", urls[0])
    assert m and 30000 <= int(m.group(1)) < 30016 <= int(m.group(2)) < 30032, urls
    assert f"weight_sync.master_address={ip}" in args
    m = re.search(rf"\(head {node} {re.escape(ip)}, rendezvous port (\d+), weight-sync port (\d+)", text)
    assert m and 29500 <= int(m.group(1)) < int(m.group(2)) < 29516
    assert (jobdir / f"trainer-{node}.log").is_file() and (jobdir / f"rollout-{node}-1.log").is_file()
    engines = [re.search(r"nccl port (\d+), dist-init port (\d+)", (jobdir / f"rollout-{node}-{t}.log").read_text())
               for t in (0, 1)]
    ports = [int(m.group(i)) for m in engines for i in (1, 2)] + [int(m.group(1)), int(m.group(2))]
    assert len(set(ports)) == 6, ports  # http, NCCL and dist-init ports of both engines all distinct
    assert "trainer finished (latest checkpoint: 3" in text

    # the conversion job on the run's latest checkpoint -> a Hugging Face folder
    hf = tmp_path / "hf"
    cjob, cout = submit(tmp_path, "to-hf", "--checkpoint", str(run), "--out", str(hf), script="slurm/convert.sbatch")
    info = wait_state(cjob, ENDED, 300, cout)
    assert info["JobState"] == "COMPLETED", cout.read_text()[-4000:]
    base = json.loads((REPO / "examples/tiny/base_model/config.json").read_text())
    assert json.loads((hf / "config.json").read_text())["hidden_size"] == base["hidden_size"]
    from safetensors import safe_open

    shapes = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    assert shapes["model.embed_tokens.weight"] == (base["vocab_size"], base["hidden_size"])
    assert sum(k.endswith("self_attn.q_proj.weight") for k in shapes) == base["num_hidden_layers"]
    bad, bout = submit(tmp_path, "to-nowhere", script="slurm/convert.sbatch")
    assert wait_state(bad, ENDED, 60, bout)["ExitCode"] == "2:0"
    assert "first argument: to-hf or to-megatron (got 'to-nowhere')" in bout.read_text()


def test_ci_recipe_with_vllm_engines_through_sbatch(cluster, tmp_path):
    """ROLLOUT_BACKEND=vllm in CPU mode (issue 18): the rollout step starts the embedded server in
    vLLM's dialect (`--api-dialect vllm`, the stand-in for `vllm serve`) and the trainer gets
    rollout.backend=vllm-embedded, so it samples and syncs weights through vLLM's routes
    (VLLMClient); two short steps complete."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", "trainer.total_training_steps=2", "trainer.save_interval=0",
                      "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
                      *FAST, env={"ROLLOUT_BACKEND": "vllm"})
    info = wait_state(job, ENDED, 600, out)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert "ROLLOUT_BACKEND=vllm); trainer rollout.backend=vllm-embedded" in text
    assert metric_steps(run) == [1, 2]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_sync/version"] for r in rows if "train/acc" in r] == [1, 2]  # synced over vLLM's routes
    jobdir = run / "slurm" / f"job-{job}"
    assert (jobdir / "trainer.args").read_text().splitlines()[-1] == "rollout.backend=vllm-embedded"
    node = job_info(job)["NodeList"]
    assert "(vllm dialect," in (jobdir / f"rollout-{node}-0.log").read_text()
    assert "rollout servers reachable" in (run / "train.log").read_text()


def test_colocated_ci_recipe_through_sbatch(cluster, tmp_path):
    """rollout.colocate=true (issue 17): the job has no rollout step; `megatron-rl train` starts its
    engine itself (on CPU the embedded server, standing in for SGLang with --enable-memory-saver) and
    hands the weights over by shared-memory handles; two short steps complete with the colocated
    phases recorded."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", "trainer.total_training_steps=2", "trainer.save_interval=0",
                      "data.train_batch_size=4", "data.gen_batch_size=6", "rollout.n=4", "actor.ppo_mini_batch_size=2",
                      "rollout.colocate=true", *FAST)
    info = wait_state(job, ENDED, 600, out)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert "rollout: colocated: 1 engine(s) started by the trainer on its devices" in text
    assert "rollout step started" not in text
    jobdir = run / "slurm" / f"job-{job}"
    assert not list(jobdir.glob("rollout-*.log"))
    assert not any(a.startswith("rollout.server_urls") for a in (jobdir / "trainer.args").read_text().splitlines())
    assert metric_steps(run) == [1, 2]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/acc" in r]
    assert [r["weight_sync/version"] for r in steps] == [1, 2]
    assert all("colocate/engine_release_s" in r and "colocate/trainer_onload_s" in r for r in steps)


def test_requeue_mid_run_resumes_from_last_checkpoint(cluster, tmp_path):
    """`scontrol requeue` while step 3+ runs (every process of the job gets SIGTERM, then SIGKILL
    after KillWait): the requeued job resumes from the newest checkpoint on disk (the periodic
    one of step 2 or a later one), not from step 0, and finishes all 4 steps."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", "trainer.total_training_steps=4", "trainer.save_interval=2", *FAST)
    wait_for(lambda: (latest_ckpt(run) or 0) >= 2, 600, "the periodic checkpoint of step 2", out)
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
    release(job, out)
    at_requeue = latest_ckpt(run)
    assert at_requeue is not None and 2 <= at_requeue < 4
    info = wait_state(job, ENDED, 600, out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out.read_text()[-4000:]
    assert resumed_from(run) == [at_requeue]
    # the second run trained only the steps after the checkpoint
    log = (run / "train.log").read_text()
    after = log[log.index(f"resuming from step {at_requeue}"):]
    assert int(re.search(r"step (\d+): acc", after).group(1)) == at_requeue + 1
    assert sorted(set(metric_steps(run))) == [1, 2, 3, 4]
    assert latest_ckpt(run) == 4 and json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "slurm" / f"job-{job}.r1").is_dir()


def test_usr1_checkpoints_exits_and_self_requeues(cluster, tmp_path):
    """The pre-emption path on its own: SIGUSR1 to the batch shell (what --signal=B:USR1@600 sends
    before the time limit) -> forwarded to the trainer, which finishes its step, writes a
    checkpoint (no periodic one: save_interval 100) and exits 75 -> the script requeues the job ->
    the next run resumes from exactly that checkpoint."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", "trainer.total_training_steps=4", "trainer.save_interval=100",
                      *FAST)
    wait_for(lambda: (run / "train.log").exists() and "step 1: acc" in (run / "train.log").read_text(), 600,
             "step 1", out)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, capture_output=True)
    release(job, out)
    text = out.read_text()
    stopped = latest_ckpt(run)
    assert stopped is not None and 1 <= stopped < 4, text[-4000:]
    assert f"trainer stopped on SIGUSR1 after writing checkpoint {stopped}" in text
    assert f"requeued job {job}" in text
    info = wait_state(job, ENDED, 600, out)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out.read_text()[-4000:]
    assert resumed_from(run) == [stopped]
    assert sorted(set(metric_steps(run))) == [1, 2, 3, 4] and latest_ckpt(run) == 4


@pytest.mark.parametrize(
    "env, overrides, message",
    [
        ({"TRAINER_NODES": "2"}, [], "TRAINER_NODES=2 + ROLLOUT_NODES=0 = 2 but the job has 1 node(s)"),
        ({}, ["model.path=/nonexistent/model"], "model.path '/nonexistent/model' has no config.json"),
        ({"MEGATRON_RL_IFACE": "ib0"}, [], "has no interface 'ib0'"),
        ({}, ["foo.bar=1"], "unknown config key 'foo'"),
        ({"RECIPE": "examples/tiny/nope.yaml"}, [], "RECIPE=examples/tiny/nope.yaml: no such file"),
        ({}, ["run_dir=/proc/no/run"], "run_dir=/proc/no/run: cannot create /proc/no/run/slurm"),
    ],
)
def test_misconfigured_job_fails_in_seconds(cluster, tmp_path, env, overrides, message):
    """Node counts that do not add up, a missing model, an interface a node lacks: the job fails
    within seconds with the setting named, and no rollout or trainer step was started."""
    t0 = time.monotonic()
    job, out = submit(tmp_path, f"run_dir={tmp_path / 'run'}", *overrides, env=env)  # a later run_dir= wins
    info = wait_state(job, ENDED, 120, out)
    took = time.monotonic() - t0
    text = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", text
    assert message in text
    assert "rollout step started" not in text and "trainer step started" not in text
    print(f"{job}: failed after {took:.1f} s: {message}")


def test_a_failing_step_stops_the_others(cluster, tmp_path):
    """The rollout step is killed while the trainer runs (`scancel --signal=KILL JOB.STEP`): the
    script stops the trainer step too, prints the engines' log tails and fails the job; no step of
    the job is left running (its torchrun has exited)."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", "trainer.total_training_steps=50", *FAST)
    wait_for(lambda: "trainer step started" in (out.read_text() if out.exists() else ""), 300, "the trainer step", out)

    # steps: 0 = the head's port check, 1 = rollout engines, 2 = trainer (both run `bash`)
    step = f"{job}.1"
    assert step in subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True,
                                  text=True).stdout.split()
    subprocess.run(["scancel", "--signal=KILL", step], check=True, capture_output=True)
    info = wait_state(job, ENDED, 180, out)
    text = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", text[-4000:]
    assert "error: the rollout step died while training" in text
    assert "stopping the trainer step" in text
    torchrun = int((run / "slurm" / f"job-{job}" / "torchrun.0.pid").read_text())
    wait_for(lambda: not Path(f"/proc/{torchrun}").exists(), 30, f"the trainer's torchrun (pid {torchrun}) to exit", out)


def test_usr1_during_trainer_start_up_still_requeues(cluster, tmp_path):
    """The pre-emption signal while the trainer is still starting (torchrun importing, ranks building
    the model: SIGUSR1's default action ends them, nothing can be checkpointed yet): the job is
    requeued all the same, to resume from the newest checkpoint on disk, instead of failing."""
    run = tmp_path / "run"
    job, out = submit(tmp_path, f"run_dir={run}", *FAST)
    wait_for(lambda: "trainer step started" in (out.read_text() if out.exists() else ""), 300, "the trainer step", out)
    pid = run / "slurm" / f"job-{job}" / "torchrun.0.pid"
    wait_for(lambda: pid.exists() and pid.read_text().strip(), 60, "the torchrun pid file", out)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, capture_output=True)
    info = wait_state(job, {"PENDING"}, 180, out)
    subprocess.run(["scancel", job], capture_output=True)
    text = out.read_text()
    assert info["Restarts"] == "1", text[-4000:]
    assert "on SIGUSR1 without writing a checkpoint; the next run starts over (no checkpoint yet)" in text, text[-4000:]
    assert f"requeued job {job}" in text
    assert (run / "slurm" / "owner").read_text().strip() == job  # kept for the requeued run


def _started(out: Path) -> str | None:
    text = out.read_text() if out.exists() else ""
    return text if "trainer step started" in text else None


def test_two_jobs_at_once_get_their_own_ports_and_run_dirs(cluster, tmp_path):
    """Two jobs starting together on one node (one CPU each): each engine's and each trainer's ports
    are picked before the other job's servers bind theirs, so only the port claims keep them apart;
    both come up on their own ports. A third job into a run_dir in use fails in seconds naming the
    job that holds it; once that job has ended the run_dir is free again."""
    ra, rb = tmp_path / "a", tmp_path / "b"
    one_cpu = ["--cpus-per-task=1"]
    a, aout = submit(tmp_path, f"run_dir={ra}", *FAST, sbatch_args=one_cpu)
    wait_for(lambda: "logs:" in (aout.read_text() if aout.exists() else ""), 120, "job A's pre-flight", aout)
    c, cout = submit(tmp_path, f"run_dir={ra}", *FAST, sbatch_args=one_cpu)
    info = wait_state(c, ENDED, 120, cout)
    assert info["ExitCode"] == "2:0" and f"is in use by job {a}" in cout.read_text(), cout.read_text()
    assert "rollout step started" not in cout.read_text()
    b, bout = submit(tmp_path, f"run_dir={rb}", *FAST, sbatch_args=one_cpu)
    texts = [wait_for(lambda o=o: _started(o), 300, "the trainer step", o) for o in (aout, bout)]
    url = [re.search(r"rollout engines up: (\S+)", t).group(1) for t in texts]
    trainer = [re.search(r"rendezvous port (\d+), weight-sync port (\d+)", t).groups() for t in texts]
    engine = [re.search(r"\(nccl port (\d+), dist-init port (\d+)\)", (r / "slurm" / f"job-{j}" /
                                                                      f"rollout-{job_info(j)['NodeList']}-0.log")
                        .read_text()).groups() for r, j in ((ra, a), (rb, b))]
    ports = [u.rsplit(":", 1)[1] for u in url] + [p for pair in trainer + engine for p in pair]
    assert len(set(ports)) == 10, ports
    # both trainers reach their own servers (a shared port would have killed one job's server)
    for r in (ra, rb):
        wait_for(lambda r=r: (r / "train.log").exists() and "rollout servers reachable" in (r / "train.log").read_text(),
                 300, f"the trainer of {r.name} to reach its servers", aout)
    assert {job_info(j)["JobState"] for j in (a, b)} == {"RUNNING"}
    assert jobtool.slurm_job_alive(a) and not jobtool.slurm_job_alive("999999")
    for j in (a, b):
        subprocess.run(["scancel", j], capture_output=True)
    for j, o in ((a, aout), (b, bout)):
        wait_state(j, ENDED, 180, o)
    # job A has ended: its owner file is stale, a new job takes the run_dir over
    d, dout = submit(tmp_path, f"run_dir={ra}", *FAST, sbatch_args=one_cpu)
    wait_for(lambda: "rollout step started" in (dout.read_text() if dout.exists() else ""), 120, "job D's start", dout)
    subprocess.run(["scancel", d], capture_output=True)
    assert (ra / "slurm" / "owner").read_text().strip() == d
