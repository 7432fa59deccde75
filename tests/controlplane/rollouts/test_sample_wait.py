"""An analysis that waits for its samples (``sample_wait_seconds``): a
measurement short of requests is not counted while the wait lasts, the next
looks back to the run's start, and only after the wait is a shortfall
inconclusive. The judge's side as a table, then the reconciler's."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import time_machine

from controlplane.rollouts import controller
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.judge import AnalysisPhase as P
from controlplane.rollouts.judge import MetricResult, MetricRule, RunSpec, Sample, take_round
from controlplane.rollouts.models import AnalysisRun, Measurement
from tests.controlplane.rollouts.factories import Fleet, follow, make_fleet
from tests.controlplane.rollouts.test_controller import reload, start, template, traffic

TTFT = MetricRule("ttft", "client_ttft_p99", min_samples=20)
SPEC = RunSpec(metrics=(TTFT,), interval_seconds=60, count=2, sample_wait_seconds=600)
SHORT = {"ttft": Sample(0.5, 0.5, 3, 50)}
ENOUGH = {"ttft": Sample(0.5, 0.5, 30, 50)}


@pytest.mark.parametrize(
    ("since_start", "samples", "counted", "phase", "result"),
    [
        (100, SHORT, False, P.PENDING, MetricResult()),  # within the wait: not counted, still pending
        (100, ENOUGH, True, P.RUNNING, MetricResult(count=1, successful=1)),
        (600, SHORT, True, P.INCONCLUSIVE, MetricResult(count=1, inconclusive=1)),  # the wait is over
    ],
)
def test_a_round_short_of_samples_counts_only_after_the_wait(
    since_start: float, samples: dict[str, Sample], counted: bool, phase: P, result: MetricResult
) -> None:
    outcome = take_round(SPEC, {}, samples, since_start)
    assert outcome.counted is counted
    assert outcome.phase is phase
    assert outcome.results.get("ttft", MetricResult()) == result
    if not counted:
        assert outcome.message.startswith("waiting for samples, 500 s more at most")


def test_without_a_wait_a_shortfall_is_inconclusive_at_once() -> None:
    spec = RunSpec(metrics=(TTFT,), count=2)
    outcome = take_round(spec, {}, SHORT, 5)
    assert outcome.counted and outcome.phase is P.INCONCLUSIVE


def test_a_failed_query_is_counted_even_within_the_wait() -> None:
    outcome = take_round(SPEC, {}, {"ttft": Sample(None, None, 0, 0, error="db away")}, 5)
    assert outcome.counted and outcome.results["ttft"].error == 1


@pytest.mark.parametrize(("since_start", "lookback"), [(10, 60), (200, 200), (700, 60)])
def test_while_waiting_a_measurement_looks_back_to_the_start(since_start: float, lookback: float) -> None:
    assert SPEC.lookback_at(since_start) == lookback


def test_the_wait_survives_the_runs_snapshot() -> None:
    assert RunSpec.from_json(SPEC.to_json()).sample_wait_seconds == 600


# ---- the reconciler ---------------------------------------------------------------------------------
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> Any:
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def fleet(clock: Any, db: Any) -> Fleet:
    return make_fleet(num_stable=2, num_canary=1)


def test_low_traffic_gathers_its_samples_instead_of_pausing(clock: Any, fleet: Fleet) -> None:
    template(sample_wait_seconds=120)  # window 30 s, every 10 s, 2 measurements, 5 samples per side
    r = start(fleet, [{"set_weight": 1000}, {"analysis": {"template": "quick"}}, {"set_weight": 2000}, {"pause": {}}])
    follow(fleet)
    controller.drive(r.pk)  # the canary's weight
    follow(fleet)
    controller.drive(r.pk)  # the analysis starts and measures: nothing yet
    run = AnalysisRun.objects.get(rollout=r)
    assert reload(r).phase == Phase.PROGRESSING
    assert run.phase == P.PENDING and run.message.startswith("waiting for samples")
    assert Measurement.objects.get(run=run).verdicts[0]["reason"].startswith("too few samples")

    clock.shift(2)
    traffic(fleet, canary_ttft=0.2, n=3)
    clock.shift(10)
    controller.drive(r.pk)  # 3 of 5: still waiting
    run.refresh_from_db()
    assert run.phase == P.PENDING and Measurement.objects.filter(run=run).count() == 2

    clock.shift(40)  # past the 30 s window: only the run's start reaches back to the first 3 requests
    traffic(fleet, canary_ttft=0.2, n=3)
    controller.drive(r.pk)
    run.refresh_from_db()
    latest = Measurement.objects.filter(run=run).latest("taken_at")
    assert latest.window_seconds == pytest.approx(52, abs=1)
    assert latest.verdicts[0]["canary_samples"] == 6
    assert run.metric_results()["ttft"] == MetricResult(count=1, successful=1)

    clock.shift(10)
    traffic(fleet, canary_ttft=0.2, n=3)
    controller.drive(r.pk)
    run.refresh_from_db()
    assert run.phase == P.SUCCESSFUL


def test_after_the_wait_a_shortfall_pauses_as_before(clock: Any, fleet: Fleet) -> None:
    template(sample_wait_seconds=20)
    r = start(fleet, [{"set_weight": 1000}, {"analysis": {"template": "quick"}}, {"pause": {}}])
    follow(fleet)
    controller.drive(r.pk)
    traffic(fleet, canary_ttft=0.2, n=2)
    follow(fleet)
    controller.drive(r.pk)
    assert reload(r).phase == Phase.PROGRESSING
    clock.shift(30)
    controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.PAUSED and "inconclusive" in r.message
