from __future__ import annotations

from typing import Any

import pytest

from controlplane.alerts import defaults
from controlplane.alerts.models import AlertRule


@pytest.fixture
def shipped_rules(db: Any) -> None:
    """The shipped rules, switched off: a migration installs them, but a
    transactional test elsewhere in the run flushes every table."""
    defaults.install(AlertRule)
    AlertRule.objects.update(enabled=False)


@pytest.fixture
def celery_with_beat(transactional_db: Any, tmp_path: Any) -> Any:
    """A real Celery worker with an embedded beat on this run's queue and
    the test database, evaluating alert rules every second."""
    import uuid

    from django.conf import settings

    from tests.conftest import RUN_ID, control_plane_env
    from tests.support import PYTHON, running

    argv = [
        PYTHON,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        "-B",
        "-s",
        str(tmp_path / "beat-schedule"),
        "--pool",
        "solo",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "-Q",
        settings.CELERY_TASK_DEFAULT_QUEUE,
        "-n",
        f"alerts-{RUN_ID}-{uuid.uuid4().hex[:4]}@%h",
    ]
    env = control_plane_env(
        ALERT_EVAL_INTERVAL="1",
        ROLLOUT_SWEEP_INTERVAL_SECONDS="1",
        ROLLOUT_SWEEP_GRACE_SECONDS="2",
        ROLLOUT_ACK_WAIT_SECONDS="1",
    )
    with running(argv, env=env, log_path=tmp_path / "celery.log") as proc:
        proc.wait_for_output("ready.", timeout=60)
        yield proc
