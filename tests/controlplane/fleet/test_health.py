"""Liveness and drift: the pure rules as tables, then the sweep on stored rows
with time moved by time-machine."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.utils import timezone

from controlplane import outages
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import Thresholds, WorkerState, drift_since, is_drifting, liveness
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool, make_profile
from workers.contract import parse_heartbeat

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIMITS = Thresholds(unhealthy_after_seconds=10, offline_after_seconds=60)


@pytest.fixture(autouse=True)
def no_outage() -> Iterator[None]:
    outages.forget()
    yield
    outages.forget()


AFTER_OUTAGE = Thresholds(
    unhealthy_after_seconds=10, offline_after_seconds=60, heartbeat_interval_seconds=2, outage_grace_seconds=32
)


@pytest.mark.parametrize(
    ("current", "silent_seconds", "expected"),
    [
        (WorkerState.READY, 0, WorkerState.READY),
        (WorkerState.READY, 9.9, WorkerState.READY),
        (WorkerState.READY, 10, WorkerState.UNHEALTHY),
        (WorkerState.DRAINING, 30, WorkerState.UNHEALTHY),
        (WorkerState.APPLYING, 59, WorkerState.UNHEALTHY),
        (WorkerState.REGISTERING, 11, WorkerState.UNHEALTHY),
        (WorkerState.UNHEALTHY, 30, WorkerState.UNHEALTHY),
        (WorkerState.UNHEALTHY, 60, WorkerState.OFFLINE),
        (WorkerState.READY, 3600, WorkerState.OFFLINE),
        (WorkerState.OFFLINE, 3600, WorkerState.OFFLINE),
    ],
)
def test_liveness_table(current: WorkerState, silent_seconds: float, expected: WorkerState) -> None:
    assert liveness(current, T0, T0 + timedelta(seconds=silent_seconds), LIMITS) == expected


# (last seen, control plane last failed, now), in seconds after T0: a worker
# silent only through the control plane's own outage is not blamed for it.
@pytest.mark.parametrize(
    ("current", "last_seen", "failed_at", "now", "expected"),
    [
        # a 30 s database outage ended at 40; the worker last beat at 10
        (WorkerState.READY, 10, 40, 41, WorkerState.READY),  # within one heartbeat interval: no judging
        (WorkerState.READY, 10, 40, 42, WorkerState.READY),  # 2 s silent since the outage, not 32
        (WorkerState.READY, 10, 40, 71.9, WorkerState.READY),  # the agent may still be backing off
        (WorkerState.READY, 10, 40, 72, WorkerState.UNHEALTHY),  # silent past its longest backoff
        (WorkerState.UNHEALTHY, 10, 40, 100, WorkerState.OFFLINE),  # offline counts from the outage too
        (WorkerState.UNHEALTHY, 10, 40, 99, WorkerState.UNHEALTHY),
        # heard from after the outage: the ordinary limits
        (WorkerState.READY, 45, 40, 54.9, WorkerState.READY),
        (WorkerState.READY, 45, 40, 55, WorkerState.UNHEALTHY),
        # an outage long ago changes nothing
        (WorkerState.READY, 100, 40, 110, WorkerState.UNHEALTHY),
        # no outage at all: the ordinary limits
        (WorkerState.READY, 10, None, 20, WorkerState.UNHEALTHY),
        # already lost before the outage: staying lost is not a judgement
        (WorkerState.OFFLINE, 10, 40, 41, WorkerState.OFFLINE),
    ],
)
def test_liveness_after_the_control_planes_own_outage_table(
    current: WorkerState, last_seen: float, failed_at: float | None, now: float, expected: WorkerState
) -> None:
    at = lambda seconds: T0 + timedelta(seconds=seconds)  # noqa: E731
    failed = at(failed_at) if failed_at is not None else None
    assert liveness(current, at(last_seen), at(now), AFTER_OUTAGE, failed) == expected


def test_states_are_ordered_so_lost_is_one_comparison() -> None:
    assert [s for s in WorkerState if s.is_lost] == [WorkerState.UNHEALTHY, WorkerState.OFFLINE]
    assert WorkerState.READY < WorkerState.UNHEALTHY < WorkerState.OFFLINE


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
def test_drift_clock_table(
    previous: datetime | None, desired: int | None, running: int | None, expected: datetime | None
) -> None:
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
        assert Worker.sweep_liveness() == [(worker.pk, WorkerState.READY, WorkerState.UNHEALTHY)]
        assert Worker.sweep_liveness() == [], "a second sweep finds nothing more to do"
        clock.shift(60)
        assert Worker.sweep_liveness() == [(worker.pk, WorkerState.UNHEALTHY, WorkerState.OFFLINE)]
    steps = AuditEvent.objects.filter(action="worker.state_change").order_by("time")
    assert [(e.before["state"], e.after["state"], e.actor_repr) for e in steps] == [
        ("ready", "unhealthy", "system:health-sweep"),
        ("unhealthy", "offline", "system:health-sweep"),
    ]


@pytest.mark.django_db
def test_the_first_sweeps_after_a_database_outage_do_not_blame_the_workers(settings) -> None:  # type: ignore[no-untyped-def]
    """The outage was the control plane's: its heartbeats were refused. The
    sweep counts silence from its own last failure (recorded in Redis by
    whichever process failed), so the worker is not marked unhealthy."""
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    settings.WORKER_OUTAGE_GRACE_SECONDS = 20
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("patient")
        worker.record_heartbeat(parse_heartbeat(heartbeat_request()))
        clock.shift(33)  # a 30 s database outage: every heartbeat refused, the last at T0+33
        outages.note_database_failure()
        clock.shift(1)
        assert Worker.sweep_liveness() == [], "within one heartbeat interval of the outage"
        clock.shift(15)
        assert Worker.sweep_liveness() == [], "silent 16 s since the outage; the agent may be backing off"
        clock.shift(5)
        assert Worker.sweep_liveness() == [(worker.pk, WorkerState.READY, WorkerState.UNHEALTHY)]


@pytest.mark.django_db
def test_a_worker_that_never_heartbeats_is_judged_from_its_registration(settings) -> None:  # type: ignore[no-untyped-def]
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("mute")
        clock.shift(11)
        assert Worker.sweep_liveness() == [(worker.pk, WorkerState.REGISTERING, WorkerState.UNHEALTHY)]


@pytest.mark.django_db
def test_the_sweep_does_not_overwrite_a_heartbeat_that_landed_meanwhile(settings) -> None:  # type: ignore[no-untyped-def]
    settings.WORKER_UNHEALTHY_AFTER_SECONDS = 10
    with time_machine.travel(T0, tick=False) as clock:
        worker, _ = enroll_worker("racer")
        worker.record_heartbeat(parse_heartbeat(heartbeat_request()))
        clock.shift(30)
        stale = list(Worker.objects.filter(pk=worker.pk))  # what a sweep read...
        Worker.objects.get(pk=worker.pk).record_heartbeat(parse_heartbeat(heartbeat_request()))  # ...then this landed
        claimed = Worker.objects.filter(
            pk=worker.pk, state=stale[0].state, last_heartbeat_at=stale[0].last_heartbeat_at
        ).count()
        assert claimed == 0, "the sweep's conditional update would match nothing"
        assert Worker.sweep_liveness() == []
        assert Worker.objects.get(pk=worker.pk).state == WorkerState.READY


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


def test_the_outage_grace_covers_the_agents_longest_backoff() -> None:
    """After an outage an agent's next heartbeat may come as late as its
    longest backoff; the grace must cover it, or the sweep blames it."""
    from controlplane.fleet import conf
    from workers.agent.agent import MAX_BACKOFF_SECONDS

    assert conf.WORKER_OUTAGE_GRACE_SECONDS.default > MAX_BACKOFF_SECONDS
