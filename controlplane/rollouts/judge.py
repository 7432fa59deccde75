"""The canary judge and the analysis-run bookkeeping. Pure: no Django, no I/O.

Design note. An analysis compares the canary pool with a baseline (the
baseline pool if the rollout has one, else the stable pool) over a window,
metric by metric, the way Argo Rollouts' AnalysisRun does:

* ``judge(rule, sample)`` turns one metric's numbers into a verdict.
  Too few samples, or no data, is *inconclusive*, never failed. A latency
  metric fails when the canary is worse than the baseline by more than its
  ratio allows *and* by more than its absolute floor (so 2 ms against 1 ms
  is not a 2× regression). The error rate is tested as two proportions: it
  fails only when the canary's excess is above the floor and significant.
* A measurement round judges every metric once; each metric keeps Argo's
  counters (successful, failed, inconclusive, error, consecutive errors).
* ``assess_metric``/``assess_run`` apply the limits: more failures than
  ``failure_limit`` fails the metric, more inconclusives than
  ``inconclusive_limit`` makes it inconclusive, more consecutive errors
  than ``consecutive_error_limit`` errs it; reaching ``count`` measurements
  succeeds it. The run takes the worst completed metric as soon as one
  completes badly (Argo terminates the run then), else succeeds when all do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import IntEnum, StrEnum
from typing import Any

from controlplane.metrics.figures import Direction


class AnalysisPhase(IntEnum):
    """Ordered from best to worst once completed (Argo's ``IsWorse`` order):
    ``phase >= SUCCESSFUL`` means completed; ``max()`` is the worst."""

    PENDING = 0
    RUNNING = 1
    SUCCESSFUL = 2
    INCONCLUSIVE = 3
    ERROR = 4
    FAILED = 5

    @property
    def completed(self) -> bool:
        return self >= AnalysisPhase.SUCCESSFUL

    @property
    def label(self) -> str:
        return self.name.lower()


class Check(StrEnum):
    RATIO = "ratio"
    ERROR_RATE = "error_rate"
    # The canary's hung streams (silent now, or ended by the idle timeout)
    # against ``floor``, the number allowed: a count, judged without a
    # minimum sample, because a wedged scheduler may finish nothing at all.
    HANGING = "hanging"


@dataclass(frozen=True)
class MetricRule:
    """How one metric is judged. ``max_ratio`` is the worsening allowed
    (1.2: the canary may be up to 20% worse); ``floor`` is an absolute
    difference, in the figure's unit, below which nothing counts;
    ``min_samples`` is the requests each side needs for a verdict."""

    name: str
    figure: str
    direction: Direction = Direction.LOWER
    test: Check = Check.RATIO
    max_ratio: float = 1.2
    floor: float = 0.0
    min_samples: int = 20
    confidence: float = 0.95  # error-rate test only

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "figure": self.figure,
            "direction": self.direction.value,
            "test": self.test.value,
            "max_ratio": self.max_ratio,
            "floor": self.floor,
            "min_samples": self.min_samples,
            "confidence": self.confidence,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetricRule:
        return cls(
            name=data["name"],
            figure=data["figure"],
            direction=Direction(data.get("direction", "lower")),
            test=Check(data.get("test", "ratio")),
            max_ratio=float(data.get("max_ratio", 1.2)),
            floor=float(data.get("floor", 0.0)),
            min_samples=int(data.get("min_samples", 20)),
            confidence=float(data.get("confidence", 0.95)),
        )


@dataclass(frozen=True)
class Sample:
    """One metric's numbers for one measurement. ``error``: the query failed;
    ``unavailable``: the metrics backend (Prometheus) did not answer, which
    says nothing about the canary (inconclusive, never failed)."""

    canary: float | None
    baseline: float | None
    canary_samples: int
    baseline_samples: int
    error: str | None = None
    unavailable: str | None = None


@dataclass(frozen=True)
class MetricVerdict:
    phase: AnalysisPhase
    reason: str
    ratio: float | None = None  # > 1 means the canary is worse
    worse_by: float | None = None  # how much worse the canary is, in the figure's unit (< 0: better)
    z: float | None = None  # error-rate test statistic
    too_few_samples: bool = False  # inconclusive only for want of requests (a sample wait may measure on)

    def to_json(self, rule: MetricRule, sample: Sample) -> dict[str, Any]:
        return {
            "metric": rule.name,
            "figure": rule.figure,
            "phase": self.phase.label,
            "reason": self.reason,
            "canary": sample.canary,
            "baseline": sample.baseline,
            "canary_samples": sample.canary_samples,
            "baseline_samples": sample.baseline_samples,
            "ratio": _finite(self.ratio),
            "worse_by": _finite(self.worse_by),
            "z": _finite(self.z),
            "max_ratio": rule.max_ratio,
            "floor": rule.floor,
            "min_samples": rule.min_samples,
            "direction": rule.direction.value,
        }


def _finite(value: float | None) -> float | None:
    """JSON (and PostgreSQL's jsonb) has no infinity; the reason says it."""
    return value if value is not None and math.isfinite(value) else None


def judge(rule: MetricRule, sample: Sample) -> MetricVerdict:
    if sample.unavailable:
        return MetricVerdict(AnalysisPhase.INCONCLUSIVE, sample.unavailable)
    if sample.error:
        return MetricVerdict(AnalysisPhase.ERROR, f"measurement failed: {sample.error}")
    if rule.test is Check.HANGING:
        return _judge_hanging(rule, sample)
    short = [
        f"{side} has {n} < {rule.min_samples}"
        for side, n in (("canary", sample.canary_samples), ("baseline", sample.baseline_samples))
        if n < rule.min_samples
    ]
    if short:
        return MetricVerdict(AnalysisPhase.INCONCLUSIVE, "too few samples: " + ", ".join(short), too_few_samples=True)
    if sample.canary is None or sample.baseline is None:
        missing = "canary" if sample.canary is None else "baseline"
        return MetricVerdict(AnalysisPhase.INCONCLUSIVE, f"no data for the {missing}")
    if rule.test is Check.ERROR_RATE:
        return _judge_error_rate(rule, sample)
    return _judge_ratio(rule, sample.canary, sample.baseline)


def _judge_ratio(rule: MetricRule, canary: float, baseline: float) -> MetricVerdict:
    if rule.direction is Direction.LOWER:
        worse_by, worse, better = canary - baseline, canary, baseline
    else:
        worse_by, worse, better = baseline - canary, baseline, canary
    ratio = worse / better if better > 0 else (math.inf if worse > 0 else 1.0)
    if worse_by <= rule.floor:
        return MetricVerdict(
            AnalysisPhase.SUCCESSFUL, f"within the floor ({worse_by:+.4g} ≤ {rule.floor:g})", ratio, worse_by
        )
    if ratio > rule.max_ratio:
        return MetricVerdict(
            AnalysisPhase.FAILED,
            f"canary {ratio:.3g}× the baseline > {rule.max_ratio:g}× and worse by "
            f"{worse_by:.4g} > floor {rule.floor:g}",
            ratio,
            worse_by,
        )
    return MetricVerdict(
        AnalysisPhase.SUCCESSFUL, f"canary {ratio:.3g}× the baseline ≤ {rule.max_ratio:g}×", ratio, worse_by
    )


def _judge_hanging(rule: MetricRule, sample: Sample) -> MetricVerdict:
    hung = sample.canary or 0.0
    if hung > rule.floor:
        return MetricVerdict(
            AnalysisPhase.FAILED,
            f"{hung:g} canary streams hung (silent past GATEWAY_STREAM_SILENCE_SECONDS or ended by "
            f"GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS) > {rule.floor:g} allowed",
            worse_by=hung,
        )
    return MetricVerdict(
        AnalysisPhase.SUCCESSFUL, f"{hung:g} canary streams hung ≤ {rule.floor:g} allowed", worse_by=hung
    )


def _z_critical(confidence: float) -> float:
    """One-sided normal quantile by bisection on erf (no scipy)."""
    lo, hi = 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < confidence:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _judge_error_rate(rule: MetricRule, sample: Sample) -> MetricVerdict:
    """Two-proportion z-test, one-sided (is the canary's error rate higher?)."""
    assert sample.canary is not None and sample.baseline is not None
    n_c, n_b = sample.canary_samples, sample.baseline_samples
    p_c, p_b = sample.canary, sample.baseline
    worse_by = p_c - p_b
    ratio = p_c / p_b if p_b > 0 else (math.inf if p_c > 0 else 1.0)
    if worse_by <= rule.floor:
        return MetricVerdict(
            AnalysisPhase.SUCCESSFUL, f"error rate within the floor ({worse_by:+.4g} ≤ {rule.floor:g})", ratio, worse_by
        )
    pooled = (p_c * n_c + p_b * n_b) / (n_c + n_b)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_c + 1 / n_b))
    z = worse_by / se if se > 0 else math.inf
    critical = _z_critical(rule.confidence)
    if z >= critical:
        return MetricVerdict(
            AnalysisPhase.FAILED,
            f"canary errors {p_c:.2%} vs {p_b:.2%}: higher by {worse_by:.2%} > floor, z={z:.2f} ≥ {critical:.2f}",
            ratio,
            worse_by,
            z,
        )
    return MetricVerdict(
        AnalysisPhase.INCONCLUSIVE,
        f"canary errors {p_c:.2%} vs {p_b:.2%}: above the floor but not significant (z={z:.2f} < {critical:.2f})",
        ratio,
        worse_by,
        z,
    )


