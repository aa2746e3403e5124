"""The receiver's weight-update session (megatron_rl.weight_sync.session) without HTTP: open/close, call
numbering, the refuse rule, the "+partial" rule, groups, the receive buffer, the model-update lock,
and the fault-injection test hook. Broadcasts run on a real one-rank gloo group (rank 0 sends to
itself, so received tensors keep what they held); a broken collective is simulated by patching
``torch.distributed.broadcast``."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch

from megatron_rl.weight_sync.session import (
    PARTIAL_VERSION_SUFFIX,
    ModelUpdateLock,
    SessionError,
    UpdateSession,
)
from megatron_rl.engine.test_hooks import FAULT_REFUSE_UPDATES_ENV, refused_update_calls
from megatron_rl.ports import find_free_port

_names = (f"test_update_session_{i}" for i in itertools.count())


class FakeTarget:
    """Two parameters, a version label, a lock; ``load_weights`` is all or nothing like the engine's."""

    def __init__(self, *, direct: bool = False, load_error: Exception | None = None) -> None:
        self.weight_version = "v0"
        self.model_lock = threading.Lock()
        self.params = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
        self.direct = direct
        self.load_error = load_error
        self.loads: list[list[str]] = []

    def direct_targets(self, names, dtypes, shapes):
        return [self.params[n] for n in names] if self.direct else None

    def load_weights(self, named_tensors):
        if self.load_error is not None:
            raise self.load_error
        unknown = [n for n, _ in named_tensors if n not in self.params]
        if unknown:
            raise ValueError(f"unknown parameter name(s) {unknown}")
        for n, t in named_tensors:
            self.params[n].copy_(t)
        self.loads.append([n for n, _ in named_tensors])


def _session(target: FakeTarget | None = None, refused_calls: frozenset[int] = frozenset()) -> UpdateSession:
    return UpdateSession(target or FakeTarget(), group_timeout_s=30, refused_calls=refused_calls,
                         refused_by=FAULT_REFUSE_UPDATES_ENV)


def _join(session: UpdateSession) -> str:
    name = next(_names)
    session.init_group(name=name, backend="gloo", host="127.0.0.1", port=find_free_port(), world_size=1, rank=0)
    return name


@pytest.fixture
def joined():
    """A session on a fresh target with one joined one-rank gloo group; the group is destroyed after."""
    sessions = []

    def make(target: FakeTarget | None = None, refused_calls: frozenset[int] = frozenset()):
        s = _session(target, refused_calls)
        name = _join(s)
        sessions.append(s)
        return s, name

    yield make
    for s in sessions:
        for name in list(s.groups):
            s.destroy_group(name)


def _update(s: UpdateSession, group: str, *, names=("a",), version: str | None = None, load_format=None):
    shapes = {"a": [2, 3], "b": [4], "zz": [1]}
    call = s.start_update(names=list(names), dtypes=["float32"] * len(names), shapes=[shapes[n] for n in names],
                          group_name=group, load_format=load_format, weight_version=version)
    s.receive(call)
    return call


# ---- open / close ----------------------------------------------------------------------------


def test_begin_twice_is_refused_and_end_closes():
    s = _session()
    assert not s.is_open
    s.begin()
    assert s.is_open and not s.wrote
    with pytest.raises(SessionError, match=r"called while a weight update session is already open; "
                                           r"call end_weight_update\(\) first"):
        s.begin()
    assert s.is_open
    s.end()
    assert not s.is_open
    s.begin()  # a closed session opens again
    assert s.is_open


def test_end_without_begin_is_refused():
    s = _session()
    with pytest.raises(SessionError, match=r"end_weight_update\(\) called without an open weight update session"):
        s.end()
    s.begin()
    s.end()
    with pytest.raises(SessionError, match="without an open"):
        s.end()


def test_begin_for_a_draft_model_is_refused():
    s = _session()
    with pytest.raises(SessionError, match="the server has no draft model"):
        s.begin("draft")
    assert not s.is_open
    s.begin("target")
    assert s.is_open


# ---- update calls: numbering and refusals -----------------------------------------------------


def test_update_outside_a_session_is_refused_and_still_numbered(joined):
    s, group = joined()
    with pytest.raises(SessionError) as e:
        s.start_update(names=["a"], dtypes=["float32"], shapes=[[2, 3]], group_name=group)
    assert str(e.value) == (
        "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
    assert s.calls == 1
    assert s.target.weight_version == "v0"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(names=["a"], dtypes=["float32", "float32"], shapes=[[2, 3]]),
         "names, dtypes and shapes must be non-empty lists of one length, got 1, 2, 1"),
        (dict(names=[], dtypes=[], shapes=[]), "must be non-empty lists of one length, got 0, 0, 0"),
        (dict(load_format="safetensors"), "load_format 'safetensors' is not supported"),
        (dict(selector="draft"), "the server has no draft model"),
        (dict(dtypes=["float99"]), "Failed to update weights: "),
        (dict(group_name="nope"), "no weight update group named 'nope'"),
    ],
)
def test_a_refusal_before_any_write_changes_nothing(joined, kwargs, message):
    s, group = joined()
    s.begin()
    call = dict(names=["a"], dtypes=["float32"], shapes=[[2, 3]], group_name=group) | kwargs
    with pytest.raises(SessionError) as e:
        s.start_update(**call)
    assert message in str(e.value)
    assert str(e.value).endswith(". No weight was changed.")
    assert s.target.weight_version == "v0" and not s.wrote and s.is_open


