"""Worker liveness and drift, decided from times alone. Pure: no Django.

A worker that misses heartbeats for ``unhealthy_after_seconds`` is unhealthy
(the gateway stops routing to it); after ``offline_after_seconds`` it is
offline. A heartbeat brings it back to whatever it reports. Drift is the
time a worker has spent not running the revision it should; it counts only
past a grace period, since every rollout makes a few seconds of honest drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import IntEnum


class State(IntEnum):
    """Ordered: every state from UNHEALTHY up means "not heard from"."""

    REGISTERING = 0  # enrolled, no heartbeat yet
    READY = 1
    DRAINING = 2  # admits nothing new, finishing in-flight requests
    APPLYING = 3  # rebuilding its engine on a new profile (or loading)
    UNHEALTHY = 4  # missed heartbeats
    OFFLINE = 5  # missed heartbeats for long

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_lost(self) -> bool:
        return self >= State.UNHEALTHY


# What an agent reports (workers.contract.AGENT_STATES) → our state. An agent
# still loading its first engine is, to an operator, applying a profile.
AGENT_STATE_MAP: dict[str, State] = {
    "ready": State.READY,
    "draining": State.DRAINING,
    "applying": State.APPLYING,
    "loading": State.APPLYING,
}


@dataclass(frozen=True)
class Thresholds:
    unhealthy_after_seconds: float
    offline_after_seconds: float


def liveness(current: State, last_seen: datetime, now: datetime, limits: Thresholds) -> State:
    """The state a worker should be in, given when it was last heard from.

    Only ever moves a worker down to UNHEALTHY or OFFLINE; coming back is the
    heartbeat's business (it carries the state the worker reports).
    """
    silent_seconds = (now - last_seen).total_seconds()
    if silent_seconds >= limits.offline_after_seconds:
        return State.OFFLINE
    if silent_seconds >= limits.unhealthy_after_seconds and current < State.UNHEALTHY:
        return State.UNHEALTHY
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
