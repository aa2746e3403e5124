"""The colocated memory protocol's order and readiness polling (issue 17, CASES.md N11), with
fake engines on a fake device ledger (24 GiB; trainer 20 resident / 2 offloaded; engine weights
8, KV 10, one bucket 1)."""

import pytest
import torch

from megatron_rl.errors import WeightSyncError
from megatron_rl.trainer.offload import Colocation
from megatron_rl.weight_sync.colocated import ColocatedWeightSender, EngineMemory, PhaseLog


class Ledger:
    def __init__(self):
        self.trainer, self.weights, self.kv, self.bucket = 2, 8, 10, 0
        self.peak, self.calls = 0, []

    def note(self, call):
        self.calls.append(call)
        self.peak = max(self.peak, self.trainer + self.weights + self.kv + self.bucket)


class FakeEngine:
    base_url = "http://fake:1"

    def __init__(self, ledger):
        self.l = ledger
        self.version = "0"

    def release_memory_occupation(self, tags):
        self.l.weights, self.l.kv = (0 if "weights" in tags else self.l.weights), (0 if "kv_cache" in tags else self.l.kv)
        self.l.note(("release", tuple(tags)))
        return {"rss_before": 18 << 30, "rss_after": 0}

    def resume_memory_occupation(self, tags):
        if "weights" in tags:
            self.l.weights = 8
        if "kv_cache" in tags:
            self.l.kv = 10
        self.l.note(("resume", tuple(tags)))
        return {}

    def update_weights_from_tensor(self, payloads, **kw):
        self.l.bucket = 1
        self.l.note(("update", kw.get("weight_version")))
        self.l.bucket = 0
        if kw.get("weight_version"):
            self.version = kw["weight_version"]
        return {"success": True}

    def pause_generation(self, mode):
        self.l.note(("pause",))

    def begin_weight_update(self, **kw):
        self.l.note(("begin",))

    def end_weight_update(self, **kw):
        self.l.note(("end",))

    def flush_cache(self, **kw):
        self.l.note(("flush",))
        return ""

    def weight_version(self):
        return self.version

    def update_weight_version(self, new_version, abort_all_requests=False):
        assert not abort_all_requests  # the sync never aborts to relabel
        self.l.note(("label", new_version))
        self.version = new_version

    def continue_generation(self):
        self.l.note(("continue",))

    def generate(self):
        assert self.l.weights and self.l.kv, "a forward on released memory"
        self.l.note(("generate",))


class FakeOffload:
    def __init__(self, ledger):
        self.l = ledger

    def onload(self):
        self.l.trainer = 20
        self.l.note(("onload",))

    def offload(self):
        self.l.trainer = 2
        self.l.note(("offload",))


def _step(ledger, engine, colocation, sender, version):
    engine.generate()
    colocation.before_train()
    ledger.note(("train",))
    colocation.after_train()
    sender.begin_update()
    sender.send([(f"w{i}", torch.ones(4)) for i in range(3)], weight_version=version)
    sender.finish_update(version)
    engine.generate()


def test_order_and_peaks_on_the_ledger():
    ledger = Ledger()
    engine = FakeEngine(ledger)
    log = PhaseLog()
    memory = EngineMemory(lambda: [engine], log)
    colocation = Colocation(FakeOffload(ledger), memory, log, barrier=lambda: ledger.note(("barrier",)))
    sender = ColocatedWeightSender([engine], memory=memory, bucket_size_mib=1e-5, dtype=torch.float32)
    sender.init_group()
    for v in ("1", "2"):
        _step(ledger, engine, colocation, sender, v)
        metrics = colocation.metrics()
        assert {"colocate/engine_release_s", "colocate/trainer_onload_s", "colocate/trainer_offload_s",
                "colocate/engine_resume_weights_s", "colocate/engine_resume_kv_cache_s"} <= set(metrics)
    names = [c[0] for c in ledger.calls]
    one_step = names[:names.index("generate", 1) + 1]
    assert one_step == ["generate", "release", "barrier", "onload", "train", "offload", "resume", "pause", "begin",
                        "update", "update", "update", "end", "resume", "flush", "label", "continue", "generate"]
    assert ledger.calls[1] == ("release", ("weights", "kv_cache"))
    assert ledger.calls[6] == ("resume", ("weights",)) and ledger.calls[13] == ("resume", ("kv_cache",))
    assert ledger.peak <= 24  # 20 (train), 2 + 8 + 1 (update), 2 + 8 + 10 (generate)
    # the wrong order (weights resumed while the trainer is on the device) is never issued
    for i, c in enumerate(ledger.calls):
        if c == ("resume", ("weights",)):
            assert names[:i][::-1].index("offload") < names[:i][::-1].index("onload")


def test_first_publish_resumes_nothing():
    ledger = Ledger()
    engine = FakeEngine(ledger)
    memory = EngineMemory(lambda: [engine], PhaseLog())
    sender = ColocatedWeightSender([engine], memory=memory, dtype=torch.float32)
    sender.begin_update()
    sender.send([("w", torch.ones(2))], weight_version="0")
    sender.finish_update("0")
    assert "resume" not in [c[0] for c in ledger.calls]


def test_readiness_poll_waits_for_the_memory(monkeypatch):
    readings = iter([70.2, 70.2, 66.0, 12.5])
    sleeps = []
    monkeypatch.setattr("time.sleep", lambda s: sleeps.append(s))
    memory = EngineMemory(lambda: [FakeEngine(Ledger())], PhaseLog(), release_poll=lambda: next(readings),
                          release_threshold_gib=0.8 * 80)
    memory.release()
    assert len(sleeps) == 3  # onloads at the 4th reading


def test_readiness_poll_gives_up_naming_engine_and_reading(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    memory = EngineMemory(lambda: [FakeEngine(Ledger())], PhaseLog(), release_poll=lambda: 70.2,
                          release_threshold_gib=64.0, max_polls=60)
    with pytest.raises(WeightSyncError, match=r"http://fake:1 .* still uses 70.2 GiB .* after 60 polls"):
        memory.release()


def test_a_node_without_engines_up_sends_nothing_and_reads_no_dtype():
    """Another node's leader whose engines are all down: its sender has no engines of its own; it
    must not ask the other nodes' engines (their URLs may be unreachable from there) and sends
    nothing (found by the breaker)."""
    class Unreachable:
        base_url = "http://127.0.0.1:1"

        def model_info(self):
            raise AssertionError("a node without engines read another node's /model_info")

    sender = ColocatedWeightSender([], control_clients=[Unreachable()], load_format=None)
    sender.init_group()
    stats = sender.send([("w", torch.ones(2))], weight_version="1")
    assert sender.initialized and stats["num_tensors"] == 1 and stats["bytes"] == 8
