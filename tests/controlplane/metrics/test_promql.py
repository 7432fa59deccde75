"""PromQL's arithmetic against hand-computed fixtures.

Each case says the numbers it was worked out with, so a reader can check it
with pencil and paper against Prometheus's extrapolatedRate and BucketQuantile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from controlplane.metrics import promql


def series(start: float, step: float, values: list[float]) -> list[tuple[float, float]]:
    return [(start + i * step, v) for i, v in enumerate(values)]


INCREASE_CASES = [
    pytest.param(
        # 12 samples every 5 s from t=5: first 10, last 120, increase 110 over 55 s.
        # Start gap 5 s < 1.1 x 5 s, zero point 55 x 10/110 = 5 s: extrapolate 5 s.
        # End gap 0. 110 x (55 + 5 + 0) / 55 = 120.
        series(5, 5, [10 * (i + 1) for i in range(12)]),
        0,
        60,
        120.0,
        id="steady_counter_extrapolates_to_both_edges",
    ),
    pytest.param(
        # 10, 20, 5 (reset), 15 at t=5..20: 15 - 10 + 20 = 25 over 15 s.
        # Start gap 5 s, zero point 15 x 10/25 = 6 s: extrapolate 5 s. 25 x 20/15.
        series(5, 5, [10, 20, 5, 15]),
        0,
        20,
        25 * 20 / 15,
        id="counter_reset_adds_the_value_before_the_reset",
    ),
    pytest.param(
        # 100, 120 (+20), 3 (reset: +120), 4, 1 (reset: +4), 2: 2 - 100 + 120 + 4 = 26 over 25 s.
        # Start gap 5 s, zero point 25 x 100/26 > 5 s: extrapolate 5 s. 26 x 30/25.
        series(5, 5, [100, 120, 3, 4, 1, 2]),
        0,
        30,
        26 * 30 / 25,
        id="two_counter_resets_in_one_window",
    ),
    pytest.param(
        # A series born mid-window: samples t=30..60 (7), values 3..9, increase 6 over 30 s.
        # Start gap 30 s >= 5.5 s: extrapolate half an interval, 2.5 s (zero point 15 s).
        # 6 x (30 + 2.5) / 30 = 6.5.
        series(30, 5, [3, 4, 5, 6, 7, 8, 9]),
        0,
        60,
        6.5,
        id="series_starting_inside_the_window_extrapolates_half_an_interval",
    ),
    pytest.param(
        # t=10:1, 20:11, 30:21 in (0, 60]: increase 20 over 20 s, interval 10 s.
        # Start gap 10 s < 11 s, but the zero point is 20 x 1/20 = 1 s away: use 1 s.
        # End gap 30 s >= 11 s: half an interval, 5 s. 20 x (20 + 1 + 5) / 20 = 26.
        series(10, 10, [1, 11, 21]),
        0,
        60,
        26.0,
        id="extrapolation_stops_at_the_counters_zero_point",
    ),
    pytest.param(
        # The sample at t=0 sits on the open left edge and is out: (30, 130), (60, 160).
        # Increase 30 over 30 s, start gap 30 s < 33 s, zero point 130 s: 30 x 60/30.
        [(0, 100.0), (30, 130.0), (60, 160.0)],
        0,
        60,
        60.0,
        id="sample_on_the_left_edge_is_outside_the_range",
    ),
    pytest.param(series(5, 5, [7, 7, 7, 7]), 0, 20, 0.0, id="flat_counter_is_zero_not_no_data"),
    pytest.param(series(5, 5, [42]), 0, 20, None, id="one_sample_is_no_data"),
    pytest.param([], 0, 20, None, id="empty_window_is_no_data"),
    pytest.param(series(100, 5, [1, 2, 3]), 0, 60, None, id="samples_all_after_the_window_is_no_data"),
]


@pytest.mark.parametrize(("samples", "start", "end", "expected"), INCREASE_CASES)
def test_increase_matches_hand_computed_prometheus_value(samples, start, end, expected) -> None:
    got = promql.increase(samples, start, end)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, rel=1e-12)


def test_rate_is_increase_per_second_of_the_range() -> None:
    assert promql.rate(series(5, 5, [10 * (i + 1) for i in range(12)]), 0, 60) == pytest.approx(2.0)
    assert promql.rate([], 0, 60) is None


def test_vectorised_windows_extrapolate_each_series_with_its_own_zero_point() -> None:
    # Two series sampled together at t=10, 20, 30 in (0, 60]: one starts at 1
    # (zero point 1 s away), the other at 1000 (no clamp, 10 s back).
    window = promql.CounterWindow(
        first_t=10,
        last_t=30,
        num_samples=3,
        first_values=np.array([1.0, 1000.0]),
        increases=np.array([20.0, 20.0]),
    )
    got = promql.extrapolated_increase(window, 0, 60)
    assert got == pytest.approx([26.0, 20 * (20 + 10 + 5) / 20])


def test_delta_of_a_gauge_ignores_resets_and_the_zero_point() -> None:
    # 10 -> 4 is a drop, not a reset: delta = -6 over 10 s, extrapolated 5 s each side.
    samples = series(5, 5, [10, 7, 4])
    window = promql.summarize(promql.select_range(samples, 0, 20), is_counter=False)
    assert window is not None
    assert promql.extrapolated_increase(window, 0, 20, is_counter=False) == pytest.approx(-6 * 20 / 10)


def test_max_over_time_takes_the_window_only_and_none_when_empty() -> None:
    samples = [(0, 99.0), (5, 3.0), (10, 8.0)]
    assert promql.max_over_time(samples, 0, 10) == 8.0
    assert promql.max_over_time(samples, 10, 20) is None


BUCKETS = [(0.1, 10.0), (0.5, 60.0), (1.0, 90.0), (math.inf, 100.0)]

QUANTILE_CASES = [
    # rank 50 lands in (0.1, 0.5] holding 50, 40 into it: 0.1 + 0.4 x 40/50.
    pytest.param(0.5, BUCKETS, 0.42, id="interpolates_inside_the_bucket"),
    # rank 5 lands in the lowest bucket: from 0, 0.1 x 5/10.
    pytest.param(0.05, BUCKETS, 0.05, id="lowest_bucket_interpolates_from_zero"),
    # rank 99 lands in +Inf: the second-highest upper bound.
    pytest.param(0.99, BUCKETS, 1.0, id="rank_in_the_inf_bucket_answers_the_highest_finite_bound"),
    pytest.param(0.5, list(reversed(BUCKETS)), 0.42, id="bucket_order_does_not_matter"),
    # 8 < 10 below it is lifted to 10; rank 10 is met by the lowest bucket: 0.1.
    pytest.param(
        0.5, [(0.1, 10.0), (0.5, 8.0), (1.0, 20.0), (math.inf, 20.0)], 0.1, id="non_monotonic_counts_are_made_monotonic"
    ),
    # Same-bound buckets add: (0.5, 10), (+Inf, 20); rank 5: 0.5 x 5/10.
    pytest.param(0.25, [(0.5, 5.0), (0.5, 5.0), (math.inf, 20.0)], 0.25, id="buckets_with_one_bound_are_merged"),
    # A negative lowest bound is answered as is when the rank lands there.
    pytest.param(0.1, [(-1.0, 5.0), (1.0, 10.0), (math.inf, 10.0)], -1.0, id="non_positive_lowest_bound_is_returned"),
    pytest.param(0.5, [(0.1, 1.0), (1.0, 2.0)], None, id="no_inf_bucket_is_no_data"),
    pytest.param(0.5, [(0.1, 0.0), (math.inf, 0.0)], None, id="zero_observations_is_no_data"),
    pytest.param(0.5, [], None, id="no_buckets_is_no_data"),
    pytest.param(0.5, [(math.inf, 4.0)], None, id="only_the_inf_bucket_is_no_data"),
    pytest.param(-0.1, BUCKETS, -math.inf, id="q_below_zero_is_minus_inf"),
    pytest.param(1.1, BUCKETS, math.inf, id="q_above_one_is_plus_inf"),
    pytest.param(math.nan, BUCKETS, None, id="q_nan_is_no_data"),
]


@pytest.mark.parametrize(("q", "buckets", "expected"), QUANTILE_CASES)
def test_histogram_quantile_matches_hand_computed_prometheus_value(q, buckets, expected) -> None:
    got = promql.histogram_quantile(q, buckets)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected, rel=1e-12)


def test_histogram_quantile_of_increases_over_a_window_with_a_reset() -> None:
    # Two scrapes per bucket straddling a worker restart: le=0.5 goes 40 -> 4
    # (reset: +40), +Inf 50 -> 10 (+50). Increases 4 and 10; 5 s apart inside
    # (0, 10] with the first sample at t=5: both extrapolate by the same 5 s
    # (zero points 5 x 40/4 and 5 x 50/10 are further), factor 2.
    le_half = promql.increase([(5, 40.0), (10, 4.0)], 0, 10)
    le_inf = promql.increase([(5, 50.0), (10, 10.0)], 0, 10)
    assert (le_half, le_inf) == (pytest.approx(8.0), pytest.approx(20.0))
    # rank 0.5 x 20 = 10 > 8: lands in +Inf, answers 0.5.
    assert promql.histogram_quantile(0.5, [(0.5, le_half), (math.inf, le_inf)]) == 0.5
    # rank 0.25 x 20 = 5 in (0, 0.5]: 0.5 x 5/8.
    assert promql.histogram_quantile(0.25, [(0.5, le_half), (math.inf, le_inf)]) == pytest.approx(0.3125)


QUANTILE_OVER_VALUES = [
    pytest.param(0.5, [4.0, 1.0, 3.0, 2.0], 2.5, id="median_between_two_values"),
    pytest.param(0.99, [float(i) for i in range(1, 101)], 99.01, id="p99_of_one_to_hundred"),
    pytest.param(0.99, [7.0], 7.0, id="one_value_is_itself"),
    pytest.param(0.99, [], None, id="no_values_is_no_data"),
]


@pytest.mark.parametrize(("q", "values", "expected"), QUANTILE_OVER_VALUES)
def test_exact_quantile_over_values_follows_promql_quantile(q, values, expected) -> None:
    got = promql.quantile(q, values)
    assert got == (None if expected is None else pytest.approx(expected))


def test_ratio_without_a_denominator_is_no_data() -> None:
    assert promql.ratio(1.0, 0.0) is None
    assert promql.ratio(None, 2.0) is None
    assert promql.ratio(1.0, 4.0) == 0.25


def test_range_windows_agree_with_increase_at_every_point_including_resets_and_gaps() -> None:
    # One counter scraped every 5 s with a reset at t=40 and a missed scrape
    # at t=65; ranges of 20 s evaluated every 10 s.
    samples = [(t, v) for t, v in series(5, 5, [3, 8, 14, 20, 27, 30, 31, 2, 9, 15, 22, 30, 41, 45]) if t != 65]
    times = np.array([t for t, _ in samples])
    raw = np.array([v for _, v in samples])
    folded = [0.0]
    for prev, curr in zip(raw, raw[1:], strict=False):
        folded.append(folded[-1] + (prev if curr < prev else 0.0))
    totals = (raw + np.array(folded))[:, None]
    points = np.arange(0.0, 91.0, 10.0)
    windows = promql.range_windows(times, totals, np.array(folded)[:, None], points, 20.0)
    for j, end in enumerate(points):
        expected = promql.increase(samples, end - 20, end)
        got = windows.increases[j, 0]
        if expected is None:
            assert math.isnan(got), end
        else:
            assert got == pytest.approx(expected), end


def test_max_in_windows_skips_empty_ranges_and_nan_samples() -> None:
    times = np.array([5.0, 10.0, 15.0, 40.0])
    values = np.array([3.0, np.nan, 7.0, 1.0])
    windows = promql.range_windows(times, np.zeros((4, 0)), None, np.array([10.0, 20.0, 30.0, 40.0]), 10.0)
    got = promql.max_in_windows(values, windows)
    assert got[0] == 3.0 and got[1] == 7.0 and math.isnan(got[2]) and got[3] == 1.0


def test_vectorised_quantiles_agree_with_the_scalar_rules_case_by_case() -> None:
    # Every hand-computed case above with a strictly ascending, +Inf-topped
    # bucket list, side by side in one call.
    cases = [
        (0.5, BUCKETS),
        (0.05, BUCKETS),
        (0.99, BUCKETS),
        (0.5, [(0.1, 10.0), (0.5, 8.0), (1.0, 20.0), (math.inf, 20.0)]),
        (0.5, [(0.1, 0.0), (0.5, 0.0), (1.0, 0.0), (math.inf, 0.0)]),
        (0.0, [(0.1, 0.0), (0.5, 3.0), (1.0, 3.0), (math.inf, 3.0)]),
    ]
    bounds = [0.1, 0.5, 1.0, math.inf]
    for q in (0.0, 0.05, 0.5, 0.99):
        counts = np.array([[c for _, c in buckets] for _, buckets in cases]).T
        got = promql.histogram_quantiles(q, bounds, counts)
        for j, (_, buckets) in enumerate(cases):
            expected = promql.histogram_quantile(q, buckets)
            assert (math.isnan(got[j]) and expected is None) or got[j] == pytest.approx(expected), (q, buckets)
    assert promql.histogram_quantiles(0.5, [-1.0, 1.0, math.inf], np.array([[5.0], [10.0], [10.0]]))[0] == -1.0
    assert math.isnan(promql.histogram_quantiles(0.5, [0.1, 1.0], np.array([[1.0], [2.0]]))[0])  # no +Inf
