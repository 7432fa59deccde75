"""Figures over stored data: the one door the API, dashboards, rollouts and
alerts go through.

    query("ttft_p99", 300, group_by="cohort", selector={"pool": "gpu-a"})
        -> {"canary": 0.41, "stable": 0.38}
    query_range("ttft_p99", 300, group_by="pool", start=..., end=..., step_seconds=60)
        -> RangeResult(times=[...], series={"gpu-a": [0.4, None, ...]})

A value of None is *no data* (nothing happened in the window, or fewer than
two scrapes), never zero. Groups: ``fleet`` (one group), ``worker``,
``pool``, ``cohort`` (the pool's role in the routing table), and for
request-log figures ``length_bucket``.

How data is read (see models.py for the row format):

* one window: for each target, its first and last snapshot inside the window
  (two index probes), their reset-corrected totals and sample numbers give
  Prometheus's extrapolated increase for every series at once. Windows that
  reach past raw retention read minute rollups the same way. The peak-memory
  maximum is one aggregate: minute rollups inside, raw scrapes at the edges.
* a time series whose windows start and end on whole minutes (a page's
  chart, ``query_range_many(aligned=True)``): each minute rollup's head (the
  counters and the charted histograms) at its first and last scrape, 2 rows
  a minute per target, equal to the raw scrapes' windows
  (``_edge_windows``); its live point from the one-window read above.
* another time series: every minute rollup of the range (60 per target per
  hour), or for windows under 10 minutes the raw scrapes at each window's
  edges, windows evaluated at each point with the same arithmetic.
* request-log figures read the gateway's log rows of the window.

Each read windows only the series the asked figures read
(``figures.narrow``; a page's figures need a few hundred of 2,085) and
inflates a stored vector only up to the last of them; callers that ask no
figures (the batched reader, the advisor) get every series.

All of the above is the database backend. With ``METRICS_BACKEND=prometheus``
scraped figures come from Prometheus instead (``backends.py``: each figure's
registry PromQL, compiled as the shipped rules are); request-log figures
stay here. A backend that does not answer raises ``BackendUnavailable``.

Beside ``query``/``query_range``, the pieces a batched reader builds on are
public too (``reader.Reader`` is one: it answers many queries of one cycle,
reading each window once): ``check_window`` (a window's bounds, or
QueryError), ``point_windows`` (every target's inputs over one window, its
stored rows shared within ``shared_reads()``), ``group_of`` (a target's group) and ``Epoch`` (a
timestamp column as epoch seconds, computed by the database).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import psycopg
from django.db import connection
from django.db.models import BinaryField, F, FloatField, Func, Max, OuterRef, Q, QuerySet, Subquery, Window
from django.db.models.expressions import BaseExpression
from django.db.models.functions import Ceil, RowNumber
from django.utils import timezone
from numpy.typing import NDArray

from controlplane.gateway import bus
from controlplane.gateway.inflight import STATUS_STREAM_TIMED_OUT
from controlplane.gateway.models import RequestLog
from controlplane.metrics import backends, catalogue, figures, promql
from controlplane.metrics.backends import (
    BackendUnavailable as BackendUnavailable,  # the query layer's too
)
from controlplane.metrics.catalogue import Layout
from controlplane.metrics.figures import Figure, Objectives, RequestRows, TargetWindows
from controlplane.metrics.models import (
    RAW_RETENTION,
    CounterReset,
    Rollup,
    SeriesLayout,
    ServiceObjectives,
    Snapshot,
    Target,
    minute_of,
    unpack,
)
from controlplane.metrics.promql import Floats

SELECTOR_KEYS = ("worker", "pool", "cohort")
NO_POOL, NO_COHORT = backends.NO_POOL, backends.NO_COHORT
FLEET = "fleet"
MAX_RANGE_POINTS = 1500
# The gateway logs a request whose client went away first as 499
# (controlplane/gateway/proxy.py: STATUS_CLIENT_GONE): cancelled, not served.
STATUS_CLIENT_GONE = 499
# Retention deletes the oldest raw minute while a window is read: keep clear.
_RAW_MARGIN = timedelta(minutes=2)
# The positions of the series a read windows (None: every one), and the
# layout naming them: ``figures.narrow`` for the figures asked, or the whole
# layout for a caller that reads everything (the alert reader, the advisor).
Columns = NDArray[np.intp] | None
Narrow = Callable[[Layout], tuple[Layout, Columns]]


def _whole(layout: Layout) -> tuple[Layout, Columns]:
    return layout, None


def _cut(values: Floats, columns: Columns) -> Floats:
    return values if columns is None else values[..., columns]


def _unpack_through(blob: bytes | memoryview, columns: Columns) -> Floats:
    """A stored vector, or only its values up to the last of ``columns``:
    inflating stops there. A page's figures read series early in the layout
    (the panel's end at 616 of 2,085), and inflating every window's two
    16-KB vectors whole was most of a figures page's time."""
    if columns is None:
        return unpack(blob)
    return np.frombuffer(zlib.decompressobj().decompress(bytes(blob), (int(columns[-1]) + 1) * 8), dtype=np.float64)


def _inflate_once(
    inflated: dict[int, Floats], blobs: Mapping[int, bytes | memoryview], pk: int, columns: Columns
) -> Floats:
    """Scrape ``pk``'s vector through ``columns``, from ``inflated`` when read before."""
    if pk not in inflated:
        inflated[pk] = _unpack_through(blobs[pk], columns)
    return inflated[pk]


def _whole_width(vector: Floats, layout: Layout, columns: Columns) -> bool:
    """Whether a vector read by ``_unpack_through`` has its target's width
    (the scraper stores every vector at its target's layout): of a prefix,
    that it holds every column read."""
    return len(vector) == (len(layout) if columns is None else int(columns[-1]) + 1)


class QueryError(ValueError):
    """Bad input, naming the parameter (the API answers 400 with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class RangeResult:
    times: list[float]  # epoch seconds, the end of each point's window
    series: dict[str, list[float | None]]


# ---- validation ------------------------------------------------------------------


def figure_named(name: str) -> Figure:
    try:
        return figures.get(name)
    except KeyError:
        raise QueryError("figure", f"unknown figure {name!r}; one of {', '.join(figures.FIGURES)}") from None


def check_group_by(figure: Figure, group_by: str | None) -> str:
    group_by = group_by or FLEET
    choices = figures.group_by_choices(figure)
    if group_by not in choices:
        if group_by == "length_bucket":
            raise QueryError(
                "group_by",
                f"{figure.name} comes from scraped histograms the workers do not label "
                "by prompt length; use a client_* figure (or ttft_*, stall_*, "
                "prefill_time_*) for length buckets",
            )
        raise QueryError("group_by", f"one of {', '.join(choices)}")
    return group_by


def check_selector(selector: Mapping[str, str] | None) -> dict[str, str]:
    selector = dict(selector or {})
    for key in selector:
        if key not in SELECTOR_KEYS:
            raise QueryError("selector", f"unknown label {key!r}; one of {', '.join(SELECTOR_KEYS)}")
    return selector


MAX_DURATION_SECONDS = 100 * 365 * 86400  # far past any retention; keeps `end - range` a valid datetime


def parse_duration(text: str, field: str = "window") -> float:
    """``300``, ``30s``, ``5m``, ``1h``, ``2d`` → seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = (text or "").strip()
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise QueryError(field, f"{text!r} is not a duration (e.g. 30s, 5m, 1h, 7d)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise QueryError(field, "must be a positive duration")
    if seconds > MAX_DURATION_SECONDS:
        raise QueryError(field, "at most 100 years")
    return seconds


def objectives_now() -> Objectives:
    row = ServiceObjectives.current()
    return Objectives(row.ttft_seconds, row.tpot_seconds)


# ---- public API ------------------------------------------------------------------


def query(
    figure: str,
    window_seconds: float,
    group_by: str | None = None,
    selector: Mapping[str, str] | None = None,
    now: datetime | None = None,
    objectives: Objectives | None = None,
) -> dict[str, float | None]:
    """The figure over the window ending ``now``, per group."""
    return query_many([figure], window_seconds, group_by, selector, now, objectives)[figure]


def query_many(
    names: Sequence[str],
    window_seconds: float,
    group_by: str | None = None,
    selector: Mapping[str, str] | None = None,
    now: datetime | None = None,
    objectives: Objectives | None = None,
) -> dict[str, dict[str, float | None]]:
    """Several figures over one window, reading the stored data once."""
    now = now or timezone.now()
    window = check_window(window_seconds)
    points = np.array([now.timestamp()])
    return {
        name: {group: values[0] for group, values in series.items()}
        for name, series in _evaluate(names, window, group_by, selector, points, objectives, dense=False).items()
    }


def query_range(
    figure: str,
    window_seconds: float,
    group_by: str | None = None,
    selector: Mapping[str, str] | None = None,
    *,
    start: datetime,
    end: datetime,
    step_seconds: float,
    objectives: Objectives | None = None,
) -> RangeResult:
    """The figure at ``end``, ``end - step``, ... back to ``start``, each over
    the window ending there."""
    return query_range_many(
        [figure],
        window_seconds,
        group_by,
        selector,
        start=start,
        end=end,
        step_seconds=step_seconds,
        objectives=objectives,
    )[figure]


def query_range_many(
    names: Sequence[str],
    window_seconds: float,
    group_by: str | None = None,
    selector: Mapping[str, str] | None = None,
    *,
    start: datetime,
    end: datetime,
    step_seconds: float,
    objectives: Objectives | None = None,
    aligned: bool = False,
) -> dict[str, RangeResult]:
    """Several figures' series over one range, reading the stored data once.

    ``aligned``: the points on whole multiples of the step (as Grafana aligns
    a range query) and the last at ``end`` itself, so a page's chart keeps its
    past points from one render to the next and, with a step of whole minutes,
    reads minute rollups (``_edge_windows``) rather than every scrape."""
    window = check_window(window_seconds)
    if step_seconds <= 0 or not math.isfinite(step_seconds):
        raise QueryError("step", "must be a positive duration")
    span = (end - start).total_seconds()
    if span < 0:
        raise QueryError("start", "must not be after end")
    if span / step_seconds + 1 + aligned > MAX_RANGE_POINTS:
        raise QueryError("step", f"at most {MAX_RANGE_POINTS} points; use a larger step")
    if aligned:
        first, last = math.ceil(start.timestamp() / step_seconds), math.floor(end.timestamp() / step_seconds)
        grid = step_seconds * np.arange(first, last + 1, dtype=np.float64)
        points = np.append(grid[grid < end.timestamp() - _GRID_TOLERANCE_SECONDS], end.timestamp())
    else:
        count = int(span // step_seconds) + 1
        points = np.asarray(end.timestamp() - step_seconds * np.arange(count)[::-1], dtype=np.float64)
    evaluated = _evaluate(names, window, group_by, selector, points, objectives, dense=True)
    times = points.tolist()
    return {name: RangeResult(times, series) for name, series in evaluated.items()}


def group_of(labels: Mapping[str, str], group_by: str) -> str:
    if group_by == FLEET:
        return FLEET
    if group_by == "pool":
        return labels.get("pool") or NO_POOL
    if group_by == "cohort":
        return labels.get("cohort") or NO_COHORT
    return labels.get(group_by, "")


# ---- evaluation ------------------------------------------------------------------


def check_window(window_seconds: float) -> float:
    """The window in seconds, or QueryError: positive, and within rollup retention."""
    if not (isinstance(window_seconds, (int, float)) and math.isfinite(window_seconds) and window_seconds > 0):
        raise QueryError("window", "must be a positive duration")
    if window_seconds > 14 * 86400:
        raise QueryError("window", "at most 14 days (rollup retention)")
    return float(window_seconds)


def _evaluate(
    names: Sequence[str],
    window: float,
    group_by: str | None,
    selector: Mapping[str, str] | None,
    points: Floats,
    objectives: Objectives | None,
    *,
    dense: bool,
) -> dict[str, dict[str, list[float | None]]]:
    chosen = [figure_named(name) for name in names]
    group_by_checked = {f.name: check_group_by(f, group_by) for f in chosen}
    selector = check_selector(selector)
    out: dict[str, dict[str, list[float | None]]] = {}

    scrape = [f for f in chosen if f.source == "scrape"]
    if scrape:
        out.update(
            backend().scrape_figures(scrape, window, group_by_checked[scrape[0].name], selector, points, dense=dense)
        )

    requests = [f for f in chosen if f.source == "requests"]
    if requests:
        objectives = objectives or objectives_now()
        rows_by_group = _request_rows(points, window, selector, group_by_checked[requests[0].name])
        for f in requests:
            out[f.name] = {
                g: _clean(f.from_requests(rows, points, window, objectives))
                for g, rows in sorted(rows_by_group.items())
            }
    return out


def _scrape_from_database(
    scrape: Sequence[Figure], window: float, by: str, selector: Mapping[str, str], points: Floats, dense: bool
) -> dict[str, dict[str, list[float | None]]]:
    """The database backend: scraped figures from the control plane's own
    snapshots and rollups, windowing only the series these figures read."""
    needs_peak = any(f.needs_peak_memory for f in scrape)
    by_prompt = by == "length_bucket"

    def narrow(layout: Layout) -> tuple[Layout, Columns]:
        return figures.narrow(layout, scrape, by_prompt=by_prompt)

    edges = (
        _edge_windows(points[:-1], window, selector, needs_peak, narrow)
        if dense and len(points) > 1 and _on_minutes(points[:-1], window)
        else None
    )
    if not dense:
        parts = [(points, point_windows(points, window, selector, needs_peak, narrow))]
    elif edges is not None:
        # Every window but the newest is whole minutes: their first and last
        # scrapes are in the minute rollups. The newest (the live point, which
        # must equal what the query API says) from its own read.
        parts = [(points[:-1], edges), (points[-1:], point_windows(points[-1:], window, selector, needs_peak, narrow))]
    elif _raw_dense(points, window):
        # Windows a few minutes long hold too few minute rollups to compute
        # anything (a 1-minute window holds one): read the raw scrapes.
        parts = [(points, _raw_dense_windows(points, window, selector, needs_peak, narrow))]
    elif _dt(float(points[-1]) - window) >= timezone.now() - RAW_RETENTION + _RAW_MARGIN:
        # The newest point from raw scrapes: the current minute's rollup is
        # partial, and the live point must equal what the query API says.
        parts = [
            (
                points[:-1],
                _dense_windows(points[:-1], window, selector, needs_peak, narrow) if len(points) > 1 else [],
            ),
            (points[-1:], point_windows(points[-1:], window, selector, needs_peak, narrow)),
        ]
    else:
        parts = [(points, _dense_windows(points, window, selector, needs_peak, narrow))]
    return _join_parts(scrape, parts, by)


DATABASE = backends.Database(_scrape_from_database)


def backend() -> backends.Backend:
    """The backend scraped figures come from (``METRICS_BACKEND``)."""
    return backends.current(DATABASE)


def _join_parts(
    chosen: Sequence[Figure], parts: Sequence[tuple[Floats, list[TargetWindows]]], group_by: str
) -> dict[str, dict[str, list[float | None]]]:
    """Each figure per group over consecutive runs of points, each run with
    its own loaded windows; a group absent from a run has no data there."""
    if group_by == "length_bucket":
        return _join_by_prompt(chosen, parts)
    pieces: list[dict[str, figures.Group]] = []
    for part_points, loaded in parts:
        grouped: dict[str, list[TargetWindows]] = defaultdict(list)
        for tw in loaded:
            grouped[group_of(tw.labels, group_by)].append(tw)
        pieces.append({g: figures.Group(tws, len(part_points)) for g, tws in grouped.items()})
    groups = sorted({g for piece in pieces for g in piece} | ({FLEET} if group_by == FLEET else set()))
    out: dict[str, dict[str, list[float | None]]] = {}
    for f in chosen:
        out[f.name] = {
            group: [
                value
                for (part_points, _), piece in zip(parts, pieces, strict=True)
                for value in (_clean(f.from_group(piece[group])) if group in piece else [None] * len(part_points))
            ]
            for group in groups
        }
    return out


def _join_by_prompt(
    chosen: Sequence[Figure], parts: Sequence[tuple[Floats, list[TargetWindows]]]
) -> dict[str, dict[str, list[float | None]]]:
    """Scraped figures per prompt-length bucket: every target in one group,
    read through each bucket's histogram (a bucket without data is absent)."""
    groups = [figures.Group(loaded, len(part_points)) for part_points, loaded in parts]
    out: dict[str, dict[str, list[float | None]]] = {}
    for f in chosen:
        by_bucket = {
            label: [value for group in groups for value in _clean(f.from_group_by_prompt(group, label))]
            for label in catalogue.LENGTH_BUCKET_LABELS
        }
        out[f.name] = {label: values for label, values in by_bucket.items() if any(v is not None for v in values)}
    return out


def _clean(values: Floats) -> list[float | None]:
    return [None if not math.isfinite(v) else float(v) for v in values]


def _targets(start: float, end: float, selector: Mapping[str, str]) -> list[Target]:
    filters = {
        f"{'worker_name' if k == 'worker' else k + '_name' if k == 'pool' else k}": v for k, v in selector.items()
    }
    return list(
        Target.objects.filter(last_at__gt=_dt(start), first_at__lte=_dt(end), **filters).only(
            "id", "worker_name", "pool_name", "cohort", "layout_id"
        )
    )


class Epoch(Func):
    """A timestamp as epoch seconds, computed by the database: parsing
    thousands of timestamps in Python costs more than the query."""

    template = "CAST(EXTRACT(EPOCH FROM %(expressions)s) AS double precision)"
    output_field = FloatField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)", **extra
        )


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


class _Offsets:
    """Each target's reset offsets as of a time (zeros before any reset)."""

    def __init__(self, target_ids: Iterable[int], until: float):
        self._by_target: dict[int, list[tuple[float, Floats]]] = defaultdict(list)
        for target_id, ts, blob in (
            CounterReset.objects.filter(target_id__in=list(target_ids), ts__lte=_dt(until))
            .order_by("ts")
            .values_list("target_id", "ts", "offsets")
        ):
            self._by_target[target_id].append((ts.timestamp(), unpack(blob)))

    def at(self, target_id: int, times: Floats, width: int, columns: Columns = None) -> Floats | None:
        """[len(times), width] offsets, or of only ``columns`` (``width`` their number)."""
        resets = self._by_target.get(target_id)
        if not resets:
            return None
        out = np.zeros((len(times), width))
        for ts, offsets in resets:
            out[times >= ts] = _cut(offsets, columns)
        return out


@dataclass
class _StoredEnds:
    """One target's stored inputs over one window, every series: its first
    and last row inside (times, sample count, totals, reset offsets at the
    first; None: fewer than two rows) and its peak-memory maximum."""

    labels: dict[str, str]
    layout: Layout
    peak: float
    ends: tuple[float, float, int, Floats, Floats, Floats | None] | None = None


@dataclass
class _PointRead:
    start: float
    end: float
    window: float
    targets: list[_StoredEnds]

    def windows(self, narrow: Narrow) -> list[TargetWindows]:
        """Each target's increases over the window, of the series ``narrow`` keeps."""
        out = []
        for stored in self.targets:
            layout, columns = narrow(stored.layout)
            increases = np.full((1, len(layout)), np.nan)
            if stored.ends is not None:
                t0, t1, num_samples, first_totals, last_totals, first_offsets = stored.ends
                first, last = _cut(first_totals, columns), _cut(last_totals, columns)
                first_raw = first - (_cut(first_offsets, columns) if first_offsets is not None else 0.0)
                summary = promql.CounterWindow(t0, t1, num_samples, first_raw, last - first)
                increases[0] = promql.extrapolated_increase(summary, self.start, self.end)
            out.append(TargetWindows(stored.labels, layout, increases, np.array([stored.peak]), self.window))
        return out


_shared: contextvars.ContextVar[dict[tuple[Any, ...], _PointRead] | None] = contextvars.ContextVar(
    "metrics_shared_reads", default=None
)


@contextlib.contextmanager
def shared_reads() -> Iterator[None]:
    """Inside this block, one-window reads of the same window are done once:
    a page that draws series (whose newest point is the window ending now)
    and a table of more figures over that same window reads it once."""
    token = _shared.set({})
    try:
        yield
    finally:
        _shared.reset(token)


def point_windows(
    points: Floats, window: float, selector: Mapping[str, str], needs_peak: bool, narrow: Narrow = _whole
) -> list[TargetWindows]:
    """Each target's inputs over ``window`` ending at ``points[-1]`` (one point),
    for the targets that ``selector`` picks ({} for every one), of the series
    ``narrow`` keeps (every one unless told). The stored rows are read once
    per window and selector inside ``shared_reads()``, whatever the series."""
    memo = _shared.get()
    if memo is None:
        return _read_point_window(points, window, selector, needs_peak).windows(narrow)
    key = (float(points[-1]), window, tuple(sorted(selector.items())))
    for peak in (True, needs_peak):  # a read with the peak serves one without
        if (*key, peak) in memo:
            return memo[(*key, peak)].windows(narrow)
    memo[(*key, needs_peak)] = read = _read_point_window(points, window, selector, needs_peak)
    return read.windows(narrow)


def _read_point_window(points: Floats, window: float, selector: Mapping[str, str], needs_peak: bool) -> _PointRead:
    """One window (``points`` has one element) from first/last rows."""
    end = float(points[-1])
    start = end - window
    targets = _targets(start, end, selector)
    if not targets:
        return _PointRead(start, end, window, [])
    ids = [t.pk for t in targets]
    raw = _dt(start) >= timezone.now() - RAW_RETENTION + _RAW_MARGIN
    inside: QuerySet[Snapshot] | QuerySet[Rollup]
    if raw:
        inside = Snapshot.objects.filter(target=OuterRef("pk"), ts__gt=_dt(start), ts__lte=_dt(end))
        model: type[Snapshot] | type[Rollup] = Snapshot
        time_field = "ts"
    else:
        inside = Rollup.objects.filter(
            target=OuterRef("pk"),
            minute__gte=minute_of(_dt(start)),
            minute__lte=_dt(end),
            last_ts__gt=_dt(start),
            last_ts__lte=_dt(end),
        )
        model = Rollup
        time_field = "last_ts"
    order = "ts" if raw else "minute"
    ends = (
        Target.objects.filter(pk__in=ids)
        .annotate(
            first_id=Subquery(inside.order_by(order).values("pk")[:1]),
            last_id=Subquery(inside.order_by(f"-{order}").values("pk")[:1]),
        )
        .values_list("pk", "first_id", "last_id")
    )
    wanted = {row_id for _, a, b in ends for row_id in (a, b) if row_id is not None}
    rows = {
        pk: (ts.timestamp(), seq, values)
        for pk, ts, seq, values in model.objects.filter(pk__in=wanted).values_list("pk", time_field, "seq", "values")
    }
    peaks = _peak_memory(ids, start, end, raw) if needs_peak else {}
    offsets = _Offsets(ids, end)
    by_id = {t.pk: t for t in targets}
    read = _PointRead(start, end, window, [])
    for target_id, first_id, last_id in ends:
        t = by_id[target_id]
        layout = SeriesLayout.layout_by_id(t.layout_id)
        peak_value = peaks.get(target_id)
        stored = _StoredEnds(t.labels(), layout, np.nan if peak_value is None else peak_value)
        if first_id is not None and last_id is not None and first_id != last_id:
            (t0, seq0, blob0), (t1, seq1, blob1) = rows[first_id], rows[last_id]
            first_totals, last_totals = unpack(blob0), unpack(blob1)
            if len(first_totals) == len(last_totals) == len(layout) and t1 > t0:
                first_offsets = offsets.at(target_id, np.array([t0]), len(layout))
                stored.ends = (
                    t0,
                    t1,
                    seq1 - seq0 + 1,
                    first_totals,
                    last_totals,
                    first_offsets[0] if first_offsets is not None else None,
                )
        read.targets.append(stored)
    return read


def _peak_memory(ids: list[int], start: float, end: float, raw: bool) -> dict[int, float]:
    """max_over_time of the peak gauge per target: whole minutes from rollups,
    the partial minutes at the edges from raw scrapes."""
    start_dt, end_dt = _dt(start), _dt(end)
    first_whole = minute_of(start_dt) + timedelta(minutes=1)
    last_whole_end = minute_of(end_dt)
    peaks: dict[int, float] = {}

    def merge(rows: Iterable[tuple[int, float | None]]) -> None:
        for target_id, value in rows:
            if value is not None and (target_id not in peaks or value > peaks[target_id]):
                peaks[target_id] = value

    if not raw:
        merge(
            Rollup.objects.filter(target_id__in=ids, minute__gte=minute_of(start_dt), minute__lte=end_dt)
            .values("target_id")
            .annotate(m=Max("peak_memory_bytes"))
            .values_list("target_id", "m")
        )
        return peaks
    if first_whole < last_whole_end:
        merge(
            Rollup.objects.filter(target_id__in=ids, minute__gte=first_whole, minute__lt=last_whole_end)
            .values("target_id")
            .annotate(m=Max("peak_memory_bytes"))
            .values_list("target_id", "m")
        )
        edges = Q(ts__gt=start_dt, ts__lt=first_whole) | Q(ts__gte=last_whole_end, ts__lte=end_dt)
    else:
        edges = Q(ts__gt=start_dt, ts__lte=end_dt)
    merge(
        Snapshot.objects.filter(edges, target_id__in=ids)
        .values("target_id")
        .annotate(m=Max("peak_memory_bytes"))
        .values_list("target_id", "m")
    )
    return peaks


# A time series whose windows are shorter than this reads raw scrapes, not
# minute rollups: a window must hold two samples, and one of a few minutes
# holds a few rollups at most (a 1-minute window one, so every point was no
# data). Raw reads are bounded: only ranges this long, within raw retention.
RAW_DENSE_WINDOW_SECONDS = 600.0
RAW_DENSE_SPAN_SECONDS = 6 * 3600.0


def _raw_dense(points: Floats, window: float) -> bool:
    start = float(points[0]) - window
    return (
        window < RAW_DENSE_WINDOW_SECONDS
        and float(points[-1]) - start <= RAW_DENSE_SPAN_SECONDS
        and _dt(start) >= timezone.now() - RAW_RETENTION + _RAW_MARGIN
    )


def _raw_dense_windows(
    points: Floats, window: float, selector: Mapping[str, str], needs_peak: bool, narrow: Narrow = _whole
) -> list[TargetWindows]:
    """Windows at many points from raw scrapes: every scrape's time and sample
    number first (small rows), then the packed vectors of only the first and
    last scrape of each window, as ``point_windows`` reads one window."""
    start, end = float(points[0]) - window, float(points[-1])
    targets = _targets(start, end, selector)
    if not targets:
        return []
    by_id = {t.pk: t for t in targets}
    rows_by_target, blobs = _window_edges(points, window, list(by_id), start, end)
    plans: dict[int, tuple[Floats, np.ndarray, np.ndarray, np.ndarray, np.ndarray, Floats]] = {}
    wanted: set[int] = set()
    for target_id, rows in rows_by_target.items():
        pks = np.array([r[0] for r in rows], dtype=np.int64)
        times = np.array([r[1] for r in rows], dtype=np.float64)
        seqs = np.array([r[2] for r in rows], dtype=np.int64)
        peaks = np.array([np.nan if r[3] is None else r[3] for r in rows], dtype=np.float64)
        first = np.searchsorted(times, points - window, side="right")
        last = np.searchsorted(times, points, side="right") - 1
        ok = last > first
        plans[target_id] = (times, pks, seqs, first, last, peaks)
        wanted.update(pks[first[ok]].tolist())
        wanted.update(pks[last[ok]].tolist())
    if blobs is None:
        blobs = dict(Snapshot.objects.filter(pk__in=wanted).values_list("pk", "values")) if wanted else {}
    offsets = _Offsets(by_id, end)
    out = []
    for target_id, t in by_id.items():
        stored = SeriesLayout.layout_by_id(t.layout_id)
        layout, columns = narrow(stored)
        increases = np.full((len(points), len(layout)), np.nan)
        peak_values = np.full(len(points), np.nan)
        plan = plans.get(target_id)
        if plan is not None:
            times, pks, seqs, first, last, peaks = plan
            unpacked: dict[int, Floats] = {}  # a scrape ends one window and begins another: inflate it once
            for j in np.flatnonzero(last > first):
                i0, i1 = int(first[j]), int(last[j])
                v0, v1 = (_inflate_once(unpacked, blobs, int(pks[i]), columns) for i in (i0, i1))
                if not (_whole_width(v0, stored, columns) and _whole_width(v1, stored, columns)):
                    continue
                v0, v1 = _cut(v0, columns), _cut(v1, columns)
                first_offsets = offsets.at(target_id, times[i0 : i0 + 1], len(layout), columns)
                summary = promql.CounterWindow(
                    float(times[i0]),
                    float(times[i1]),
                    int(seqs[i1] - seqs[i0] + 1),
                    v0 - (first_offsets[0] if first_offsets is not None else 0.0),
                    v1 - v0,
                )
                increases[j] = promql.extrapolated_increase(summary, float(points[j]) - window, float(points[j]))
            if needs_peak:
                has = last >= first
                windows = promql.Windows(points, window, increases, np.where(has, first, -1), np.where(has, last, -1))
                peak_values = promql.max_in_windows(peaks, windows)
        out.append(TargetWindows(t.labels(), layout, increases, peak_values, window))
    return out


# Points at most this far off a regular grid still count as on it (float error).
_GRID_TOLERANCE_SECONDS = 1e-6


def _grid(points: Floats, window: float) -> tuple[float, float] | None:
    """(first edge, step) when every window edge lies on one regular grid
    (points evenly spaced, the window a whole number of steps), else None."""
    if len(points) < 2:
        return None
    step = float(points[1] - points[0])
    if step <= 0 or not np.allclose(np.diff(points), step, rtol=0, atol=_GRID_TOLERANCE_SECONDS):
        return None
    steps = window / step
    if abs(steps - round(steps)) > _GRID_TOLERANCE_SECONDS or round(steps) < 1:
        return None
    return float(points[0]) - window, step


def _window_edges(
    points: Floats, window: float, target_ids: list[int], start: float, end: float
) -> tuple[dict[int, list[tuple[int, float, int, float | None]]], dict[int, bytes | memoryview] | None]:
    """Each target's scrapes a window at ``points`` can begin or end on, as
    (pk, time, seq, peak memory), in time order.

    A window (p - window, p] begins at the first scrape after p - window and
    ends at the last at or before p. When every edge lies on one grid, those
    are the first and the last scrape between two grid lines: the database
    picks them (a row number over each target's scrapes between two lines),
    and only they come back, with the slice's peak memory, rather than every
    scrape's row (an hour of 5-s scrapes at 200 workers, two rows for each of 66 slices: 26,400 rows instead
    of 144,000), with their packed vectors: almost every one begins or ends
    some window, and asking for them by primary key after was a 24,000-item
    ``IN`` list to build and send. Each kept row carries the peak of its
    slice, so the max over a window's rows is the max over its scrapes. Off
    the grid, every scrape's row and no vectors (the caller fetches those it
    needs): the second item is None."""
    scrapes = Snapshot.objects.filter(target_id__in=target_ids, ts__gt=_dt(start), ts__lte=_dt(end)).annotate(
        t=Epoch("ts")
    )
    grid = _grid(points, window)
    out: dict[int, list[tuple[int, float, int, float | None]]] = defaultdict(list)
    if grid is None:
        for target_id, pk, seconds, seq, peak in scrapes.order_by("target_id", "ts").values_list(
            "target_id", "pk", "t", "seq", "peak_memory_bytes"
        ):
            out[target_id].append((pk, seconds, seq, peak))
        return out, None
    first_edge, step = grid
    # The slice (first_edge + (k-1)·step, first_edge + k·step] is number k.
    by_slice: list[BaseExpression | F | str] = ["target_id", Ceil((F("t") - first_edge) / step)]
    edges = (
        scrapes.annotate(
            from_start=Window(RowNumber(), partition_by=by_slice, order_by=F("ts").asc()),
            from_end=Window(RowNumber(), partition_by=by_slice, order_by=F("ts").desc()),
            slice_peak=Window(Max("peak_memory_bytes"), partition_by=by_slice),
        )
        .filter(Q(from_start=1) | Q(from_end=1))
        .order_by("target_id", "ts")
        .values_list("target_id", "pk", "t", "seq", "slice_peak", "values")
    )
    blobs: dict[int, bytes | memoryview] = {}
    for target_id, pk, seconds, seq, peak, blob in edges:
        out[target_id].append((pk, seconds, seq, peak))
        blobs[pk] = blob
    return out, blobs


# A scrape this close to a whole minute might sit on a window's edge, where
# which side it falls is the question the minute rollups cannot answer
# (a window opens after its start, and a minute's first scrape at its very
# start is then outside): such a read takes the other paths.
_EDGE_TOLERANCE_SECONDS = 1e-3


def _on_minutes(points: Floats, window: float) -> bool:
    """Whether every window (p - window, p] starts and ends on a whole minute."""
    edges = np.append(points, float(points[0]) - window) / 60.0
    return bool(np.all(np.abs(edges - np.round(edges)) * 60.0 < _GRID_TOLERANCE_SECONDS))


def _edge_windows(
    points: Floats, window: float, selector: Mapping[str, str], needs_peak: bool, narrow: Narrow = _whole
) -> list[TargetWindows] | None:
    """Windows at many points, each of whole minutes (``_on_minutes``), from
    the minute rollups' heads at their first and last scrape: a window begins
    at its first minute's first scrape and ends at its last minute's last,
    and counts the minutes' samples between, so it equals the raw scrapes'
    window (what ``_raw_dense_windows`` reads). An hour's chart at 200
    workers reads 12,000 rollups' two ~130-value heads, not 144,000
    scrapes' whole vectors.

    None where the rollups cannot say it, and the caller reads another way:
    a series past the head (``Layout.head``), rows written before rollups
    kept heads, or a scrape within ``_EDGE_TOLERANCE_SECONDS`` of a whole
    minute (which side of a window's edge it falls is then the question)."""
    start, end = float(points[0]) - window, float(points[-1])
    targets = _targets(start, end, selector)
    if not targets:
        return []
    by_id = {t.pk: t for t in targets}
    narrowed = {}
    for t in targets:
        stored = SeriesLayout.layout_by_id(t.layout_id)
        layout, columns = narrowed[t.pk] = narrow(stored)
        if columns is None or (len(columns) and int(columns[-1]) >= stored.head):
            return None
    # Only the span of the heads the figures read, [lo, hi) over every
    # target's columns: the overview's chart reads one counter of 131.
    lo = min((int(c[0]) for _, c in narrowed.values() if c is not None and len(c)), default=0)
    hi = max((int(c[-1]) + 1 for _, c in narrowed.values() if c is not None and len(c)), default=lo)
    rows: dict[int, list[tuple[float, float, int, float | None, bytes, bytes]]] = defaultdict(list)
    # In no order (sorting 12,000 rows of vectors spilled to disk in the
    # database; each target's few dozen are sorted here).
    fetched = _fetch_binary(
        Rollup.objects.filter(target_id__in=list(by_id), minute__gte=_dt(start), minute__lt=_dt(end))
        .annotate(
            t0=Epoch("first_ts"),
            t1=Epoch("last_ts"),
            first_span=_Bytes("head_first", lo, hi),
            last_span=_Bytes("head_last", lo, hi),
        )
        .values_list("target_id", "t0", "t1", "num_samples", "peak_memory_bytes", "first_span", "last_span")
    )
    for target_id, *row in fetched:
        if row[0] is None or row[4] is None or row[5] is None:
            return None
        rows[target_id].append(tuple(row))
    offsets = _Offsets(by_id, end)
    out = []
    for target_id, t in by_id.items():
        layout, columns = narrowed[target_id]
        # This target's part of the span: a head shorter than ``hi`` (another
        # layout's) ends before it, past every column it reads.
        width = min(hi, SeriesLayout.layout_by_id(t.layout_id).head) - lo
        target_rows = sorted(rows.get(target_id, []), key=lambda r: r[1])
        times = np.array([edge for r in target_rows for edge in r[:2]], dtype=np.float64)
        if (np.abs(times / 60.0 - np.round(times / 60.0)) * 60.0 < _EDGE_TOLERANCE_SECONDS).any():
            return None
        # A minute's scrapes are numbered through the range: its first is one
        # past the previous minute's last.
        counts = np.array([r[2] for r in target_rows], dtype=np.int64)
        numbers = np.empty(2 * len(target_rows), dtype=np.int64)
        numbers[1::2] = np.cumsum(counts)
        numbers[0::2] = numbers[1::2] - counts + 1
        # Every head of the target, first and last of each minute, as one array.
        joined = b"".join(bytes(h) for r in target_rows for h in r[4:])
        if len(joined) != len(times) * width * 8:
            return None  # a head not of its layout's length: never, as the scraper writes
        totals = np.frombuffer(joined, dtype=np.float64).reshape(len(times), width)[:, np.asarray(columns) - lo]
        windows = promql.range_windows(
            times, totals, offsets.at(target_id, times, len(layout), columns), points, window, sample_numbers=numbers
        )
        if needs_peak:
            peak_values = np.array([np.nan if r[3] is None else r[3] for r in target_rows for _ in (0, 1)])
            peaks = promql.max_in_windows(peak_values, windows)
        else:
            peaks = np.full(len(points), np.nan)
        out.append(TargetWindows(t.labels(), layout, windows.increases, peaks, window))
    return out


class _Bytes(Func):
    """Values ``[lo, hi)`` of a column of float64 bytes, cut by the database
    (PostgreSQL decompresses only as far as the cut)."""

    function = "SUBSTR"
    # Two integers of ours, written into the statement (no parameter to type).
    template = "%(function)s(%(expressions)s, %(start)d, %(length)d)"
    output_field = BinaryField()

    def __init__(self, column: str, lo: int, hi: int):
        super().__init__(F(column), start=8 * int(lo) + 1, length=8 * (int(hi) - int(lo)))

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, function="SUBSTRING", **extra)


