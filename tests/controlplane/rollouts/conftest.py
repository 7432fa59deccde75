"""Processes the rollout tests start themselves: Celery workers (with beat,
to kill one and resume on another) on this run's queue and test database."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RUN_ID, control_plane_env
from tests.support import PYTHON, Process, running

# Short clocks: the sweeper restarts a lost run within a few seconds.
FAST = {
    "ROLLOUT_SWEEP_INTERVAL_SECONDS": "1",
    "ROLLOUT_SWEEP_GRACE_SECONDS": "2",
    "ROLLOUT_ACK_WAIT_SECONDS": "1",
}


@pytest.fixture
def start_celery(
    transactional_db: Any, tmp_path: Path
) -> Iterator[Callable[..., contextlib.AbstractContextManager[Process]]]:
    """``with start_celery(beat=True) as proc:`` runs one Celery worker (with
    an embedded beat when asked) until the block ends."""
    from django.conf import settings

    counter = iter(range(100))

    @contextlib.contextmanager
    def start(*, beat: bool = False, **env: str) -> Iterator[Process]:
        n = next(counter)
        argv = [
            PYTHON,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "-Q",
            settings.CELERY_TASK_DEFAULT_QUEUE,
            "-n",
            f"rollouts-{RUN_ID}-{n}-{uuid.uuid4().hex[:4]}@%h",
        ]
        if beat:
            argv += ["-B", "-s", str(tmp_path / f"beat-{n}")]
        with running(argv, env=control_plane_env(**{**FAST, **env}), log_path=tmp_path / f"celery-{n}.log") as proc:
            proc.wait_for_output("ready.", timeout=60)
            yield proc

    yield start
