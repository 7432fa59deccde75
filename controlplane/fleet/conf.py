"""The fleet's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from controlplane.conf import Tunable

HEARTBEAT_INTERVAL_SECONDS = Tunable(
    "HEARTBEAT_INTERVAL_SECONDS",
    2.0,
    "what workers are told to use while the fleet is small (the floor of the interval that grows with it)",
)
HEARTBEAT_TARGET_RATE = Tunable(
    "HEARTBEAT_TARGET_RATE",
    200.0,
    "heartbeats a second the whole fleet may send: past this × `HEARTBEAT_INTERVAL_SECONDS` live workers, "
    "each is told a longer interval (whole seconds), and the health sweep's limits scale with the interval told",
)
HEARTBEAT_INTERVAL_MAX_SECONDS = Tunable(
    "HEARTBEAT_INTERVAL_MAX_SECONDS",
    15.0,
    "the longest interval workers are told, however large the fleet (the rate may pass the target past it)",
)
HEARTBEAT_THREADS = Tunable(
    "HEARTBEAT_THREADS", 8, "threads (and database connections) per web process serving heartbeats"
)
WORKER_UNHEALTHY_AFTER_SECONDS = Tunable(
    "WORKER_UNHEALTHY_AFTER_SECONDS",
    10.0,
    "silence before a worker is marked unhealthy (at the base interval; a worker told a longer one, in proportion)",
)
WORKER_OUTAGE_GRACE_SECONDS = Tunable(
    "WORKER_OUTAGE_GRACE_SECONDS",
    32.0,
    "after the control plane's own outage, the silence allowed a worker (the agents' longest backoff, 30 s, and more)",
)
WORKER_OFFLINE_AFTER_SECONDS = Tunable(
    "WORKER_OFFLINE_AFTER_SECONDS", 60.0, "silence before a worker is marked offline (likewise in proportion)"
)
HEALTH_SWEEP_INTERVAL_SECONDS = Tunable(
    "HEALTH_SWEEP_INTERVAL_SECONDS", 5.0, "how often Celery beat runs the health sweep"
)
DRIFT_GRACE_SECONDS = Tunable("DRIFT_GRACE_SECONDS", 120.0, "desired ≠ running for longer than this counts as drift")
