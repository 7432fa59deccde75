"""One alert's life, decided from its condition and the clock. Pure: no Django.

Design note. This is Prometheus's alerting rule (rules/alerting.go) for one
label set, plus the two things Prometheus leaves to the operator's rule
file: a "no data" state and flap damping.

* Inactive → pending when the condition first holds (``active_at``); pending
  → firing once it has held for ``for`` (at once when ``for`` is 0).
  ``fired_at`` is the alert's ``startsAt``.
* A pending alert whose condition clears goes back to inactive; Prometheus
  forgets it, we keep the row and the transition for the history.
* A firing alert whose condition clears keeps firing for
  ``keep_firing_for`` (``keep_firing_since`` marks when it cleared; the
  condition holding again resets it), then resolves (``resolved_at`` is
  its ``endsAt``).
* No data (the figure has no value) is never read as "fine". Per rule it
  counts as: ``nodata`` — after ``for`` without data the alert enters the
  state NODATA, which is active (shown, notified) like firing; when data
  returns the alert resolves or carries on from there. ``alerting`` — the
  condition holds. ``ok`` — the condition does not hold (the operator said
  so; the transition's reason still says "no data").
* Flapping: an alert that started firing ``flap_threshold`` times within
  ``flap_window_seconds`` is flapping, and a flapping alert does not
  resolve: it keeps firing until those firings age out of the window. One
  alert instead of a storm of fire/resolve notices; the flag shows on it.

States are ordered so "active" is one comparison: ``state >= NODATA``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import IntEnum, StrEnum


class AlertState(IntEnum):
    INACTIVE = 0
    RESOLVED = 1  # was active (firing or no data), now clear
    NODATA = 2
    PENDING = 3
    FIRING = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def is_active(self) -> bool:
        """Shown among the current alerts; NODATA and FIRING are notified."""
        return self >= AlertState.NODATA

    @property
    def is_notified(self) -> bool:
        return self in (AlertState.NODATA, AlertState.FIRING)


class NoData(StrEnum):
    """What a missing value counts as (Grafana's names)."""

    NODATA = "nodata"
    ALERTING = "alerting"
    OK = "ok"


COMPARATORS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def compare(value: float, comparator: str, threshold: float) -> bool:
    return COMPARATORS[comparator](value, threshold)


@dataclass(frozen=True)
class Spec:
    """The parts of a rule that the state machine reads."""

    for_seconds: float = 0.0
    keep_firing_for_seconds: float = 0.0
    no_data: NoData = NoData.NODATA
    flap_window_seconds: float = 600.0
    flap_threshold: int = 3  # times it started firing within the window


@dataclass(frozen=True)
class Progress:
    """Where one alert is in its life: its state, the value that decided it,
    and the times the state machine counts from (the ``Alert`` row stores them)."""

    state: AlertState = AlertState.INACTIVE
    value: float | None = None
    active_at: datetime | None = None  # when the condition (or no data) began: Prometheus's ActiveAt
    fired_at: datetime | None = None  # startsAt
    resolved_at: datetime | None = None  # endsAt
    keep_firing_since: datetime | None = None
    nodata_since: datetime | None = None
    fired_times: tuple[datetime, ...] = field(default_factory=tuple)  # within the flap window


@dataclass(frozen=True)
class Transition:
    from_state: AlertState
    to_state: AlertState
    at: datetime
    value: float | None
    reason: str


def is_flapping(alert: Progress, spec: Spec, now: datetime) -> bool:
    horizon = now - timedelta(seconds=spec.flap_window_seconds)
    return sum(1 for t in alert.fired_times if t > horizon) >= spec.flap_threshold


def step(
    spec: Spec, alert: Progress, condition: bool | None, value: float | None, now: datetime
) -> tuple[Progress, Transition | None]:
    """Advance one alert by one evaluation at ``now``.

    ``condition`` is whether the rule's comparison holds, None for no data;
    ``value`` is the figure's value that decided it (None for no data).
    Returns the new state and the transition made, if any.
    """
    if value is not None and not math.isfinite(value):
        value = None
        condition = None
    previous = alert.state

    # First, read no data as the rule says.
    reason_suffix = ""
    if condition is None:
        if spec.no_data == NoData.ALERTING:
            condition, reason_suffix = True, " (no data, counted as alerting)"
        elif spec.no_data == NoData.OK:
            condition, reason_suffix = False, " (no data, counted as ok)"
        else:
            return _no_data(spec, alert, now)

    if alert.value != value or alert.nodata_since is not None:
        alert = replace(alert, value=value, nodata_since=None)

    # Data is back after a spell of no data: resolve, or start over.
    if previous == AlertState.NODATA:
        if not condition:
            return _move(
                spec,
                alert,
                AlertState.RESOLVED,
                now,
                "data returned, condition clear",
                resolved_at=now,
                active_at=None,
                keep_firing_since=None,
            )
        alert = replace(alert, state=AlertState.INACTIVE, active_at=None, fired_at=None)
        previous_for_reason = "data returned, condition holds"
    else:
        previous_for_reason = "condition holds"

    if condition:
        if alert.state in (AlertState.INACTIVE, AlertState.RESOLVED):
            alert = replace(
                alert, state=AlertState.PENDING, active_at=now, fired_at=None, resolved_at=None, keep_firing_since=None
            )
            if spec.for_seconds > 0:
                return _finish(previous, alert, now, previous_for_reason + reason_suffix)
        if alert.keep_firing_since is not None:
            alert = replace(alert, keep_firing_since=None)
        if alert.state == AlertState.PENDING and _held(alert.active_at, now, spec.for_seconds):
            alert = _with_firing(replace(alert, state=AlertState.FIRING, fired_at=now), now, spec)
            held = f"held for {_duration(spec.for_seconds)}" if spec.for_seconds > 0 else "condition holds"
            return _finish(previous, alert, now, held + reason_suffix)
        return _finish(previous, alert, now, previous_for_reason + reason_suffix)

    # The condition is clear.
    if alert.state == AlertState.PENDING:
        return _move(
            spec,
            alert,
            AlertState.INACTIVE,
            now,
            "condition cleared before `for` elapsed" + reason_suffix,
            active_at=None,
        )
    if alert.state == AlertState.FIRING:
        since = alert.keep_firing_since or now
        if alert.keep_firing_since != since:
            alert = replace(alert, keep_firing_since=since)
        if spec.keep_firing_for_seconds > 0 and (now - since) < timedelta(seconds=spec.keep_firing_for_seconds):
            return alert, None  # kept firing
        if is_flapping(alert, spec, now):
            return alert, None  # flapping: held firing until the changes age out
        return _move(
            spec,
            alert,
            AlertState.RESOLVED,
            now,
            "condition cleared" + reason_suffix,
            resolved_at=now,
            active_at=None,
            keep_firing_since=None,
        )
    return alert, None


def _no_data(spec: Spec, alert: Progress, now: datetime) -> tuple[Progress, Transition | None]:
    if alert.state == AlertState.NODATA:
        return replace(alert, value=None), None
    since = alert.nodata_since or now
    alert = replace(alert, nodata_since=since)
    if not _held(since, now, spec.for_seconds):
        return alert, None  # not long enough yet: whatever the alert was, it stays
    wait = f" for {_duration(spec.for_seconds)}" if spec.for_seconds > 0 else ""
    return _move(
        spec,
        alert,
        AlertState.NODATA,
        now,
        f"no data{wait}",
        value=None,
        active_at=since,
        fired_at=now,
        resolved_at=None,
        keep_firing_since=None,
    )


def _move(
    spec: Spec, alert: Progress, to: AlertState, now: datetime, reason: str, **fields: object
) -> tuple[Progress, Transition]:
    previous = alert.state
    moved = replace(alert, state=to, **fields)  # type: ignore[arg-type]
    return moved, Transition(previous, to, now, moved.value, reason)


def _finish(previous: AlertState, alert: Progress, now: datetime, reason: str) -> tuple[Progress, Transition | None]:
    if alert.state == previous:
        return alert, None
    return alert, Transition(previous, alert.state, now, alert.value, reason)


def _with_firing(alert: Progress, now: datetime, spec: Spec) -> Progress:
    horizon = now - timedelta(seconds=spec.flap_window_seconds)
    return replace(alert, fired_times=tuple(t for t in alert.fired_times if t > horizon) + (now,))


def _held(since: datetime | None, now: datetime, seconds: float) -> bool:
    return since is not None and (now - since) >= timedelta(seconds=seconds)


def _duration(seconds: float) -> str:
    """Prometheus's duration style: 90 → 1m30s."""
    total = int(round(seconds))
    if total == 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if total >= size:
            parts.append(f"{total // size}{unit}")
            total %= size
    return "".join(parts)


format_duration = _duration
