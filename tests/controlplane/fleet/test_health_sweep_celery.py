"""The health sweep as it runs in production: Celery beat schedules it, a
real Celery worker runs it against the test database."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import State
from controlplane.fleet.models import Worker
from tests.conftest import control_plane_env
from tests.controlplane.factories import enroll_worker
from tests.support import PYTHON, Process, running

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def wait_for(predicate: Any, timeout: float, what: str, *procs: Process) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    logs = "\n".join(p.output()[-3000:] for p in procs)
    raise AssertionError(f"{what} not seen within {timeout}s\n{logs}")


def test_beat_schedules_the_sweep_and_a_worker_marks_silent_workers(celery_worker: Process, tmp_path: Path) -> None:
    now = timezone.now()
    silent, _ = enroll_worker("silent-30s")
    gone, _ = enroll_worker("silent-2h")
    alive, _ = enroll_worker("alive")
    Worker.objects.filter(pk=silent.pk).update(state=State.READY, last_heartbeat_at=now - timedelta(seconds=30))
    Worker.objects.filter(pk=gone.pk).update(state=State.READY, last_heartbeat_at=now - timedelta(hours=2))
    Worker.objects.filter(pk=alive.pk).update(state=State.READY, last_heartbeat_at=now + timedelta(minutes=5))

    argv = [PYTHON, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "INFO",
            "--schedule", str(tmp_path / "beat-schedule"), "--pidfile", ""]
    env = control_plane_env(HEALTH_SWEEP_INTERVAL_SECONDS="0.5")
    with running(argv, env=env, log_path=tmp_path / "beat.log") as beat:
        expected = {("silent-30s", State.UNHEALTHY), ("silent-2h", State.OFFLINE), ("alive", State.READY)}
        wait_for(
            lambda: set(Worker.objects.values_list("name", "state")) == expected,
            60,
            "the sweep's transitions",
            beat,
            celery_worker,
        )
        assert "fleet health sweep" in beat.output()
    actors = set(AuditEvent.objects.filter(action="worker.state_change").values_list("object_repr", "actor_repr"))
    assert actors == {("silent-30s", "system:health-sweep"), ("silent-2h", "system:health-sweep")}
