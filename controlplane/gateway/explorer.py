"""The request log as operators search it: the Requests page and ``/api/v1/requests/``.

``parse(params)`` turns query parameters into a ``RequestQuery`` or raises
``ValidationError`` naming the field; ``RequestQuery.page()`` returns one
page by keyset (the sort key and the id of the last row, as an opaque
cursor), so a page deep into 10M rows costs what the first does: each
sortable figure has an index on (figure, id). Sorting by a figure leaves out
the rows that lack it (a request that failed before its first token has no
TTFT). ``RequestQuery.rows()`` streams the whole filtered set in the same
order from a server-side cursor, so an export never holds it in memory and
equals the pages laid end to end.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import F, Q, QuerySet
from django.utils.dateparse import parse_datetime

from controlplane.fleet.models import Pool, Worker
from controlplane.fleet.pools import ROLES
from controlplane.gateway.facts import PREFILL_MODES
from controlplane.gateway.models import RequestLog
from workers.figures import PROMPT_BUCKETS

# Sort keys: the figure's name in the API → its column.
SORTS = {
    "time": "created_at",
    "ttft": "ttft_seconds",
    "max_gap": "max_gap_seconds",
    "e2e": "e2e_seconds",
    "tpot": "tpot_seconds",
    "queue": "queue_seconds",
    "prefill": "prefill_seconds",
}
SLOW_BY = {"ttft": "ttft_seconds", "max_gap": "max_gap_seconds", "e2e": "e2e_seconds"}
SPLITS = ("chunked", "whole")
STATUS_WORDS = ("ok", "failed")
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

# A row as the API, the page and the exports give it, in this order.
COLUMNS = (
    "id",
    "request_id",
    "created_at",
    "model",
    "cohort",
    "pool",
    "worker",
    "profile_revision_id",
    "status",
    "error",
    "stream",
    "prefill_mode",
    "prompt_split",
    "num_prefill_chunks",
    "prompt_tokens",
    "cached_tokens",
    "computed_tokens",
    "output_tokens",
    "ttft_seconds",
    "max_gap_seconds",
    "tpot_seconds",
    "e2e_seconds",
    "queue_seconds",
    "prefill_seconds",
    "preemptions",
)
_SOURCES = tuple({"pool": "pool__name", "worker": "worker__name"}.get(c, c) for c in COLUMNS)


@dataclass
class RequestQuery:
    filters: Q = field(default_factory=Q)
    sort: str = "time"
    descending: bool = True
    limit: int = DEFAULT_LIMIT
    after: tuple[Any, int] | None = None  # the cursor: (sort value, id) of the last row shown

    @property
    def column(self) -> str:
        return SORTS[self.sort]

    def queryset(self) -> QuerySet[RequestLog]:
        qs = RequestLog.objects.filter(self.filters)
        if self.column != "created_at":
            qs = qs.filter(**{f"{self.column}__isnull": False})
        sign = "-" if self.descending else ""
        return qs.order_by(f"{sign}{self.column}", f"{sign}id")

    def _after(self, qs: QuerySet[RequestLog]) -> QuerySet[RequestLog]:
        if self.after is None:
            return qs
        # A row comparison, which PostgreSQL answers from the (column, id) index.
        op = "<" if self.descending else ">"
        table = RequestLog._meta.db_table
        return qs.extra(where=[f'("{table}"."{self.column}", "{table}"."id") {op} (%s, %s)'], params=list(self.after))

    def page(self) -> tuple[list[dict[str, Any]], str | None]:
        """One page of rows and the cursor of the next (None: the last page)."""
        raw = list(self._after(self.queryset()).values_list(*_SOURCES)[: self.limit + 1])
        more = len(raw) > self.limit
        raw = raw[: self.limit]
        cursor = encode_cursor(raw[-1][COLUMNS.index(self.column)], raw[-1][0]) if more and raw else None
        return [dict(zip(COLUMNS, map(_plain, r), strict=True)) for r in raw], cursor

    def rows(self, chunk_size: int = 5000) -> Iterator[tuple[Any, ...]]:
        """Every row of the filtered set, in page order, as tuples in ``COLUMNS`` order."""
        return self._after(self.queryset()).values_list(*_SOURCES).iterator(chunk_size=chunk_size)


def encode_cursor(value: Any, row_id: int) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    return base64.urlsafe_b64encode(json.dumps([value, row_id]).encode()).decode().rstrip("=")


def _decode_cursor(raw: str, sort: str) -> tuple[Any, int]:
    try:
        value, row_id = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, TypeError) as exc:
        raise ValidationError({"cursor": ["not a cursor this API gave out."]}) from exc
    if not isinstance(row_id, int):
        raise ValidationError({"cursor": ["not a cursor this API gave out."]})
    if sort == "time":
        when = parse_datetime(value) if isinstance(value, str) else None
        if when is None:
            raise ValidationError({"cursor": ["not a cursor of a time-sorted page."]})
        return when, row_id
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError({"cursor": [f"not a cursor of a page sorted by {sort}."]})
    return float(value), row_id


def bucket_bounds(name: str) -> tuple[float, float]:
    """A prompt-length bucket's (exclusive low, inclusive high) token counts."""
    low = 0.0
    for bucket, bound in PROMPT_BUCKETS:
        if bucket == name:
            return low, bound
        low = bound
    raise KeyError(name)