def test_calls_are_numbered_from_one(joined):
    s, group = joined()
    s.begin()
    assert _update(s, group).number == 1
    assert _update(s, group, names=("b",)).number == 2
    assert s.calls == 2


# ---- the +partial rule ------------------------------------------------------------------------


def test_a_write_then_a_refusal_marks_the_version_partial_once(joined):
    s, group = joined()
    s.begin()
    _update(s, group)  # bucket 1 lands, no version yet
    assert s.wrote and s.target.loads == [["a"]]
    with pytest.raises(SessionError) as e:
        s.start_update(names=["b"], dtypes=["float32"], shapes=[[4]], group_name="gone")
    msg = str(e.value)
    assert "no weight update group named 'gone'." in msg
    assert "This call changed no weight, but earlier calls of this session did." in msg
    assert "weight_version is now 'v0+partial'" in msg and msg.endswith("send all of them again.")
    assert s.target.weight_version == "v0" + PARTIAL_VERSION_SUFFIX
    with pytest.raises(SessionError):  # a second refusal does not add a second suffix
        s.start_update(names=["b"], dtypes=["float99"], shapes=[[4]], group_name=group)
    assert s.target.weight_version == "v0+partial"


def test_a_call_that_sets_a_version_ends_the_mix(joined):
    s, group = joined()
    s.begin()
    _update(s, group)
    assert s.wrote
    _update(s, group, names=("b",), version="1")  # the last bucket of a complete sync
    assert s.target.weight_version == "1" and not s.wrote
    with pytest.raises(SessionError) as e:
        s.start_update(names=["b"], dtypes=["float32"], shapes=[[4]], group_name="gone")
    assert str(e.value).endswith(". No weight was changed.")
    assert s.target.weight_version == "1"


def test_a_full_sync_clears_partial(joined):
    s, group = joined()
    s.begin()
    _update(s, group)
    with pytest.raises(SessionError):
        s.start_update(names=["b"], dtypes=["float32"], shapes=[[4]], group_name="gone")
    assert s.target.weight_version == "v0+partial"
    _update(s, group, names=("a", "b"), version="2")
    assert s.target.weight_version == "2"


def test_a_refusal_outside_the_session_that_wrote_does_not_mark(joined):
    s, group = joined()
    s.begin()
    _update(s, group)
    s.end()
    with pytest.raises(SessionError, match="must run between"):  # closed: not even a refusal of the session
        s.start_update(names=["a"], dtypes=["float32"], shapes=[[2, 3]], group_name=group)
    s.begin()  # a new session starts with nothing written
    assert not s.wrote
    with pytest.raises(SessionError) as e:
        s.start_update(names=["a"], dtypes=["float32"], shapes=[[2, 3]], group_name="gone")
    assert str(e.value).endswith(". No weight was changed.")
    assert s.target.weight_version == "v0"


def test_refused_after_receiving_follows_the_rule(joined):
    s, group = joined()
    s.begin()
    with pytest.raises(SessionError) as e:  # nothing written yet: the version stays
        _update(s, group, names=("zz",))
    assert "Failed to update weights: unknown parameter name(s) ['zz']. No weight was changed." == str(e.value)
    assert s.target.weight_version == "v0" and not s.wrote
    _update(s, group)
    with pytest.raises(SessionError) as e:
        _update(s, group, names=("zz",))
    assert "earlier calls of this session did" in str(e.value)
    assert s.target.weight_version == "v0+partial"


def test_a_failed_load_after_an_earlier_write_marks_partial_without_claiming_this_call_wrote_nothing(joined):
    s, group = joined()
    s.begin()
    _update(s, group)
    s.target.load_error = RuntimeError("out of memory")
    with pytest.raises(SessionError) as e:
        _update(s, group, names=("b",), version="3")
    msg = str(e.value)
    assert "Failed to update weights: out of memory; the group may be out of step" in msg
    assert "This call changed no weight" not in msg
    assert s.target.weight_version == "v0+partial"  # the call's version is not set


