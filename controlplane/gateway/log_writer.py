"""The gateway's request log: ``LogWriter`` drains request records into
``RequestLog`` on its own thread, in batches, so that the event loop never
waits on the database."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, IntegrityError, close_old_connections, connection, transaction

from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.models import ClientKey, RequestLog
from controlplane.gateway.record import RequestRecord
from controlplane.profiles.models import ProfileRevision

log = logging.getLogger(__name__)


class LogWriter(threading.Thread):
    """Batches ``RequestRecord``s into ``RequestLog`` rows off the event loop.

    ``put`` is a deque append: it never blocks. While the database is away
    rows wait, up to ``max_backlog``; past that the oldest are dropped and
    counted, because a log must never take the gateway down with it."""

    def __init__(
        self, *, flush_seconds: float, batch_size: int, max_backlog: int, metrics: GatewayMetrics | None = None
    ):
        super().__init__(name="gateway-log", daemon=True)
        self.flush_seconds = flush_seconds
        self.batch_size = batch_size
        self.max_backlog = max_backlog
        self.metrics = metrics
        self._rows: collections.deque[RequestRecord] = collections.deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.num_written = 0

    def put(self, record: RequestRecord) -> None:
        self._rows.append(record)
        if len(self._rows) > self.max_backlog:
            with contextlib.suppress(IndexError):
                self._rows.popleft()
                if self.metrics is not None:
                    self.metrics.log_dropped.inc()
        if len(self._rows) >= self.batch_size:
            self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is left (waiting up to ``timeout`` for the database)."""
        self._stopping.set()
        self._wake.set()
        self.join(timeout)
        log.info("request log: %d rows written, %d left unwritten", self.num_written, len(self._rows))

    def run(self) -> None:
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            stopping = self._stopping.is_set()
            while self._rows:
                if not self.flush_once():
                    if stopping:
                        log.error("dropping %d request-log rows at shutdown: the database is away", len(self._rows))
                        return
                    time.sleep(min(self.flush_seconds, 1.0))
                    break
            if stopping:
                return

    def flush_once(self) -> bool:
        batch: list[RequestRecord] = []
        with contextlib.suppress(IndexError):
            while len(batch) < self.batch_size:
                batch.append(self._rows.popleft())
        if not batch:
            return True
        try:
            close_old_connections()
            write_records(batch)
        except DatabaseError:
            log.warning("could not write %d request-log rows; will retry", len(batch), exc_info=True)
            self._rows.extendleft(reversed(batch))
            return False
        self.num_written += len(batch)
        return True


# RequestLog's columns in the order _values() gives them.
COLUMNS = (
    "request_id",
    "created_at",
    "model",
    "cohort",
    "pool_id",
    "worker_id",
    "profile_revision_id",
    "api_key_id",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "ttft_seconds",
    "max_gap_seconds",
    "tpot_seconds",
    "e2e_seconds",
    "status",
    "error",
    "stream",
    "prefill_mode",
    "prompt_split",
    "num_prefill_chunks",
    "computed_tokens",
    "queue_seconds",
    "prefill_seconds",
    "preemptions",
    "timeline",
)


def _values(r: RequestRecord) -> tuple[Any, ...]:
    return (
        _text(r.request_id),
        _datetime(r.created_at),
        r.model,
        r.cohort,
        r.pool_id,
        r.worker_id,
        r.profile_revision_id,
        r.api_key_id,
        r.prompt_tokens,
        r.cached_tokens,
        r.output_tokens,
        r.ttft_seconds,
        r.max_gap_seconds,
        r.tpot_seconds,
        r.e2e_seconds,
        r.status,
        _text(r.error),
        r.stream,
        r.prefill_mode,
        r.prompt_split,
        r.num_prefill_chunks,
        r.computed_tokens,
        r.queue_seconds,
        r.prefill_seconds,
        r.preemptions,
        r.timeline,
    )


def _text(value: str) -> str:
    """``value`` as PostgreSQL's text holds it. A client's request id and a
    worker's error message (which may quote the request) can carry a NUL or
    a lone surrogate, and one such row failed its whole batch, again at
    every retry: each becomes a replacement character."""
    if value.isascii() and "\x00" not in value:
        return value
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def write_records(batch: list[RequestRecord]) -> None:
    """Insert the rows: with COPY on PostgreSQL (building ORM objects cost
    the gateway about 90 µs of CPU per row, which it shares with the event
    loop), bulk_create elsewhere."""
    try:
        if connection.vendor == "postgresql":
            with transaction.atomic():  # the deferred foreign keys are checked here
                with connection.cursor() as cursor:
                    table = connection.ops.quote_name(RequestLog._meta.db_table)
                    with cursor.cursor.copy(f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                        for r in batch:
                            values = _values(r)
                            copy.write_row((*values[:-1], _json(values[-1])))
        else:
            RequestLog.objects.bulk_create([_row(r) for r in batch])
    except IntegrityError:
        # A worker, pool, revision or key was deleted since the snapshot: keep
        # the rows, without the references that no longer exist.
        rows = [_row(r) for r in batch]
        _drop_dangling(rows)
        RequestLog.objects.bulk_create(rows)
    last_used: dict[int, float] = {}
    for r in batch:
        if r.api_key_id is not None:
            last_used[r.api_key_id] = max(last_used.get(r.api_key_id, 0.0), r.created_at)
    for key_id, when in last_used.items():
        ClientKey.objects.filter(pk=key_id).update(last_used=_datetime(when))


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _datetime(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, tz=UTC)


def _row(r: RequestRecord) -> Any:
    return RequestLog(**dict(zip(COLUMNS, _values(r), strict=True)))  # attnames: pool_id=, worker_id=, ...


def _drop_dangling(rows: list[Any]) -> None:
    for attr, model in (
        ("pool_id", Pool),
        ("worker_id", Worker),
        ("profile_revision_id", ProfileRevision),
        ("api_key_id", ClientKey),
    ):
        ids = {getattr(r, attr) for r in rows} - {None}
        existing = set(model.objects.filter(pk__in=ids).values_list("pk", flat=True))
        for r in rows:
            if getattr(r, attr) not in existing:
                setattr(r, attr, None)
