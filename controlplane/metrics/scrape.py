"""The scraper: every ``SCRAPE_INTERVAL`` read each live worker's ``/metrics``
and store one snapshot per worker.

A round is split into shards of at most ``SCRAPE_SHARD_SIZE`` workers
(``start_round``), each a Celery task (``run_shard``), so that several Celery
processes share a large fleet's parsing and storing (about 12 ms of CPU a
worker: one process holds only ~330 workers in a 4-s timeout). The tick
runs the first shard itself and queues the rest. The round's row counts its
shards; the last to end finishes it (``ScrapeRound.finish_shard``) and tells
the pages once.

Phases of a shard, one ``now`` for the whole round (it is every sample's
timestamp, as Prometheus stamps a target's samples with its scrape's start):

1. Fetch. Every worker of the shard at once (asyncio + httpx), each bounded
   by the scrape timeout, so one that hangs delays nobody and misses this round.
2. Parse. Reduce each page to the kept series (``catalogue.parse``).
3. Store, in one transaction holding the targets' row locks: fold each
   vector into its target's running totals, write the snapshot, upsert the
   minute rollup, record resets and every worker's scrape status (a worker
   that did not answer is marked down with why).
4. Tell the metric pages, after commit, once the round's last shard has
   ended: ``live.Event.METRICS_SCRAPED``, to the fleet-wide group and each
   scraped worker's.

With ``METRICS_BACKEND=prometheus`` there is no round: Prometheus scrapes the
workers, and beat's tick only tells the pages (``announce_figures``), so they
re-read their figures from it on the same cadence.

Safe to run twice at once: a target refuses a sample not newer than its last.
Beat's task still skips a tick while a round (any of its shards) is in flight
(``round_in_flight``), so a fleet whose round outgrows the interval does not
fill every Celery process with rounds; and a shard that gets a process only
after its round's time is up scrapes nothing and just counts itself done.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import httpx
import numpy as np
from django.db import transaction
from django.utils import timezone

from controlplane import live
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RoutingPool
from controlplane.metrics import catalogue, conf
from controlplane.metrics.models import (
    CounterReset,
    Rollup,
    ScrapeRound,
    ScrapeStatus,
    SeriesLayout,
    Snapshot,
    Target,
    minute_of,
    pack,
    raw_bytes,
    unpack,
)

log = logging.getLogger(__name__)

MAX_PAGE_BYTES = 8 * 1024 * 1024
T = TypeVar("T")


def scrape_timeout_seconds() -> float:
    """SCRAPE_TIMEOUT_SECONDS, else 0.8 of the interval within 0.5–10 s: a round
    ends before the next is due, and one slow worker cannot hold the rest long."""
    interval = conf.SCRAPE_INTERVAL.get()
    return conf.SCRAPE_TIMEOUT_SECONDS.get() or max(0.5, min(interval * 0.8, 10.0))


@dataclass(frozen=True)
class Job:
    worker_id: int
    worker_name: str
    url: str  # the worker's base URL; /metrics is appended
    pool_name: str
    cohort: str


@dataclass(frozen=True)
class Fetched:
    job: Job
    text: str | None
    error: str
    duration_seconds: float


# ---- 1. fetch ---------------------------------------------------------------------


async def fetch_all(jobs: Sequence[Job], timeout_seconds: float) -> list[Fetched]:
    limits = httpx.Limits(max_connections=max(len(jobs), 1), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_seconds, limits=limits, follow_redirects=False) as client:

        async def one(job: Job) -> Fetched:
            started = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    client.get(job.url.rstrip("/") + "/metrics", headers={"Accept": "text/plain"}), timeout_seconds
                )
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}")
                if len(response.content) > MAX_PAGE_BYTES:
                    raise RuntimeError("page too large")
                return Fetched(job, response.text, "", time.monotonic() - started)
            except TimeoutError:
                return Fetched(job, None, f"timed out after {timeout_seconds:g}s", time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - any failure is this worker's, not the round's
                message = str(exc) or type(exc).__name__
                return Fetched(job, None, message[:300], time.monotonic() - started)

        return list(await asyncio.gather(*(one(job) for job in jobs)))


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run the fetch on a loop of its own, in another thread when this one
    already runs a loop (a caller inside async code, a test's browser)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# ---- the round ----------------------------------------------------------------------


def jobs_for_fleet(worker_ids: Sequence[int] | None = None) -> list[Job]:
    """Every worker that should answer (of ``worker_ids``, when given): ready,
    draining or applying a profile (its server stays up meanwhile). Lost
    workers are left to the health sweep."""
    cohorts = cohorts_by_pool()
    workers = Worker.objects.filter(
        state__in=[WorkerState.READY, WorkerState.DRAINING, WorkerState.APPLYING]
    ).select_related("pool")
    if worker_ids is not None:
        workers = workers.filter(pk__in=worker_ids)
    return [
        Job(w.pk, w.name, w.url, w.pool.name if w.pool else "", cohorts.get(w.pool_id, "") if w.pool_id else "")
        for w in workers
    ]


def cohorts_by_pool() -> dict[int, str]:
    """A pool's cohort is its role in the routing table (stable, canary, baseline)."""
    out: dict[int, str] = {}
    for pool_id, role in RoutingPool.objects.order_by("table_id").values_list("pool_id", "role"):
        out.setdefault(pool_id, role)
    return out


