"""The torch range: setup.py's install_requires, constraints.txt and the start-up check of the
modules that touch torch internals (megatron_rl/versions.py) agree."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from megatron_rl import versions
from megatron_rl.versions import check_torch_version

REPO = Path(__file__).resolve().parents[2]


def test_supported_range_is_enforced(caplog):
    for ok in ("2.6.0", "2.6.0+cpu", "2.9.1", "2.14.1", "2.14.1+cu130"):
        check_torch_version("test", ok)
    for bad in ("2.5.1", "2.0.0", "1.13.1", "3.0.0"):
        with pytest.raises(RuntimeError, match=r"supports torch >=2\.6\.0,<3 .*this is torch " + re.escape(bad)):
            check_torch_version("megatron_rl.parallel.cpu_compat", bad)
    versions._warned.discard("newer")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.versions"):
        check_torch_version("newer", "2.16.0a0+nv25.10")  # an NGC pre-release build: allowed, warned once
        check_torch_version("newer", "2.16.0a0+nv25.10")
    assert len([r for r in caplog.records if "newer than the newest tested" in r.message]) == 1
    check_torch_version("installed")  # the torch of this environment is supported


def test_setup_ranges_constraints_and_check_agree():
    setup_py = (REPO / "setup.py").read_text()
    assert '"torch>=2.6.0,<3"' in setup_py
    assert not re.search(r'"[\w-]+==', setup_py), "install_requires holds ranges; exact pins go to constraints.txt"
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)$", (REPO / "constraints.txt").read_text(), re.M))
    assert {"torch", "megatron-core", "transformers"} <= set(pins)
    tested = tuple(int(x) for x in pins["torch"].split(".")[:2])
    assert versions.TORCH_MIN <= tested <= versions.TORCH_TESTED[1]
    assert versions.TORCH_MIN == versions.TORCH_TESTED[0] == (2, 6)


def test_internals_users_check_at_start():
    for mod in ("parallel/cpu_compat.py", "weight_sync/group.py"):
        assert "check_torch_version(__name__)" in (REPO / "megatron_rl" / mod).read_text(), mod


def test_setup_sh_installs_with_constraints_and_restamps_on_change():
    sh = (REPO / "scripts" / "setup.sh").read_text()
    assert 'pip install -q -c constraints.txt -e ".[test]"' in sh
    assert "constraints.txt -nt" in sh and "setup.py -nt" in sh and "cksum" in sh
