"""The scraper and retention on Celery beat.

``metrics.scrape`` runs every SCRAPE_INTERVAL; a round that is still queued
when the next is due expires instead of piling up, and a tick that finds a
round still running skips. A round of more than SCRAPE_SHARD_SIZE workers is
split: the tick queues ``metrics.scrape_shard`` for all but the first shard
(on commit) and runs the first itself, so idle Celery processes share the
rest. With
``METRICS_BACKEND=prometheus`` it scrapes nothing (Prometheus scrapes the
workers) and only tells the live metric pages that figures may have moved, so
they re-read them from Prometheus each SCRAPE_INTERVAL. ``metrics.purge`` drops
raw snapshots after 24 h and rollups after 14 days, once a minute.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.celery import app
from controlplane.metrics import backends, conf
from controlplane.metrics.models import purge_expired
from controlplane.metrics.scrape import announce_figures, round_in_flight, run_shard, start_round

log = logging.getLogger(__name__)

PURGE_INTERVAL_SECONDS = 60.0


@app.task(name="metrics.scrape")
def scrape() -> dict[str, int]:
    if not backends.scrapes():
        # METRICS_BACKEND=prometheus: Prometheus scrapes the workers; the pages still re-render on this beat.
        announce_figures()
        return {"targets": 0, "failed": 0}
    busy = round_in_flight(timezone.now())
    if busy is not None:
        log.warning("scrape round of %s still running; this tick skipped", busy.started_at.isoformat())
        return {"targets": 0, "failed": 0, "skipped": 1}
    scrape_round, shards = start_round()
    for worker_ids in shards[1:]:
        # robust: a shard that cannot be queued leaves its round unfinished
        # (it stops counting at its horizon); the tick's own shard still runs.
        transaction.on_commit(functools.partial(scrape_shard.delay, scrape_round.pk, worker_ids), robust=True)
    if shards:
        run_shard(scrape_round.pk, shards[0])
        scrape_round.refresh_from_db()
    # "failed" so far: the other shards may still be running
    return {"targets": scrape_round.num_targets, "failed": scrape_round.num_failed, "shards": len(shards)}


@app.task(name="metrics.scrape_shard")
def scrape_shard(round_id: int, worker_ids: list[int]) -> dict[str, int]:
    """One shard of a round the tick began. No expiry: a shard that starts
    after its round's time is up skips its workers itself and still counts
    itself done, so the round's row closes."""
    scrape_round = run_shard(round_id, worker_ids)
    if scrape_round is None:
        return {"targets": 0, "failed": 0}  # the round's row is gone
    return {"targets": len(worker_ids), "finished": int(scrape_round.finished_at is not None)}


@app.task(name="metrics.purge")
def purge() -> dict[str, int]:
    return purge_expired(timezone.now())


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    sender.add_periodic_task(
        conf.SCRAPE_INTERVAL.get(), scrape.s(), name="metrics scrape", expires=conf.SCRAPE_INTERVAL.get()
    )
    sender.add_periodic_task(PURGE_INTERVAL_SECONDS, purge.s(), name="metrics purge", expires=PURGE_INTERVAL_SECONDS)