def parse(params: Mapping[str, str]) -> RequestQuery:
    """Query parameters → a query, or ValidationError naming every bad field."""
    errors: dict[str, list[str]] = {}
    q = Q()

    def bad(name: str, message: str) -> None:
        errors.setdefault(name, []).append(message)

    def text(name: str) -> str:
        return (params.get(name) or "").strip()

    for name, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
        if value := text(name):
            when = parse_datetime(value)
            if when is None or when.tzinfo is None:
                bad(name, "an ISO 8601 time with its zone, e.g. 2026-01-31T12:00:00Z.")
            else:
                q &= Q(**{lookup: when})
    if model := text("model"):
        q &= Q(model=model)
    if cohort := text("cohort"):
        if cohort not in ROLES:
            bad("cohort", f"one of {', '.join(ROLES)}.")
        q &= Q(cohort=cohort)
    for name, model_cls in (("pool", Pool), ("worker", Worker)):
        if value := text(name):
            found = model_cls.objects.filter(name=value).values_list("pk", flat=True).first()
            if found is None:
                bad(name, f"no {name} is named `{value}`.")
            q &= Q(**{f"{name}_id": found})
    if revision := text("revision"):
        if not revision.isdigit():
            bad("revision", "a profile revision id (a whole number).")
        else:
            q &= Q(profile_revision_id=int(revision))
    if mode := text("prefill_mode"):
        if mode not in PREFILL_MODES:
            bad("prefill_mode", f"one of {', '.join(PREFILL_MODES)}.")
        q &= Q(prefill_mode=mode)
    if split := text("split"):
        if split not in SPLITS:
            bad("split", "chunked (the prompt was split into chunks) or whole.")
        q &= Q(prompt_split=split == "chunked")
    if status := text("status"):
        if status == "ok":
            q &= Q(status=200, error="")
        elif status == "failed":
            q &= Q(status__gte=500) | Q(status=429) | (Q(status=200) & ~Q(error=""))
        elif status.isdigit() and 100 <= int(status) <= 999:
            q &= Q(status=int(status))
        else:
            bad("status", "an HTTP status (200, 598, ...), ok or failed.")
    if bucket := text("bucket"):
        try:
            low, high = bucket_bounds(bucket)
        except KeyError:
            bad("bucket", f"one of {', '.join(name for name, _ in PROMPT_BUCKETS)}.")
        else:
            q &= Q(prompt_tokens__gt=low) & (Q() if high == float("inf") else Q(prompt_tokens__lte=high))
    slow_by, slow_above = text("slow_by"), text("slow_above")
    if slow_by or slow_above:
        if slow_by not in SLOW_BY:
            bad("slow_by", f"one of {', '.join(SLOW_BY)}, with slow_above.")
        try:
            threshold = float(slow_above)
            if threshold < 0:
                raise ValueError
        except ValueError:
            bad("slow_above", "a number of seconds, 0 or more, with slow_by.")
        else:
            if slow_by in SLOW_BY:
                q &= Q(**{f"{SLOW_BY[slow_by]}__gt": threshold})
    sort = text("sort") or "time"
    if sort not in SORTS:
        bad("sort", f"one of {', '.join(SORTS)}.")
    order = text("order") or "desc"
    if order not in ("asc", "desc"):
        bad("order", "asc or desc.")
    limit = DEFAULT_LIMIT
    if raw_limit := text("limit"):
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
            bad("limit", f"a whole number from 1 to {MAX_LIMIT}.")
        else:
            limit = int(raw_limit)
    after = None
    if (cursor := text("cursor")) and sort in SORTS:
        try:
            after = _decode_cursor(cursor, sort)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    if errors:
        raise ValidationError(errors)
    return RequestQuery(q, sort, order == "desc", limit, after)


FILTER_PARAMS = (
    "since",
    "until",
    "model",
    "cohort",
    "pool",
    "worker",
    "revision",
    "prefill_mode",
    "split",
    "status",
    "bucket",
    "slow_by",
    "slow_above",
    "sort",
    "order",
)