def round_horizon() -> timedelta:
    """How long after its start a round may still be running: an interval
    plus its timeout. Past it, the round has died or is hopelessly late."""
    return timedelta(seconds=conf.SCRAPE_INTERVAL.get() + scrape_timeout_seconds())


def round_in_flight(now: datetime) -> ScrapeRound | None:
    """A round begun less than an interval plus its timeout ago and not yet
    finished (a sharded round: not every shard has ended): beat's next tick
    skips rather than start a second one beside it. Two at once are safe but not free: at 100 live workers on two cores
    bench_fleet saw rounds of 6-8 s every 5 s hold both Celery processes,
    and a rollout abort waited 3 s behind them for a process. One that
    began longer ago than that has died with its process, and no longer
    counts."""
    horizon = now - round_horizon()
    return (
        ScrapeRound.objects.filter(finished_at__isnull=True, started_at__gt=horizon, started_at__lte=now)
        .order_by("-started_at")
        .first()
    )


def scrape_fleet(now: datetime | None = None, jobs: Sequence[Job] | None = None) -> ScrapeRound:
    """One round in this process, unsharded: benches, tests and tools that
    want the round done when this returns."""
    now = now or timezone.now()
    jobs = jobs_for_fleet() if jobs is None else list(jobs)
    scrape_round = ScrapeRound.objects.create(started_at=now, num_targets=len(jobs))
    num_failed = _scrape(now, jobs)
    scrape_round.finish_shard(num_failed, timezone.now())
    _announce(now, [job.worker_id for job in jobs])
    return scrape_round


def start_round(now: datetime | None = None) -> tuple[ScrapeRound, list[list[int]]]:
    """Begin a round over the fleet: its row, and its shards (worker ids, at
    most ``SCRAPE_SHARD_SIZE`` each) for ``run_shard``. A fleet with no
    worker to scrape makes a round that is finished at once."""
    now = now or timezone.now()
    worker_ids = [job.worker_id for job in jobs_for_fleet()]
    size = max(1, conf.SCRAPE_SHARD_SIZE.get())
    # As even as the shard size allows: 450 workers at 200 are 150 × 3, not 200 + 200 + 50.
    num_shards = math.ceil(len(worker_ids) / size)
    shards = [worker_ids[i::num_shards] for i in range(num_shards)]
    scrape_round = ScrapeRound.objects.create(
        started_at=now,
        num_targets=len(worker_ids),
        num_shards=num_shards,
        finished_at=None if shards else timezone.now(),
    )
    return scrape_round, shards


def run_shard(round_id: int, worker_ids: Sequence[int]) -> ScrapeRound | None:
    """Scrape one shard of a round: these workers, at the round's ``now``.
    Counts itself done on the round's row whatever happens (a shard that
    raises counts its workers failed), so the round's bookkeeping closes;
    the shard that ends the round tells the pages. None if the round is gone."""
    scrape_round = ScrapeRound.objects.filter(pk=round_id).first()
    if scrape_round is None:
        return None
    now = scrape_round.started_at
    if timezone.now() - now > round_horizon():
        # No Celery process was free in the round's time: the next round is
        # due or running, and a sample this late would be refused anyway.
        log.warning("scrape shard of %d workers too late for its round of %s; skipped", len(worker_ids), now)
        _finish_shard(scrape_round, len(worker_ids))
        return scrape_round
    try:
        num_failed = _scrape(now, jobs_for_fleet(worker_ids))
    except Exception:
        _finish_shard(scrape_round, len(worker_ids))
        raise
    _finish_shard(scrape_round, num_failed)
    return scrape_round


