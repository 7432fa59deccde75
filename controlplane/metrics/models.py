"""Stored metrics: compact per-worker snapshots, minute rollups, scrape health.

Row format (the benchmark fleet is 50 workers x 24 h of 5-s scrapes, 864 000
snapshots):

* ``Target`` is one worker under one set of labels (pool, cohort) and one
  ``SeriesLayout`` — what Prometheus calls a target's series. When a worker
  moves pool or its cohort changes, new rows start, so a window grouped by
  cohort sums each series under the cohort it had then. The target also holds
  the scraper's running state (last raw vector, reset offsets, sample counts).
* ``Snapshot``: one row per target and scrape: the time, a per-target sample
  number, the peak-memory gauge as a column, and every kept series as one
  zlib-packed float64 vector. Counters are stored reset-corrected ("totals",
  see ``catalogue.fold``), so a window's increase needs only its first and
  last row per target, found by the (target, ts) index: a query costs two
  index probes per worker whatever the window's length. Sample numbers give
  the sample count for Prometheus's extrapolation without counting rows.
* ``Rollup``: one row per target and minute: the totals at the minute's last
  scrape, the max of the peak gauge, and the minute's sample count. Written
  on every scrape (the current minute is updated in place), so charts read
  minutes and never the 5-s rows. Kept 14 days; snapshots 24 hours. For the
  charts it also keeps the vector's head (``Layout.head``: the counters and
  the charted histograms, ~130 values) at the minute's first and last scrape,
  with the first's time: a window whose ends are whole minutes begins at its
  first minute's first scrape and ends at its last minute's last, exactly the
  raw rows' window (``query._edge_windows``), and a chart reads two small
  vectors a minute rather than twelve whole ones. Heads are plain float64
  bytes (``raw_bytes``), not zlib: a chart of 200 workers reads 24,000 of
  them, and inflating each was a third of its time; PostgreSQL compresses
  the row instead (migration 0003).
* ``CounterReset``: the offsets after each detected reset (rare), to recover
  a sample's raw value.
"""

from __future__ import annotations

import zlib
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from django.db import models, transaction
from django.db.models import F
from django.utils import timezone

from controlplane import audit
from controlplane.metrics.catalogue import Layout
from controlplane.metrics.figures import DEFAULT_OBJECTIVES
from controlplane.metrics.promql import Floats

RAW_RETENTION = timedelta(hours=24)
ROLLUP_RETENTION = timedelta(days=14)


def pack(values: Floats) -> bytes:
    return zlib.compress(np.ascontiguousarray(values, dtype=np.float64).tobytes(), 1)


def unpack(blob: bytes | memoryview) -> Floats:
    return np.frombuffer(zlib.decompress(bytes(blob)), dtype=np.float64)


def raw_bytes(values: Floats) -> bytes:
    """A rollup head: float64 bytes as they are, so a chart joins a target's
    heads into one array with no inflating (PostgreSQL compresses the row)."""
    return np.ascontiguousarray(values, dtype=np.float64).tobytes()


def minute_of(ts: datetime) -> datetime:
    return ts.replace(second=0, microsecond=0)


class SeriesLayout(models.Model):
    digest = models.CharField(max_length=40, unique=True)
    keys = models.JSONField()

    _cache: dict[int, Layout] = {}

    def as_layout(self) -> Layout:
        layout = SeriesLayout._cache.get(self.pk)
        if layout is None:
            layout = SeriesLayout._cache[self.pk] = Layout(tuple(self.keys))
        return layout

    @classmethod
    def for_layout(cls, layout: Layout) -> SeriesLayout:
        row, _ = cls.objects.get_or_create(digest=layout.digest, defaults={"keys": list(layout.keys)})
        return row

    @classmethod
    def layout_by_id(cls, pk: int) -> Layout:
        layout = cls._cache.get(pk)
        if layout is None:
            layout = cls.objects.get(pk=pk).as_layout()
        return layout