# ---- exports ------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A datetime in ISO 8601, as PostgreSQL's JSON writes it (so the page and the exports agree)."""
    return value.isoformat() if isinstance(value, datetime) else value


def _copy_sql(query: RequestQuery, fmt: str) -> tuple[str, tuple[Any, ...]]:
    """``COPY (the filtered, sorted rows) TO STDOUT``: PostgreSQL formats every
    value and streams the result as it goes (Python-side formatting held an
    export to a few thousand rows per second)."""
    plain = [c for c in COLUMNS if c not in ("pool", "worker")]
    qs = query._after(query.queryset()).values(*plain, pool_name=F("pool__name"), worker_name=F("worker__name"))
    inner, params = qs.query.sql_with_params()
    outer = [f'r."{c}"' for c in COLUMNS]
    outer[COLUMNS.index("pool")], outer[COLUMNS.index("worker")] = "r.pool_name", "r.worker_name"
    if fmt == "jsonl":
        pairs = ", ".join(f"'{c}', {expr}" for c, expr in zip(COLUMNS, outer, strict=True))
        return f"COPY (SELECT json_build_object({pairs})::text FROM ({inner}) AS r) TO STDOUT", params
    outer[COLUMNS.index("created_at")] = "to_json(r.created_at) #>> '{}'"
    columns = ", ".join(f'{expr} AS "{c}"' for c, expr in zip(COLUMNS, outer, strict=True))
    return f"COPY (SELECT {columns} FROM ({inner}) AS r) TO STDOUT (FORMAT CSV, HEADER)", params


def _copied(query: RequestQuery, fmt: str) -> Iterator[bytes]:
    sql, params = _copy_sql(query, fmt)
    with connection.cursor() as cursor, cursor.cursor.copy(sql, params) as copy:
        if fmt == "csv":
            yield from (bytes(block) for block in copy)
            return
        # COPY's text format doubles each backslash of the JSON (it has no raw
        # newlines or tabs to escape: JSON escapes them itself); undo exactly that.
        for block in copy:
            yield bytes(block).replace(b"\\\\", b"\\")


def _python_csv(query: RequestQuery) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for n, row in enumerate(query.rows(), 1):
        writer.writerow([_plain(v) for v in row])
        if n % 1000 == 0:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode()


def _python_jsonl(query: RequestQuery) -> Iterator[bytes]:
    dumps = json.JSONEncoder(separators=(",", ":"), default=_plain).encode
    lines: list[str] = []
    for row in query.rows():
        lines.append(dumps(dict(zip(COLUMNS, map(_plain, row), strict=True))))
        if len(lines) >= 1000:
            yield ("\n".join(lines) + "\n").encode()
            lines = []
    if lines:
        yield ("\n".join(lines) + "\n").encode()


def csv_lines(query: RequestQuery) -> Iterator[bytes]:
    """The filtered set as CSV, a header then one line per row, streamed."""
    return _copied(query, "csv") if connection.vendor == "postgresql" else _python_csv(query)


def jsonl_lines(query: RequestQuery) -> Iterator[bytes]:
    """The filtered set as JSON Lines, one object per row, streamed."""
    return _copied(query, "jsonl") if connection.vendor == "postgresql" else _python_jsonl(query)


# ---- one request's timeline ------------------------------------------------------------
@dataclass(frozen=True)
class TimelineEvent:
    label: str
    at_seconds: float  # since the request's arrival at the gateway
    num_tokens: int | None = None


def timeline(row: RequestLog) -> list[TimelineEvent]:
    """Arrival, queued, each prefill chunk, first token, end. The engine's times
    count from its own arrival, a network hop after the gateway's: they are
    laid on the gateway's clock as they are, which puts them early by that hop."""
    events = [TimelineEvent("arrived", 0.0)]
    data = row.timeline or {}
    if row.queue_seconds is not None:
        events.append(TimelineEvent("scheduled (left the queue)", row.queue_seconds))
    for i, (offset, num_tokens) in enumerate(data.get("chunks") or []):
        events.append(TimelineEvent(f"prefill chunk {i + 1}", float(offset), int(num_tokens)))
    if row.ttft_seconds is not None:
        events.append(TimelineEvent("first token", row.ttft_seconds))
    elif row.queue_seconds is not None and row.prefill_seconds is not None:
        events.append(TimelineEvent("first token (engine)", row.queue_seconds + row.prefill_seconds))
    if row.e2e_seconds is not None:
        events.append(TimelineEvent("ended", row.e2e_seconds))
    return sorted(events, key=lambda e: e.at_seconds)


def gaps(row: RequestLog) -> list[float]:
    """The gaps between token events the client saw (the first ``meter.MAX_GAPS``)."""
    return [float(g) for g in (row.timeline or {}).get("gaps") or []]