def _fetch_binary(rows: QuerySet[Any]) -> list[tuple[Any, ...]]:
    """A ``values_list`` query's rows through the driver, without Django's
    per-row converters (a tenth of a chart's read). On PostgreSQL in binary:
    Django's cursors bind on the client, and so get every column as text,
    each bytea hex-encoded (twice its bytes, then decoded here); a chart's
    24 MB of heads took 100 ms longer that way."""
    sql, params = rows.query.sql_with_params()
    if connection.vendor == "postgresql":
        connection.ensure_connection()
        with psycopg.Cursor(connection.connection) as cursor:
            cursor.execute(sql, params, binary=True)
            return cursor.fetchall()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def _dense_windows(
    points: Floats, window: float, selector: Mapping[str, str], needs_peak: bool, narrow: Narrow = _whole
) -> list[TargetWindows]:
    """Windows at many points from every minute rollup of the range, of the
    series ``narrow`` keeps: each vector is cut to them before it is stacked."""
    start, end = float(points[0]) - window, float(points[-1])
    targets = _targets(start, end, selector)
    if not targets:
        return []
    by_id = {t.pk: t for t in targets}
    rows: dict[int, list[tuple[float, float | None, bytes | memoryview]]] = defaultdict(list)
    for target_id, last_ts, peak, blob in (
        Rollup.objects.filter(target_id__in=list(by_id), minute__gte=minute_of(_dt(start)), minute__lte=_dt(end))
        .annotate(t=Epoch("last_ts"))
        .order_by("target_id", "minute")
        .values_list("target_id", "t", "peak_memory_bytes", "values")
    ):
        rows[target_id].append((last_ts, peak, blob))
    offsets = _Offsets(by_id, end)
    out = []
    for target_id, t in by_id.items():
        stored = SeriesLayout.layout_by_id(t.layout_id)
        layout, columns = narrow(stored)
        target_rows = [r for r in rows.get(target_id, []) if start < r[0] <= end]
        vectors = [_unpack_through(blob, columns) for _, _, blob in target_rows]
        keep = [i for i, v in enumerate(vectors) if _whole_width(v, stored, columns)]
        times = np.array([target_rows[i][0] for i in keep])
        totals = np.vstack([_cut(vectors[i], columns) for i in keep]) if keep else np.zeros((0, len(layout)))
        windows = promql.range_windows(
            times, totals, offsets.at(target_id, times, len(layout), columns), points, window
        )
        peak_values = np.array([np.nan if target_rows[i][1] is None else target_rows[i][1] for i in keep])
        peaks = promql.max_in_windows(peak_values, windows) if needs_peak else np.full(len(points), np.nan)
        out.append(TargetWindows(t.labels(), layout, windows.increases, peaks, window))
    return out