class Target(models.Model):
    worker = models.ForeignKey(
        "fleet.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="metric_targets"
    )
    worker_name = models.CharField(max_length=100)
    pool_name = models.CharField(max_length=100, blank=True)
    cohort = models.CharField(
        max_length=32, blank=True, help_text="the pool's role in the routing table; blank: unrouted"
    )
    layout = models.ForeignKey(SeriesLayout, on_delete=models.PROTECT, related_name="+")
    first_at = models.DateTimeField()
    last_at = models.DateTimeField(db_index=True)

    # The scraper's running reduction (see catalogue.fold).
    num_samples = models.PositiveIntegerField(default=0)
    num_rollups = models.PositiveIntegerField(default=0)
    last_raw = models.BinaryField()
    offsets = models.BinaryField()
    rollup_minute = models.DateTimeField(null=True)
    rollup_peak_bytes = models.FloatField(null=True)
    rollup_num_samples = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["worker_name", "pool_name", "cohort", "layout"], name="metrics_target_identity"
            )
        ]

    def __str__(self) -> str:
        return f"{self.worker_name} ({self.pool_name or '-'}/{self.cohort or '-'})"

    def labels(self) -> dict[str, str]:
        return {"worker": self.worker_name, "pool": self.pool_name, "cohort": self.cohort}


class Snapshot(models.Model):
    target = models.ForeignKey(Target, on_delete=models.CASCADE, related_name="+", db_index=False)
    ts = models.DateTimeField()
    seq = models.PositiveIntegerField(help_text="this target's sample number, from 1")
    peak_memory_bytes = models.FloatField(null=True)
    values = models.BinaryField()

    class Meta:
        # The one index: (target, ts) serves first/last-in-window probes, the
        # edge scans and retention (deleted per target), so no index on ts alone.
        constraints = [models.UniqueConstraint(fields=["target", "ts"], name="metrics_snapshot_target_ts")]


class Rollup(models.Model):
    target = models.ForeignKey(Target, on_delete=models.CASCADE, related_name="+", db_index=False)
    minute = models.DateTimeField()
    last_ts = models.DateTimeField(help_text="the minute's last scrape; the totals are as of then")
    seq = models.PositiveIntegerField(help_text="this target's minute number, from 1")
    num_samples = models.PositiveSmallIntegerField()
    peak_memory_bytes = models.FloatField(null=True, help_text="max over the minute's scrapes")
    values = models.BinaryField()
    first_ts = models.DateTimeField(null=True, help_text="the minute's first scrape (null: a row from before 0003)")
    head_first = models.BinaryField(null=True, help_text="the head of the totals at the minute's first scrape")
    head_last = models.BinaryField(null=True, help_text="the head of the totals at its last (of values)")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["target", "minute"], name="metrics_rollup_target_minute")]


class CounterReset(models.Model):
    target = models.ForeignKey(Target, on_delete=models.CASCADE, related_name="resets")
    ts = models.DateTimeField()
    offsets = models.BinaryField(help_text="the target's offsets from this scrape on")

    class Meta:
        indexes = [models.Index(fields=["target", "ts"], name="metrics_reset_target_ts")]


class ScrapeStatus(models.Model):
    """Each worker's last scrape: Prometheus's ``up``, and why not."""

    worker = models.OneToOneField("fleet.Worker", on_delete=models.CASCADE, related_name="scrape_status")
    up = models.BooleanField(default=False)
    last_attempt_at = models.DateTimeField(null=True)
    last_success_at = models.DateTimeField(null=True)
    last_duration_seconds = models.FloatField(null=True)
    last_error = models.CharField(max_length=300, blank=True)
    num_consecutive_failures = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.worker_id}: {'up' if self.up else 'down'}"


