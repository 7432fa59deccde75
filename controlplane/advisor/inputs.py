"""The advisor's inputs, gathered from live figures for one pool (or the
fleet) over a window: the metrics backend (``METRICS_BACKEND``: the control
plane's stored scrapes, or Prometheus), the gateway's request log and the
fleet's registry. ``verdicts.py`` judges them.

What comes from where:

* windowed figures (queue P99, memory peak/mean, the decode-gap quantiles,
  prefill time per token, throughput, stalls): the query layer
  (``metrics.query.query_many``), so each backend computes them as every
  page does; the counter totals beside them (preemptions, decode gaps
  counted) from the window's first and last snapshot per worker, or
  Prometheus's ``increase()``;
* per-scrape samples (waiting and running requests, KV usage, the memory
  peak, preemptions and long-prefill steps between scrapes): every scrape
  for windows up to ten minutes (raw snapshots, or the raw samples
  Prometheus stored), else evenly spaced ones (minute rollups, or a
  ``query_range`` step), at most ``MAX_SAMPLES_PER_WORKER`` per worker: a
  24-h window is a sample of its minutes, not all 1440 of them;
* prompt lengths, cached tokens and TTFTs: the gateway's log rows of the
  window, at most ``MAX_REQUEST_ROWS``: the newest of each tenth of the window;
* memory and model facts: the workers' own gauges (weights, KV bytes per
  token, activation bytes per prefill token, ``chunkpilot:max_model_len`` and
  ``chunkpilot:long_prefill_tokens``) and their registered hardware and
  context length;
* the decode side: the operator's TPOT objective as the TBT objective (or the
  one the caller passes), the ITL P50 as the decode step time, and the stall
  P99 (each request's largest gap) with its count; the request log's when the
  workers do not export it.

Head-of-line blocking is exact where the workers count each request's gaps
(``chunkpilot:decode_gap_*``). Where they do not, it is approximate, from the
request log: each request's largest gap, split by whether its decode
overlapped a long prompt's prefill (arrival to first token), so the finding
says so. "Long" there is the workers' own threshold
(``chunkpilot:long_prefill_tokens``, else ``workers.figures.long_prefill_tokens``
of the context).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from django.db.models import Q

from controlplane.advisor import conf
from controlplane.advisor.verdicts import (
    THRESHOLDS,
    Decode,
    Engine,
    Gaps,
    Inputs,
    Profile,
    Requests,
    Samples,
    Thresholds,
    Throughput,
)
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog, RoutingPool
from controlplane.metrics import backends, catalogue, query
from controlplane.metrics.backends import FLEET
from controlplane.metrics.figures import GAP_LONG, GAP_OTHER, MAX_GAP, Group
from controlplane.metrics.models import Rollup, SeriesLayout, Snapshot, Target, minute_of, unpack
from workers.figures import long_prefill_tokens, percentile

MAX_SAMPLES_PER_WORKER = 60
MAX_REQUEST_ROWS = 10_000
LOG_SLICES = 10
RAW_SAMPLE_WINDOW_SECONDS = 600.0
SAMPLE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
SAMPLE_COUNTERS = ("vllm:num_preemptions_total", "chunkpilot:long_prefill_steps_total")
FACT_GAUGES = (
    "chunkpilot:weight_bytes",
    "chunkpilot:kv_bytes_per_token",
    "chunkpilot:activation_bytes_per_token",
    "chunkpilot:max_model_len",
    "chunkpilot:long_prefill_tokens",
)
SAMPLE_KEYS = (*SAMPLE_GAUGES, *SAMPLE_COUNTERS, *FACT_GAUGES)
WINDOW_FIGURES = (
    "decode_gap_long_prefill_p99",
    "decode_gap_other_p99",
    "queue_time_p99",
    "memory_peak_to_mean",
    "output_tokens_per_second",
    "stall_p99",
    "prefill_seconds_per_token",
    "itl_p50",
)
WINDOW_TOTALS = (f"{GAP_LONG}_count", f"{GAP_OTHER}_count", f"{MAX_GAP}_count", "vllm:num_preemptions_total")


def thresholds() -> Thresholds:
    """Each row of ``verdicts.Thresholds`` from its tunable."""
    return Thresholds(**{row.field: conf.threshold(row.field).get() for row in THRESHOLDS})


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _value(values: np.ndarray) -> float | None:
    v = float(values[0])
    return v if math.isfinite(v) else None


@dataclass
class _Window:
    """One window's figures and counter totals for one selector, read once."""

    figures: dict[str, float | None]
    totals: dict[str, float | None]
    num_workers: int

    def figure(self, name: str) -> float | None:
        return self.figures.get(name)

    def total(self, key: str) -> float | None:
        return self.totals.get(key)


