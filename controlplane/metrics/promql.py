"""PromQL's windowed arithmetic, pure and free of Django.

The control plane computes its figures from scraped cumulative counters and
histogram buckets with the same arithmetic Prometheus uses, so a figure on a
Chunkpilot dashboard and the same figure in the shipped Grafana dashboard
agree. Read against Prometheus 3.x (``promql/functions.go``
``extrapolatedRate``, ``promql/quantile.go`` ``BucketQuantile``):

* A range ``(start, end]`` is left-open: a sample exactly at ``start`` is out.
* ``increase``/``rate`` need two samples; fewer is *no data* (None), never 0.
  Counter resets (a value below its predecessor) add the value before the
  reset. The result is extrapolated to the range's edges when the first/last
  sample lies within 1.1 average sample intervals of them, else by half an
  interval; never back past the counter's extrapolated zero point.
* ``histogram_quantile`` sorts and merges buckets by upper bound, needs a
  ``+Inf`` bucket and at least two buckets, forces the cumulative counts to be
  monotonic (ignoring relative deltas below 1e-12), answers the upper bound of
  the second-highest bucket when the rank lands in ``+Inf``, and interpolates
  linearly from 0 in the lowest bucket. Zero observations is no data.

The storage layer keeps counters reset-corrected ("totals") so that a window
needs only its first and last sample; ``CounterWindow`` is that summary, and
``extrapolated_increase`` works on it (vectorised over many series at once).
``summarize`` builds it from plain raw samples, which the table tests use.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Floats = NDArray[np.float64]

# Relative differences between neighbouring buckets below this are float noise
# (Prometheus's smallDeltaTolerance).
SMALL_DELTA_TOLERANCE = 1e-12
_MIN_NORMAL = 2.2250738585072014e-308


@dataclass(frozen=True)
class CounterWindow:
    """What ``increase`` needs from one series' samples inside a range.

    ``first_values`` and ``increases`` may be arrays: many series sampled at
    the same times (one worker's scrape) share ``first_t``/``last_t``/
    ``num_samples`` and are extrapolated together.
    """

    first_t: float
    last_t: float
    num_samples: int
    first_values: Floats | float  # the raw value of the first sample (zero-point check)
    increases: Floats | float  # last - first, plus every value seen just before a reset


def select_range(samples: Sequence[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The samples with ``start < t <= end`` (samples sorted by time)."""
    times = [t for t, _ in samples]
    return list(samples[bisect_right(times, start) : bisect_right(times, end)])


def summarize(samples: Sequence[tuple[float, float]], *, is_counter: bool = True) -> CounterWindow | None:
    """Reduce a range's raw samples to a ``CounterWindow``; None below two samples."""
    if len(samples) < 2:
        return None
    increase = samples[-1][1] - samples[0][1]
    if is_counter:
        for (_, prev), (_, curr) in zip(samples, samples[1:], strict=False):
            if curr < prev:
                increase += prev
    return CounterWindow(samples[0][0], samples[-1][0], len(samples), samples[0][1], increase)


def extrapolated_increase(
    window: CounterWindow, range_start: float, range_end: float, *, is_counter: bool = True
) -> Floats | float:
    """Prometheus's ``increase()`` (``delta()`` when not a counter) for a
    window summary; element-wise when the window holds arrays."""
    sampled = window.last_t - window.first_t
    increases = np.asarray(window.increases, dtype=np.float64)
    first_values = np.asarray(window.first_values, dtype=np.float64)
    if window.num_samples < 2 or sampled <= 0:
        raise ValueError("a window needs two samples at different times")
    average_interval = sampled / (window.num_samples - 1)
    threshold = average_interval * 1.1

    to_start = window.first_t - range_start
    if to_start >= threshold:
        to_start = average_interval / 2
    to_end = range_end - window.last_t
    if to_end >= threshold:
        to_end = average_interval / 2

    to_start_each = np.full_like(increases, to_start)
    if is_counter:
        # Counters cannot go below zero: do not extrapolate back past the
        # point where the line through the samples would cross zero.
        with np.errstate(divide="ignore", invalid="ignore"):
            to_zero = np.where((increases > 0) & (first_values >= 0), sampled * (first_values / increases), to_start)
        to_start_each = np.minimum(to_start_each, to_zero)
    result = increases * ((sampled + to_start_each + to_end) / sampled)
    return float(result) if result.ndim == 0 else result


def increase(
    samples: Sequence[tuple[float, float]], range_start: float, range_end: float, *, is_counter: bool = True
) -> float | None:
    """``increase(series[range_end - range_start])`` evaluated at ``range_end``."""
    window = summarize(select_range(samples, range_start, range_end), is_counter=is_counter)
    if window is None:
        return None
    return float(extrapolated_increase(window, range_start, range_end, is_counter=is_counter))


def rate(samples: Sequence[tuple[float, float]], range_start: float, range_end: float) -> float | None:
    """``rate(series[...])``: the increase per second of the range."""
    value = increase(samples, range_start, range_end)
    return None if value is None else value / (range_end - range_start)


def max_over_time(samples: Sequence[tuple[float, float]], range_start: float, range_end: float) -> float | None:
    values = [v for _, v in select_range(samples, range_start, range_end)]
    return max(values) if values else None


def _almost_equal(a: float, b: float, epsilon: float) -> bool:
    if a == b:
        return True
    abs_sum = abs(a) + abs(b)
    diff = abs(a - b)
    if a == 0 or b == 0 or abs_sum < _MIN_NORMAL:
        return diff < epsilon * _MIN_NORMAL
    return diff / min(abs_sum, float(np.finfo(np.float64).max)) < epsilon


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """``histogram_quantile(q, ...)`` over (upper bound, cumulative count)
    pairs of one classic histogram; None where Prometheus answers NaN."""
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(buckets, key=lambda b: b[0])
    if not ordered or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return None

    # Merge buckets that share an upper bound (series that differ only in
    # labels Prometheus aggregated away arrive this way).
    merged: list[list[float]] = []
    for bound, count in ordered:
        if merged and merged[-1][0] == bound:
            merged[-1][1] += count
        else:
            merged.append([bound, count])

    # The envelope: no bucket may hold fewer than the one below it.
    prev = merged[0][1]
    for bucket in merged[1:]:
        curr = bucket[1]
        if curr == prev:
            continue
        if _almost_equal(prev, curr, SMALL_DELTA_TOLERANCE) or curr < prev:
            bucket[1] = prev
            continue
        prev = curr

    if len(merged) < 2:
        return None
    observations = merged[-1][1]
    if observations == 0 or math.isnan(observations):
        return None
    rank = q * observations
    counts = [count for _, count in merged[:-1]]
    b = bisect_left(counts, rank)  # first bucket whose count reaches the rank
    if b == len(merged) - 1:
        return merged[-2][0]
    if b == 0 and merged[0][0] <= 0:
        return merged[0][0]
    bucket_start = 0.0
    bucket_end, count = merged[b]
    if b > 0:
        bucket_start = merged[b - 1][0]
        count -= merged[b - 1][1]
        rank -= merged[b - 1][1]
    if count == 0:
        return None  # 0/0: Prometheus answers NaN (q = 0 over an empty lowest bucket)
    return bucket_start + (bucket_end - bucket_start) * (rank / count)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, no data when either is missing or the
    denominator is zero (PromQL answers NaN or Inf there; a dashboard shows a gap)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def quantile(q: float, values: Sequence[float]) -> float | None:
    """PromQL's ``quantile``/``quantile_over_time`` over exact values: linear
    between the closest ranks, rank ``q * (n - 1)``. No values, no data."""
    if not len(values) or math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lower = max(0, math.floor(rank))
    upper = min(len(ordered) - 1, lower + 1)
    weight = rank - math.floor(rank)
    return float(ordered[lower] * (1 - weight) + ordered[upper] * weight)


@dataclass(frozen=True)
class Windows:
    """Increases of many series over many ranges that end at ``points``.

    ``increases[j]`` is NaN in every column where range ``j`` held fewer than
    two samples (no data)."""

    points: Floats  # range ends, seconds
    range_seconds: float
    increases: Floats  # [num_points, num_series]
    first_index: NDArray[np.intp]  # per point: the first sample inside, or -1
    last_index: NDArray[np.intp]  # per point: the last sample inside, or -1


def range_windows(
    times: Floats,
    totals: Floats,
    raw_offsets: Floats | None,
    points: Floats,
    range_seconds: float,
    sample_numbers: NDArray[np.int64] | None = None,
) -> Windows:
    """``increase(x[range])`` at each of ``points`` for every column of
    ``totals`` (one row per sample, sorted by ``times``, counters already
    reset-corrected: see ``catalogue.fold``). ``raw_offsets`` (same shape, or
    None for none) turns a total back into the raw value for the zero-point
    check.

    ``sample_numbers`` (one per row, non-decreasing) are for rows that stand
    for the edges of runs of samples, not every sample (a minute's first and
    last scrape): a range's sample count is then the difference of its first
    and last row's numbers, plus one, rather than its rows."""
    times = np.asarray(times, dtype=np.float64)
    points = np.asarray(points, dtype=np.float64)
    num_series = totals.shape[1] if totals.ndim == 2 else 0
    first = np.searchsorted(times, points - range_seconds, side="right")
    last = np.searchsorted(times, points, side="right") - 1
    inside = last - first + 1
    num_samples = inside
    if sample_numbers is not None and len(times):
        numbers = np.asarray(sample_numbers, dtype=np.int64)
        first_number = numbers[np.minimum(first, len(times) - 1)]
        num_samples = np.where(inside >= 1, numbers[np.maximum(last, 0)] - first_number + 1, 0)
    ok = num_samples >= 2
    increases = np.full((len(points), num_series), np.nan)
    first_index = np.where(inside >= 1, first, -1)
    last_index = np.where(inside >= 1, last, -1)
    if ok.any():
        i0, i1 = first[ok], last[ok]
        first_values = totals[i0] - (raw_offsets[i0] if raw_offsets is not None else 0.0)
        increases[ok] = _extrapolate(
            times[i0],
            times[i1],
            num_samples[ok],
            first_values,
            totals[i1] - totals[i0],
            points[ok] - range_seconds,
            points[ok],
        )
    return Windows(points, range_seconds, increases, first_index, last_index)


def _extrapolate(
    first_t: Floats,
    last_t: Floats,
    num_samples: NDArray[np.intp],
    first_values: Floats,
    increases: Floats,
    range_start: Floats,
    range_end: Floats,
) -> Floats:
    """``extrapolated_increase`` for counters, one row per range."""
    sampled = (last_t - first_t)[:, None]
    average_interval = sampled / (num_samples[:, None] - 1)
    threshold = average_interval * 1.1
    to_start = (first_t - range_start)[:, None]
    to_start = np.where(to_start >= threshold, average_interval / 2, to_start)
    to_end = (range_end - last_t)[:, None]
    to_end = np.where(to_end >= threshold, average_interval / 2, to_end)
    with np.errstate(divide="ignore", invalid="ignore"):
        to_zero = np.where((increases > 0) & (first_values >= 0), sampled * (first_values / increases), to_start)
        to_start = np.minimum(to_start, to_zero)
        return increases * ((sampled + to_start + to_end) / sampled)


def max_in_windows(values: Floats, windows: Windows) -> Floats:
    """Per range, the max of ``values`` (one per sample) over the samples
    inside it, NaN where none (or all NaN)."""
    out = np.full(len(windows.points), np.nan)
    has = windows.first_index >= 0
    if has.any() and len(values):
        padded = np.append(np.asarray(values, dtype=np.float64), np.nan)
        bounds = np.empty(2 * int(has.sum()), dtype=np.intp)
        bounds[0::2] = windows.first_index[has]
        bounds[1::2] = windows.last_index[has] + 1
        out[has] = np.fmax.reduceat(padded, bounds)[0::2]
    return out


def histogram_quantiles(q: float, bounds: Sequence[float], counts: Floats) -> Floats:
    """``histogram_quantile`` for many histograms with the same bucket bounds:
    ``counts[i, j]`` is bucket ``i`` (ascending ``bounds``) of histogram ``j``.
    NaN where Prometheus answers NaN. Same rules as ``histogram_quantile``,
    vectorised over the histograms (the panel evaluates hundreds)."""
    bounds_array = np.asarray(bounds, dtype=np.float64)
    counts = np.array(counts, dtype=np.float64, copy=True)
    num_buckets, num = counts.shape if counts.ndim == 2 else (0, 0)
    out = np.full(num, np.nan)
    if math.isnan(q) or num_buckets < 2 or not (math.isinf(bounds_array[-1]) and bounds_array[-1] > 0):
        return out
    if q < 0 or q > 1:
        out[:] = -math.inf if q < 0 else math.inf
        return out
    if np.any(np.diff(bounds_array) <= 0):
        raise ValueError("bounds must be strictly ascending (merge equal bounds first)")
    # The envelope, ignoring float-noise differences (see histogram_quantile).
    prev = counts[0].copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(1, num_buckets):
            curr = counts[i]
            diff = np.abs(prev - curr)
            abs_sum = np.abs(prev) + np.abs(curr)
            tiny = (prev == 0) | (curr == 0) | (abs_sum < _MIN_NORMAL)
            almost = np.where(tiny, diff < SMALL_DELTA_TOLERANCE * _MIN_NORMAL, diff < SMALL_DELTA_TOLERANCE * abs_sum)
            fix = (curr != prev) & (almost | (curr < prev))
            counts[i] = np.where(fix, prev, curr)
            prev = np.where(fix, prev, curr)
    observations = counts[-1]
    rank = q * observations
    reached = counts[:-1] >= rank  # [num_buckets - 1, num]
    b = np.where(reached.any(axis=0), reached.argmax(axis=0), num_buckets - 1)
    columns = np.arange(num)
    below = np.where(b > 0, counts[np.maximum(b - 1, 0), columns], 0.0)
    start = np.where(b > 0, bounds_array[np.maximum(b - 1, 0)], 0.0)
    end = bounds_array[b]
    in_bucket = counts[b, columns] - below
    with np.errstate(divide="ignore", invalid="ignore"):
        interpolated = start + (end - start) * ((rank - below) / in_bucket)
    value = np.where(b == num_buckets - 1, bounds_array[-2], interpolated)
    value = np.where((b == 0) & (bounds_array[0] <= 0), bounds_array[0], value)
    ok = (observations > 0) & ~np.isnan(observations) & ~np.isnan(counts).any(axis=0)
    return np.where(ok & ((b == num_buckets - 1) | (b == 0) & (bounds_array[0] <= 0) | (in_bucket != 0)), value, np.nan)