def _finish_shard(scrape_round: ScrapeRound, num_failed: int) -> None:
    if scrape_round.finish_shard(num_failed, timezone.now()):
        # Every worker this round asked, whichever shard asked it.
        now = scrape_round.started_at
        _announce(now, list(ScrapeStatus.objects.filter(last_attempt_at=now).values_list("worker_id", flat=True)))


def _scrape(now: datetime, jobs: Sequence[Job]) -> int:
    """Fetch, parse and store these workers' pages; how many failed."""
    fetched = _run(fetch_all(jobs, scrape_timeout_seconds())) if jobs else []
    parsed: list[tuple[Fetched, catalogue.Scrape | None, str]] = []
    for f in fetched:
        if f.text is None:
            parsed.append((f, None, f.error))
            continue
        try:
            parsed.append((f, catalogue.parse(f.text), ""))
        except Exception as exc:  # noqa: BLE001 - a garbled page marks that worker down
            parsed.append((f, None, f"unparsable metrics: {exc}"[:300]))
    return record(now, parsed)


def announce_figures(now: datetime | None = None) -> list[int]:
    """``METRICS_BACKEND=prometheus``: the control plane scrapes nothing, but
    Prometheus has scraped meanwhile, so tell the metric pages what a round
    would (the same event, to the fleet-wide group and each worker a round
    would have scraped) and they re-render from Prometheus. The workers told."""
    now = now or timezone.now()
    worker_ids = [job.worker_id for job in jobs_for_fleet()]
    _announce(now, worker_ids)
    return worker_ids


def _announce(now: datetime, worker_ids: list[int]) -> None:
    live.publish(live.Event.METRICS_SCRAPED, scopes=worker_ids, at=now.timestamp(), worker_ids=worker_ids)


# ---- 3. store -----------------------------------------------------------------------


