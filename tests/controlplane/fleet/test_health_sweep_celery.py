"""The health sweep as it runs in production: Celery beat schedules it, a
real Celery worker runs it against the test database."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.conftest import control_plane_env
from tests.controlplane.factories import enroll_worker
from tests.support import PYTHON, Process, running, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_beat_schedules_the_sweep_and_a_worker_marks_silent_workers(celery_worker: Process, tmp_path: Path) -> None:
    now = timezone.now()
    silent, _ = enroll_worker("silent-30s")
    gone, _ = enroll_worker("silent-2h")
    alive, _ = enroll_worker("alive")
    Worker.objects.filter(pk=silent.pk).update(state=WorkerState.READY, last_heartbeat_at=now - timedelta(seconds=30))
    Worker.objects.filter(pk=gone.pk).update(state=WorkerState.READY, last_heartbeat_at=now - timedelta(hours=2))
    Worker.objects.filter(pk=alive.pk).update(state=WorkerState.READY, last_heartbeat_at=now + timedelta(minutes=5))

    argv = [
        PYTHON,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "beat",
        "--loglevel",
        "INFO",
        "--schedule",
        str(tmp_path / "beat-schedule"),
        "--pidfile",
        "",
    ]
    env = control_plane_env(HEALTH_SWEEP_INTERVAL_SECONDS="0.5")
    with running(argv, env=env, log_path=tmp_path / "beat.log") as beat:
        expected = {
            ("silent-30s", WorkerState.UNHEALTHY),
            ("silent-2h", WorkerState.OFFLINE),
            ("alive", WorkerState.READY),
        }
        wait_until(
            lambda: set(Worker.objects.values_list("name", "state")) == expected,
            60,
            "the sweep's transitions",
            interval=0.2,
            detail=lambda: "\n".join(p.output()[-3000:] for p in (beat, celery_worker)),
        )
        assert "fleet health sweep" in beat.output()
    actors = set(AuditEvent.objects.filter(action="worker.state_change").values_list("object_repr", "actor_repr"))
    assert actors == {("silent-30s", "system:health-sweep"), ("silent-2h", "system:health-sweep")}
