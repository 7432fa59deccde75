"""The metrics app's Celery beat entries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.metrics import conf, tasks
from controlplane.metrics.models import ScrapeRound
from controlplane.metrics.scrape import scrape_timeout_seconds
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


@pytest.mark.django_db
def test_a_tick_skips_while_a_round_is_still_running_and_not_behind_a_dead_one() -> None:
    now = timezone.now()
    running = ScrapeRound.objects.create(started_at=now - timedelta(seconds=1))
    assert tasks.scrape() == {"targets": 0, "failed": 0, "skipped": 1}
    assert ScrapeRound.objects.count() == 1, "no second round beside the running one"

    # A round that began longer ago than an interval plus its timeout died with its process.
    gone = conf.SCRAPE_INTERVAL.get() + scrape_timeout_seconds() + 1
    ScrapeRound.objects.filter(pk=running.pk).update(started_at=now - timedelta(seconds=gone))
    assert "skipped" not in tasks.scrape()
    assert ScrapeRound.objects.filter(finished_at__isnull=False).count() == 1

    # A finished round does not hold the next one either.
    assert "skipped" not in tasks.scrape()
    assert ScrapeRound.objects.filter(finished_at__isnull=False).count() == 2
