"""`ServerFleet.report_failure` when the last server up fails and this process cannot restart it
(another node's colocated engine): it restarts a down server it can restart instead of stopping
the run (found by the breaker: the outcome depended on which engine died last)."""

import pytest

from megatron_rl.errors import RolloutServerError
from megatron_rl.rollout.fleet import ServerFleet


class FakeClient:
    def __init__(self, url: str) -> None:
        self.base_url = url
        self.healthy = True

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        return self.healthy


class FakeProcess:
    """A started server: dead until `restart()`."""

    def __init__(self, client: FakeClient) -> None:
        self.client, self.running, self.restarts = client, True, 0
        self.log_path = "fake.log"
        self.process = type("P", (), {"pid": 4242})()

    def alive(self) -> bool:
        return self.running

    def restart(self) -> None:
        self.running, self.client.healthy = True, True
        self.restarts += 1

    def log_tail(self, lines: int = 20) -> str:
        return ""


def _fleet(max_restarts: int = 2):
    local, remote = FakeClient("http://node0:1"), FakeClient("http://node1:1")
    proc = FakeProcess(local)
    resynced = []
    fleet = ServerFleet([local, remote], [proc, None], max_restarts=max_restarts, resync=resynced.append)
    return fleet, local, remote, proc, resynced


def test_the_restartable_server_is_restarted_when_the_last_one_down_is_remote():
    fleet, local, remote, proc, resynced = _fleet()
    proc.running, local.healthy = False, False
    fleet.report_failure(0, 0, ConnectionError("reset"))  # dropped: node 1's engine is still up
    assert fleet.up_indices() == [1] and proc.restarts == 0
    remote.healthy = False
    fleet.report_failure(1, 0, ConnectionError("reset"))  # none up: node 0's engine comes back
    assert proc.restarts == 1 and fleet.restarts == 1 and fleet.up_indices() == [0]
    assert resynced == [[local]]


def test_the_budget_still_applies():
    fleet, local, remote, proc, _ = _fleet(max_restarts=0)
    proc.running, local.healthy = False, False
    fleet.report_failure(0, 0, ConnectionError("reset"))
    remote.healthy = False
    with pytest.raises(RolloutServerError, match=r"restart budget is spent \(rollout.max_server_restarts=0\)"):
        fleet.report_failure(1, 0, ConnectionError("reset"))
