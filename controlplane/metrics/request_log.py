"""The gateway's request log over a window, kept between reads (alert
evaluation cycles).

An hour of traffic is tens of thousands of rows; reading all of them every
15 seconds is most of a cycle. Rows are written once and never changed, so
each process keeps the rows of its last window and, next cycle, reads only
the rows that arrived since, after checking that the part it keeps is still
exactly what the table holds: the count and the sum of the ids of the rows
in the kept range, one aggregate over the ``created_at`` index. Rows that a
gateway wrote late into that range (a batch flushed after a slow commit),
rows deleted by retention, or a database rolled back under it (tests) all
change the check, and the window is read afresh. So the rows are always
the table's rows, as a fresh read would give them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from django.db import connection
from django.db.models import Count, Sum

from controlplane.gateway.models import RequestLog
from controlplane.metrics.query import Epoch

COLUMNS = (
    "id",
    "epoch",
    "status",
    "error",
    "ttft_seconds",
    "tpot_seconds",
    "max_gap_seconds",
    "e2e_seconds",
    "worker_id",
    "pool_id",
    "cohort",
)


@dataclass
class Rows:
    """Columns sorted by arrival (``created`` in epoch seconds)."""

    ids: np.ndarray
    created: np.ndarray
    status: np.ndarray
    has_error: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    max_gap: np.ndarray
    e2e: np.ndarray
    worker_ids: np.ndarray  # -1: none
    pool_ids: np.ndarray
    cohorts: np.ndarray  # object: strings

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, index: np.ndarray | slice) -> Rows:
        return Rows(*(getattr(self, name)[index] for name in self.__dataclass_fields__))

    @classmethod
    def concat(cls, parts: list[Rows]) -> Rows:
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in cls.__dataclass_fields__))


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _fetch(start: float, end: float) -> Rows:
    """Rows with start < created_at <= end, one plain cursor (Django's
    per-value converters cost more than the query here)."""
    qs = (
        RequestLog.objects.filter(created_at__gt=_dt(start), created_at__lte=_dt(end))
        .annotate(epoch=Epoch("created_at"))
        .order_by("created_at", "id")
        .values_list(*COLUMNS)
    )
    sql, params = qs.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        raw = cursor.fetchall()
    if not raw:
        empty = np.zeros(0)
        return Rows(
            np.zeros(0, dtype=np.int64),
            empty,
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=bool),
            empty,
            empty,
            empty,
            empty,
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=object),
        )
    ids, created, status, error, ttft, tpot, max_gap, e2e, workers, pools, cohorts = zip(*raw, strict=True)
    return Rows(
        ids=np.array(ids, dtype=np.int64),
        created=np.array(created, dtype=np.float64),
        status=np.array(status, dtype=np.int64),
        has_error=np.array([bool(e) for e in error], dtype=bool),
        ttft=np.array(ttft, dtype=np.float64),
        tpot=np.array(tpot, dtype=np.float64),
        max_gap=np.array(max_gap, dtype=np.float64),
        e2e=np.array(e2e, dtype=np.float64),
        worker_ids=np.array([-1 if w is None else w for w in workers], dtype=np.int64),
        pool_ids=np.array([-1 if p is None else p for p in pools], dtype=np.int64),
        cohorts=np.array([c or "" for c in cohorts], dtype=object),
    )


def _checksum(start: float, end: float) -> tuple[int, int]:
    got = RequestLog.objects.filter(created_at__gt=_dt(start), created_at__lte=_dt(end)).aggregate(
        n=Count("id"), s=Sum("id")
    )
    return int(got["n"] or 0), int(got["s"] or 0)


class _Cache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.database: tuple[str, str] | None = None
        self.start = self.end = 0.0
        self.rows: Rows | None = None
        self.num_full_reads = 0

    def window(self, start: float, end: float) -> Rows:
        database = (connection.alias, str(connection.settings_dict.get("NAME")))
        with self.lock:
            rows = self.rows
            reusable = rows is not None and self.database == database and self.start <= start < self.end <= end
            if reusable:
                assert rows is not None
                kept = rows.take(rows.created > start)
                if _checksum(start, self.end) == (len(kept), int(kept.ids.sum())):
                    newer = _fetch(self.end, end)
                    self.rows = Rows.concat([kept, newer]) if len(newer) else kept
                    self.start, self.end = start, end
                    return self.rows
            self.rows = _fetch(start, end)
            self.database, self.start, self.end = database, start, end
            self.num_full_reads += 1
            return self.rows


_cache = _Cache()


def window(start: float, end: float) -> Rows:
    """The log's rows with start < created_at <= end, sorted by arrival."""
    return _cache.window(start, end)
