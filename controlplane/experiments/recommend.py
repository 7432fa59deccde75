"""Which arm of an experiment to roll out, and why; or that none can be
named. Pure: dataclasses in and out, no Django.

Design note. Every arm replays the same seeded requests in each repeat
(repeat ``r`` of every arm is one arrival and length sequence), so two arms
are compared **pair by pair**: the difference of their figures in repeat 0,
in repeat 1, and so on. The spread is a bootstrap confidence interval of
the mean of those paired differences (seeded, so one input gives one
answer); load that differs between repeats cancels out of it.

First, arms that failed, broke an objective (TTFT P99, TPOT P99, stall P99
over the objective, on the mean over repeats) or ran under conditions
unlike the workload's (``not_comparable``) are set aside, each named with
why. Every arm is set beside the baseline (the pools' current profile
unless the operator named another): its paired difference on the score,
with the interval. Then, among the rest:

* fewer than ``min_repeats`` repeats: no winner. One repeat has no spread,
  so "0.304 req/s against 0.303" says nothing; the answer names the best
  measured and says what a winner would need;
* the best score wins when its paired difference against every other
  contender has an interval clear of zero and is at least ``min_effect``
  (5%) of that contender's score: a consistent 1% is not worth a rollout,
  and two arms that behave alike (a chunk cap that never splits a prompt
  against monolithic) must come out alike, not by the luck of the clock;
* otherwise, among those it cannot be told from, throughput decides under
  the same rule;
* otherwise **no significant winner**, a first-class outcome: the arms
  that could not be told apart are named, and the baseline is kept.

The score is serving capacity when every contender measured it in every
repeat, else goodput (requests/s that met both the TTFT and the TPOT
objective).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

DEFAULT_REPEATS = 3
MIN_REPEATS = 2  # pairs below this have no interval
MIN_EFFECT = 0.05  # a winner is at least this much better (relative) than each arm it beats
CONFIDENCE = 0.95
NUM_RESAMPLES = 2000


class Outcome(StrEnum):
    WINNER = "winner"
    NO_SIGNIFICANT_WINNER = "no_significant_winner"
    NEEDS_REPEATS = "needs_repeats"
    NONE_MET = "none_met"  # every arm failed, broke an objective or was not comparable

    @property
    def label(self) -> str:
        return {
            Outcome.WINNER: "winner",
            Outcome.NO_SIGNIFICANT_WINNER: "no significant winner",
            Outcome.NEEDS_REPEATS: "needs more repeats",
            Outcome.NONE_MET: "no arm qualifies",
        }[self]


@dataclass(frozen=True)
class Objectives:
    ttft_p99_seconds: float
    tpot_p99_seconds: float
    stall_p99_seconds: float | None = None


@dataclass(frozen=True)
class ArmFigures:
    """One arm's figures, one value per repeat, in repeat order (value ``r``
    of every arm is from the same requests)."""

    name: str
    goodput: Sequence[float] = ()
    throughput: Sequence[float] = ()
    ttft_p99_seconds: Sequence[float] = ()
    tpot_p99_seconds: Sequence[float] = ()
    stall_p99_seconds: Sequence[float] = ()
    capacity: Sequence[float] = ()  # empty: not measured
    failed: str = ""  # why the arm produced no figures
    not_comparable: str = ""  # why its conditions were not the workload's


@dataclass(frozen=True)
class Difference:
    """Mean of the paired differences (a − b) and its bootstrap interval."""

    mean: float
    low: float
    high: float
    num_pairs: int

    @property
    def significant(self) -> bool:
        return self.num_pairs >= MIN_REPEATS and (self.low > 0 or self.high < 0)

    def to_json(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "num_pairs": self.num_pairs}


def paired_difference(
    a: Sequence[float], b: Sequence[float], *, seed: int = 0, num_resamples: int = NUM_RESAMPLES
) -> Difference:
    """a − b repeat by repeat; the percentile bootstrap interval of the mean
    (``CONFIDENCE``), seeded. One pair: the interval is the value itself,
    and never significant."""
    diffs = [x - y for x, y in zip(a, b, strict=False)]
    if not diffs:
        return Difference(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(diffs)
    if len(diffs) < MIN_REPEATS:
        return Difference(mean, mean, mean, len(diffs))
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(statistics.fmean(rng.choices(diffs, k=n)) for _ in range(num_resamples))
    tail = (1 - CONFIDENCE) / 2
    low = means[int(math.floor(tail * (num_resamples - 1)))]
    high = means[int(math.ceil((1 - tail) * (num_resamples - 1)))]
    return Difference(mean, low, high, n)


@dataclass(frozen=True)
class Recommendation:
    winner: str | None
    basis: str  # "capacity" or "goodput"
    reasons: tuple[str, ...]
    broke: dict[str, list[str]] = field(default_factory=dict)  # arm → what it broke (or why it failed)
    tied: tuple[str, ...] = ()  # the arms that could not be told apart, best first
    outcome: Outcome = Outcome.WINNER
    baseline: str | None = None
    versus_baseline: dict[str, Difference] = field(default_factory=dict)  # arm → (arm − baseline) on the basis

    def to_json(self) -> dict[str, object]:
        return {
            "winner": self.winner,
            "outcome": self.outcome.value,
            "outcome_label": self.outcome.label,
            "basis": self.basis,
            "reasons": list(self.reasons),
            "broke": self.broke,
            "tied": list(self.tied),
            "baseline": self.baseline,
            "versus_baseline": {name: d.to_json() for name, d in self.versus_baseline.items()},
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


def _interval(d: Difference, unit: str) -> str:
    return (
        f"{d.mean:+.3g} {unit} (95% interval {d.low:+.3g} to {d.high:+.3g}, "
        f"{d.num_pairs} paired repeat{'s' if d.num_pairs != 1 else ''})"
    )


def recommend(
    arms: Sequence[ArmFigures],
    objectives: Objectives,
    *,
    baseline: str | None = None,
    seed: int = 0,
    min_repeats: int = MIN_REPEATS,
    min_effect: float = MIN_EFFECT,
) -> Recommendation:
    """See the design note. ``baseline``: the arm the others are set
    beside (default: the one named "baseline", else the first)."""
    names = [a.name for a in arms]
    if baseline not in names:
        baseline = "baseline" if "baseline" in names else (names[0] if names else None)

    # First, set aside what cannot win.
    broke: dict[str, list[str]] = {}
    for arm in arms:
        if arm.failed:
            broke[arm.name] = [f"failed: {arm.failed}"]
            continue
        problems = violations(arm, objectives)
        if arm.not_comparable:
            problems.append(f"not comparable: {arm.not_comparable}")
        if problems:
            broke[arm.name] = problems
    contenders = [a for a in arms if a.name not in broke]
    broke_reasons = tuple(
        f"{name} {why[0]}"
        if why[0].startswith(("failed", "not comparable"))
        else f"{name} broke an objective: {'; '.join(why)}"
        for name, why in broke.items()
    )
    basis = "capacity" if contenders and all(len(a.capacity) >= min_repeats for a in contenders) else "goodput"
    unit = "req/s"

    def score(a: ArmFigures) -> Sequence[float]:
        return a.capacity if basis == "capacity" else a.goodput

    # Every arm beside the baseline.
    base = next((a for a in arms if a.name == baseline), None)
    versus = {
        a.name: paired_difference(score(a), score(base), seed=seed)
        for a in arms
        if base is not None and a.name != base.name and not a.failed and score(a) and score(base)
    }

    def result(
        winner: str | None, outcome: Outcome, reasons: tuple[str, ...], tied: tuple[str, ...] = ()
    ) -> Recommendation:
        return Recommendation(winner, basis, (*reasons, *broke_reasons), broke, tied, outcome, baseline, versus)

    if not contenders:
        return result(None, Outcome.NONE_MET, ("no arm met every objective; none is recommended",))

    def mean(values: Sequence[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    ranked = sorted(contenders, key=lambda a: (mean(score(a)), mean(a.throughput)), reverse=True)
    best = ranked[0]
    repeats = min(len(score(a)) for a in contenders)
    if repeats < min_repeats:
        runner = f"; next {ranked[1].name} at {mean(score(ranked[1])):.3g} {unit}" if len(ranked) > 1 else ""
        return result(
            None,
            Outcome.NEEDS_REPEATS,
            (
                f"no winner from {repeats} repeat{'s' if repeats != 1 else ''}: a difference needs a confidence "
                f"interval, which needs at least {min_repeats} paired repeats ({DEFAULT_REPEATS} recommended). "
                f"Measured best: {best.name} at {mean(score(best)):.3g} ± 0 {unit}{runner}",
            ),
        )
    if len(ranked) == 1:
        return result(
            best.name,
            Outcome.WINNER,
            (f"{best.name} is the only arm that met every objective: {mean(score(best)):.3g} {unit} of {basis}",),
        )

    # The best score wins when it is clear of every other contender.
    def clear(d: Difference, other: Sequence[float]) -> bool:
        return d.significant and abs(d.mean) >= min_effect * abs(mean(other))

    gaps = {a.name: paired_difference(score(best), score(a), seed=seed) for a in ranked[1:]}
    near = [a for a in ranked[1:] if not clear(gaps[a.name], score(a))]
    keep = " (the current profile: keep it)" if best.name == baseline else ""
    if not near:
        second = ranked[1]
        return result(
            best.name,
            Outcome.WINNER,
            (
                f"{best.name} has the highest {basis}{keep}: {mean(score(best)):.3g} {unit}; against the next, "
                f"{second.name}: {_interval(gaps[second.name], unit)}",
            ),
        )
    # Within each other's interval on the score: throughput, under the same rule.
    group = [best, *near]
    by_throughput = sorted(group, key=lambda a: mean(a.throughput), reverse=True)
    top = by_throughput[0]
    t_gaps = {a.name: paired_difference(top.throughput, a.throughput, seed=seed) for a in by_throughput[1:]}
    if all(clear(t_gaps[a.name], a.throughput) for a in by_throughput[1:]):
        second = by_throughput[1]
        return result(
            top.name,
            Outcome.WINNER,
            (
                f"{', '.join(a.name for a in group)} cannot be told apart on {basis}; {top.name} has the highest "
                f"throughput: {mean(top.throughput):.4g} tok/s; against {second.name}: "
                f"{_interval(t_gaps[second.name], 'tok/s')}",
            ),
        )
    tied = tuple(a.name for a in group)
    return result(
        None,
        Outcome.NO_SIGNIFICANT_WINNER,
        (
            f"no significant winner: the paired differences of {', '.join(tied)} on {basis} and on throughput have "
            f"95% intervals that include zero, or are under {min_effect:.0%}, over {repeats} repeats; "
            + (f"keep {baseline}" if any(a.name == baseline for a in contenders) else "none is clearly better")
            + ", or run more repeats or longer arms to tell them apart",
        ),
        tied,
    )
