"""The metrics app's Celery beat entries."""

from __future__ import annotations

from controlplane.metrics import conf
from controlplane.metrics.tasks import PURGE_INTERVAL_SECONDS


def beat_schedule() -> dict:
    from controlplane.celery import app

    app.loader.import_default_modules()
    app.finalize()
    return app.conf.beat_schedule


def test_beat_scrapes_every_scrape_interval_and_a_late_round_expires() -> None:
    entry = beat_schedule()["metrics scrape"]
    assert entry["task"] == "metrics.scrape"
    assert entry["schedule"] == conf.SCRAPE_INTERVAL.get()
    assert entry["options"]["expires"] == conf.SCRAPE_INTERVAL.get()


def test_beat_purges_expired_metrics_once_a_minute() -> None:
    entry = beat_schedule()["metrics purge"]
    assert entry["task"] == "metrics.purge"
    assert entry["schedule"] == PURGE_INTERVAL_SECONDS == 60
