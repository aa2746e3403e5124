"""slurm/jobtool.py: per-engine ports and interface resolution (CASES.md B31), and the static job
checks that make a misconfigured sbatch job fail before any step starts. No Slurm needed."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("jobtool", REPO / "slurm" / "jobtool.py")
jobtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jobtool)


def test_b31_eight_engines_get_24_distinct_free_deterministic_ports():
    """B31: 8 engines on one node, base port 30000, 3 ports each (http, NCCL, dist-init): 24
    distinct ports, each free when handed out (checked here by binding it), the same on a second
    call for the same (node, slot), and no random offset: slot i starts at 30000 + 16 i."""
    base, host = 30000, "127.0.0.1"
    got = [jobtool.slot_ports(base, slot, 3, host=host) for slot in range(8)]
    flat = [p for ports in got for p in ports]
    assert len(flat) == 24 and len(set(flat)) == 24
    for slot, ports in enumerate(got):
        lo = base + 16 * slot
        assert all(lo <= p < lo + 16 for p in ports)
        assert ports == sorted(ports)
    # free at allocation: each can be bound now
    for p in flat:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, p))
    assert [jobtool.slot_ports(base, slot, 3, host=host) for slot in range(8)] == got


def test_b31_busy_ports_are_skipped_deterministically_inside_the_slot():
    """A port already bound on the node is skipped; the slot still never reaches into a
    neighbour's block, and the same busy table always gives the same answer."""
    busy = {30000, 30002, 30016}
    free = lambda host, port: port not in busy  # noqa: E731 - a fake port table of one node
    assert jobtool.slot_ports(30000, 0, 3, is_free=free) == [30001, 30003, 30004]
    assert jobtool.slot_ports(30000, 1, 3, is_free=free) == [30017, 30018, 30019]
    assert jobtool.slot_ports(30000, 0, 3, is_free=free) == [30001, 30003, 30004]
    # a real bound socket is seen as busy
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        slot_base = taken - (taken - 20000) % 16
        assert taken not in jobtool.slot_ports(slot_base, 0, 3)


def test_b31_full_block_is_an_error_naming_the_setting():
    with pytest.raises(jobtool.JobConfigError, match=r"only 2 of the 16 ports 30016-30031 of engine slot 1.*ROLLOUT_BASE_PORT"):
        jobtool.slot_ports(30000, 1, 3, is_free=lambda h, p: p in (30020, 30021))
    with pytest.raises(jobtool.JobConfigError, match="outside 1024-65535"):
        jobtool.slot_ports(65530, 0, 3)


def test_b31_interface_resolution_per_node():
    """B31: the named interface's IPv4 on a node that has it; a node without it is an error that
    names the node and the interface."""
    node1 = {"eth0": ["10.0.0.5"], "ib0": ["192.168.1.5"]}
    node2 = {"eth0": ["10.0.0.6"], "lo": ["127.0.0.1"]}
    assert jobtool.resolve_ipv4("ib0", node1, "node1") == "192.168.1.5"
    assert jobtool.resolve_ipv4("eth0", node1, "node1") == "10.0.0.5"
    with pytest.raises(jobtool.JobConfigError, match=r"node node2 has no interface 'ib0'.*eth0 \(10\.0\.0\.6\)"):
        jobtool.resolve_ipv4("ib0", node2, "node2")
    with pytest.raises(jobtool.JobConfigError, match="'ib0' on node node3 has no IPv4"):
        jobtool.resolve_ipv4("ib0", {"ib0": []}, "node3")
    # this machine's real table: loopback resolves to 127.0.0.1
    assert jobtool.resolve_ipv4("lo", jobtool.interface_table(), socket.gethostname()) == "127.0.0.1"