def record(now: datetime, parsed: Sequence[tuple[Fetched, catalogue.Scrape | None, str]]) -> int:
    """Store one round. Returns how many workers failed to answer."""
    layouts: dict[str, SeriesLayout] = {}
    for _, scrape, _ in parsed:
        if scrape is not None and scrape.layout.digest not in layouts:
            layouts[scrape.layout.digest] = SeriesLayout.for_layout(scrape.layout)

    with transaction.atomic():
        # A worker deleted while we fetched is gone from the round.
        alive = set(Worker.objects.filter(pk__in=[f.job.worker_id for f, _, _ in parsed]).values_list("pk", flat=True))
        parsed = [p for p in parsed if p[0].job.worker_id in alive]
        ok = [(f, s) for f, s, _ in parsed if s is not None]
        targets = _lock_targets(now, [(f.job, layouts[s.layout.digest]) for f, s in ok])
        snapshots: list[Snapshot] = []
        rollups: list[Rollup] = []
        resets: list[CounterReset] = []
        changed: list[Target] = []
        for (fetched, scrape), target in zip(ok, targets, strict=True):
            if target.num_samples and target.last_at >= now:
                continue  # another round already stored a later sample
            target.worker_id = fetched.job.worker_id  # a worker re-created under its old name
            layout = scrape.layout
            previous = unpack(target.last_raw) if target.num_samples else None
            offsets = unpack(target.offsets) if target.num_samples else None
            if previous is not None and len(previous) != len(layout):
                previous = offsets = None
            folded = catalogue.fold(previous, offsets, scrape.values, layout.is_counter)
            if folded.reset:
                resets.append(CounterReset(target=target, ts=now, offsets=pack(folded.offsets)))
            peak = _finite(scrape.values[layout.index[catalogue.PEAK_MEMORY]])
            target.num_samples += 1
            packed, head = pack(folded.totals), raw_bytes(folded.totals[: layout.head])
            snapshots.append(
                Snapshot(target=target, ts=now, seq=target.num_samples, peak_memory_bytes=peak, values=packed)
            )
            minute = minute_of(now)
            if target.rollup_minute != minute:
                target.num_rollups += 1
                target.rollup_minute = minute
                target.rollup_peak_bytes = peak
                target.rollup_num_samples = 1
            else:
                target.rollup_num_samples += 1
                if peak is not None:
                    target.rollup_peak_bytes = (
                        peak if target.rollup_peak_bytes is None else max(target.rollup_peak_bytes, peak)
                    )
            rollups.append(
                Rollup(
                    target=target,
                    minute=minute,
                    last_ts=now,
                    seq=target.num_rollups,
                    num_samples=min(target.rollup_num_samples, 32767),
                    peak_memory_bytes=target.rollup_peak_bytes,
                    values=packed,
                    head_last=head,
                    # Kept from the minute's first scrape: the upsert below never updates them.
                    first_ts=now,
                    head_first=head,
                )
            )
            target.last_raw = pack(scrape.values)
            target.offsets = pack(folded.offsets)
            target.last_at = now
            changed.append(target)
        Snapshot.objects.bulk_create(snapshots)
        Rollup.objects.bulk_create(
            rollups,
            update_conflicts=True,
            unique_fields=["target", "minute"],
            update_fields=["last_ts", "num_samples", "peak_memory_bytes", "values", "head_last"],
        )
        CounterReset.objects.bulk_create(resets)
        Target.objects.bulk_update(
            changed,
            [
                "worker",
                "num_samples",
                "num_rollups",
                "rollup_minute",
                "rollup_peak_bytes",
                "rollup_num_samples",
                "last_raw",
                "offsets",
                "last_at",
            ],
        )
        return _record_status(now, parsed)


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _lock_targets(now: datetime, wanted: Sequence[tuple[Job, SeriesLayout]]) -> list[Target]:
    """The target of each (job, layout), created when new, row-locked in id order."""
    names = sorted({job.worker_name for job, _ in wanted})

    def identity(t: Target) -> tuple[str, str, str, int]:
        return (t.worker_name, t.pool_name, t.cohort, t.layout_id)

    existing = {identity(t): t for t in Target.objects.select_for_update().filter(worker_name__in=names).order_by("pk")}
    missing = []
    for job, layout in wanted:
        key = (job.worker_name, job.pool_name, job.cohort, layout.pk)
        if key not in existing:
            empty = pack(np.zeros(0))
            t = Target(
                worker_id=job.worker_id,
                worker_name=job.worker_name,
                pool_name=job.pool_name,
                cohort=job.cohort,
                layout=layout,
                first_at=now,
                last_at=now,
                last_raw=empty,
                offsets=empty,
            )
            existing[key] = t
            missing.append(t)
    if missing:
        # Another round may create the same target meanwhile: take theirs.
        Target.objects.bulk_create(missing, ignore_conflicts=True)
        fresh = Target.objects.select_for_update().filter(worker_name__in=[t.worker_name for t in missing])
        for t in fresh:
            existing[identity(t)] = t
    return [existing[(job.worker_name, job.pool_name, job.cohort, layout.pk)] for job, layout in wanted]


def _record_status(now: datetime, parsed: Sequence[tuple[Fetched, catalogue.Scrape | None, str]]) -> int:
    previous = {
        s.worker_id: s for s in ScrapeStatus.objects.filter(worker_id__in=[f.job.worker_id for f, _, _ in parsed])
    }
    rows = []
    num_failed = 0
    for f, scrape, error in parsed:
        old = previous.get(f.job.worker_id)
        up = scrape is not None
        num_failed += not up
        rows.append(
            ScrapeStatus(
                worker_id=f.job.worker_id,
                up=up,
                last_attempt_at=now,
                last_success_at=now if up else (old.last_success_at if old else None),
                last_duration_seconds=f.duration_seconds,
                last_error="" if up else error,
                num_consecutive_failures=0 if up else (old.num_consecutive_failures if old else 0) + 1,
            )
        )
    ScrapeStatus.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["worker"],
        update_fields=[
            "up",
            "last_attempt_at",
            "last_success_at",
            "last_duration_seconds",
            "last_error",
            "num_consecutive_failures",
        ],
    )
    return num_failed