def test_receiving_in_place_counts_as_written_from_the_first_byte(joined, monkeypatch):
    """A direct (in-place) receive cut off mid-way leaves a mix even in the session's first call."""
    s, group = joined(FakeTarget(direct=True))
    s.begin()

    def broken(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(torch.distributed, "broadcast", broken)
    with pytest.raises(SessionError) as e:
        _update(s, group, names=("a", "b"), version="1")
    assert "Connection closed by peer; the group may be out of step (destroy and re-create it" in str(e.value)
    assert s.target.weight_version == "v0+partial" and s.wrote
    monkeypatch.undo()
    _update(s, group, names=("a", "b"), version="1")
    assert s.target.weight_version == "1" and not s.wrote
    assert s.target.loads == []  # in place: load_weights is never needed


# ---- the fault-injection hook -----------------------------------------------------------------


def test_refused_calls_follow_the_rule_and_others_go_through(joined):
    s, group = joined(refused_calls=frozenset({2, 4}))
    s.begin()
    _update(s, group)  # call 1
    with pytest.raises(SessionError) as e:  # call 2
        _update(s, group, names=("b",))
    assert f"Failed to update weights: call 2 refused by {FAULT_REFUSE_UPDATES_ENV}." in str(e.value)
    assert "earlier calls of this session did" in str(e.value) and "'v0+partial'" in str(e.value)
    _update(s, group, names=("a", "b"), version="1")  # call 3: the retry's full sync
    assert s.target.weight_version == "1"
    s.end()
    with pytest.raises(SessionError) as e:  # call 4: refused by the hook before the session check
        _update(s, group)
    assert str(e.value) == f"Failed to update weights: call 4 refused by {FAULT_REFUSE_UPDATES_ENV}. " \
                           "No weight was changed."
    assert s.calls == 4


def test_refused_update_calls_reads_the_variable(monkeypatch):
    monkeypatch.delenv(FAULT_REFUSE_UPDATES_ENV, raising=False)
    assert refused_update_calls() == frozenset()
    monkeypatch.setenv(FAULT_REFUSE_UPDATES_ENV, " ")
    assert refused_update_calls() == frozenset()
    monkeypatch.setenv(FAULT_REFUSE_UPDATES_ENV, "2, 3,")
    assert refused_update_calls() == frozenset({2, 3})
    monkeypatch.setenv(FAULT_REFUSE_UPDATES_ENV, "two")
    with pytest.raises(ValueError, match=f"{FAULT_REFUSE_UPDATES_ENV}='two': expected comma-separated"):
        refused_update_calls()
    monkeypatch.setenv(FAULT_REFUSE_UPDATES_ENV, "0,1")
    with pytest.raises(ValueError, match="call numbers start at 1"):
        refused_update_calls()


# ---- groups and the receive buffer ------------------------------------------------------------


def test_groups_by_name(joined):
    s, group = joined()
    with pytest.raises(SessionError, match=f"Failed to init group: a group named '{group}' already exists"):
        s.init_group(name=group, backend="gloo", host="127.0.0.1", port=find_free_port(), world_size=1, rank=0)
    if not torch.cuda.is_available():
        with pytest.raises(SessionError, match="backend 'nccl' needs CUDA"):
            s.check_new_group("other", "nccl")
    with pytest.raises(SessionError, match="Failed to destroy group: no group named 'nope'"):
        s.destroy_group("nope")
    s.destroy_group(group)
    assert group not in s.groups
    with pytest.raises(SessionError, match="Failed to destroy group: no group named"):
        s.destroy_group(group)
    s.init_group(name=group, backend="gloo", host="127.0.0.1", port=find_free_port(), world_size=1, rank=0)
    assert group in s.groups  # the name is free again after destroy


def test_a_failed_rendezvous_is_refused():
    s = _session()
    with pytest.raises(SessionError, match="Failed to init group: "):
        s.init_group(name=next(_names), backend="gloo", host="127.0.0.1", port=find_free_port(), world_size=1,
                     rank=1)  # rank outside the world
    assert s.groups == {}


def test_the_receive_buffer_is_kept_and_grown(joined):
    s, group = joined()
    s.begin()
    assert s.recv_buffer is None
    _update(s, group, names=("a", "b"), load_format="flattened_bucket")
    first = s.recv_buffer
    assert first is not None and first.dtype == torch.uint8 and first.numel() >= (6 + 4) * 4
    _update(s, group, names=("b",))  # smaller: the same buffer
    assert s.recv_buffer is first
    s.target.params["c"] = torch.zeros(64)
    call = s.start_update(names=["c"], dtypes=["float32"], shapes=[[64]], group_name=group)
    s.receive(call)  # larger: grown
    assert s.recv_buffer.numel() >= 64 * 4 > first.numel()
    assert s.target.loads == [["a", "b"], ["b"], ["c"]]


# ---- the model-update lock ---------------------------------------------------------------------


def test_model_update_lock_orders_writers_after_readers():
    async def scenario():
        lock = ModelUpdateLock()
        events = []
        await lock.acquire_read()

        async def writer():
            await lock.acquire_write(wait_for_readers=True)
            events.append("write")
            await lock.release_write()

        w = asyncio.create_task(writer())
        await asyncio.sleep(0.05)
        assert lock.writer_active and events == []  # waits for the reader in flight
        reader2 = asyncio.create_task(lock.acquire_read())
        await asyncio.sleep(0.05)
        assert not reader2.done()  # a new reader waits for the writer
        events.append("read done")
        await lock.release_read()
        await w
        await reader2
        assert events == ["read done", "write"] and not lock.writer_active
        await lock.release_read()
        await lock.acquire_write(wait_for_readers=False)  # a paused server does not wait for readers
        await lock.release_write()

    asyncio.run(scenario())
