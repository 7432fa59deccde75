"""Liveness and drift: the pure rules as tables, then the sweep on stored rows
with time moved by time-machine."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import State, Thresholds, drift_since, is_drifting, liveness
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool, make_profile
from workers.contract import parse_heartbeat

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIMITS = Thresholds(unhealthy_after_seconds=10, offline_after_seconds=60)


@pytest.mark.parametrize(
    ("current", "silent_seconds", "expected"),
    [
        (State.READY, 0, State.READY),
        (State.READY, 9.9, State.READY),
        (State.READY, 10, State.UNHEALTHY),
        (State.DRAINING, 30, State.UNHEALTHY),
        (State.APPLYING, 59, State.UNHEALTHY),
        (State.REGISTERING, 11, State.UNHEALTHY),
        (State.UNHEALTHY, 30, State.UNHEALTHY),
        (State.UNHEALTHY, 60, State.OFFLINE),
        (State.READY, 3600, State.OFFLINE),
        (State.OFFLINE, 3600, State.OFFLINE),
    ],
)
def test_liveness_table(current: State, silent_seconds: float, expected: State) -> None:
    assert liveness(current, T0, T0 + timedelta(seconds=silent_seconds), LIMITS) == expected


def test_states_are_ordered_so_lost_is_one_comparison() -> None:
    assert [s for s in State if s.is_lost] == [State.UNHEALTHY, State.OFFLINE]
    assert State.READY < State.UNHEALTHY < State.OFFLINE


@pytest.mark.parametrize(
    ("previous", "desired", "running", "expected"),
    [
        (None, 1, 1, None),
        (None, None, 5, None),
        (None, 2, 1, T0),
        (None, 2, None, T0),
        (T0 - timedelta(hours=1), 2, 1, T0 - timedelta(hours=1)),
        (T0 - timedelta(hours=1), 2, 2, None),
    ],
)
def test_drift_clock_table(previous: datetime | None, desired: int | None, running: int | None, expected: datetime | None) -> None:
    assert drift_since(previous, desired, running, T0) == expected


def test_drift_counts_only_past_the_grace_period() -> None:
    assert not is_drifting(None, T0, 120)
    assert not is_drifting(T0, T0 + timedelta(seconds=119), 120)
    assert is_drifting(T0, T0 + timedelta(seconds=120), 120)


@pytest.mark.django_db
def test_the_sweep_marks_silent_workers_unhealthy_then_offline_and_audits_each_step(settings) -> None:  # type: ignore[no-untyped-def]
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    settings.WORKER_OFFLINE_AFTER_SECONDS = 60
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("silent")
        quiet_one = Worker.objects.get(pk=worker.pk)
        quiet_one.record_heartbeat(parse_heartbeat(heartbeat_request()))
        clock.shift(9)
        assert Worker.sweep_liveness() == []
        clock.shift(2)
        assert Worker.sweep_liveness() == [(worker.pk, State.READY, State.UNHEALTHY)]
        assert Worker.sweep_liveness() == [], "a second sweep finds nothing more to do"
        clock.shift(60)
        assert Worker.sweep_liveness() == [(worker.pk, State.UNHEALTHY, State.OFFLINE)]
    steps = AuditEvent.objects.filter(action="worker.state_change").order_by("time")
    assert [(e.before["state"], e.after["state"], e.actor_repr) for e in steps] == [
        ("ready", "unhealthy", "system:health-sweep"),
        ("unhealthy", "offline", "system:health-sweep"),
    ]


@pytest.mark.django_db
def test_a_worker_that_never_heartbeats_is_judged_from_its_registration(settings) -> None:  # type: ignore[no-untyped-def]
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("mute")
        clock.shift(11)
        assert Worker.sweep_liveness() == [(worker.pk, State.REGISTERING, State.UNHEALTHY)]


@pytest.mark.django_db
def test_the_sweep_does_not_overwrite_a_heartbeat_that_landed_meanwhile(settings) -> None:  # type: ignore[no-untyped-def]
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("racer")
        worker.record_heartbeat(parse_heartbeat(heartbeat_request()))
        clock.shift(30)
        stale = list(Worker.objects.filter(pk=worker.pk))  # what a sweep read...
        Worker.objects.get(pk=worker.pk).record_heartbeat(parse_heartbeat(heartbeat_request()))  # ...then this landed
        claimed = Worker.objects.filter(pk=worker.pk, state=stale[0].state, last_heartbeat_at=stale[0].last_heartbeat_at).count()
        assert claimed == 0, "the sweep's conditional update would match nothing"
        assert Worker.sweep_liveness() == []
        assert Worker.objects.get(pk=worker.pk).state == State.READY


@pytest.mark.django_db
def test_refresh_drift_rederives_clocks_from_stored_state() -> None:
    revision = make_profile()
    worker, _ = enroll_worker(pool=make_pool(revision=revision))
    Worker.objects.filter(pk=worker.pk).update(drift_since=None)  # lost, say, by a crash
    now = timezone.now()
    assert list(Worker.objects.with_stale_drift_clock()) == [worker]
    assert Worker.refresh_drift(Worker.objects.with_stale_drift_clock(), now) == 1
    assert Worker.objects.get(pk=worker.pk).drift_since == now
    assert list(Worker.objects.with_stale_drift_clock()) == []
    Worker.objects.filter(pk=worker.pk).update(running_revision=revision)  # in step, clock still running
    assert list(Worker.objects.with_stale_drift_clock()) == [worker]
    assert Worker.refresh_drift(Worker.objects.with_stale_drift_clock(), now) == 1
    assert Worker.objects.get(pk=worker.pk).drift_since is None
