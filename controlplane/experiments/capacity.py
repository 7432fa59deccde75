"""Serving capacity: the highest arrival rate at which at least 90% of the
requests meet both the TTFT and the TPOT objective (Sarathi-Serve's and
DistServe's figure). Pure: dataclasses in and out, no Django.

Design note. An arm's rate ramp replays the workload at rising multiples of
its recorded rate, one point a rate. A point *holds* when it served
requests and their SLO attainment (the share meeting both objectives,
failed requests counted as missing them) is at least the target. The
capacity is the highest rate of the points that hold below the lowest rate
that does not: a lucky point above a failed one does not count, since a
server that misses at 2 req/s is not trusted at 3. The ramp stops at the
first point that does not hold; when even the lowest rate fails, the
capacity is 0 (below the ramp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class RampPoint:
    rate: float  # requests per second offered
    attainment: float  # share of the requests that met both objectives
    num_requests: int

    def holds(self, target: float = ATTAINMENT_TARGET) -> bool:
        return self.num_requests > 0 and self.attainment >= target

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RampPoint:
        return cls(float(data["rate"]), float(data["attainment"]), int(data["num_requests"]))


def serving_capacity(points: Sequence[RampPoint], target: float = ATTAINMENT_TARGET) -> float | None:
    """The capacity the points show (see the design note); None with no point."""
    if not points:
        return None
    capacity = 0.0
    for point in sorted(points, key=lambda p: p.rate):
        if not point.holds(target):
            break
        capacity = point.rate
    return capacity


def ramp_finished(points: Sequence[RampPoint], num_rates: int, target: float = ATTAINMENT_TARGET) -> bool:
    """True when the ramp has nothing left to measure: every rate taken, or a
    point that does not hold (no higher rate can raise the capacity)."""
    return len(points) >= num_rates or any(not p.holds(target) for p in points)
