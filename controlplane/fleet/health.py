"""Worker liveness and drift, decided from times alone. Pure: no Django.

A worker that misses heartbeats for ``unhealthy_after_seconds`` is unhealthy
(the gateway stops routing to it); after ``offline_after_seconds`` it is
offline. A heartbeat brings it back to whatever it reports. Drift is the
time a worker has spent not running the revision it should; it counts only
past a grace period, since every rollout makes a few seconds of honest drift.

Silence is the workers' only when the control plane could hear them. While
its database was down every heartbeat was refused, and the agents backed off;
so a worker last heard from before the control plane's own last failure is
judged on the silence since that failure, against a longer limit that
covers the agents' longest backoff, and nothing is judged at all until a
full heartbeat interval has passed since the failure.

A large fleet is told to heartbeat less often (``fleet_heartbeat_interval``),
so that the web tier's heartbeat load stays near a target rate; each worker
is then judged against the interval it was told (``Thresholds.for_interval``):
the same number of missed heartbeats, never a shorter silence than the
configured limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import IntEnum


class WorkerState(IntEnum):
    """Ordered: every state from UNHEALTHY up means "not heard from"."""

    REGISTERING = 0  # enrolled, no heartbeat yet
    READY = 1
    DRAINING = 2  # admits nothing new, finishing in-flight requests
    APPLYING = 3  # rebuilding its engine on a new profile (or loading)
    UNHEALTHY = 4  # missed heartbeats, or its agent says its engine cannot serve
    OFFLINE = 5  # missed heartbeats for long

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_lost(self) -> bool:
        return self >= WorkerState.UNHEALTHY


# What an agent reports (workers.contract.AGENT_STATES) → our state. An agent
# still loading its first engine is, to an operator, applying a profile.
AGENT_STATE_MAP: dict[str, WorkerState] = {
    "ready": WorkerState.READY,
    "draining": WorkerState.DRAINING,
    "applying": WorkerState.APPLYING,
    "loading": WorkerState.APPLYING,
    "unhealthy": WorkerState.UNHEALTHY,  # its engine stopped serving; the reason is Worker.health_error
}


@dataclass(frozen=True)
class Thresholds:
    unhealthy_after_seconds: float
    offline_after_seconds: float
    # After the control plane's own outage: no judging for one heartbeat
    # interval, and silence through it is allowed the agents' backoff.
    heartbeat_interval_seconds: float = 0.0
    outage_grace_seconds: float = 0.0

    def for_interval(self, interval_seconds: float | None) -> Thresholds:
        """The limits for a worker told to heartbeat every ``interval_seconds``:
        scaled with it from the base interval, so that a worker keeping to a
        longer interval misses no more heartbeats before it is marked than one
        at the base interval does. Never below the base limits; None (told
        nothing yet) is the base interval."""
        base = self.heartbeat_interval_seconds
        if interval_seconds is None or base <= 0 or interval_seconds <= base:
            return self
        factor = interval_seconds / base
        return replace(
            self,
            unhealthy_after_seconds=self.unhealthy_after_seconds * factor,
            offline_after_seconds=self.offline_after_seconds * factor,
            heartbeat_interval_seconds=interval_seconds,
        )


def fleet_heartbeat_interval(
    num_workers: int, *, target_rate: float, floor_seconds: float, ceiling_seconds: float
) -> float:
    """The interval to tell every worker, so that ``num_workers`` heartbeat at
    most ``target_rate`` times a second in all: never below ``floor_seconds``
    (the configured interval, which small fleets keep), never above
    ``ceiling_seconds`` (past it the rate exceeds the target: a dead worker
    must still be noticed in time). Above the floor it is rounded up to whole
    seconds, so the fleet holds few distinct intervals and a slowly growing
    fleet does not change it at every enrollment."""
    if target_rate <= 0:
        return floor_seconds
    needed_seconds = num_workers / target_rate
    if needed_seconds <= floor_seconds:
        return floor_seconds
    return max(floor_seconds, min(ceiling_seconds, float(math.ceil(needed_seconds))))


def liveness(
    current: WorkerState,
    last_seen: datetime,
    now: datetime,
    limits: Thresholds,
    control_plane_failed_at: datetime | None = None,
) -> WorkerState:
    """The state a worker should be in, given when it was last heard from and
    when the control plane itself last failed to record a heartbeat.

    Only ever moves a worker down to UNHEALTHY or OFFLINE; coming back is the
    heartbeat's business (it carries the state the worker reports).
    """
    unhealthy_after_seconds = limits.unhealthy_after_seconds
    if control_plane_failed_at is not None:
        if (now - control_plane_failed_at).total_seconds() < limits.heartbeat_interval_seconds:
            return current  # the workers have not yet had one chance to be heard
        if last_seen < control_plane_failed_at:
            last_seen = control_plane_failed_at
            unhealthy_after_seconds = max(unhealthy_after_seconds, limits.outage_grace_seconds)
    silent_seconds = (now - last_seen).total_seconds()
    if silent_seconds >= limits.offline_after_seconds:
        return WorkerState.OFFLINE
    if silent_seconds >= unhealthy_after_seconds and current < WorkerState.UNHEALTHY:
        return WorkerState.UNHEALTHY
    return current


def drift_since(
    previous: datetime | None, desired_revision_id: int | None, running_revision_id: int | None, now: datetime
) -> datetime | None:
    """When the current spell of drift began; None while in step.

    No desired revision means nothing to drift from."""
    if desired_revision_id is None or desired_revision_id == running_revision_id:
        return None
    return previous or now


def is_drifting(since: datetime | None, now: datetime, grace_seconds: float) -> bool:
    return since is not None and now - since >= timedelta(seconds=grace_seconds)
