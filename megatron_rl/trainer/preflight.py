"""Launch-time checks (placeholder until the config redesign lands)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def run_environment_checks(cfg) -> None:
    from megatron_rl.config.loader import environment_checks

    for desc, check in environment_checks(cfg):
        skipped = check()
        logger.info("environment check %s: %s", f"skipped ({skipped})" if skipped else "passed", desc)
