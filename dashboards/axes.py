"""Chart axes that do not lie about magnitude, computed with the chart's data
so that the browser only draws them (metrics.js, experiments.js).

uPlot scales an axis to its data: one point spans years of time, and two
lines 1% apart fill the plot from top to bottom, so a small difference reads
as a cliff. Here a value axis always holds zero (a figure's difference then
reads as its share of the whole), its ticks are round steps, and each tick
label carries as many decimals as its step needs, so no two labels read the
same. A time axis over one instant spans a minute either side of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

NUM_TICKS = 5
# A time axis over a single instant: this much either side of it.
LONE_POINT_PAD_SECONDS = 60.0
# The span of an axis whose values are all zero, per display kind.
_ZERO_SPAN = {"duration": 0.001, "percent": 0.01, "times": 1.0}
_NICE_STEPS = (1.0, 2.0, 2.5, 5.0, 10.0)
_MAX_DECIMALS = 9


@dataclass(frozen=True)
class Axis:
    """A value axis: its range, its ticks and their labels."""

    min: float
    max: float
    ticks: tuple[float, ...]
    labels: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def nice_step(raw_step: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at least ``raw_step``."""
    power = 10.0 ** math.floor(math.log10(raw_step))
    return next(m * power for m in _NICE_STEPS if m * power >= raw_step * (1 - 1e-9))


def decimals(step: float) -> int:
    """How many decimals tell multiples of ``step`` apart."""
    for d in range(_MAX_DECIMALS + 1):
        scaled = step * 10**d
        if abs(scaled - round(scaled)) < 1e-6 * scaled:
            return d
    return _MAX_DECIMALS


def _suffix(unit: str) -> str:
    if unit == "tokens/s":
        return " tok/s"
    return "/s" if unit.endswith("/s") else ""


def tick_labels(ticks: Sequence[float], step: float, display: str, unit: str) -> tuple[str, ...]:
    """Each tick in the chart's unit, with the decimals its step needs."""
    top = max((abs(t) for t in ticks), default=0.0)
    if display == "duration":
        scale, suffix = (1000.0, " ms") if top < 1 else (1.0, " s")
    elif display == "percent":
        scale, suffix = 100.0, "%"
    elif display == "times":
        scale, suffix = 1.0, "×"
    else:
        scale, suffix = 1.0, _suffix(unit)
    d = decimals(step * scale)
    return tuple(f"{t * scale:,.{d}f}{suffix}" for t in ticks)


def value_axis(values: Iterable[float | None], display: str, unit: str = "") -> Axis | None:
    """An axis from zero to past the largest value (or from below the
    smallest, when one is negative), in round steps; None without values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    low, high = min(0.0, min(finite)), max(0.0, max(finite))
    if low == high:
        high = _ZERO_SPAN.get(display, 1.0)
    step = nice_step((high - low) / (NUM_TICKS - 1))
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    ticks = tuple(round(i * step, 12) for i in range(first, last + 1))
    return Axis(ticks[0], ticks[-1], ticks, tick_labels(ticks, step, display, unit))


def time_range(times: Sequence[float]) -> tuple[float, float] | None:
    """The x range of a time axis: the data's own, or a minute either side of a lone instant."""
    if not times:
        return None
    low, high = min(times), max(times)
    if low == high:
        return (low - LONE_POINT_PAD_SECONDS, high + LONE_POINT_PAD_SECONDS)
    return (low, high)


def log_range(xs: Sequence[float]) -> tuple[float, float] | None:
    """The x range of a log axis (chunk sizes): the data's own, or a factor
    of two either side of a lone point."""
    positive = [x for x in xs if x > 0]
    if not positive:
        return None
    low, high = min(positive), max(positive)
    if low == high:
        return (low / 2, high * 2)
    return (low, high)


def with_axes(chart: dict[str, Any]) -> dict[str, Any]:
    """A time chart's payload (``times``, ``lines``, ``display``, ``unit``)
    with its value axis and x range added, for metrics.js."""
    axis = value_axis((v for line in chart["lines"] for v in line["values"]), chart["display"], chart["unit"])
    chart["y_axis"] = axis.to_json() if axis else None
    chart["x_range"] = time_range(chart["times"])
    return chart