class ScrapeRound(models.Model):
    """One tick of the scraper: when, how many answered. Dashboards read the
    latest to say how fresh they are.

    A round's targets are split into shards, each a Celery task of its own
    (``metrics.scrape_shard``; the tick runs the first); each shard adds its failures as it ends, and the
    last to end finishes the round, so ``finished_at - started_at`` is the
    whole round's duration."""

    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True)
    num_targets = models.PositiveIntegerField(default=0)
    num_failed = models.PositiveIntegerField(default=0)
    num_shards = models.PositiveIntegerField(default=1)
    num_shards_done = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-started_at"]

    @classmethod
    def latest(cls) -> ScrapeRound | None:
        return cls.objects.filter(finished_at__isnull=False).order_by("-started_at").first()

    def finish_shard(self, num_failed: int, now: datetime) -> bool:
        """Count one shard of this round done, with its failures; the last
        shard finishes the round. True for the shard that finished it. Two
        conditional updates, safe for shards ending at once in several
        processes: each increment is atomic, and only one can set finished_at."""
        rounds = ScrapeRound.objects.filter(pk=self.pk)
        rounds.update(num_shards_done=F("num_shards_done") + 1, num_failed=F("num_failed") + num_failed)
        finished = rounds.filter(finished_at__isnull=True, num_shards_done__gte=F("num_shards")).update(finished_at=now)
        self.refresh_from_db(fields=["num_shards_done", "num_failed", "finished_at"])
        return finished == 1


class ServiceObjectives(models.Model):
    """The operator's TTFT and TPOT objectives, which goodput counts against.
    One row (pk 1)."""

    ttft_seconds = models.FloatField(
        default=DEFAULT_OBJECTIVES.ttft_seconds, help_text="a request's time to first token must be at most this"
    )
    tpot_seconds = models.FloatField(
        default=DEFAULT_OBJECTIVES.tpot_seconds, help_text="and its time per output token at most this"
    )
    updated_at = models.DateTimeField(default=timezone.now)

    @classmethod
    def current(cls) -> ServiceObjectives:
        row, _ = cls.objects.get_or_create(pk=1)
        return row

    def as_dict(self) -> dict[str, float]:
        return {"ttft_seconds": self.ttft_seconds, "tpot_seconds": self.tpot_seconds}

    def __str__(self) -> str:
        return f"TTFT ≤ {self.ttft_seconds:g} s, TPOT ≤ {self.tpot_seconds:g} s"

    def change(self, ttft_seconds: float, tpot_seconds: float, *, actor: Any, now: datetime | None = None) -> None:
        """Set both objectives, with the audit row in the same transaction."""
        now = now or timezone.now()
        with transaction.atomic():
            before = self.as_dict()
            self.ttft_seconds, self.tpot_seconds, self.updated_at = float(ttft_seconds), float(tpot_seconds), now
            self.save()
            audit.record(actor, "metrics.objectives", self, before, self.as_dict(), time=now)


def purge_expired(now: datetime, *, batch_size: int = 5000) -> dict[str, int]:
    """Delete what retention no longer keeps, target by target so each delete
    walks the (target, time) index, in short batches. Safe to run twice at once."""
    raw_cutoff = now - RAW_RETENTION
    rollup_cutoff = now - ROLLUP_RETENTION
    counts = {"snapshots": 0, "rollups": 0, "targets": 0, "rounds": 0}
    for target_id in Target.objects.values_list("pk", flat=True):
        for model, field, cutoff, key in (
            (Snapshot, "ts", raw_cutoff, "snapshots"),
            (Rollup, "minute", rollup_cutoff, "rollups"),
        ):
            while True:
                ids = list(
                    model.objects.filter(target_id=target_id, **{f"{field}__lt": cutoff})
                    .order_by(field)
                    .values_list("pk", flat=True)[:batch_size]
                )
                if not ids:
                    break
                counts[key] += model.objects.filter(pk__in=ids).delete()[0]
    # A target unseen for the whole rollup retention has nothing left to show.
    counts["targets"] = Target.objects.filter(last_at__lt=rollup_cutoff).delete()[1].get("metrics.Target", 0)
    counts["rounds"] = ScrapeRound.objects.filter(started_at__lt=raw_cutoff).delete()[0]
    return counts