# ---- runs: counters, limits, schedule ---------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """An AnalysisTemplate as a run uses it (snapshotted when the run starts)."""

    metrics: tuple[MetricRule, ...]
    interval_seconds: float = 30.0
    count: int = 3
    initial_delay_seconds: float = 0.0
    window_seconds: float | None = None  # each measurement looks back this far; None: the interval
    failure_limit: int = 0
    inconclusive_limit: int = 0
    consecutive_error_limit: int = 2
    # Up to this long after the run starts, a measurement short of samples is
    # not counted: the next one looks back to the run's start, so low traffic
    # gathers its samples instead of pausing the rollout. 0: off (Argo's way).
    sample_wait_seconds: float = 0.0

    @property
    def lookback_seconds(self) -> float:
        return self.window_seconds or self.interval_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "metrics": [m.to_json() for m in self.metrics],
            "interval_seconds": self.interval_seconds,
            "count": self.count,
            "initial_delay_seconds": self.initial_delay_seconds,
            "window_seconds": self.window_seconds,
            "failure_limit": self.failure_limit,
            "inconclusive_limit": self.inconclusive_limit,
            "consecutive_error_limit": self.consecutive_error_limit,
            "sample_wait_seconds": self.sample_wait_seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        return cls(
            metrics=tuple(MetricRule.from_json(m) for m in data["metrics"]),
            interval_seconds=float(data.get("interval_seconds", 30.0)),
            count=int(data.get("count", 3)),
            initial_delay_seconds=float(data.get("initial_delay_seconds", 0.0)),
            window_seconds=None if data.get("window_seconds") is None else float(data["window_seconds"]),
            failure_limit=int(data.get("failure_limit", 0)),
            inconclusive_limit=int(data.get("inconclusive_limit", 0)),
            consecutive_error_limit=int(data.get("consecutive_error_limit", 2)),
            sample_wait_seconds=float(data.get("sample_wait_seconds", 0.0)),
        )

    def waits_for_samples(self, seconds_since_start: float) -> bool:
        return seconds_since_start < self.sample_wait_seconds

    def lookback_at(self, seconds_since_start: float) -> float:
        """How far a measurement looks back: the window, or while the run
        may wait for samples, everything since the run started."""
        if self.waits_for_samples(seconds_since_start):
            return max(self.lookback_seconds, seconds_since_start)
        return self.lookback_seconds


