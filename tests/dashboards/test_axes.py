"""Chart axes (dashboards/axes.py): an axis over one point spans a sensible
range, a value axis holds zero so differences read at their size, and no two
tick labels read the same."""

from __future__ import annotations

import pytest

from dashboards import axes


def test_an_axis_over_one_point_spans_a_sensible_range() -> None:
    t = 1_900_000_000.0
    low, high = axes.time_range([t]) or (0.0, 0.0)
    assert low < t < high and high - low == 2 * axes.LONE_POINT_PAD_SECONDS  # two minutes, not years
    axis = axes.value_axis([0.00992], "duration")
    assert axis is not None and axis.min == 0 and 0.00992 < axis.max <= 0.02
    assert axes.log_range([256]) == (128, 512)


def test_a_time_axis_over_several_points_is_theirs() -> None:
    assert axes.time_range([10.0, 70.0, 40.0]) == (10.0, 70.0)
    assert axes.time_range([]) is None


@pytest.mark.parametrize(
    ("values", "display", "most_height"),
    [
        ([0.298, 0.304], "number", 0.05),  # a 2% gap is a small part of the axis, not all of it
        ([0.00992, 0.00991], "duration", 0.01),
        ([0.001, 0.0012], "percent", 0.5),
    ],
)
def test_a_value_axis_holds_zero_so_a_gap_reads_at_its_size(
    values: list[float], display: str, most_height: float
) -> None:
    axis = axes.value_axis(values, display)
    assert axis is not None and axis.min == 0 and axis.max >= max(values)
    assert (max(values) - min(values)) / (axis.max - axis.min) <= most_height


@pytest.mark.parametrize(
    ("values", "display", "unit", "labels"),
    [
        ([0.00992, 0.00991], "duration", "s", ("0.0 ms", "2.5 ms", "5.0 ms", "7.5 ms", "10.0 ms")),
        ([0.001, 0.0012], "percent", "", ("0.00%", "0.05%", "0.10%", "0.15%")),
        ([0.0], "percent", "", ("0.00%", "0.25%", "0.50%", "0.75%", "1.00%")),
        ([2.5], "duration", "s", ("0 s", "1 s", "2 s", "3 s")),
        ([1234.5, 1300.0], "number", "tokens/s", ("0 tok/s", "500 tok/s", "1,000 tok/s", "1,500 tok/s")),
        ([-0.2, 0.5], "number", "req/s", ("-0.2/s", "0.0/s", "0.2/s", "0.4/s", "0.6/s")),
        ([5.0], "times", "", ("0×", "2×", "4×", "6×")),
    ],
)
def test_tick_labels_are_round_and_never_repeat(
    values: list[float], display: str, unit: str, labels: tuple[str, ...]
) -> None:
    axis = axes.value_axis(values, display, unit)
    assert axis is not None and axis.labels == labels
    assert len(set(axis.labels)) == len(axis.labels)


@pytest.mark.parametrize("top", [1e-6, 3.3e-4, 0.0123, 0.998, 7.77, 42.0, 999.0, 123456.0])
@pytest.mark.parametrize("display", ["duration", "percent", "times", "number"])
def test_no_two_ticks_read_the_same_at_any_magnitude(top: float, display: str) -> None:
    axis = axes.value_axis([top * 0.99, top], display)
    assert axis is not None and len(set(axis.labels)) == len(axis.labels) == len(axis.ticks), axis
    assert axis.ticks[0] <= 0 < top <= axis.ticks[-1]


def test_no_values_no_axis() -> None:
    assert axes.value_axis([None, float("nan")], "number") is None
