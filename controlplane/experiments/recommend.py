"""Which arm of an experiment to roll out, and why. Pure: dataclasses in
and out, no Django.

Design note. An arm's score is its serving capacity when every contender
measured one, else its goodput (requests/s that met both the TTFT and the
TPOT objective). First, arms that failed or broke an objective (TTFT P99,
TPOT P99, stall P99 over the objective, each judged on the mean over
repeats) are set aside, each named with what it broke. Then the best
score wins, unless another arm's score is within the two arms' spread over
repeats: then throughput decides, under the same rule; and when that does
not separate them either, the answer is a tie, with no winner. One repeat
has no spread, so any difference decides.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Objectives:
    ttft_p99_seconds: float
    tpot_p99_seconds: float
    stall_p99_seconds: float | None = None


@dataclass(frozen=True)
class ArmFigures:
    """One arm's figures, one value per repeat."""

    name: str
    goodput: Sequence[float] = ()
    throughput: Sequence[float] = ()
    ttft_p99_seconds: Sequence[float] = ()
    tpot_p99_seconds: Sequence[float] = ()
    stall_p99_seconds: Sequence[float] = ()
    capacity: Sequence[float] = ()  # empty: not measured
    failed: str = ""  # why the arm produced no figures


@dataclass(frozen=True)
class Spread:
    mean: float
    half_range: float  # (max − min) / 2 over repeats; 0 for one repeat

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(0.0, 0.0)
        return cls(statistics.fmean(values), (max(values) - min(values)) / 2)

    def overlaps(self, other: Spread) -> bool:
        """Within each other's noise: the gap is at most the two half-ranges.
        With no spread on either side, only equal means overlap."""
        return abs(self.mean - other.mean) <= self.half_range + other.half_range


@dataclass(frozen=True)
class Recommendation:
    winner: str | None
    basis: str  # "capacity" or "goodput"
    reasons: tuple[str, ...]
    broke: dict[str, list[str]] = field(default_factory=dict)  # arm → what it broke (or why it failed)
    tied: tuple[str, ...] = ()  # the arms that could not be told apart, best first

    def to_json(self) -> dict[str, object]:
        return {
            "winner": self.winner,
            "basis": self.basis,
            "reasons": list(self.reasons),
            "broke": self.broke,
            "tied": list(self.tied),
        }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def violations(arm: ArmFigures, objectives: Objectives) -> list[str]:
    out = []
    checks = (
        ("TTFT P99", arm.ttft_p99_seconds, objectives.ttft_p99_seconds),
        ("TPOT P99", arm.tpot_p99_seconds, objectives.tpot_p99_seconds),
        ("stall P99", arm.stall_p99_seconds, objectives.stall_p99_seconds),
    )
    for label, values, limit in checks:
        if limit is not None and values and (value := statistics.fmean(values)) > limit:
            out.append(f"{label} {_ms(value)} > objective {_ms(limit)}")
    return out


def recommend(arms: Sequence[ArmFigures], objectives: Objectives) -> Recommendation:
    broke: dict[str, list[str]] = {}
    for arm in arms:
        if arm.failed:
            broke[arm.name] = [f"failed: {arm.failed}"]
        elif problems := violations(arm, objectives):
            broke[arm.name] = problems
    contenders = [a for a in arms if a.name not in broke]
    broke_reasons = tuple(
        f"{name} broke an objective: {'; '.join(why)}" if not why[0].startswith("failed") else f"{name} {why[0]}"
        for name, why in broke.items()
    )
    if not contenders:
        return Recommendation(
            None, "goodput", ("no arm met every objective; none is recommended", *broke_reasons), broke
        )
    basis = "capacity" if all(a.capacity for a in contenders) else "goodput"

    def score(a: ArmFigures) -> Spread:
        return Spread.of(a.capacity if basis == "capacity" else a.goodput)

    def throughput(a: ArmFigures) -> Spread:
        return Spread.of(a.throughput)

    ranked = sorted(contenders, key=lambda a: (score(a).mean, throughput(a).mean), reverse=True)
    best = ranked[0]
    near = [a for a in ranked if score(a).overlaps(score(best))]
    unit = "req/s"
    if len(near) == 1:
        runner = f"; next {ranked[1].name} at {score(ranked[1]).mean:.3g} {unit}" if len(ranked) > 1 else ""
        return Recommendation(
            best.name,
            basis,
            (
                f"{best.name} has the highest {basis}: {score(best).mean:.3g} ± {score(best).half_range:.2g} {unit}"
                f"{runner}",
                *broke_reasons,
            ),
            broke,
        )
    # Within each other's noise on the score: throughput breaks the tie.
    by_throughput = sorted(near, key=lambda a: throughput(a).mean, reverse=True)
    top = by_throughput[0]
    still = [a for a in by_throughput if throughput(a).overlaps(throughput(top))]
    names = ", ".join(a.name for a in near)
    if len(still) == 1:
        return Recommendation(
            top.name,
            basis,
            (
                f"{names} are within their spread on {basis}; {top.name} has the highest throughput: "
                f"{throughput(top).mean:.4g} tok/s",
                *broke_reasons,
            ),
            broke,
        )
    tied = tuple(a.name for a in still)
    return Recommendation(
        None,
        basis,
        (
            f"no winner: {', '.join(tied)} differ by less than their spread over repeats on {basis} and on "
            "throughput; run more repeats or longer arms to tell them apart",
            *broke_reasons,
        ),
        broke,
        tied,
    )
