"""The asynchronous producer's admission control (`trainer/async_producer.py`, ALGORITHMS.md
section 8) with a simulated engine on real threads: cases N01 (eta = 0 is the synchronous step:
no generation on W0 while W0's batch trains; eta = 1 start versions [0,0,1]) and N03 (admission,
not discard: every prompt trained once, in order, staleness <= eta, the trainer's wait logged),
and N05's buffer rules (exactly one batch a take, no duplicates or gaps, a bounded queue, a failed
step named instead of an endless wait). Time units are short sleeps; every assertion is on order
and versions, which the gate fixes whatever the timing."""

import threading
import time
from types import SimpleNamespace

import pytest

from megatron_rl.trainer.async_producer import AsyncProducer, StalenessGate

UNIT = 0.02  # seconds of one simulated time unit


class _Sim:
    """A dataset of prompts P0, P1, ... drawn B per step; generation takes `gen_units(prompt)` time
    units (the step's prompts run concurrently: the step takes the longest); records for every step
    the published version when its generation started, and the intervals of generation."""

    def __init__(self, gate: StalenessGate, *, batch: int, gen_units) -> None:
        self.gate, self.batch, self.gen_units = gate, batch, gen_units
        self.cursor = 0
        self.start_versions: dict[int, int] = {}
        self.gen_intervals: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def produce(self, step: int):
        t0 = time.monotonic()
        self.start_versions[step] = self.gate.version
        prompts = list(range(self.cursor, self.cursor + self.batch))
        self.cursor += self.batch
        time.sleep(max(self.gen_units(p) for p in prompts) * UNIT)
        with self.lock:
            self.gen_intervals.append((t0, time.monotonic()))
        return SimpleNamespace(prompts=prompts, timings={})

    def snapshot(self) -> dict:
        return {"data": {"position": self.cursor}}


def _train(eta: int, steps: int, *, batch: int, gen_units, train_units: float):
    """The trainer's side of the loop: take step s, train (a sleep), publish version s."""
    gate = StalenessGate(eta, version=0)
    sim = _Sim(gate, batch=batch, gen_units=gen_units)
    ahead = AsyncProducer(sim.produce, sim.snapshot, gate, first=1, last=steps).start()
    trained, waits, train_intervals, staleness = [], [], [], []
    try:
        for step in range(1, steps + 1):
            produced, waited = ahead.take(step, resync=lambda: None)
            trained.append(produced.prompts)
            waits.append(waited)
            staleness.append((step - 1) - produced.start_version)  # trained version - start version
            t0 = time.monotonic()
            time.sleep(train_units * UNIT)
            train_intervals.append((t0, time.monotonic()))
            ahead.published(step)
    finally:
        ahead.close()
    return SimpleNamespace(sim=sim, trained=trained, waits=waits, train=train_intervals, staleness=staleness,
                           produced_state=produced.state)


def _overlaps(a: list, b: list) -> bool:
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


def test_n01_eta0_never_generates_while_the_trainer_trains():
    # 4 prompts a step, slow trainer (the case's 2 s, scaled): a leaky producer would refill meanwhile
    r = _train(0, 3, batch=4, gen_units=lambda p: 1, train_units=5)
    assert [r.sim.start_versions[s] for s in (1, 2, 3)] == [0, 1, 2]
    assert r.staleness == [0, 0, 0]
    assert not _overlaps(r.sim.gen_intervals, r.train)


def test_n01_eta1_starts_at_versions_0_0_1():
    r = _train(1, 3, batch=4, gen_units=lambda p: 1, train_units=5)
    assert [r.sim.start_versions[s] for s in (1, 2, 3)] == [0, 0, 1]
    assert r.staleness == [0, 1, 1]
    assert _overlaps(r.sim.gen_intervals, r.train)  # the point of it: generation overlaps training


def test_n03_admission_trains_every_prompt_once_in_order_with_bounded_staleness():
    # even prompts short (0.5 step durations), odd long (3); B = 2, eta = 1, 10 steps
    r = _train(1, 10, batch=2, gen_units=lambda p: 0.5 if p % 2 == 0 else 3, train_units=1)
    assert r.trained == [[2 * k, 2 * k + 1] for k in range(10)]  # admission order, nothing requeued
    flat = [p for b in r.trained for p in b]
    assert len(flat) == len(set(flat)) == 20
    assert sum(p % 2 for p in flat) / len(flat) == 0.5  # the long share is the data's
    assert max(r.staleness) <= 1
    assert sum(r.waits[1:]) > 0  # the trainer waits for the long groups instead of discarding them