def _check(**kw):
    args = dict(config=str(REPO / "examples/qwen2.5-32b/dapo.yaml"), overrides=[], total_nodes=8, trainer_nodes=4,
                rollout_nodes=4, gpus_per_node=8, rollout_tp_size=4, engines_per_node=1, device="gpu")
    args.update(kw)
    return jobtool.check_job(args.pop("config"), args.pop("overrides"), **args)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(trainer_nodes=4, rollout_nodes=3), r"TRAINER_NODES=4 \+ ROLLOUT_NODES=3 = 7 but the job has 8"),
        (dict(total_nodes=7, trainer_nodes=3, rollout_nodes=4),
         r"TRAINER_NODES=3 x GPUS_PER_NODE=8 = 24 trainer ranks do not divide into "
         r"trainer.tensor_model_parallel_size 8 x trainer.pipeline_model_parallel_size 2"),
        (dict(rollout_tp_size=3), r"ROLLOUT_TP_SIZE=3 must divide GPUS_PER_NODE=8"),
        (dict(total_nodes=4, trainer_nodes=4, rollout_nodes=0), r"ROLLOUT_NODES=0 on GPUs"),
        (dict(trainer_nodes=9, rollout_nodes=-1), r"ROLLOUT_NODES=-1: must be >= 0 .*TRAINER_NODES=9 leaves no nodes "
                                                  r"of the job's 8"),
        (dict(), r"model.path is not set: pass MODEL_PATH"),
        (dict(overrides=["model.path=/nonexistent/Qwen2.5-32B"]), r"model.path '/nonexistent/Qwen2.5-32B' has no config.json"),
        (dict(overrides=["trainer.tensor_model_parallel_size=16"]),
         r"tensor_model_parallel_size 16 must divide num_attention_heads 40"),
    ],
)
def test_misconfigured_job_is_refused_naming_the_setting(kw, message):
    """The 32B recipe's job layout: node counts that do not add up or divide, a missing model
    path: each is refused by the check the sbatch script runs before any step."""
    with pytest.raises(jobtool.JobConfigError, match=message):
        _check(**kw)


