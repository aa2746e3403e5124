"""`EngineSet.restart_dead` (a colocated node leader's own engines, issue 17): an engine whose
process exited or that no longer answers `/health` (hung) is restarted, within the node's
`rollout.max_server_restarts`; a healthy one is left alone (the hung case was found by the
breaker: only exited engines were restarted)."""

from types import SimpleNamespace

from megatron_rl.parallel.nodes import NodeInfo
from megatron_rl.rollout.engine_set import EngineSet


class FakeServer:
    def __init__(self, exited: bool = False, healthy: bool = True) -> None:
        self.exit_code = 1 if exited else None
        self.healthy, self.restarts, self.log_path, self.port = healthy, 0, "fake.log", 1
        self.checks = 0

    @property
    def process(self):
        return SimpleNamespace(poll=lambda: self.exit_code, pid=1)

    def client(self, **kwargs):
        def is_healthy(timeout_s=2.0):
            self.checks += 1
            return self.healthy

        return SimpleNamespace(is_healthy=is_healthy, close=lambda: None)

    def restart(self) -> None:
        self.exit_code, self.healthy = None, True
        self.restarts += 1

    def stop(self) -> None:
        self.exit_code = 0


def _engines(servers, budget: int) -> EngineSet:
    cfg = SimpleNamespace(rollout=SimpleNamespace(colocate=True, server_urls=["http://given:1"],  # no launch
                                                  max_server_restarts=budget), run_dir="unused")
    engines = EngineSet(cfg, NodeInfo(1, 2, 0, 1))
    engines.processes = servers
    return engines


def test_exited_and_hung_engines_are_restarted_healthy_ones_are_not():
    exited, hung, fine = FakeServer(exited=True), FakeServer(healthy=False), FakeServer()
    engines = _engines([exited, hung, fine], budget=3)
    assert engines.restart_dead() == 2
    assert (exited.restarts, hung.restarts, fine.restarts) == (1, 1, 0) and engines.restarts == 2
    assert engines.restart_dead() == 0  # all answer now


def test_a_hung_engine_past_the_budget_is_not_checked_again():
    hung = FakeServer(healthy=False)
    engines = _engines([hung], budget=0)
    assert engines.restart_dead() == 0 and hung.checks == 1
    assert engines.restart_dead() == 0 and hung.checks == 1  # no 5 s health timeout every step


def test_the_node_budget_is_kept():
    first, second = FakeServer(exited=True), FakeServer(exited=True)
    engines = _engines([first, second], budget=1)
    assert engines.restart_dead() == 1 and (first.restarts, second.restarts) == (1, 0)
    assert engines.restart_dead() == 0 and second.restarts == 0  # spent: it stays down
    engines.stop()
    assert first.exit_code == 0