def test_eta2_keeps_the_producer_at_most_three_steps_ahead_and_snapshots_each_step():
    gate = StalenessGate(2, version=0)
    sim = _Sim(gate, batch=2, gen_units=lambda p: 0)
    ahead = AsyncProducer(sim.produce, sim.snapshot, gate, first=1, last=10).start()
    try:
        deadline = time.monotonic() + 5
        while len(sim.start_versions) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert sorted(sim.start_versions) == [1, 2, 3]  # step 4 waits for version 1 (backpressure)
        produced, _ = ahead.take(1, resync=lambda: None)
        assert produced.state == {"data": {"position": 2}}  # the cursor right after step 1, not after step 3
        ahead.published(1)
        deadline = time.monotonic() + 5
        while 4 not in sim.start_versions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sim.start_versions[4] == 1
    finally:
        ahead.close()


def test_a_failed_step_is_raised_at_take_naming_the_error():
    gate = StalenessGate(1, version=0)

    def produce(step):
        if step == 2:
            raise RuntimeError("group s2-b0-p3: request timed out after 5 s")
        return SimpleNamespace(timings={})

    ahead = AsyncProducer(produce, dict, gate, first=1, last=3).start()
    try:
        ahead.take(1, resync=lambda: None)
        with pytest.raises(RuntimeError, match="s2-b0-p3"):
            ahead.take(2, resync=lambda: None)
    finally:
        ahead.close()


def test_a_resync_asked_by_the_producer_runs_on_the_main_thread_while_it_waits():
    gate = StalenessGate(1, version=0)
    ran_on = []

    def produce(step):
        ahead.request_resync(timeout=5)  # an engine restarted mid-rollout
        return SimpleNamespace(timings={})

    ahead = AsyncProducer(produce, dict, gate, first=1, last=1)
    ahead.start()
    try:
        ahead.take(1, resync=lambda: ran_on.append(threading.current_thread().name))
    finally:
        ahead.close()
    assert ran_on == [threading.main_thread().name]


def test_close_releases_a_producer_waiting_at_the_gate():
    gate = StalenessGate(0, version=0)
    sim = _Sim(gate, batch=1, gen_units=lambda p: 0)
    ahead = AsyncProducer(sim.produce, sim.snapshot, gate, first=1, last=5).start()
    ahead.take(1, resync=lambda: None)
    ahead.close(join_s=5)
    assert not ahead._thread.is_alive()
    assert sorted(sim.start_versions) == [1]


def test_gate_rejects_negative_eta():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(-1, version=0)


def _idle_producer():
    return AsyncProducer(lambda s: SimpleNamespace(), dict, StalenessGate(1, 0), first=1, last=1)


def test_while_the_main_thread_evaluates_a_resync_runs_on_the_asking_thread():
    """The evaluation's own requests find the engine dead: the main thread waits for them and cannot
    publish, so the re-sync runs on the rollout thread that asks, at once."""
    ahead = _idle_producer()
    ran, release = [], threading.Event()

    def publish():
        ran.append(threading.current_thread().name)
        release.wait(5)

    with ahead.evaluating(lambda: pytest.fail("nothing was pending")):
        t = threading.Thread(target=ahead.resync_from_thread, args=(publish,), name="eval-request")
        t.start()
        time.sleep(0.1)
        assert ran == ["eval-request"] and not ahead.resync_pending()
        release.set()
        t.join(5)
    assert not t.is_alive()


def test_leaving_the_evaluation_waits_for_a_resync_in_progress():
    ahead = _idle_producer()
    release, order = threading.Event(), []

    def publish():
        release.wait(5)
        order.append("published")

    def evaluation():
        with ahead.evaluating(lambda: None):
            threading.Thread(target=ahead.resync_from_thread, args=(publish,)).start()
            time.sleep(0.1)
        order.append("left")

    ev = threading.Thread(target=evaluation)
    ev.start()
    time.sleep(0.3)
    assert order == [] and ev.is_alive()  # still inside: the re-sync holds it
    release.set()
    ev.join(5)
    assert order == ["published", "left"]


def test_a_resync_pending_when_the_evaluation_starts_runs_first_on_the_main_thread():
    ahead = _idle_producer()
    waiter = threading.Thread(target=ahead.resync_from_thread, args=(lambda: pytest.fail("not here"),))
    waiter.start()
    deadline = time.monotonic() + 5
    while not ahead.resync_pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    ran = []
    with ahead.evaluating(lambda: ran.append(threading.current_thread() is threading.main_thread())):
        waiter.join(5)
    assert ran == [True] and not waiter.is_alive() and not ahead.resync_pending()


def test_a_resync_after_close_outside_an_evaluation_is_an_error():
    from megatron_rl.errors import RolloutServerError

    ahead = _idle_producer()
    ahead.close()
    with pytest.raises(RolloutServerError, match="could not be re-synced"):
        ahead.resync_from_thread(lambda: pytest.fail("the main thread publishes, not this one"))