def _window(now: datetime, window: float, selector: Mapping[str, str]) -> _Window:
    values = query.query_many(WINDOW_FIGURES, window, FLEET, selector, now)
    read = {name: by.get(FLEET) for name, by in values.items()}
    source = query.backend()
    if isinstance(source, backends.Prometheus):
        at = now.timestamp()
        return _Window(
            read,
            source.increases(WINDOW_TOTALS, window, selector, at),
            source.count_workers("vllm:num_requests_running", window, selector, at),
        )
    loaded = query.point_windows(np.array([now.timestamp()]), window, selector, True)
    if not loaded:
        return _Window(read, dict.fromkeys(WINDOW_TOTALS), 0)
    group = Group(loaded, 1)
    return _Window(read, {key: _value(group.sum_key(key)) for key in WINDOW_TOTALS}, len(group.targets))


# ---- per-scrape samples ------------------------------------------------------------


@dataclass
class _SampleRows:
    samples: Samples
    facts: dict[str, list[float]]  # each fact gauge's newest value per worker


@dataclass
class _WorkerSamples:
    """One worker's samples: per series key (and ``PEAK``), one value per sample."""

    worker: int
    seats: float  # its profile's max_num_seqs; NaN: unknown
    columns: dict[str, np.ndarray]


PEAK = "peak"


def _seats(worker: Worker | None) -> float:
    return float((worker.running_profile.get("max_num_seqs") if worker else None) or math.nan)


def _samples(now: datetime, window: float, selector: Mapping[str, str]) -> _SampleRows:
    source = query.backend()
    unit = "scrapes" if window <= RAW_SAMPLE_WINDOW_SECONDS else "minute samples"
    if isinstance(source, backends.Prometheus):
        return _assemble(_samples_from_prometheus(source, now, window, selector), unit)
    return _assemble(_samples_from_database(now, window, selector), unit)