# ---- the gateway's request log -----------------------------------------------------------


def _request_rows(points: Floats, window: float, selector: Mapping[str, str], group_by: str) -> dict[str, RequestRows]:
    start, end = float(points[0]) - window, float(points[-1])
    qs = RequestLog.objects.filter(created_at__gt=_dt(start), created_at__lte=_dt(end))
    for key, value in selector.items():
        qs = qs.filter(**{"worker__name" if key == "worker" else "pool__name" if key == "pool" else "cohort": value})
    columns = [
        "created_at",
        "status",
        "error",
        "ttft_seconds",
        "tpot_seconds",
        "max_gap_seconds",
        "e2e_seconds",
        "prompt_tokens",
        "worker__name",
        "pool__name",
        "cohort",
    ]
    raw = list(qs.order_by("created_at").values_list(*columns))
    if not raw and group_by != FLEET:
        return {}
    groups: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(raw):
        prompt_tokens, worker, pool, cohort = row[7:]
        if group_by == "length_bucket":
            key = catalogue.length_bucket(prompt_tokens or 0)
        else:
            key = group_of({"worker": worker or "", "pool": pool or "", "cohort": cohort or ""}, group_by)
        groups[key].append(i)
    if group_by == FLEET:
        groups.setdefault(FLEET, [])

    def floats(index: int) -> Floats:
        return np.array([np.nan if r[index] is None else r[index] for r in raw], dtype=np.float64)

    all_rows = (
        RequestRows(
            created=np.array([r[0].timestamp() for r in raw], dtype=np.float64),
            ok=np.array([is_ok(r[1], r[2]) for r in raw], dtype=bool),
            failed=np.array([is_failed(r[1], r[2]) for r in raw], dtype=bool),
            ttft=floats(3),
            tpot=floats(4),
            max_gap=floats(5),
            e2e=floats(6),
            timed_out=np.array([r[1] == STATUS_STREAM_TIMED_OUT for r in raw], dtype=bool),
            cancelled=np.array([r[1] == STATUS_CLIENT_GONE for r in raw], dtype=bool),
        )
        if raw
        else RequestRows.empty()
    )
    out = {}
    for key, indices in groups.items():
        mask = np.zeros(len(raw), dtype=bool)
        mask[indices] = True
        # Each group is a share of the stream all these rows make: its rates
        # are over the stream's time with traffic (figures._per_window_rate).
        out[key] = replace(all_rows.take(mask), stream=all_rows.created)
    if group_by == "length_bucket":
        out = {label: out[label] for label in catalogue.LENGTH_BUCKET_LABELS if label in out}
    return out


def is_ok(status: int, error: str) -> bool:
    """Succeeded: HTTP 200 and no error mid-stream."""
    return status == 200 and not error


def is_failed(status: int, error: str) -> bool:
    """The service's failure: 5xx, 429 (overload), or a 200 whose stream broke.
    Other 4xx (bad input, the client went away) are the client's doing."""
    return status >= 500 or status == 429 or (status == 200 and bool(error))


def silent_streams_by_pool() -> dict[str, int]:
    """Streams in flight silent past GATEWAY_STREAM_SILENCE_SECONDS, over every
    live gateway, by pool name: what finished-request figures cannot see."""
    out: dict[str, int] = {}
    for item in bus.silent_streams():
        out[item["pool"]] = out.get(item["pool"], 0) + int(item["streams"])
    return out
