"""The canary judge and Argo's analysis-run bookkeeping, as tables. Pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from controlplane.rollouts.judge import (
    AnalysisPhase as P,
)
from controlplane.rollouts.judge import (
    Check,
    Direction,
    MetricResult,
    MetricRule,
    RunSpec,
    Sample,
    assess_metric,
    assess_run,
    judge,
    next_measurement_at,
    take_round,
)

TTFT = MetricRule("ttft", "client_ttft_p99", Direction.LOWER, Check.RATIO, max_ratio=1.2, floor=0.05, min_samples=20)
THROUGHPUT = MetricRule(
    "tput", "client_requests_per_second", Direction.HIGHER, Check.RATIO, max_ratio=1.25, floor=0.5, min_samples=20
)
ERRORS = MetricRule("errors", "error_rate", Direction.LOWER, Check.ERROR_RATE, floor=0.01, min_samples=20)


@pytest.mark.parametrize(
    ("rule", "sample", "phase", "why"),
    [
        # latency, lower is better
        (TTFT, Sample(0.50, 0.48, 100, 100), P.SUCCESSFUL, "within the floor"),
        (TTFT, Sample(0.57, 0.50, 100, 100), P.SUCCESSFUL, "1.14× the baseline ≤ 1.2×"),
        (TTFT, Sample(0.80, 0.50, 100, 100), P.FAILED, "1.6× the baseline > 1.2×"),
        # 3× worse, but 20 ms: under the absolute floor, so it does not count
        (TTFT, Sample(0.030, 0.010, 100, 100), P.SUCCESSFUL, "within the floor"),
        # better is always fine
        (TTFT, Sample(0.20, 0.50, 100, 100), P.SUCCESSFUL, "within the floor"),
        # too few samples is inconclusive, never failed, however bad it looks
        (TTFT, Sample(9.0, 0.50, 19, 100), P.INCONCLUSIVE, "canary has 19 < 20"),
        (TTFT, Sample(9.0, 0.50, 100, 3), P.INCONCLUSIVE, "baseline has 3 < 20"),
        (TTFT, Sample(None, 0.50, 100, 100), P.INCONCLUSIVE, "no data for the canary"),
        (TTFT, Sample(0.5, None, 100, 100), P.INCONCLUSIVE, "no data for the baseline"),
        (TTFT, Sample(None, None, 0, 0, error="QueryError: window"), P.ERROR, "measurement failed"),
        # a baseline of zero: any worsening past the floor is an infinite ratio
        (TTFT, Sample(0.2, 0.0, 100, 100), P.FAILED, "canary inf× the baseline"),
        # throughput, higher is better
        (THROUGHPUT, Sample(9.0, 10.0, 100, 100), P.SUCCESSFUL, "1.11× the baseline ≤ 1.25×"),
        (THROUGHPUT, Sample(9.7, 10.0, 100, 100), P.SUCCESSFUL, "within the floor"),
        (THROUGHPUT, Sample(7.0, 10.0, 100, 100), P.FAILED, "1.43× the baseline > 1.25×"),
        (THROUGHPUT, Sample(20.0, 10.0, 100, 100), P.SUCCESSFUL, "within the floor"),
        # error rate: two proportions
        (ERRORS, Sample(0.0, 0.0, 200, 200), P.SUCCESSFUL, "within the floor"),
        (ERRORS, Sample(0.015, 0.010, 200, 200), P.SUCCESSFUL, "within the floor"),
        (ERRORS, Sample(0.20, 0.0, 200, 200), P.FAILED, "z="),
        (ERRORS, Sample(0.05, 0.0, 40, 40), P.INCONCLUSIVE, "not significant"),
        (ERRORS, Sample(1.0, 0.0, 5, 500), P.INCONCLUSIVE, "canary has 5 < 20"),
    ],
)
def test_judge_compares_canary_with_baseline(rule: MetricRule, sample: Sample, phase: P, why: str) -> None:
    verdict = judge(rule, sample)
    assert verdict.phase is phase, verdict.reason
    assert why in verdict.reason


def test_a_verdict_keeps_the_numbers_behind_it() -> None:
    sample = Sample(0.80, 0.50, 120, 130)
    data = judge(TTFT, sample).to_json(TTFT, sample)
    assert data["canary"] == 0.80 and data["baseline"] == 0.50
    assert data["canary_samples"] == 120 and data["baseline_samples"] == 130
    assert data["ratio"] == pytest.approx(1.6) and data["worse_by"] == pytest.approx(0.30)
    assert data["phase"] == "failed" and data["max_ratio"] == 1.2 and data["floor"] == 0.05


def test_an_infinite_ratio_is_stored_as_null_with_its_reason() -> None:
    sample = Sample(0.2, 0.0, 100, 100)
    data = judge(TTFT, sample).to_json(TTFT, sample)
    assert data["ratio"] is None and "inf" in data["reason"]


SPEC = RunSpec(
    metrics=(TTFT, ERRORS),
    interval_seconds=10,
    count=3,
    failure_limit=0,
    inconclusive_limit=1,
    consecutive_error_limit=2,
)


@pytest.mark.parametrize(
    ("result", "phase"),
    [
        (MetricResult(), P.PENDING),
        (MetricResult(count=1, successful=1), P.RUNNING),
        (MetricResult(count=3, successful=3), P.SUCCESSFUL),
        (MetricResult(count=1, failed=1), P.FAILED),  # failure limit 0
        (MetricResult(count=1, inconclusive=1), P.RUNNING),  # inconclusive limit 1
        (MetricResult(count=2, inconclusive=2), P.INCONCLUSIVE),
        (MetricResult(count=3, successful=2, inconclusive=1), P.SUCCESSFUL),
        (MetricResult(error=2, consecutive_error=2), P.RUNNING),
        (MetricResult(error=3, consecutive_error=3), P.ERROR),
        (MetricResult(count=2, successful=2, error=5, consecutive_error=0), P.RUNNING),
    ],
)
def test_metric_assessment_applies_argo_limits(result: MetricResult, phase: P) -> None:
    assert assess_metric(SPEC, result)[0] is phase


def test_a_failed_metric_ends_the_run_even_while_others_measure() -> None:
    results = {"ttft": MetricResult(count=1, failed=1), "errors": MetricResult(count=1, successful=1)}
    phase, message = assess_run(SPEC, results)
    assert phase is P.FAILED and message.startswith("ttft:")


def test_the_worst_completed_metric_decides_the_run() -> None:
    results = {"ttft": MetricResult(count=2, inconclusive=2), "errors": MetricResult(error=3, consecutive_error=3)}
    assert assess_run(SPEC, results)[0] is P.ERROR


def test_rounds_count_until_every_metric_has_its_count() -> None:
    good = {"ttft": Sample(0.5, 0.5, 50, 50), "errors": Sample(0.0, 0.0, 50, 50)}
    results: dict[str, MetricResult] = {}
    phases = []
    for _ in range(3):
        outcome = take_round(SPEC, results, good)
        results = outcome.results
        phases.append(outcome.phase)
    assert phases == [P.RUNNING, P.RUNNING, P.SUCCESSFUL]
    assert results["ttft"] == MetricResult(count=3, successful=3)


def test_an_error_round_resets_after_a_good_one() -> None:
    broken = {name: Sample(None, None, 0, 0, error="db away") for name in ("ttft", "errors")}
    good = {"ttft": Sample(0.5, 0.5, 50, 50), "errors": Sample(0.0, 0.0, 50, 50)}
    outcome = take_round(SPEC, {}, broken)
    assert outcome.worst is P.ERROR and outcome.phase is P.RUNNING
    outcome = take_round(SPEC, outcome.results, good)
    assert outcome.results["ttft"].consecutive_error == 0 and outcome.results["ttft"].error == 1


def test_measurements_follow_the_initial_delay_then_the_interval() -> None:
    spec = RunSpec(metrics=(TTFT,), interval_seconds=15, initial_delay_seconds=30)
    with time_machine.travel(datetime(2026, 3, 1, 12, 0, tzinfo=UTC), tick=False) as clock:
        started = datetime.now(UTC)
        assert next_measurement_at(spec, started, None) == started + timedelta(seconds=30)
        clock.shift(31)
        taken = datetime.now(UTC)
        assert next_measurement_at(spec, started, taken) == taken + timedelta(seconds=15)


def test_specs_and_counters_survive_json() -> None:
    assert RunSpec.from_json(SPEC.to_json()) == SPEC
    result = MetricResult(count=2, successful=1, failed=1, error=1, consecutive_error=1)
    assert MetricResult.from_json(result.to_json()) == result


HANGING = MetricRule("hanging", "timed_out_streams", Direction.LOWER, Check.HANGING, floor=0.0, min_samples=20)


@pytest.mark.parametrize(
    "sample, phase, words",
    [
        # One hung canary stream fails at once, however few requests finished.
        (Sample(1.0, 0.0, 0, 0), P.FAILED, "1 canary streams hung"),
        (Sample(3.0, 5.0, 500, 500), P.FAILED, "3 canary streams hung"),
        (Sample(0.0, 2.0, 3, 500), P.SUCCESSFUL, "0 canary streams hung"),
        (Sample(None, None, 0, 0), P.SUCCESSFUL, "0 canary streams hung"),
        (Sample(None, None, 0, 0, error="redis away"), P.ERROR, "redis away"),
    ],
)
def test_hung_canary_streams_fail_without_a_minimum_sample(sample: Sample, phase: P, words: str) -> None:
    verdict = judge(HANGING, sample)
    assert verdict.phase is phase and words in verdict.reason
