"""The figure registry: every figure Chunkpilot shows, in one place.

Each figure has a name, a unit, which way is better, and how to compute it
over a range from one group's inputs. The query API, the dashboards, the
rollout analysis and the alert rules all read this registry, so a figure has
one definition everywhere (docs/architecture.md, "Metrics", says what each means).

Two sources:

* ``scrape`` figures are PromQL over the workers' scraped counters and
  histograms: a group's series are summed bucket by bucket (``sum by (le)``)
  after each series' ``increase`` over the range, exactly like
  ``histogram_quantile(0.99, sum by (le) (rate(x_bucket[w])))``. Their
  ``promql`` attribute is that expression, which the shipped Grafana
  dashboard and Prometheus rules use verbatim.
* ``requests`` figures are exact, from the gateway's per-request log:
  percentiles over requests (PromQL's ``quantile`` rule), goodput against
  the operator's objectives, error rate. Only these can be grouped by prompt
  length, which only the gateway knows.

Pure: inputs are arrays (``TargetWindows``, ``RequestRows``); NaN means no
data and becomes None at the edge. A range in which nothing happened is no
data, never zero — except counts of events that demonstrably did not happen
(a rate over a range with samples but no increase is 0).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from typing import Literal, cast

import numpy as np
from numpy.typing import NDArray

from controlplane.metrics import catalogue, promql
from controlplane.metrics.catalogue import Layout
from controlplane.metrics.promql import Floats


class Direction(StrEnum):
    """Which way a figure gets better: the figure registry and the canary judge share it."""

    LOWER = "lower"  # lower is better (latency, errors)
    HIGHER = "higher"  # higher is better (throughput)


Source = Literal["scrape", "requests"]


@dataclass
class TargetWindows:
    """One target's inputs over ranges ending at ``points``."""

    labels: dict[str, str]
    layout: Layout
    increases: Floats  # [num_points, len(layout)], NaN: fewer than two samples
    peak_memory: Floats  # [num_points]: max of the peak-memory gauge, NaN: no samples
    range_seconds: float


@dataclass
class RequestRows:
    """The gateway's log for one group, sorted by ``created``."""

    created: Floats  # epoch seconds
    ok: np.ndarray  # bool: answered 200 and finished without error
    failed: np.ndarray  # bool: the service failed it (5xx, 429, broken stream)
    ttft: Floats  # NaN where unknown (failed before a token)
    tpot: Floats
    max_gap: Floats
    e2e: Floats
    # bool: the gateway ended the stream its worker stopped feeding (598); None: not read
    timed_out: np.ndarray | None = None
    # bool: the client went away before the answer was done (499); None: not read
    cancelled: np.ndarray | None = None
    # The arrivals (sorted) of the whole stream this group is a share of: every
    # group of one query. None: the group is the stream. See _per_window_rate.
    stream: Floats | None = None

    @classmethod
    def empty(cls) -> RequestRows:
        nothing = np.zeros(0)
        return cls(
            nothing,
            np.zeros(0, dtype=bool),
            np.zeros(0, dtype=bool),
            nothing,
            nothing,
            nothing,
            nothing,
            np.zeros(0, dtype=bool),
            np.zeros(0, dtype=bool),
        )

    def take(self, index: np.ndarray | slice) -> RequestRows:
        return RequestRows(
            self.created[index],
            self.ok[index],
            self.failed[index],
            self.ttft[index],
            self.tpot[index],
            self.max_gap[index],
            self.e2e[index],
            None if self.timed_out is None else self.timed_out[index],
            None if self.cancelled is None else self.cancelled[index],
            self.stream,
        )

    def served(self) -> np.ndarray:
        """Rows the service answered: every one but those the client cancelled (499)."""
        return np.ones(len(self.created), dtype=bool) if self.cancelled is None else ~self.cancelled


@dataclass(frozen=True)
class Objectives:
    ttft_seconds: float
    tpot_seconds: float


# The service objectives until an operator sets them: the overview's goodput
# (ServiceObjectives) and a new experiment's objectives both start here.
DEFAULT_OBJECTIVES = Objectives(ttft_seconds=2.0, tpot_seconds=0.1)


class Group:
    """One group's targets over the same points, with ``sum by (series)``
    computed once and shared by every figure read from the group."""

    def __init__(self, targets: Sequence[TargetWindows], num_points: int):
        self.targets = list(targets)
        self.num_points = num_points
        self._sums: list[tuple[Layout, Floats, np.ndarray]] | None = None

    @property
    def range_seconds(self) -> float:
        return self.targets[0].range_seconds

    def sums(self) -> list[tuple[Layout, Floats, np.ndarray]]:
        """Per distinct layout: the sum over its targets of every series'
        increase, and where any target had data."""
        if self._sums is None:
            by_layout: dict[str, list[TargetWindows]] = {}
            for t in self.targets:
                by_layout.setdefault(t.layout.digest, []).append(t)
            self._sums = []
            for same in by_layout.values():
                # A running sum, not nansum over np.stack: the stack (and
                # nansum's copy of it) is targets x points x series, 100 MB
                # and most of a figures page's time at 100 workers.
                total = np.zeros_like(same[0].increases, dtype=np.float64)
                seen = np.zeros(total.shape, dtype=bool)
                for t in same:
                    has = ~np.isnan(t.increases)
                    np.add(total, t.increases, out=total, where=has)
                    seen |= has
                self._sums.append((same[0].layout, total, seen))
        return self._sums

    def sum_key(self, key: str) -> Floats:
        """``sum(increase(key[w]))``: NaN where no series of the group had data."""
        total = np.zeros(self.num_points)
        seen = np.zeros(self.num_points, dtype=bool)
        for layout, sums, has in self.sums():
            i = layout.index.get(key)
            if i is not None:
                total += np.where(has[:, i], sums[:, i], 0.0)
                seen |= has[:, i]
        return np.where(seen, total, np.nan)


ScrapeFn = Callable[[Group], Floats]
RequestFn = Callable[[RequestRows, Floats, float, Objectives], Floats]


