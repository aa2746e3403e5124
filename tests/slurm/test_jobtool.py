"""slurm/jobtool.py: per-engine ports and interface resolution (CASES.md B31), the static job
checks that make a misconfigured sbatch job fail before any step starts, the engine choice
(ROLLOUT_BACKEND) and the `vllm serve` line of slurm/lib/engine.sh. No Slurm needed."""

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


def _fake_model_files(tmp_path, family: str) -> list[str]:
    """Overrides naming a model folder holding only examples/<family>/config.json and empty data files."""
    model = tmp_path / family
    model.mkdir()
    (model / "config.json").write_text((REPO / f"examples/{family}/config.json").read_text())
    data = tmp_path / "d.jsonl"
    data.write_text("")
    return [f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]


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


def _fake_module(root: Path, dotted: str) -> None:
    """A stand-in for ``python -m <dotted>`` under ``root``: it records its argv, its GPUs and
    VLLM_SERVER_DEV_MODE in the JSON file named by FAKE_OUT."""
    *pkgs, mod = dotted.split(".")
    d = root
    for pkg in pkgs:
        d = d / pkg
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    (d / f"{mod}.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'gpus': os.environ['CUDA_VISIBLE_DEVICES'],"
        " 'dev_mode': os.environ.get('VLLM_SERVER_DEV_MODE'),"
        " 'original_logprob': os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB')}, open(os.environ['FAKE_OUT'], 'w'))\n"
    )


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_engine_script_gpu_branch_flags_and_gpus(tmp_path, backend):
    """slurm/lib/engine.sh in GPU mode, two engines of TP 4 on one node (B31: unique ports per
    engine), for either engine (ROLLOUT_BACKEND). Neither SGLang nor vLLM can run here, so a fake
    `sglang.launch_server` / `vllm.entrypoints.cli.main` module (it only records its argv and
    environment) stands in for it; everything else is the real script. vLLM's line is
    `launcher.build_vllm_command`'s, the recipe's `rollout.vllm_extra_args` (JOB_VLLM_EXTRA_ARGS)
    before VLLM_EXTRA_ARGS, in dev mode."""
    import json
    import os
    import subprocess
    import sys

    from megatron_rl.rollout.launcher import build_vllm_command

    _fake_module(tmp_path / "fake", "sglang.launch_server" if backend == "sglang" else "vllm.entrypoints.cli.main")
    job = tmp_path / "job"
    (job / "urls").mkdir(parents=True)
    (job / "hosts").write_text("gpu-node-1 127.0.0.1\n")  # ports are checked by binding this address
    # away from other tests' ports and below Linux's ephemeral range (32768+), where any outgoing
    # connection on the machine can hold a port for a while
    base = 20000 + 16 * 8 * (os.getpid() % 60) + (0 if backend == "sglang" else 32)
    got = []
    for slot in (0, 1):
        env = dict(os.environ, SLURMD_NODENAME="gpu-node-1", SLURM_LOCALID=str(slot), SLURM_PROCID=str(4 + slot),
                   JOB_DIR=str(job), PYTHON=sys.executable, REPO=str(REPO), MEGATRON_RL_DEVICE="gpu",
                   MODEL_PATH="/ckpt/Qwen2.5-32B", ROLLOUT_BASE_PORT=str(base), ROLLOUT_TP_SIZE="4",
                   ROLLOUT_MEM_FRACTION="0.85", ROLLOUT_SEED="7", SGLANG_EXTRA_ARGS="--enable-metrics",
                   ROLLOUT_BACKEND=backend, VLLM_PYTHON=sys.executable,
                   JOB_VLLM_EXTRA_ARGS="--max-model-len 22528",
                   VLLM_EXTRA_ARGS="--enforce-eager --override-generation-config '{\"temperature\": 1.0}'",
                   FAKE_OUT=str(tmp_path / f"engine{slot}.json"),
                   PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
        env.pop("VLLM_SERVER_DEV_MODE", None)
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        proc = subprocess.run(["bash", str(REPO / "slurm/lib/engine.sh")], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        got.append(json.loads((tmp_path / f"engine{slot}.json").read_text()))
    assert got[0]["gpus"] == "0,1,2,3" and got[1]["gpus"] == "4,5,6,7"
    for slot, g in enumerate(got):
        p = base + 16 * slot
        if backend == "sglang":
            assert g["argv"] == ["--model-path", "/ckpt/Qwen2.5-32B", "--tp-size", "4", "--host", "127.0.0.1",
                                 "--port", str(p), "--nccl-port", str(p + 1), "--dist-init-addr", f"127.0.0.1:{p + 2}",
                                 "--mem-fraction-static", "0.85", "--random-seed", "7", "--enable-metrics"]
            assert g["dev_mode"] is None
            assert g["original_logprob"] == "1"   # unscaled log-probs, as the trainer's (launcher.SGLANG_ENV)
        else:
            want = build_vllm_command("/ckpt/Qwen2.5-32B", python=sys.executable, host="127.0.0.1", port=p, tp_size=4,
                                      gpu_memory_utilization=0.85, seed=7,
                                      extra_args=["--max-model-len", "22528", "--enforce-eager",
                                                  "--override-generation-config", '{"temperature": 1.0}'])
            assert g["argv"] == want[3:]  # what `python -m vllm.entrypoints.cli.main` sees: serve MODEL ...
            assert g["argv"][:2] == ["serve", "/ckpt/Qwen2.5-32B"] and g["dev_mode"] == "1"
            flags = dict(zip(g["argv"][2::2], g["argv"][3::2]))
            assert flags["--tensor-parallel-size"] == "4" and flags["--gpu-memory-utilization"] == "0.85"
            assert flags["--seed"] == "7" and flags["--port"] == str(p) and flags["--host"] == "127.0.0.1"
            assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
    assert (job / "urls" / "00004").read_text().strip() == f"http://127.0.0.1:{base}"
    assert (job / "urls" / "00005").read_text().strip() == f"http://127.0.0.1:{base + 16}"


def test_vllm_cmd_prints_the_launchers_line_shell_quoted(capsys):
    """`jobtool.py vllm-cmd`: `launcher.build_vllm_command`'s line (what `rollout.backend: vllm`
    starts), shell-quoted, extra-args strings split as a shell would; bad values name the job variable."""
    import shlex

    from megatron_rl.rollout.launcher import build_vllm_command

    argv = ["vllm-cmd", "--python", "/opt/vllm/bin/python", "--model", "/ckpt/m", "--host", "10.0.0.5",
            "--port", "30000", "--tp-size", "4", "--gpu-memory-utilization", "0.85", "--seed", "1234",
            "--extra-args", "--max-model-len 22528", "--extra-args", ""]
    assert jobtool.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert shlex.split(line) == build_vllm_command(
        "/ckpt/m", python="/opt/vllm/bin/python", host="10.0.0.5", port=30000, tp_size=4, gpu_memory_utilization=0.85,
        seed=1234, extra_args=["--max-model-len", "22528"])
    assert """--weight-transfer-config '{"backend": "nccl"}'""" in line
    with pytest.raises(jobtool.JobConfigError, match=r"gpu_memory_utilization must be in \(0, 1\).*ROLLOUT_MEM_FRACTION"):
        jobtool.vllm_command("python", "/m", host="h", port=1, tp_size=1, gpu_memory_utilization=1.5, seed=0)
    assert jobtool.main([*argv[:-1], "--enforce-eager 'unbalanced"]) == 2
    assert "VLLM_EXTRA_ARGS" in capsys.readouterr().err


def test_check_rollout_backend_picks_the_trainers_backend(tmp_path):
    """ROLLOUT_BACKEND (sglang | vllm, unset = the recipe's engine) decides the engines and the
    trainer's rollout.backend (on CPU the embedded server in the matching dialect); the config is
    checked as the trainer gets it, so a layout vLLM cannot take is refused before any step."""
    ci = str(REPO / "examples/tiny/ci.yaml")
    cpu = dict(total_nodes=1, trainer_nodes=1, rollout_nodes=0, gpus_per_node=1, rollout_tp_size=1,
               engines_per_node=1, device="cpu")
    out = jobtool.check_job(ci, [], **cpu)
    assert (out["rollout_backend"], out["trainer_backend"]) == ("sglang", "embedded")
    out = jobtool.check_job(ci, [], rollout_backend="vllm", **cpu)
    assert (out["rollout_backend"], out["trainer_backend"]) == ("vllm", "vllm-embedded")
    out = jobtool.check_job(ci, ["rollout.backend=vllm-embedded"], **cpu)  # unset: the recipe's engine
    assert (out["rollout_backend"], out["trainer_backend"]) == ("vllm", "vllm-embedded")
    with pytest.raises(jobtool.JobConfigError, match=r"ROLLOUT_BACKEND=trt: expected sglang or vllm"):
        jobtool.check_job(ci, [], rollout_backend="trt", **cpu)
    with pytest.raises(jobtool.JobConfigError, match=r"with ROLLOUT_BACKEND=vllm \(rollout.backend=vllm-embedded\): "
                                                     r".*load_format"):
        jobtool.check_job(ci, ["weight_sync.load_format=flattened_bucket"], rollout_backend="vllm", **cpu)

    files = _fake_model_files(tmp_path, "qwen2.5-32b")
    # the SGLang recipe's PP 2 cannot feed vLLM's single weight-transfer group
    with pytest.raises(jobtool.JobConfigError, match=r"ROLLOUT_BACKEND=vllm \(rollout.backend=vllm\).*"
                                                     r"pipeline_model_parallel_size 2"):
        _check(overrides=files, rollout_backend="vllm")
    out = _check(config=str(REPO / "examples/qwen2.5-32b/dapo-vllm.yaml"), overrides=files)
    assert out["rollout_backend"] == "vllm" and out["trainer_backend"] == "vllm"
    assert out["trainer_world"] == 32 and out["dp"] == 4 and out["engines"] == 8 and out["engines_per_node"] == 2
    assert out["vllm_python"] == "python" and out["vllm_extra_args"] == "--max-model-len 22528"
    out = _check(config=str(REPO / "examples/qwen2.5-32b/dapo-vllm.yaml"), overrides=files, rollout_backend="sglang")
    assert out["trainer_backend"] == "sglang"  # the job's engines decide, not the recipe


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


def test_async_recipe_passes_the_job_checks(tmp_path):
    """examples/qwen2.5-32b/dapo-async.yaml (eta = 1) with its sbatch wrapper's defaults: the
    synchronous recipe's layout, SGLang engines (they report per-token weight versions)."""
    sbatch = (REPO / "slurm/qwen2.5-32b-dapo-async.sbatch").read_text()
    assert "export RECIPE=examples/qwen2.5-32b/dapo-async.yaml" in sbatch and "#SBATCH --nodes=8" in sbatch
    files = _fake_model_files(tmp_path, "qwen2.5-32b")
    out = _check(config=str(REPO / "examples/qwen2.5-32b/dapo-async.yaml"), overrides=files)
    assert out["trainer_world"] == 32 and out["dp"] == 2 and out["engines"] == 8
    assert (out["rollout_backend"], out["trainer_backend"]) == ("sglang", "sglang")


def test_colocated_recipe_is_one_node_without_a_rollout_step(tmp_path):
    """rollout.colocate (issue 17): the trainer starts rollout.num_servers engines on each of its
    nodes itself, so the job has ROLLOUT_NODES=0 (allowed on GPUs here, unlike the disaggregated
    recipes), on one node or several; rollout nodes are refused naming the setting."""
    files = _fake_model_files(tmp_path, "qwen2.5-7b")
    recipe = str(REPO / "examples/qwen2.5-7b/dapo-colocate.yaml")
    out = _check(config=recipe, overrides=files, total_nodes=1, trainer_nodes=1, rollout_nodes=0, rollout_tp_size=2)
    assert (out["colocate"], out["engines"], out["trainer_world"]) == (1, 4, 8)
    assert out["trainer_backend"] == "sglang"
    with pytest.raises(jobtool.JobConfigError, match=r"rollout.colocate: true runs the engines on the trainer's own "
                                                     r"nodes .* ROLLOUT_NODES=1: submit with ROLLOUT_NODES=0"):
        _check(config=recipe, overrides=files, total_nodes=2, trainer_nodes=1, rollout_nodes=1, rollout_tp_size=2)
    # two nodes colocated: 4 engines on each, 16 trainer ranks
    out = _check(config=recipe, overrides=files, total_nodes=2, trainer_nodes=2, rollout_nodes=0, rollout_tp_size=2)
    assert (out["colocate"], out["engines"], out["engines_per_node"], out["trainer_world"]) == (1, 8, 4, 16)
    # the config is checked with trainer.nproc_per_node=GPUS_PER_NODE, as train.sbatch passes it:
    # 4 engines of TP 2 do not fit on 4 GPUs
    with pytest.raises(jobtool.JobConfigError, match=r"4 engines with rollout.colocate: true, but trainer.nproc_per_node 4"):
        _check(config=recipe, overrides=files, total_nodes=1, trainer_nodes=1, rollout_nodes=0, rollout_tp_size=2,
               gpus_per_node=4)
    ci = str(REPO / "examples/tiny/ci.yaml")
    cpu = dict(total_nodes=1, trainer_nodes=1, rollout_nodes=0, gpus_per_node=1, rollout_tp_size=1,
               engines_per_node=1, device="cpu")
    assert jobtool.check_job(ci, [], **cpu)["colocate"] == 0
    out = jobtool.check_job(ci, ["rollout.colocate=true"], **cpu)
    assert (out["colocate"], out["trainer_backend"], out["engines"]) == (1, "embedded", 1)


def test_moe_recipe_passes_the_job_checks_with_expert_parallel_engines(tmp_path):
    """examples/qwen3-30b-a3b/dapo.yaml with its sbatch wrapper's defaults (issue 29): 32 trainer ranks (DP 8),
    8 engines of TP 4 whose experts are split over their 4 GPUs (ROLLOUT_EP_SIZE unset: the model's config.json
    names 128 routed experts) and that return routed experts (actor.router_replay). An explicit ROLLOUT_EP_SIZE
    must divide ROLLOUT_TP_SIZE (SGLang) or equal it (vLLM), and is refused for a dense model."""
    sbatch = (REPO / "slurm/qwen3-30b-a3b-dapo.sbatch").read_text()
    assert "export RECIPE=examples/qwen3-30b-a3b/dapo.yaml" in sbatch and "#SBATCH --nodes=8" in sbatch
    assert 'ROLLOUT_TP_SIZE="${ROLLOUT_TP_SIZE:-4}"' in sbatch and 'TRAINER_NODES="${TRAINER_NODES:-4}"' in sbatch
    files = _fake_model_files(tmp_path, "qwen3-30b-a3b")
    recipe = str(REPO / "examples/qwen3-30b-a3b/dapo.yaml")
    out = _check(config=recipe, overrides=files)
    assert (out["trainer_world"], out["dp"], out["engines"], out["engines_per_node"]) == (32, 8, 8, 2)
    assert (out["rollout_ep_size"], out["router_replay"], out["rollout_backend"]) == (4, 1, "sglang")
    assert _check(config=recipe, overrides=files, rollout_ep_size=2)["rollout_ep_size"] == 2
    assert _check(config=recipe, overrides=[*files, "actor.router_replay=false"])["router_replay"] == 0
    with pytest.raises(jobtool.JobConfigError, match=r"ROLLOUT_EP_SIZE=3 must be >= 1 and divide ROLLOUT_TP_SIZE=4"):
        _check(config=recipe, overrides=files, rollout_ep_size=3)
    vllm = _check(config=recipe, overrides=files, rollout_backend="vllm")
    assert (vllm["rollout_ep_size"], vllm["trainer_backend"]) == (4, "vllm")
    with pytest.raises(jobtool.JobConfigError, match=r"ep_size 2 with a vLLM engine of tp_size 4.*ROLLOUT_EP_SIZE"):
        _check(config=recipe, overrides=files, rollout_backend="vllm", rollout_ep_size=2)
    from megatron_rl.config import load_config

    with pytest.raises(jobtool.JobConfigError, match=r"ROLLOUT_TP_SIZE=3: the model's 128 experts .* do not divide"):
        jobtool.rollout_ep_size_of(load_config(recipe, files), 3, "sglang")
    (tmp_path / "dense").mkdir()
    dense = _fake_model_files(tmp_path / "dense", "qwen2.5-32b")
    assert _check(overrides=dense)["rollout_ep_size"] == 1 and _check(overrides=dense)["router_replay"] == 0
    with pytest.raises(jobtool.JobConfigError, match=r"ROLLOUT_EP_SIZE=4: the model .* has no routed experts"):
        _check(overrides=dense, rollout_ep_size=4)


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_engine_script_gpu_branch_passes_the_moe_flags(tmp_path, backend):
    """slurm/lib/engine.sh for a Mixture-of-Experts job (ROLLOUT_EP_SIZE=4, ROUTER_REPLAY=1, as train.sbatch
    exports them from `jobtool.py check`): SGLang gets `--ep-size 4 --enable-return-routed-experts` before
    SGLANG_EXTRA_ARGS; vLLM gets `launcher.build_vllm_command`'s line with `--enable-expert-parallel
    --enable-return-routed-experts`. Stand-in engine modules record the argv (neither engine runs here)."""
    import json
    import os
    import subprocess
    import sys

    from megatron_rl.rollout.launcher import build_vllm_command

    _fake_module(tmp_path / "fake", "sglang.launch_server" if backend == "sglang" else "vllm.entrypoints.cli.main")
    job = tmp_path / "job"
    (job / "urls").mkdir(parents=True)
    (job / "hosts").write_text("gpu-node-1 127.0.0.1\n")
    base = 20000 + 16 * 8 * (os.getpid() % 60) + (64 if backend == "sglang" else 96)
    env = dict(os.environ, SLURMD_NODENAME="gpu-node-1", SLURM_LOCALID="0", SLURM_PROCID="0", JOB_DIR=str(job),
               PYTHON=sys.executable, REPO=str(REPO), MEGATRON_RL_DEVICE="gpu", MODEL_PATH="/ckpt/Qwen3-30B-A3B",
               ROLLOUT_BASE_PORT=str(base), ROLLOUT_TP_SIZE="4", ROLLOUT_MEM_FRACTION="0.85", ROLLOUT_SEED="7",
               SGLANG_EXTRA_ARGS="--enable-metrics", ROLLOUT_BACKEND=backend, VLLM_PYTHON=sys.executable,
               ROLLOUT_EP_SIZE="4", ROUTER_REPLAY="1", FAKE_OUT=str(tmp_path / "engine.json"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    env.pop("JOB_VLLM_EXTRA_ARGS", None)
    env.pop("VLLM_EXTRA_ARGS", None)
    proc = subprocess.run(["bash", str(REPO / "slurm/lib/engine.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads((tmp_path / "engine.json").read_text())["argv"]
    if backend == "sglang":
        assert argv[-4:] == ["--ep-size", "4", "--enable-return-routed-experts", "--enable-metrics"]
        assert argv[:4] == ["--model-path", "/ckpt/Qwen3-30B-A3B", "--tp-size", "4"]
    else:
        want = build_vllm_command("/ckpt/Qwen3-30B-A3B", python=sys.executable, host="127.0.0.1", port=base, tp_size=4,
                                  gpu_memory_utilization=0.85, seed=7, enable_expert_parallel=True,
                                  enable_return_routed_experts=True)
        assert argv == want[3:]
        assert "--enable-expert-parallel" in argv and "--enable-return-routed-experts" in argv
