"""Serving capacity from a ramp's measured points, as a pure function with
table tests: the highest rate whose point holds (at least 90% of the
requests met both objectives) below the lowest rate that does not."""

from __future__ import annotations

import pytest

from controlplane.experiments.capacity import RampPoint, ramp_finished, serving_capacity


def points(*rows: tuple[float, float]) -> list[RampPoint]:
    return [RampPoint(rate, attainment, 20) for rate, attainment in rows]


@pytest.mark.parametrize(
    ("measured", "capacity"),
    [
        pytest.param([], None, id="no point: not measured"),
        pytest.param(points((1, 1.0), (2, 0.95), (4, 0.6)), 2.0, id="the last rate that holds before one that misses"),
        pytest.param(points((1, 1.0), (2, 0.9), (4, 0.89)), 2.0, id="90% exactly holds; 89% does not"),
        pytest.param(points((1, 1.0), (2, 0.97), (4, 0.92)), 4.0, id="every rate holds: the highest"),
        pytest.param(points((1, 0.5), (2, 0.95)), 0.0, id="the lowest rate misses: below the ramp"),
        pytest.param(points((1, 1.0), (2, 0.5), (4, 0.95)), 1.0, id="a lucky point above a miss does not count"),
        pytest.param(points((4, 0.5), (1, 1.0), (2, 0.93)), 2.0, id="points in any order"),
        pytest.param([RampPoint(1, 1.0, 20), RampPoint(2, 1.0, 0)], 1.0, id="a point that served nothing misses"),
    ],
)
def test_serving_capacity(measured: list[RampPoint], capacity: float | None) -> None:
    assert serving_capacity(measured) == capacity


@pytest.mark.parametrize(
    ("measured", "num_rates", "finished"),
    [
        pytest.param([], 3, False, id="nothing taken yet"),
        pytest.param(points((1, 1.0), (2, 0.95)), 3, False, id="every point so far holds: go on"),
        pytest.param(points((1, 1.0), (2, 0.5)), 3, True, id="a miss ends the ramp"),
        pytest.param(points((1, 1.0), (2, 0.95), (4, 0.92)), 3, True, id="every rate taken"),
    ],
)
def test_the_ramp_stops_at_the_first_miss_or_the_last_rate(
    measured: list[RampPoint], num_rates: int, finished: bool
) -> None:
    assert ramp_finished(measured, num_rates) is finished


def test_a_custom_target() -> None:
    measured = points((1, 1.0), (2, 0.8), (4, 0.6))
    assert serving_capacity(measured, target=0.75) == 2.0
    assert serving_capacity(measured, target=0.99) == 1.0