def test_32b_layouts_pass_the_layout_checks(tmp_path):
    """The documented H100 layouts of slurm/README.md get past every layout check (a fake model
    folder with the real Qwen2.5-32B config.json stands in for the weights; data files are the
    last check and are missing here)."""
    model = tmp_path / "Qwen2.5-32B"
    model.mkdir()
    (model / "config.json").write_text((REPO / "examples/qwen2.5-32b/config.json").read_text())
    for recipe in ("grpo", "dapo", "da3po"):
        with pytest.raises(jobtool.JobConfigError, match="data file not found: /data/dapo-math-17k.parquet"):
            _check(config=str(REPO / f"examples/qwen2.5-32b/{recipe}.yaml"), overrides=[f"model.path={model}"])
    data = tmp_path / "d.jsonl"
    data.write_text("")
    out = _check(overrides=[f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]"])
    assert out["trainer_world"] == 32 and out["dp"] == 2 and out["engines"] == 8 and out["engines_per_node"] == 2


def test_engine_script_gpu_branch_flags_and_gpus(tmp_path):
    """slurm/lib/engine.sh in GPU mode, two engines of TP 4 on one node (B31: unique ports per
    engine). SGLang cannot run here, so a fake `sglang.launch_server` module (it only records its
    argv and CUDA_VISIBLE_DEVICES) stands in for it; everything else is the real script."""
    import json
    import os
    import subprocess
    import sys

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'gpus': os.environ['CUDA_VISIBLE_DEVICES']},"
        " open(os.environ['FAKE_OUT'], 'w'))\n"
    )
    job = tmp_path / "job"
    (job / "urls").mkdir(parents=True)
    (job / "hosts").write_text("gpu-node-1 127.0.0.1\n")  # ports are checked by binding this address
    # away from other tests' ports and below Linux's ephemeral range (32768+), where any outgoing
    # connection on the machine can hold a port for a while
    base = 20000 + 16 * 8 * (os.getpid() % 60)
    got = []
    for slot in (0, 1):
        env = dict(os.environ, SLURMD_NODENAME="gpu-node-1", SLURM_LOCALID=str(slot), SLURM_PROCID=str(4 + slot),
                   JOB_DIR=str(job), PYTHON=sys.executable, REPO=str(REPO), MEGATRON_RL_DEVICE="gpu",
                   MODEL_PATH="/ckpt/Qwen2.5-32B", ROLLOUT_BASE_PORT=str(base), ROLLOUT_TP_SIZE="4",
                   ROLLOUT_MEM_FRACTION="0.85", ROLLOUT_SEED="7", SGLANG_EXTRA_ARGS="--enable-metrics",
                   FAKE_OUT=str(tmp_path / f"engine{slot}.json"),
                   PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(["bash", str(REPO / "slurm/lib/engine.sh")], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        got.append(json.loads((tmp_path / f"engine{slot}.json").read_text()))
    assert got[0]["gpus"] == "0,1,2,3" and got[1]["gpus"] == "4,5,6,7"
    for slot, g in enumerate(got):
        p = base + 16 * slot
        assert g["argv"] == ["--model-path", "/ckpt/Qwen2.5-32B", "--tp-size", "4", "--host", "127.0.0.1",
                             "--port", str(p), "--nccl-port", str(p + 1), "--dist-init-addr", f"127.0.0.1:{p + 2}",
                             "--mem-fraction-static", "0.85", "--random-seed", "7", "--enable-metrics"]
    assert (job / "urls" / "00004").read_text().strip() == f"http://127.0.0.1:{base}"
    assert (job / "urls" / "00005").read_text().strip() == f"http://127.0.0.1:{base + 16}"


def test_port_claims_keep_two_jobs_on_one_node_apart(tmp_path):
    """Two jobs starting together on a node: every port is still bindable when both ask (their
    servers bind minutes later), so only the claims keep them apart. A running job's claims are
    skipped, the same job (a requeue) takes its own back, an ended job's claims are taken over."""
    alive = {"101": True, "102": True}
    kw = dict(claims_dir=str(tmp_path / "claims"), is_free=lambda h, p: True, job_alive=lambda j: alive.get(j, False))
    assert jobtool.claim_ports(30000, 0, 3, job="101", **kw) == [30000, 30001, 30002]
    assert jobtool.claim_ports(30000, 0, 3, job="102", **kw) == [30003, 30004, 30005]
    assert jobtool.claim_ports(29500, 0, 2, job="102", **kw) == [29500, 29501]
    assert (tmp_path / "claims" / "30004").read_text() == "102\n"
    assert jobtool.claim_ports(30000, 0, 3, job="101", **kw) == [30000, 30001, 30002]  # requeued: its own
    alive["101"] = False
    assert jobtool.claim_ports(30000, 0, 3, job="103", **kw) == [30000, 30001, 30002]  # 101 ended
    assert (tmp_path / "claims" / "30000").read_text() == "103\n"
    alive["103"] = True
    with pytest.raises(jobtool.JobConfigError, match=r"only 10 of the 16 ports .* claimed by running job\(s\) 102, 103"):
        jobtool.claim_ports(30000, 0, 11, job="104", **kw)


def _claim_in_process(args):
    claims, job = args
    return jobtool.claim_ports(31000, 0, 2, job=job, claims_dir=claims, is_free=lambda h, p: True,
                               job_alive=lambda j: True)


def test_port_claims_are_exclusive_under_concurrency(tmp_path):
    """Eight processes (eight jobs) claim at the same moment: the lock makes them take turns, so
    the 16 ports handed out are all distinct."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(8) as pool:
        got = pool.map(_claim_in_process, [(str(tmp_path), str(200 + i)) for i in range(8)])
    flat = [p for ports in got for p in ports]
    assert sorted(flat) == list(range(31000, 31016))


def test_check_hints_name_the_job_variable(tmp_path):
    """Each launch-time check failure names the job variable behind it; a run_dir that already holds
    checkpoints is refused up front when trainer.resume_mode=disable (a requeued job could not resume)."""
    ci = str(REPO / "examples/tiny/ci.yaml")
    kw = dict(total_nodes=1, trainer_nodes=1, rollout_nodes=0, gpus_per_node=1, rollout_tp_size=1,
              engines_per_node=1, device="cpu")
    with pytest.raises(jobtool.JobConfigError, match=r"data file not found: /nope.parquet \(data.train_files / data.val_files\)$"):
        jobtool.check_job(ci, ["data.train_files=[/nope.parquet]"], **kw)
    with pytest.raises(jobtool.JobConfigError, match=r"has no config.json \(MODEL_PATH / model.path\)$"):
        jobtool.check_job(ci, ["model.path=/nope"], **kw)
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000002" / "model_optim").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000002" / "run_state.json").write_text("{}")
    (run / "checkpoints" / "iter_0000002" / "model_optim" / "metadata.json").write_text("{}")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    assert jobtool.check_job(ci, [f"run_dir={run}"], **kw)["run_dir"] == str(run)
    with pytest.raises(jobtool.JobConfigError, match=r"holds checkpoints of an earlier run \(latest step 2\).*"
                                                     r"a requeued job needs trainer.resume_mode=auto"):
        jobtool.check_job(ci, [f"run_dir={run}", "trainer.resume_mode=disable"], **kw)
