"""The rollout controller's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from controlplane.conf import Tunable

ROLLOUT_SWEEP_INTERVAL_SECONDS = Tunable("ROLLOUT_SWEEP_INTERVAL_SECONDS", 10.0, "beat runs the sweeper this often")
ROLLOUT_SWEEP_GRACE_SECONDS = Tunable(
    "ROLLOUT_SWEEP_GRACE_SECONDS", 15.0, "a rollout whose next reconcile is this late is restarted (its task was lost)"
)
ROLLOUT_ACK_WAIT_SECONDS = Tunable(
    "ROLLOUT_ACK_WAIT_SECONDS", 5.0, "a reconcile waits this long in-process for gateway acks before it re-queues"
)
ROLLOUT_MAX_TICKS_PER_TASK = Tunable(
    "ROLLOUT_MAX_TICKS_PER_TASK", 50, "ticks one task runs back to back before it re-queues itself"
)
ROLLOUT_GATE_TIMEOUT_SECONDS = Tunable(
    "ROLLOUT_GATE_TIMEOUT_SECONDS", 120.0, "one consistency-gate replay's HTTP timeout"
)