@dataclass(frozen=True)
class Figure:
    name: str
    label: str
    unit: str  # "s", "ratio", "1/s", "tokens/s", "tokens/step", "requests/s"
    direction: Direction
    source: Source
    description: str
    promql: str = ""
    needs_peak_memory: bool = False
    display: str = ""  # how to show a value: duration, percent, times, rate, number (default: from the unit)
    # (histogram, quantile) the worker labels by prompt-length bucket: the figure per length bucket;
    # quantile None: the histogram's sample count
    by_prompt: tuple[str, float | None] | None = None
    # A percentile figure: its q (0.99 for a P99), and the figure that counts the samples it rests on
    quantile: float | None = None
    samples: str = ""
    _scrape: ScrapeFn | None = field(default=None, repr=False, compare=False)
    _requests: RequestFn | None = field(default=None, repr=False, compare=False)

    def from_group(self, group: Group) -> Floats:
        assert self._scrape is not None, self.name
        if not group.targets:
            return np.full(group.num_points, np.nan)
        return self._scrape(group)

    def from_group_by_prompt(self, group: Group, bucket: str) -> Floats:
        """The figure over one prompt-length bucket's histogram (``by_prompt``)."""
        assert self.by_prompt is not None, self.name
        histogram, q = self.by_prompt
        if not group.targets:
            return np.full(group.num_points, np.nan)
        name = catalogue.by_prompt(histogram, bucket)
        return group.sum_key(f"{name}_count") if q is None else _quantile(q, name)(group)

    def from_targets(self, targets: Sequence[TargetWindows], num_points: int) -> Floats:
        return self.from_group(Group(targets, num_points))

    def from_requests(self, rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
        assert self._requests is not None, self.name
        return self._requests(rows, points, range_seconds, objectives)

    @property
    def display_kind(self) -> str:
        if self.display:
            return self.display
        return {"s": "duration", "ratio": "percent"}.get(self.unit, "rate" if self.unit.endswith("/s") else "number")

    def format(self, value: float | None) -> str:
        """A value as a person reads it; no data is an em dash, never 0."""
        return format_value(value, self.display_kind, self.unit)

    @property
    def percentile_rule(self) -> str:
        """How this figure's percentile is computed ("" for a figure that is no percentile)."""
        if self.quantile is None:
            return ""
        return PERCENTILE_RULES[self.source]

    def percentile_info(self) -> dict[str, str | float | None]:
        """What a percentile says about itself (the API's figures, query and query_range answers)."""
        return {
            "quantile": self.quantile,
            "percentile_rule": self.percentile_rule,
            "samples_figure": self.samples or None,
        }

    def describe(self) -> dict[str, str]:
        return {
            "name": self.name,
            "label": self.label,
            "unit": self.unit,
            "direction": self.direction.value,
            "source": self.source,
            "description": self.description,
            "promql": self.promql,
            "display": self.display_kind,
        }


# One percentile definition per source, said wherever a percentile is shown.
PERCENTILE_RULES: dict[str, str] = {
    "requests": "nearest rank: of the window's n requests sorted, the one at rank ceil(q·n) "
    "(a benchmark client's definition, as guidellm's)",
    "scrape": "Prometheus' histogram_quantile over the window's summed bucket increases "
    "(linear within the bucket the rank falls in)",
}


def few_samples(q: float | None, samples: float | None) -> bool:
    """Whether a q-percentile over this many samples is decided by the single
    slowest one or a handful (a P99 over fewer than 100, a P95 under 20):
    the figure is fragile and the pages say so. No count: not marked."""
    if q is None or samples is None or not math.isfinite(samples):
        return False
    return samples < round(1 / (1 - q)) if q < 1 else True


def samples_note(f: Figure, samples: float | None) -> str:
    """What a percentile rests on, as the pages say it: "n = 240", or for a
    fragile one "n = 90: rests on the 1 slowest request"."""
    if f.quantile is None or samples is None or not math.isfinite(samples):
        return ""
    text = f"n = {samples:,.0f}"
    if few_samples(f.quantile, samples):
        k = slowest_behind(f.quantile, samples)
        noun = SAMPLE_NOUNS.get(f.samples, "samples")
        text += f": rests on the {k} slowest {noun.removesuffix('s') if k == 1 else noun}"
    return text


def slowest_behind(q: float, samples: float) -> int:
    """How many of the slowest samples a nearest-rank q-percentile over
    ``samples`` rests on: those at or above its rank (1: the slowest alone)."""
    n = max(int(round(samples)), 0)
    if n == 0:
        return 0
    return n - max(1, math.ceil(q * n - 1e-9)) + 1


def format_value(value: float | None, kind: str, unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if kind == "duration":
        if abs(value) < 1:
            return f"{value * 1000:.3g} ms" if abs(value) < 0.01 else f"{value * 1000:.0f} ms"
        return f"{value:.2f} s"
    if kind == "percent":
        return f"{value * 100:.1f}%"
    if kind == "times":
        return f"{value:.2f}×"
    suffix = {"requests/s": "/s", "tokens/s": " tok/s", "1/s": "/s", "tokens/step": " tok/step"}.get(unit, "")
    if abs(value) >= 100:
        return f"{value:,.0f}{suffix}"
    return f"{value:.3g}{suffix}"


# ---- scrape arithmetic: sums over a group's series --------------------------------


def _sum_keys(group: Group, keys: Sequence[str]) -> Floats:
    stacked = np.vstack([group.sum_key(key) for key in keys])
    return np.where(np.isnan(stacked).all(axis=0), np.nan, np.nansum(stacked, axis=0))


def _quantile(q: float, histogram: str) -> ScrapeFn:
    def compute(group: Group) -> Floats:
        return promql.histogram_quantiles(q, *_merged_buckets(group, histogram))

    return compute


def _merged_buckets(group: Group, histogram: str) -> tuple[list[float], Floats]:
    """The group's cumulative bucket counts of one histogram, summed over its
    targets at the union of their bucket bounds: ``sum by (le)``.

    Targets whose workers export different bounds (an older worker beside a
    newer one, or one worker's snapshots from before its buckets changed)
    are merged by reading each one's cumulative count at a bound it lacks
    from its own highest bound below it, a true lower count. Prometheus
    sums only the series that have a bound, so where layouts differ its
    cumulative counts fall at the other layout's bounds and a quantile can
    land in +Inf (a P99 of 2,966 s over stalls of at most 1.5 s); where all
    targets share their bounds the two are the same sum. NaN at points
    where no target had data."""
    layouts = [(layout, sums, has) for layout, sums, has in group.sums() if layout.buckets(histogram)]
    bounds = sorted({b for layout, _, _ in layouts for b, _ in layout.buckets(histogram)})
    per_bound = np.zeros((len(bounds), group.num_points))
    seen = np.zeros(group.num_points, dtype=bool)
    bound_array = np.asarray(bounds, dtype=np.float64)
    for layout, sums, has in layouts:
        own = layout.buckets(histogram)
        own_bounds = np.array([b for b, _ in own], dtype=np.float64)
        own_index = np.array([i for _, i in own], dtype=np.intp)
        below = np.searchsorted(own_bounds, bound_array, side="right") - 1
        valid = below >= 0
        counts = np.where(has[:, own_index], sums[:, own_index], 0.0)  # [num_points, own buckets]
        per_bound[valid] += counts[:, below[valid]].T
        seen |= has[:, own_index[-1]]
    per_bound[:, ~seen] = np.nan
    return bounds, per_bound


def _ratio_of(numerator: ScrapeFn, denominator: ScrapeFn) -> ScrapeFn:
    def compute(group: Group) -> Floats:
        num, den = numerator(group), denominator(group)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(den > 0, num / den, np.nan)

    return compute


def _keys(*keys: str) -> ScrapeFn:
    return lambda group: _sum_keys(group, keys)


def _mean(histogram: str) -> ScrapeFn:
    return _ratio_of(_keys(f"{histogram}_sum"), _keys(f"{histogram}_count"))


def _rate(*keys: str) -> ScrapeFn:
    return lambda group: _sum_keys(group, keys) / group.range_seconds


def _avg_over_targets(per_target: Callable[[TargetWindows], Floats]) -> ScrapeFn:
    """``avg by (group) (...)`` of a per-worker figure, ignoring workers without data."""

    def compute(group: Group) -> Floats:
        stacked = np.vstack([per_target(t) for t in group.targets])
        counts = (~np.isnan(stacked)).sum(axis=0)
        return np.where(counts > 0, np.nansum(stacked, axis=0) / np.maximum(counts, 1), np.nan)

    return compute


HELD_SECONDS = "chunkpilot:held_seconds_total"


def _time_weighted_mean(key: str) -> Callable[[TargetWindows], Floats]:
    """A ``*_seconds_total`` integral's increase over the increase of the time
    it integrates (``chunkpilot:held_seconds_total``): the mean over the time
    the worker was up within the window, so a worker younger than the window
    is not diluted by the time before it started. A worker that does not
    export that counter (it reads 0) gets rate() over the whole window."""

    def per_target(t: TargetWindows) -> Floats:
        i = t.layout.index.get(key)
        if i is None:
            return np.full(len(t.peak_memory), np.nan)
        j = t.layout.index.get(HELD_SECONDS)
        held = t.increases[:, j] if j is not None else np.zeros(len(t.increases))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(held > 0, t.increases[:, i] / held, t.increases[:, i] / t.range_seconds)

    return per_target


def _peak_to_mean(t: TargetWindows) -> Floats:
    mean = _time_weighted_mean("chunkpilot:memory_byte_seconds_total")(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, t.peak_memory / mean, np.nan)


# ---- request-log arithmetic -------------------------------------------------------


def _per_window(
    rows: RequestRows, points: Floats, range_seconds: float, reduce: Callable[[RequestRows], float]
) -> Floats:
    lo = np.searchsorted(rows.created, points - range_seconds, side="right")
    hi = np.searchsorted(rows.created, points, side="right")
    out = np.full(len(points), np.nan)
    for j, (a, b) in enumerate(zip(lo, hi, strict=True)):
        out[j] = reduce(rows.take(slice(a, b)))
    return out


def nearest_rank(values: Floats, q: float) -> float:
    """The nearest-rank percentile (``PERCENTILE_RULES["requests"]``): of n
    sorted values, the one at rank ceil(q·n), rank at least 1; NaN for none.
    A P99 of 90 values is the slowest of them, as a benchmark client reports it."""
    n = len(values)
    if not n:
        return math.nan
    rank = min(n, max(1, math.ceil(q * n - 1e-9)))
    return float(np.partition(values, rank - 1)[rank - 1])


def _request_values(w: RequestRows, column: str) -> Floats:
    values = np.asarray(getattr(w, column)[w.ok], dtype=np.float64)
    return values[~np.isnan(values)]


def _request_quantile(q: float, column: str) -> RequestFn:
    def compute(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
        return _per_window(rows, points, range_seconds, lambda w: nearest_rank(_request_values(w, column), q))

    return compute


def _request_samples(column: str) -> RequestFn:
    """How many requests a ``_request_quantile`` of this column rests on."""

    def compute(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
        return _per_window(rows, points, range_seconds, lambda w: float(len(_request_values(w, column))))

    return compute


def _meets_objectives(w: RequestRows, objectives: Objectives) -> np.ndarray:
    # A one-token answer has no time per output token: it meets that objective.
    tpot_ok = np.isnan(w.tpot) | (w.tpot <= objectives.tpot_seconds)
    # A request answered whole (not streamed) shows its client the first token
    # with the last: its time to first token is its end-to-end time.
    ttft = np.where(np.isnan(w.ttft), w.e2e, w.ttft)
    return w.ok & (ttft <= objectives.ttft_seconds) & tpot_ok


def traffic_seconds(created: Floats, start: float, end: float) -> float:
    """The part of the window ``(start, end]`` that had traffic, from the
    arrival times inside it (sorted): the span from the first arrival to the
    last, plus each edge's quiet stretch when it is shorter than 1.1 mean
    arrival intervals (traffic ran through the edge), else half an interval
    (traffic started or stopped inside the window). Prometheus' rule for
    extrapolating to a range's edges, applied to arrivals instead of scrapes,
    so a rate is requests over the time they were sent in: what a client
    computes over its run. One arrival, or a burst at one instant, tells no
    spacing: the whole window."""
    n = len(created)
    if n < 2 or created[-1] <= created[0]:
        return end - start
    spanned = float(created[-1] - created[0])
    interval = spanned / (n - 1)
    lead, trail = float(created[0]) - start, end - float(created[-1])
    lead = lead if lead < 1.1 * interval else interval / 2
    trail = trail if trail < 1.1 * interval else interval / 2
    return min(end - start, spanned + lead + trail)


def _per_window_rate(
    rows: RequestRows, points: Floats, range_seconds: float, count: Callable[[RequestRows], np.ndarray]
) -> Floats:
    """Per window, the rows ``count`` picks over the time with traffic of the
    window's requests (``traffic_seconds``).

    The time with traffic is the whole stream's, of which the group is a
    share (``RequestRows.stream``): groups split one stream, so each had
    traffic when the stream did. Read from a group's own arrivals, a 10%
    canary's three requests a minute spanned a few seconds and its rate read
    2.7x a stable pool's, per share of traffic, on the same stream."""
    lo = np.searchsorted(rows.created, points - range_seconds, side="right")
    hi = np.searchsorted(rows.created, points, side="right")
    stream = rows.created if rows.stream is None else rows.stream
    stream_lo = np.searchsorted(stream, points - range_seconds, side="right")
    stream_hi = np.searchsorted(stream, points, side="right")
    out = np.full(len(points), np.nan)
    for j, (a, b) in enumerate(zip(lo, hi, strict=True)):
        w = rows.take(slice(a, b))
        picked = count(w)
        if not len(w.created):
            # Without a single logged request we cannot tell quiet from a
            # gateway that is not logging: no data, not 0/s.
            continue
        # Over every arrival, cancelled ones included: a client that gave up
        # on the last requests at its cut-off still sent traffic until then
        # (over served arrivals only, 76 requests read 1.51/s against the
        # client's 1.00/s).
        arrivals = stream[stream_lo[j] : stream_hi[j]]
        out[j] = float(picked.sum()) / traffic_seconds(arrivals, float(points[j]) - range_seconds, float(points[j]))
    return out


def _request_count_rate(which: Literal["served", "good", "cancelled"]) -> RequestFn:
    def compute(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
        def count(w: RequestRows) -> np.ndarray:
            if which == "served":
                return w.served()
            if which == "cancelled":
                return ~w.served()
            return _meets_objectives(w, objectives)

        return _per_window_rate(rows, points, range_seconds, count)

    return compute


def _request_fraction(which: Literal["errors", "good"]) -> RequestFn:
    """A share of the served requests (those the client cancelled are neither)."""

    def compute(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
        def reduce(w: RequestRows) -> float:
            served = w.served()
            if not served.any():
                return math.nan
            hits = w.failed & served if which == "errors" else _meets_objectives(w, objectives)
            return float(hits.sum()) / float(served.sum())

        return _per_window(rows, points, range_seconds, reduce)

    return compute


def _request_count(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
    return _per_window(rows, points, range_seconds, lambda w: float(w.served().sum()))


def _cancelled_count(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
    def reduce(w: RequestRows) -> float:
        if w.cancelled is None or not len(w.created):
            return math.nan
        return float(w.cancelled.sum())

    return _per_window(rows, points, range_seconds, reduce)


def _timed_out_count(rows: RequestRows, points: Floats, range_seconds: float, objectives: Objectives) -> Floats:
    def reduce(w: RequestRows) -> float:
        if w.timed_out is None or not len(w.created):
            return math.nan
        return float(w.timed_out.sum())

    return _per_window(rows, points, range_seconds, reduce)


# ---- the registry -------------------------------------------------------------

# Client-facing latencies: the worker stamps each token when it writes the
# token's SSE event, in fine buckets (4 per doubling from 0.5 ms), on both
# engines. vLLM's own vllm:* families keep vLLM's coarse buckets and the
# engine's production times; the figures below do not read them.
TTFT = "chunkpilot:time_to_first_token_seconds"
ITL = "chunkpilot:inter_token_latency_seconds"
TPOT = "chunkpilot:request_time_per_output_token_seconds"
MAX_GAP = "chunkpilot:request_max_gap_seconds"
ENGINE_MAX_GAP = "chunkpilot:engine_request_max_gap_seconds"
DELIVERY_LAG = "chunkpilot:delivery_lag_seconds"
MERGED_DELTAS = "chunkpilot:stream_merged_deltas_total"
QUEUE = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
CHUNK_WAIT = "chunkpilot:prefill_chunk_wait_seconds"
GAP_LONG = "chunkpilot:decode_gap_long_prefill_seconds"
GAP_OTHER = "chunkpilot:decode_gap_other_seconds"
PREFILL_TOKENS = "chunkpilot:step_tokens_total{kind=prefill}"
DECODE_TOKENS = "chunkpilot:step_tokens_total{kind=decode}"
W = "$__range"  # Grafana's window variable in the PromQL strings; G: the grouping


def _hq(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le, G) (rate({histogram}_bucket[{W}])))"


def _scrape(
    name: str,
    label: str,
    unit: str,
    direction: Direction,
    description: str,
    compute: ScrapeFn,
    expr: str,
    *,
    needs_peak_memory: bool = False,
    display: str = "",
) -> Figure:
    return Figure(
        name,
        label,
        unit,
        direction,
        "scrape",
        description,
        expr,
        needs_peak_memory=needs_peak_memory,
        display=display,
        _scrape=compute,
    )


def _requests(name: str, label: str, unit: str, direction: Direction, description: str, compute: RequestFn) -> Figure:
    return Figure(name, label, unit, direction, "requests", description, _requests=compute)


L, H = Direction.LOWER, Direction.HIGHER

FIGURES: dict[str, Figure] = {
    f.name: f
    for f in [
        # The four-figure panel.
        _scrape(
            "ttft_p99",
            "TTFT P99",
            "s",
            L,
            "Arrival to the first token's SSE event written to the client, 99th percentile over the window's requests.",
            _quantile(0.99, TTFT),
            _hq(0.99, TTFT),
        ),
        _scrape(
            "memory_peak_to_mean",
            "Memory peak/mean",
            "ratio",
            L,
            "Peak engine memory over the window (max of the 15-s recent-peak gauge's scrapes) divided by its "
            "time-weighted mean (memory byte-seconds over the seconds they cover), per worker, averaged over "
            "the group. Lower means the peaks were spread out.",
            _avg_over_targets(_peak_to_mean),
            f"avg by (G) (max_over_time(chunkpilot:memory_recent_peak_bytes[{W}]) / "
            f"(rate(chunkpilot:memory_byte_seconds_total[{W}]) / rate(chunkpilot:held_seconds_total[{W}])))",
            needs_peak_memory=True,
            display="times",
        ),
        _scrape(
            "prefill_wait_mean",
            "Prefill wait mean",
            "s",
            L,
            "Per prefill chunk, how long its request waited, schedulable, since its previous chunk ended (or "
            "since arrival); mean over the window.",
            _mean(CHUNK_WAIT),
            f"sum by (G) (rate({CHUNK_WAIT}_sum[{W}])) / sum by (G) (rate({CHUNK_WAIT}_count[{W}]))",
        ),
        _scrape(
            "prefill_wait_p99",
            "Prefill wait P99",
            "s",
            L,
            "Per prefill chunk wait, 99th percentile.",
            _quantile(0.99, CHUNK_WAIT),
            _hq(0.99, CHUNK_WAIT),
        ),
        _scrape(
            "kv_fragmentation",
            "KV fragmentation",
            "ratio",
            L,
            "1 − tokens stored / (blocks held × block size), sampled each step, time-weighted mean over the "
            "window per worker, averaged over the group.",
            _avg_over_targets(_time_weighted_mean("chunkpilot:kv_fragmentation_ratio_seconds_total")),
            f"avg by (G) (rate(chunkpilot:kv_fragmentation_ratio_seconds_total[{W}]) / "
            f"rate(chunkpilot:held_seconds_total[{W}]))",
        ),
        # Beside them.
        _scrape(
            "itl_p99",
            "ITL P99",
            "s",
            L,
            "Time between consecutive token events as written to the client, 99th percentile over all gaps.",
            _quantile(0.99, ITL),
            _hq(0.99, ITL),
        ),
        _scrape(
            "stall_p99",
            "Stalls P99",
            "s",
            L,
            "Each finished request's largest gap between two token events written to the client (the "
            "user's stall, delivery delays included), 99th percentile over requests: head-of-line "
            "blocking that whole-run ITL hides.",
            _quantile(0.99, MAX_GAP),
            _hq(0.99, MAX_GAP),
        ),
        _scrape(
            "tpot_p99",
            "TPOT P99",
            "s",
            L,
            "Per request, first to last token written, per output token after the first; 99th percentile.",
            _quantile(0.99, TPOT),
            _hq(0.99, TPOT),
        ),
        _scrape(
            "tpot_mean",
            "TPOT mean",
            "s",
            L,
            "Per request, first to last token written, per output token after the first; mean.",
            _mean(TPOT),
            f"sum by (G) (rate({TPOT}_sum[{W}])) / sum by (G) (rate({TPOT}_count[{W}]))",
        ),
        _scrape(
            "queue_time_p99",
            "Queue time P99",
            "s",
            L,
            "Arrival to first scheduled, 99th percentile.",
            _quantile(0.99, QUEUE),
            _hq(0.99, QUEUE),
        ),
        _scrape(
            "queue_time_mean",
            "Queue time mean",
            "s",
            L,
            "Arrival to first scheduled, mean.",
            _mean(QUEUE),
            f"sum by (G) (rate({QUEUE}_sum[{W}])) / sum by (G) (rate({QUEUE}_count[{W}]))",
        ),
        _scrape(
            "engine_stall_p99",
            "Engine stalls P99",
            "s",
            L,
            "Each finished request's largest gap between two tokens as the engine produced them (not as "
            "written: delivery delays excluded), 99th percentile; beside stall_p99 it tells a slow engine "
            "from a worker whose event loop falls behind.",
            _quantile(0.99, ENGINE_MAX_GAP),
            _hq(0.99, ENGINE_MAX_GAP),
        ),
        _scrape(
            "delivery_lag_p99",
            "Delivery lag P99",
            "s",
            L,
            "Per SSE event written, its write time minus the engine's production time of its newest token, "
            "99th percentile: how far the worker's event loop runs behind the engine.",
            _quantile(0.99, DELIVERY_LAG),
            _hq(0.99, DELIVERY_LAG),
        ),
        _scrape(
            "merged_deltas_per_second",
            "Merged deltas/s",
            "1/s",
            L,
            "Engine outputs merged into an earlier SSE event because the worker's event loop fell behind, "
            "per second (0 when delivery keeps up).",
            _rate(MERGED_DELTAS),
            f"sum by (G) (rate({MERGED_DELTAS}[{W}]))",
        ),
        _scrape(
            "requests_per_second",
            "Requests/s",
            "requests/s",
            H,
            "Requests the engines finished, per second.",
            _rate("vllm:request_success_total"),
            f"sum by (G) (rate(vllm:request_success_total[{W}]))",
        ),
        _scrape(
            "output_tokens_per_second",
            "Output tokens/s",
            "tokens/s",
            H,
            "Generated tokens per second.",
            _rate("vllm:generation_tokens_total"),
            f"sum by (G) (rate(vllm:generation_tokens_total[{W}]))",
        ),
        _scrape(
            "prompt_tokens_per_second",
            "Prompt tokens/s",
            "tokens/s",
            H,
            "Prompt tokens taken in per second.",
            _rate("vllm:prompt_tokens_total"),
            f"sum by (G) (rate(vllm:prompt_tokens_total[{W}]))",
        ),
        _scrape(
            "prefill_tokens_per_step",
            "Prefill tokens/step",
            "tokens/step",
            Direction.HIGHER,
            "The token mix: prompt tokens run per engine step.",
            _ratio_of(_keys(PREFILL_TOKENS), _keys("chunkpilot:steps_total")),
            f'sum by (G) (rate(chunkpilot:step_tokens_total{{kind="prefill"}}[{W}])) / '
            f"sum by (G) (rate(chunkpilot:steps_total[{W}]))",
        ),
        _scrape(
            "decode_tokens_per_step",
            "Decode tokens/step",
            "tokens/step",
            Direction.HIGHER,
            "The token mix: decode tokens run per engine step.",
            _ratio_of(_keys(DECODE_TOKENS), _keys("chunkpilot:steps_total")),
            f'sum by (G) (rate(chunkpilot:step_tokens_total{{kind="decode"}}[{W}])) / '
            f"sum by (G) (rate(chunkpilot:steps_total[{W}]))",
        ),
        _scrape(
            "prefill_token_share",
            "Prefill share of tokens",
            "ratio",
            Direction.HIGHER,
            "Prompt tokens over all tokens the engines ran.",
            _ratio_of(_keys(PREFILL_TOKENS), _keys(PREFILL_TOKENS, DECODE_TOKENS)),
            f'sum by (G) (rate(chunkpilot:step_tokens_total{{kind="prefill"}}[{W}])) / '
            f"sum by (G) (rate(chunkpilot:step_tokens_total[{W}]))",
        ),
        _scrape(
            "preemptions_per_second",
            "Preemptions/s",
            "1/s",
            L,
            "Requests preempted per second.",
            _rate("vllm:num_preemptions_total"),
            f"sum by (G) (rate(vllm:num_preemptions_total[{W}]))",
        ),
        _scrape(
            "prefix_cache_hit_rate",
            "Prefix-cache hit rate",
            "ratio",
            H,
            "Cached prompt tokens over queried prompt tokens.",
            _ratio_of(_keys("vllm:prefix_cache_hits_total"), _keys("vllm:prefix_cache_queries_total")),
            f"sum by (G) (rate(vllm:prefix_cache_hits_total[{W}])) / "
            f"sum by (G) (rate(vllm:prefix_cache_queries_total[{W}]))",
        ),
        # Head-of-line blocking (the advisor's evidence; engines whose steps say what prefill ran).
        _scrape(
            "decode_gap_long_prefill_p99",
            "Decode gap P99 during long prefills",
            "s",
            L,
            "Gaps between tokens of the requests decoding while a long prefill ran (more than "
            "chunkpilot:long_prefill_tokens, relative to the model's context, left after its prefix hit), "
            "99th percentile.",
            _quantile(0.99, GAP_LONG),
            _hq(0.99, GAP_LONG),
        ),
        _scrape(
            "decode_gap_other_p99",
            "Decode gap P99 otherwise",
            "s",
            L,
            "Gaps between tokens of the requests decoding while no long prefill ran, 99th percentile.",
            _quantile(0.99, GAP_OTHER),
            _hq(0.99, GAP_OTHER),
        ),
        _scrape(
            "hol_ratio",
            "Head-of-line ratio",
            "ratio",
            L,
            "Decode gap P99 during long prefills over the decode gap P99 otherwise: how much a long prefill "
            "stalls the streams beside it (about 1 under well-tuned chunking). On a chunked canary, a rule "
            'on it is the advisor\'s "budget too large" finding.',
            _ratio_of(_quantile(0.99, GAP_LONG), _quantile(0.99, GAP_OTHER)),
            f"{_hq(0.99, GAP_LONG)} / {_hq(0.99, GAP_OTHER)}",
            display="times",
        ),
        _scrape(
            "prefill_seconds_per_token",
            "Prefill time per token",
            "s",
            L,
            "Step time spent on prefill tokens (each step's duration times its prefill share) per prompt token run.",
            _ratio_of(_keys("chunkpilot:prefill_seconds_total"), _keys(PREFILL_TOKENS)),
            f"sum by (G) (rate(chunkpilot:prefill_seconds_total[{W}])) / "
            f'sum by (G) (rate(chunkpilot:step_tokens_total{{kind="prefill"}}[{W}]))',
        ),
        _scrape(
            "prefill_time_p99",
            "Prefill time P99",
            "s",
            L,
            "First scheduled to first token (the request's prefill, chunks and waits between them), 99th percentile.",
            _quantile(0.99, PREFILL_TIME),
            _hq(0.99, PREFILL_TIME),
        ),
        _scrape(
            "prefill_time_mean",
            "Prefill time mean",
            "s",
            L,
            "First scheduled to first token, mean.",
            _mean(PREFILL_TIME),
            f"sum by (G) (rate({PREFILL_TIME}_sum[{W}])) / sum by (G) (rate({PREFILL_TIME}_count[{W}]))",
        ),
        # P50 and P95 beside every P99 of a latency histogram.
        *[
            _scrape(
                f"{stem}_p{pct}",
                f"{label} P{pct}",
                "s",
                L,
                f"{description}, {word} percentile.",
                _quantile(pct / 100, histogram),
                _hq(pct / 100, histogram),
            )
            for stem, label, description, histogram in (
                ("ttft", "TTFT", "Arrival to the first token written to the client", TTFT),
                ("itl", "ITL", "Time between consecutive token events written, over all gaps", ITL),
                ("stall", "Stalls", "Each finished request's largest gap between two written tokens", MAX_GAP),
                ("tpot", "TPOT", "Per request, time per output token as written", TPOT),
                ("queue_time", "Queue time", "Arrival to first scheduled", QUEUE),
                ("prefill_wait", "Prefill wait", "Per prefill chunk wait", CHUNK_WAIT),
                ("prefill_time", "Prefill time", "First scheduled to first token", PREFILL_TIME),
            )
            for pct, word in ((50, "50th"), (95, "95th"))
        ],
        # Exact, from the gateway's per-request log.
        _requests(
            "client_ttft_p99",
            "TTFT P99 (exact)",
            "s",
            L,
            "Time to first token as the gateway saw it, exact 99th percentile over successful requests.",
            _request_quantile(0.99, "ttft"),
        ),
        _requests(
            "client_ttft_p50",
            "TTFT P50 (exact)",
            "s",
            L,
            "Exact median time to first token.",
            _request_quantile(0.5, "ttft"),
        ),
        _requests(
            "client_tpot_p99",
            "TPOT P99 (exact)",
            "s",
            L,
            "Exact 99th percentile of time per output token.",
            _request_quantile(0.99, "tpot"),
        ),
        _requests(
            "client_stall_p99",
            "Stalls P99 (exact)",
            "s",
            L,
            "Exact 99th percentile over requests of each one's largest gap between tokens.",
            _request_quantile(0.99, "max_gap"),
        ),
        _requests(
            "client_e2e_p99",
            "End-to-end P99 (exact)",
            "s",
            L,
            "Exact 99th percentile of request latency.",
            _request_quantile(0.99, "e2e"),
        ),
        # P50 and P95 beside every exact P99 (client_ttft_p50 above).
        *[
            _requests(
                f"client_{stem}_p{pct}",
                f"{label} P{pct} (exact)",
                "s",
                L,
                f"Exact {word} percentile of {what}.",
                _request_quantile(pct / 100, column),
            )
            for stem, label, what, column in (
                ("ttft", "TTFT", "time to first token", "ttft"),
                ("tpot", "TPOT", "time per output token", "tpot"),
                ("stall", "Stalls", "each request's largest gap between tokens", "max_gap"),
                ("e2e", "End-to-end", "request latency", "e2e"),
            )
            for pct, word in ((50, "50th"), (95, "95th"))
            if (stem, pct) != ("ttft", 50)
        ],
        _requests(
            "client_requests_per_second",
            "Requests/s (gateway)",
            "requests/s",
            H,
            "Requests the gateway served, per second of the window that had traffic (traffic_seconds: "
            "quiet edges before the first and after the last arrival do not count, as a client's own "
            "rate over its run does not; a group's rate is over the whole stream's time with traffic), "
            "errors included; requests the client cancelled (499) are not "
            "served and count in client_cancelled_per_second.",
            _request_count_rate("served"),
        ),
        _requests(
            "client_cancelled_per_second",
            "Cancelled/s (gateway)",
            "requests/s",
            L,
            "Requests the client cancelled before the answer was done (logged as 499), per second of the "
            "window that had traffic; not counted as served.",
            _request_count_rate("cancelled"),
        ),
        _requests(
            "goodput",
            "Goodput",
            "requests/s",
            H,
            "Requests per second (of the window that had traffic) that succeeded and met both the TTFT and "
            "the TPOT objective.",
            _request_count_rate("good"),
        ),
        _requests(
            "goodput_ratio",
            "Within objectives",
            "ratio",
            H,
            "The share of served requests that succeeded and met both objectives.",
            _request_fraction("good"),
        ),
        _requests(
            "error_rate",
            "Error rate",
            "ratio",
            L,
            "Requests the service failed (5xx, 429 overload, a stream broken mid-way) over served requests; "
            "other 4xx are the client's doing and count as neither, and cancelled ones (499) are not served.",
            _request_fraction("errors"),
        ),
        _requests(
            "request_count",
            "Requests",
            "requests",
            H,
            "Requests served in the window (the sample size); cancelled ones are in cancelled_requests.",
            _request_count,
        ),
        _requests(
            "cancelled_requests",
            "Cancelled requests",
            "requests",
            L,
            "Requests in the window the client cancelled before the answer was done (logged as 499).",
            _cancelled_count,
        ),
        _requests(
            "timed_out_streams",
            "Timed-out streams",
            "streams",
            L,
            "Streams the gateway ended because their worker sent no token for "
            "GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS (logged as 598). The rollout analysis adds the streams "
            "silent right now (its hanging check).",
            _timed_out_count,
        ),
    ]
}

# Every percentile says how many samples it rests on: per histogram a
# ``<stem>_samples`` figure (the window's increase of its ``_count``, as
# ``sum(increase(x_count[w]))``), per request-log column a ``client_<stem>_samples``
# figure (the requests its nearest rank is taken over).
SAMPLED_HISTOGRAMS: dict[str, tuple[str, str]] = {
    "ttft": (TTFT, "requests"),
    "itl": (ITL, "token gaps"),
    "stall": (MAX_GAP, "requests"),
    "tpot": (TPOT, "requests"),
    "queue_time": (QUEUE, "requests"),
    "prefill_wait": (CHUNK_WAIT, "prefill chunks"),
    "prefill_time": (PREFILL_TIME, "requests"),
    "engine_stall": (ENGINE_MAX_GAP, "requests"),
    "delivery_lag": (DELIVERY_LAG, "SSE events"),
    "decode_gap_long_prefill": (GAP_LONG, "token gaps"),
    "decode_gap_other": (GAP_OTHER, "token gaps"),
}
_SHORT = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "stall": "Stall", "e2e": "End-to-end"}
SAMPLED_COLUMNS: dict[str, str] = {"ttft": "ttft", "tpot": "tpot", "stall": "max_gap", "e2e": "e2e"}
for _stem, (_histogram, _what) in SAMPLED_HISTOGRAMS.items():
    FIGURES[f"{_stem}_samples"] = _scrape(
        f"{_stem}_samples",
        f"{_SHORT.get(_stem, _stem.replace('_', ' ').capitalize())} samples",
        "samples",
        H,
        f"The {_what} observed in {_histogram} over the window: what its percentiles rest on.",
        _keys(f"{_histogram}_count"),
        f"sum by (G) (increase({_histogram}_count[{W}]))",
    )
# What each samples figure counts, in words (the pages' "rests on the 3 slowest requests").
SAMPLE_NOUNS: dict[str, str] = {
    **{f"{stem}_samples": what for stem, (_, what) in SAMPLED_HISTOGRAMS.items()},
    **{f"client_{stem}_samples": "requests" for stem in SAMPLED_COLUMNS},
}
for _stem, _column in SAMPLED_COLUMNS.items():
    FIGURES[f"client_{_stem}_samples"] = _requests(
        f"client_{_stem}_samples",
        f"{_SHORT[_stem]} samples (exact)",
        "samples",
        H,
        f"Successful requests in the window with a known {_column}: what the exact percentiles rest on.",
        _request_samples(_column),
    )
for _name, _figure in list(FIGURES.items()):
    _stem, _, _pct_text = _name.rpartition("_p")
    if not _pct_text.isdigit():
        continue
    if _stem.startswith("client_") and _stem.removeprefix("client_") in SAMPLED_COLUMNS:
        FIGURES[_name] = replace(_figure, quantile=int(_pct_text) / 100, samples=f"{_stem}_samples")
    elif _stem in SAMPLED_HISTOGRAMS:
        FIGURES[_name] = replace(_figure, quantile=int(_pct_text) / 100, samples=f"{_stem}_samples")
# A ratio of two P99s rests on the scarcer of its two: the gaps during long prefills.
FIGURES["hol_ratio"] = replace(FIGURES["hol_ratio"], quantile=0.99, samples="decode_gap_long_prefill_samples")

# Scraped figures the workers also export per prompt-length bucket
# (workers/server/metrics.py:BY_PROMPT_HISTOGRAMS): those may be grouped by length_bucket.
_BY_PROMPT = {
    "ttft": "chunkpilot:time_to_first_token_by_prompt_seconds",
    "stall": "chunkpilot:request_max_gap_by_prompt_seconds",
    "prefill_time": "chunkpilot:request_prefill_time_by_prompt_seconds",
}
for _stem, _histogram in _BY_PROMPT.items():
    for _pct in (50, 95, 99):
        _name = f"{_stem}_p{_pct}"
        FIGURES[_name] = replace(FIGURES[_name], by_prompt=(_histogram, _pct / 100))
    FIGURES[f"{_stem}_samples"] = replace(FIGURES[f"{_stem}_samples"], by_prompt=(_histogram, None))

# ---- the panel's layout: one table for the pages and the Grafana export ----------------


@dataclass(frozen=True)
class Chart:
    """One chart of the panel: its element id, title and the figures it draws.
    ``decides`` is the figure the chart is judged by (the P99 where it draws a
    mean beside it)."""

    id: str
    title: str
    figures: tuple[str, ...]
    decides: str = ""

    @property
    def decisive(self) -> str:
        return self.decides or self.figures[0]


# The four figures that decide whether chunked prefill is tuned right
# (docs/architecture.md, "Metrics"): one chart each, on the pages and in Grafana.
PANEL_CHARTS: tuple[Chart, ...] = (
    Chart("ttft", "TTFT P99", ("ttft_p99",)),
    Chart("memory", "Memory peak/mean", ("memory_peak_to_mean",)),
    Chart(
        "prefill_wait",
        "Prefill wait (mean, P99)",
        ("prefill_wait_mean", "prefill_wait_p99"),
        decides="prefill_wait_p99",
    ),
    Chart("kv_fragmentation", "KV fragmentation", ("kv_fragmentation",)),
)
# The figures beside them: Grafana draws each chart; the panel page's table
# shows each figure once (a percentile's sample count rides beside its value there).
BESIDE_CHARTS: tuple[Chart, ...] = (
    Chart("itl", "ITL P99", ("itl_p99",)),
    Chart("stall", "Stalls P99 (largest gap per request)", ("stall_p99",)),
    Chart("engine_stall", "Stalls P99: as written vs as the engine produced", ("stall_p99", "engine_stall_p99")),
    Chart("delivery_lag", "Delivery lag P99", ("delivery_lag_p99",)),
    Chart("merged_deltas", "Merged deltas/s", ("merged_deltas_per_second",)),
    Chart("samples", "Samples behind the percentiles (requests)", ("ttft_samples", "stall_samples")),
    Chart("tpot", "TPOT (mean, P99)", ("tpot_mean", "tpot_p99"), decides="tpot_p99"),
    Chart("queue_time", "Queue time (mean, P99)", ("queue_time_mean", "queue_time_p99"), decides="queue_time_p99"),
    Chart("token_mix", "Token mix per step", ("prefill_tokens_per_step", "decode_tokens_per_step")),
    Chart("preemptions", "Preemptions/s", ("preemptions_per_second",)),
    Chart("prefix_cache", "Prefix-cache hit rate", ("prefix_cache_hit_rate",)),
    Chart("throughput", "Throughput", ("requests_per_second", "output_tokens_per_second")),
)


def figures_of(charts: Sequence[Chart]) -> tuple[str, ...]:
    """The charts' figures in order, each once."""
    return tuple(dict.fromkeys(n for chart in charts for n in chart.figures))


PANEL_FIGURES: tuple[str, ...] = tuple(chart.decisive for chart in PANEL_CHARTS)
_SAMPLE_COUNTS = {f.samples for f in FIGURES.values() if f.samples}
BESIDE_FIGURES: tuple[str, ...] = tuple(n for n in figures_of(BESIDE_CHARTS) if n not in _SAMPLE_COUNTS)
LENGTH_TABLE_FIGURES: tuple[str, ...] = (
    "request_count",
    "client_ttft_p50",
    "client_ttft_p95",
    "client_ttft_p99",
    "client_tpot_p99",
    "client_stall_p99",
    "client_e2e_p99",
    "goodput_ratio",
    "error_rate",
)

GROUP_BY_SCRAPE = ("fleet", "worker", "pool", "cohort")
GROUP_BY_REQUESTS = ("fleet", "worker", "pool", "cohort", "length_bucket")


def get(name: str) -> Figure:
    return FIGURES[name]


def group_by_choices(figure: Figure) -> tuple[str, ...]:
    if figure.source == "requests":
        return GROUP_BY_REQUESTS
    return (*GROUP_BY_SCRAPE, "length_bucket") if figure.by_prompt is not None else GROUP_BY_SCRAPE


# ---- the series some figures read ---------------------------------------------------
#
# A stored vector holds every series of its layout (2,085 for a reference
# worker); a page's figures read a few dozen. The database backend windows
# only those (query.py): a figure finds its series by key
# (``layout.index.get``) or by histogram (``layout.buckets``) and computes
# every series alone, so over a ``Narrowed`` layout holding the series it
# reads it computes the same numbers as over the whole one.


@dataclass(frozen=True)
class Narrowed(Layout):
    """Some series of a stored layout, in its order. The digest joins the
    stored layout's, so targets whose stored layouts differ sum apart in
    ``Group.sums`` as they do at full width."""

    source_digest: str = ""

    @cached_property
    def digest(self) -> str:
        return hashlib.sha1("\n".join((self.source_digest, *self.keys)).encode()).hexdigest()


class _Lookups(Mapping[str, int]):
    """A layout's index that notes the position of every key looked up."""

    def __init__(self, index: Mapping[str, int], probe: _Probe):
        self._index = index
        self._probe = probe

    def __getitem__(self, key: str) -> int:
        position = self._index[key]
        self._probe.read.add(position)
        return position

    def __iter__(self) -> Iterator[str]:
        self._probe.reads_all = True  # a walk over every key: no narrowing
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _Probe:
    """Stands for a layout while figures are computed over zeros: notes the
    positions they look up. Anything else asked of it (``keys``, ``len``)
    fails, and the figures then read every series."""

    def __init__(self, layout: Layout):
        self.read: set[int] = set()
        self.reads_all = False
        self.digest = layout.digest
        self.index = _Lookups(layout.index, self)
        self._layout = layout

    def buckets(self, histogram: str) -> list[tuple[float, int]]:
        own = self._layout.buckets(histogram)
        self.read.update(position for _, position in own)
        return own


def series_read(chosen: Sequence[Figure], layout: Layout, *, by_prompt: bool = False) -> NDArray[np.intp] | None:
    """The positions in ``layout`` (ascending) of every series the scraped
    figures ``chosen`` read (per prompt-length bucket with ``by_prompt``),
    found by computing them once over zeros; None when one reads the layout
    in a way the probe cannot follow (then every series counts)."""
    probe = _Probe(layout)
    zeros = TargetWindows({}, cast(Layout, probe), np.zeros((1, len(layout))), np.zeros(1), 60.0)
    group = Group([zeros], 1)
    try:
        with np.errstate(all="ignore"):
            for f in chosen:
                if by_prompt:
                    for label in catalogue.LENGTH_BUCKET_LABELS:
                        f.from_group_by_prompt(group, label)
                else:
                    f.from_group(group)
    except (AttributeError, TypeError):
        return None
    if probe.reads_all:
        return None
    return np.array(sorted(probe.read), dtype=np.intp)


_NARROWED: dict[tuple[str, tuple[str, ...], bool], tuple[Layout, NDArray[np.intp] | None]] = {}


def narrow(
    layout: Layout, chosen: Sequence[Figure], *, by_prompt: bool = False
) -> tuple[Layout, NDArray[np.intp] | None]:
    """``layout`` cut to the series ``chosen`` read (``series_read``) and
    their positions in it; ``(layout, None)`` when they read all of it.
    Kept per layout and figures: a page asks the same few sets every time."""
    key = (layout.digest, tuple(f.name for f in chosen), by_prompt)
    hit = _NARROWED.get(key)
    if hit is None:
        columns = series_read(chosen, layout, by_prompt=by_prompt)
        if columns is None or len(columns) == len(layout):
            hit = (layout, None)
        else:
            hit = (Narrowed(tuple(layout.keys[i] for i in columns), source_digest=layout.digest), columns)
        if len(_NARROWED) >= 1024:  # arbitrary API sets; pages' sets come right back
            _NARROWED.clear()
        _NARROWED[key] = hit
    return hit
