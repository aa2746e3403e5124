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