def _samples_from_database(now: datetime, window: float, selector: Mapping[str, str]) -> list[_WorkerSamples]:
    end = now.timestamp()
    start = end - window
    targets = Target.objects.filter(last_at__gt=_dt(start), first_at__lte=now)
    if "pool" in selector:
        targets = targets.filter(pool_name=selector["pool"])
    by_id = {t.pk: t for t in targets.only("id", "worker_id", "layout_id")}
    workers = Worker.objects.in_bulk([t.worker_id for t in by_id.values() if t.worker_id])
    rows: list[tuple[int, float | None, Any]]
    if window <= RAW_SAMPLE_WINDOW_SECONDS:
        rows = list(
            Snapshot.objects.filter(target_id__in=list(by_id), ts__gt=_dt(start), ts__lte=now)
            .order_by("target_id", "ts")
            .values_list("target_id", "peak_memory_bytes", "values")
        )
    else:
        first = minute_of(_dt(start)) + timedelta(minutes=1)
        num_minutes = max(1, int((minute_of(now) - first).total_seconds() // 60) + 1)
        stride = max(1, math.ceil(num_minutes / MAX_SAMPLES_PER_WORKER))
        minutes = [minute_of(now) - timedelta(minutes=stride * i) for i in range(num_minutes // stride + 1)]
        rows = list(
            Rollup.objects.filter(target_id__in=list(by_id), minute__in=[m for m in minutes if m >= first])
            .order_by("target_id", "minute")
            .values_list("target_id", "peak_memory_bytes", "values")
        )
    out = []
    for target_id, group in itertools.groupby(rows, key=lambda row: row[0]):
        target = by_id[target_id]
        layout = SeriesLayout.layout_by_id(target.layout_id)
        kept = [(peak, vector) for _, peak, blob in group if len(vector := unpack(blob)) == len(layout)]
        if not kept:
            continue
        vectors = np.vstack([v for _, v in kept])
        columns = {
            key: vectors[:, i] if (i := layout.index.get(key)) is not None else np.full(len(vectors), math.nan)
            for key in SAMPLE_KEYS
        }
        columns[PEAK] = np.array([math.nan if p is None else p for p, _ in kept], dtype=np.float64)
        out.append(_WorkerSamples(target_id, _seats(workers.get(target.worker_id or 0)), columns))
    return out


def _samples_from_prometheus(
    source: backends.Prometheus, now: datetime, window: float, selector: Mapping[str, str]
) -> list[_WorkerSamples]:
    """As from the database: every scrape for windows up to ten minutes, else
    at most ``MAX_SAMPLES_PER_WORKER`` evenly spaced (a minute apart at least,
    as the database's minute rollups)."""
    end = now.timestamp()
    step = None if window <= RAW_SAMPLE_WINDOW_SECONDS else max(60.0, window / MAX_SAMPLES_PER_WORKER)
    found = source.samples((*SAMPLE_KEYS, catalogue.PEAK_MEMORY), selector, end - window, end, step)
    workers = {w.name: w for w in Worker.objects.filter(name__in=list(found))}
    out = []
    for i, (name, (_times, columns)) in enumerate(sorted(found.items())):
        worker = workers.get(name)
        columns[PEAK] = columns.pop(catalogue.PEAK_MEMORY)
        out.append(_WorkerSamples(worker.pk if worker else -1 - i, _seats(worker), columns))
    return out


def _assemble(workers: list[_WorkerSamples], unit: str) -> _SampleRows:
    """The workers' samples as one table, each counter as its increase since
    the worker's previous sample; ``unit`` says what one row is."""
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("worker", "seats", PEAK, *SAMPLE_GAUGES, *SAMPLE_COUNTERS)}
    facts: dict[str, list[float]] = {k: [] for k in FACT_GAUGES}
    for w in workers:
        n = len(w.columns[PEAK])
        if not n:
            continue
        columns["worker"].append(np.full(n, w.worker))
        columns["seats"].append(np.full(n, w.seats))
        columns[PEAK].append(w.columns[PEAK])
        for key in SAMPLE_GAUGES:
            columns[key].append(w.columns[key])
        for key in SAMPLE_COUNTERS:
            columns[key].append(np.concatenate([[math.nan], np.diff(w.columns[key])]))
        for key in FACT_GAUGES:
            newest = w.columns[key][-1]
            if math.isfinite(newest):
                facts[key].append(float(newest))

    def joined(key: str) -> list[float]:
        return np.concatenate(columns[key]).tolist() if columns[key] else []

    samples = Samples(
        worker=[int(w) for w in joined("worker")],
        waiting=joined("vllm:num_requests_waiting"),
        running=joined("vllm:num_requests_running"),
        kv_usage=joined("vllm:kv_cache_usage_perc"),
        max_num_seqs=joined("seats"),
        memory_peak_bytes=joined(PEAK),
        preemptions_delta=joined("vllm:num_preemptions_total"),
        long_prefill_steps_delta=joined("chunkpilot:long_prefill_steps_total"),
        unit=unit,
    )
    return _SampleRows(samples, facts)


# ---- the request log -----------------------------------------------------------------


@dataclass
class _Log:
    requests: Requests
    e2e: np.ndarray
    max_gap: np.ndarray
    num_read: int  # at most MAX_REQUEST_ROWS, the newest


def _request_log(now: datetime, window: float, pool: Pool | None) -> _Log:
    # The window in LOG_SLICES slices, each read newest first up to its share
    # of MAX_REQUEST_ROWS: a long window is sampled across its length (one
    # index range scan per slice), not only in its last hour.
    qs = RequestLog.objects.all()
    if pool is not None:
        qs = qs.filter(pool=pool)  # by id: the (pool, created_at) index, no join
    rows: list[tuple[Any, ...]] = []
    edges = [now - timedelta(seconds=window * (1 - i / LOG_SLICES)) for i in range(LOG_SLICES + 1)]
    for start, end in zip(edges, edges[1:], strict=False):
        part = list(
            qs.filter(created_at__gt=start, created_at__lte=end)
            .order_by("-created_at")
            .annotate(t=query.Epoch("created_at"))
            .values_list(
                "t",
                "prompt_tokens",
                "cached_tokens",
                "ttft_seconds",
                "e2e_seconds",
                "max_gap_seconds",
                "status",
                "error",
                "output_tokens",
            )[: MAX_REQUEST_ROWS // LOG_SLICES]
        )
        part.reverse()
        rows.extend(part)

    def floats(i: int) -> np.ndarray:
        return np.array([math.nan if r[i] is None else r[i] for r in rows], dtype=np.float64)

    requests = Requests(
        prompt_tokens=[r[1] for r in rows],  # a refused request's is None, never 0
        cached_tokens=[r[2] for r in rows],
        created=[r[0] for r in rows],
        ttft_seconds=[r[3] for r in rows],
        ok=[query.is_ok(r[6], r[7]) for r in rows],
        output_tokens=[r[8] for r in rows],
    )
    return _Log(requests, floats(4), floats(5), len(rows))


def approximate_gaps(log: _Log, long_tokens: int | None) -> Gaps:
    """From per-request stats: each request's largest gap, split by whether
    its decode (first token to end) overlapped any long prompt's prefill
    (arrival to first token). Coarser than per-step gaps: say so."""
    r = log.requests
    created = np.asarray(r.created, dtype=np.float64)
    ttft = np.array([math.nan if v is None else v for v in r.ttft_seconds], dtype=np.float64)
    to_compute = np.array(
        [math.nan if n is None else n - (c or 0) for n, c in zip(r.prompt_tokens, r.cached_tokens, strict=True)],
        dtype=np.float64,
    )
    with np.errstate(invalid="ignore"):
        long = (to_compute > (long_tokens if long_tokens is not None else math.inf)) & ~np.isnan(ttft)
    starts, ends = created[long], created[long] + ttft[long]
    order = np.argsort(starts)
    merged_starts: list[float] = []
    merged_ends: list[float] = []
    for a, b in zip(starts[order].tolist(), ends[order].tolist(), strict=True):
        if merged_ends and a <= merged_ends[-1]:
            merged_ends[-1] = max(merged_ends[-1], b)
        else:
            merged_starts.append(a)
            merged_ends.append(b)
    decoding = ~long & ~np.isnan(log.max_gap) & ~np.isnan(ttft) & ~np.isnan(log.e2e)
    a, b = created + ttft, created + log.e2e
    s, e = np.asarray(merged_starts), np.asarray(merged_ends)
    last = np.searchsorted(s, b, side="left") - 1
    overlaps = np.zeros(len(created), dtype=bool)
    if len(s):
        overlaps = (last >= 0) & (e[np.clip(last, 0, None)] > a)
    during = log.max_gap[decoding & overlaps]
    other = log.max_gap[decoding & ~overlaps]
    return Gaps(
        percentile(during.tolist(), 99),
        percentile(other.tolist(), 99),
        len(during),
        len(other),
        long_tokens,
        approximate=True,
    )


def exact_gaps(w: _Window, long_tokens: int | None) -> Gaps | None:
    num_long = w.total(f"{GAP_LONG}_count") or 0.0
    num_other = w.total(f"{GAP_OTHER}_count") or 0.0
    if num_long + num_other <= 0:
        return None
    return Gaps(
        w.figure("decode_gap_long_prefill_p99"),
        w.figure("decode_gap_other_p99"),
        round(num_long),
        round(num_other),
        long_tokens,
    )


# ---- the pool, its profile and its baseline ------------------------------------------------


def profile_of(pool: Pool | None) -> Profile | None:
    if pool is None or pool.desired_revision is None:
        return None
    p = pool.desired_revision.engine_profile()
    return Profile(
        p.prefill_mode,
        p.max_num_batched_tokens,
        p.chunk_cap,
        p.max_num_seqs,
        p.block_size,
        p.short_prompt_threshold,
        p.min_prefill_tokens_per_step,
    )


def baseline_of(pool: Pool) -> Pool | None:
    """The routing table's baseline pool beside ``pool``, else its stable pool
    (when ``pool`` is not the stable one)."""
    route = RoutingPool.objects.filter(pool=pool).select_related("table").first()
    if route is None:
        return None
    others = {
        r.role: r.pool
        for r in RoutingPool.objects.filter(table=route.table)
        .exclude(pool=pool)
        .select_related("pool__desired_revision")
    }
    return others.get("baseline") or others.get("stable")


def throughput(pool: Pool, w: _Window, num_requests: int) -> Throughput:
    tps = w.figure("output_tokens_per_second")
    per_worker = tps / w.num_workers if tps is not None and w.num_workers else None
    mode = pool.desired_revision.engine_profile().prefill_mode if pool.desired_revision else ""
    return Throughput(per_worker, w.figure("stall_p99"), num_requests, mode, pool.name)


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if values else None


def engine_facts(sampled: _SampleRows, w: _Window, pool: Pool | None) -> Engine:
    workers = Worker.objects.filter(pool=pool) if pool is not None else Worker.objects.all()
    memories = [float(m) for m in workers.values_list("hardware__memory_bytes", flat=True) if m]
    devices = {d for d in workers.values_list("hardware__device", flat=True) if d}
    activation = sampled.facts["chunkpilot:activation_bytes_per_token"]
    # The engines' own context length when they export it, else the one they registered.
    lengths = sampled.facts["chunkpilot:max_model_len"] or [
        float(n) for n in workers.values_list("max_model_len", flat=True) if n
    ]
    return Engine(
        device_memory_bytes=min(memories) if memories else None,
        weight_bytes=_median(sampled.facts["chunkpilot:weight_bytes"]),
        activation_bytes_per_token=max(activation) if activation else None,
        kv_bytes_per_token=_median(sampled.facts["chunkpilot:kv_bytes_per_token"]),
        prefill_seconds_per_token=w.figure("prefill_seconds_per_token"),
        max_model_len=int(min(lengths)) if lengths else None,
        device=",".join(sorted(str(d) for d in devices)),
    )


def engine_long_prefill_tokens(sampled: _SampleRows, max_model_len: int | None) -> int | None:
    """The threshold the workers classify gaps by: their gauge, else theirs for the context."""
    gauges = sampled.facts["chunkpilot:long_prefill_tokens"]
    if gauges:
        return int(min(gauges))
    return long_prefill_tokens(max_model_len) if max_model_len else None


def decode_side(w: _Window, log: _Log, tbt_objective_seconds: float | None) -> Decode:
    """The stall P99 the workers export (each request's largest gap between
    written tokens), else the request log's over successful requests."""
    tbt = tbt_objective_seconds if tbt_objective_seconds is not None else query.objectives_now().tpot_seconds
    stall, num = w.figure("stall_p99"), round(w.total(f"{MAX_GAP}_count") or 0.0)
    if stall is None or num <= 0:
        ok = np.asarray(log.requests.ok, dtype=bool) & ~np.isnan(log.max_gap)
        stall, num = percentile(log.max_gap[ok].tolist(), 99), int(ok.sum())
    return Decode(tbt, stall, num, w.figure("itl_p50"))


def gather(
    pool: Pool | None, window_seconds: float, now: datetime, *, tbt_objective_seconds: float | None = None
) -> Inputs:
    """Everything ``verdicts.advise`` needs for ``pool`` (None: the fleet)
    over the window ending ``now``; the TBT objective is the operator's TPOT
    objective unless given."""
    window = query.check_window(window_seconds)
    selector = {"pool": pool.name} if pool is not None else {}
    with query.shared_reads():
        w = _window(now, window, selector)
        sampled = _samples(now, window, selector)
        log = _request_log(now, window, pool)
        engine = engine_facts(sampled, w, pool)
        long_tokens = engine_long_prefill_tokens(sampled, engine.max_model_len)
        gaps = exact_gaps(w, long_tokens) or approximate_gaps(log, long_tokens)
        preemptions = w.total("vllm:num_preemptions_total")
        mine = base = None
        if pool is not None:
            mine = throughput(pool, w, log.num_read)
            other = baseline_of(pool)
            if other is not None:
                other_selector = {"pool": other.name}
                other_count = RequestLog.objects.filter(
                    Q(pool=other),
                    created_at__gt=now - timedelta(seconds=window),
                    created_at__lte=now,
                )[:MAX_REQUEST_ROWS].count()
                base = throughput(other, _window(now, window, other_selector), other_count)
        return Inputs(
            requests=log.requests,
            samples=sampled.samples,
            queue_p99_seconds=w.figure("queue_time_p99"),
            num_preemptions=preemptions,
            memory_peak_to_mean=w.figure("memory_peak_to_mean"),
            gaps=gaps,
            engine=engine,
            profile=profile_of(pool),
            pool=mine,
            baseline=base,
            decode=decode_side(w, log, tbt_objective_seconds),
        )
