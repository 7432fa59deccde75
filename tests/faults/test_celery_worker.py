"""A Celery worker survives Redis going away with a task in flight (acks are
late, so its message is still unacked): it reconnects when Redis is back and
runs tasks again, instead of exiting with "Unrecoverable error"."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.stores import OwnRedis
from tests.support import PYTHON, Process, child_env, wait_until

pytestmark = pytest.mark.slow


def test_a_worker_that_loses_redis_mid_task_reconnects_instead_of_exiting(tmp_path: Path) -> None:
    broker = OwnRedis(tmp_path)
    broker.start()
    env = child_env(REDIS_URL=broker.url, CELERY_QUEUE="faults", CHUNKPILOT_DATA_DIR=str(tmp_path))
    env.pop("DATABASE_URL", None)  # nothing here needs one; SQLite under tmp_path
    argv = [
        PYTHON,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        "--include",
        "tests.faults.tasks",
        "--pool",
        "prefork",
        "--concurrency",
        "1",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "-Q",
        "faults",
        "-n",
        "faults@%h",
    ]
    worker = Process(argv, env=env, log_path=tmp_path / "celery.log")
    try:
        worker.wait_for_output("ready.", timeout=120)
        from tests.faults import tasks

        with tasks.app.connection_for_write(broker.url) as conn:
            tasks.hold.apply_async((5.0,), queue="faults", connection=conn)
            worker.wait_for_output("Task faults.hold[", timeout=60)  # received: in flight, unacked
            broker.stop()
        worker.wait_for_output("Connection to broker lost", timeout=60)
        wait_until(lambda: "Trying again in" in worker.output() or not worker.alive(), 60, "a reconnect attempt")
        assert worker.alive(), worker.output()[-4000:]
        assert "Unrecoverable error" not in worker.output()
        broker.start()
        with tasks.app.connection_for_write(broker.url) as conn:
            tasks.hold.apply_async((0.25,), queue="faults", connection=conn)
        wait_until(lambda: "s: 0.25" in worker.output() or not worker.alive(), 90, "a task sent after the outage runs")
        assert worker.alive(), worker.output()[-4000:]
    finally:
        worker.stop()
        broker.stop()
