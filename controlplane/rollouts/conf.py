"""The rollout controller's settings, each overridable in settings.py or the
environment.

| setting | default | meaning |
|---|---|---|
| ROLLOUT_SWEEP_INTERVAL_SECONDS | 10.0 | beat runs the sweeper this often |
| ROLLOUT_SWEEP_GRACE_SECONDS | 15.0 | a rollout whose next reconcile is this late is restarted (its task was lost) |
| ROLLOUT_ACK_WAIT_SECONDS | 5.0 | a reconcile waits this long in-process for gateway acks before it re-queues |
| ROLLOUT_MAX_TICKS_PER_TASK | 50 | ticks one task runs back to back before it re-queues itself |
| ROLLOUT_GATE_TIMEOUT_SECONDS | 120.0 | one consistency-gate replay's HTTP timeout |
"""

from __future__ import annotations

from typing import Any

from controlplane.conf import setting_from

DEFAULTS: dict[str, Any] = {
    "ROLLOUT_SWEEP_INTERVAL_SECONDS": 10.0,
    "ROLLOUT_SWEEP_GRACE_SECONDS": 15.0,
    "ROLLOUT_ACK_WAIT_SECONDS": 5.0,
    "ROLLOUT_MAX_TICKS_PER_TASK": 50,
    "ROLLOUT_GATE_TIMEOUT_SECONDS": 120.0,
}


def get(name: str) -> Any:
    """settings.NAME, else the environment variable NAME, else the default."""
    return setting_from(DEFAULTS, name)