@dataclass(frozen=True)
class MetricResult:
    """Argo's per-metric counters. ``count`` excludes errors, as Argo's does."""

    count: int = 0
    successful: int = 0
    failed: int = 0
    inconclusive: int = 0
    error: int = 0
    consecutive_error: int = 0

    def add(self, phase: AnalysisPhase) -> MetricResult:
        if phase is AnalysisPhase.SUCCESSFUL:
            return replace(self, count=self.count + 1, successful=self.successful + 1, consecutive_error=0)
        if phase is AnalysisPhase.FAILED:
            return replace(self, count=self.count + 1, failed=self.failed + 1, consecutive_error=0)
        if phase is AnalysisPhase.INCONCLUSIVE:
            return replace(self, count=self.count + 1, inconclusive=self.inconclusive + 1, consecutive_error=0)
        if phase is AnalysisPhase.ERROR:
            return replace(self, error=self.error + 1, consecutive_error=self.consecutive_error + 1)
        raise ValueError(f"a measurement cannot be {phase.label}")

    def to_json(self) -> dict[str, int]:
        return {
            "count": self.count,
            "successful": self.successful,
            "failed": self.failed,
            "inconclusive": self.inconclusive,
            "error": self.error,
            "consecutive_error": self.consecutive_error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetricResult:
        return cls(**{k: int(data.get(k, 0)) for k in cls.__dataclass_fields__})


def assess_metric(spec: RunSpec, result: MetricResult) -> tuple[AnalysisPhase, str]:
    if result.failed > spec.failure_limit:
        return AnalysisPhase.FAILED, f"{result.failed} failed > failure limit {spec.failure_limit}"
    if result.inconclusive > spec.inconclusive_limit:
        return AnalysisPhase.INCONCLUSIVE, (
            f"{result.inconclusive} inconclusive > inconclusive limit {spec.inconclusive_limit}"
        )
    if result.consecutive_error > spec.consecutive_error_limit:
        return AnalysisPhase.ERROR, (
            f"{result.consecutive_error} consecutive errors > limit {spec.consecutive_error_limit}"
        )
    if result.count >= spec.count:
        return AnalysisPhase.SUCCESSFUL, f"{result.count} measurements taken"
    if result.count == 0 and result.error == 0:
        return AnalysisPhase.PENDING, "no measurement yet"
    return AnalysisPhase.RUNNING, f"{result.count} of {spec.count} measurements"


def assess_run(spec: RunSpec, results: dict[str, MetricResult]) -> tuple[AnalysisPhase, str]:
    """The run's phase: the worst metric that completed badly ends it at
    once; otherwise it succeeds when every metric has."""
    assessed = {m.name: assess_metric(spec, results.get(m.name, MetricResult())) for m in spec.metrics}
    bad = [
        (phase, f"{name}: {why}")
        for name, (phase, why) in assessed.items()
        if phase.completed and phase is not AnalysisPhase.SUCCESSFUL
    ]
    if bad:
        worst = max(phase for phase, _ in bad)
        return worst, "; ".join(why for phase, why in bad if phase is worst)
    if assessed and all(phase is AnalysisPhase.SUCCESSFUL for phase, _ in assessed.values()):
        return AnalysisPhase.SUCCESSFUL, f"all {len(assessed)} metrics passed"
    if not assessed:
        return AnalysisPhase.SUCCESSFUL, "no metrics to judge"
    started = any(phase is not AnalysisPhase.PENDING for phase, _ in assessed.values())
    return (AnalysisPhase.RUNNING if started else AnalysisPhase.PENDING), "measuring"


@dataclass(frozen=True)
class Round:
    """One measurement round's outcome: each metric's verdict, the new
    counters, and the run's phase after it."""

    verdicts: dict[str, MetricVerdict]
    results: dict[str, MetricResult]
    phase: AnalysisPhase
    message: str
    worst: AnalysisPhase = field(default=AnalysisPhase.SUCCESSFUL)
    counted: bool = True  # False: short of samples within the sample wait; the counters did not move


def take_round(
    spec: RunSpec, results: dict[str, MetricResult], samples: dict[str, Sample], seconds_since_start: float = math.inf
) -> Round:
    verdicts = {rule.name: judge(rule, samples[rule.name]) for rule in spec.metrics}
    worst = max((v.phase for v in verdicts.values()), default=AnalysisPhase.SUCCESSFUL)
    short = [name for name, v in verdicts.items() if v.too_few_samples]
    if short and spec.waits_for_samples(seconds_since_start):
        phase, _ = assess_run(spec, results)
        left = spec.sample_wait_seconds - seconds_since_start
        reasons = "; ".join(f"{name}: {verdicts[name].reason}" for name in short)
        return Round(
            verdicts,
            dict(results),
            phase,
            f"waiting for samples, {left:.0f} s more at most ({reasons})",
            worst,
            counted=False,
        )
    new_results = dict(results)
    for rule in spec.metrics:
        new_results[rule.name] = new_results.get(rule.name, MetricResult()).add(verdicts[rule.name].phase)
    phase, message = assess_run(spec, new_results)
    return Round(verdicts, new_results, phase, message, worst)


def next_measurement_at(spec: RunSpec, started_at: datetime, last_taken_at: datetime | None) -> datetime:
    if last_taken_at is None:
        return started_at + timedelta(seconds=spec.initial_delay_seconds)
    return last_taken_at + timedelta(seconds=spec.interval_seconds)
