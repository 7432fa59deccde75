"""The scraper and retention on Celery beat.

``metrics.scrape`` runs every SCRAPE_INTERVAL; a round that is still queued
when the next is due expires instead of piling up. ``metrics.purge`` drops
raw snapshots after 24 h and rollups after 14 days, once a minute.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.celery import app

PURGE_INTERVAL_SECONDS = 60.0


@app.task(name="metrics.scrape")
def scrape() -> dict[str, int]:
    from controlplane.metrics.scrape import scrape_fleet

    scrape_round = scrape_fleet()
    return {"targets": scrape_round.num_targets, "failed": scrape_round.num_failed}


@app.task(name="metrics.purge")
def purge() -> dict[str, int]:
    from controlplane.metrics.models import purge_expired

    return purge_expired(timezone.now())


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    sender.add_periodic_task(
        settings.SCRAPE_INTERVAL, scrape.s(), name="metrics scrape", expires=settings.SCRAPE_INTERVAL
    )
    sender.add_periodic_task(PURGE_INTERVAL_SECONDS, purge.s(), name="metrics purge", expires=PURGE_INTERVAL_SECONDS)
