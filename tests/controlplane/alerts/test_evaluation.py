"""Evaluation against stored data: rules read the metrics registry and the
fleet, alerts step their state machine at each tick, every transition is
stored with its value, and two evaluators at once make one transition.

Time moves with time-machine, one evaluation interval (15 s) per step."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.db import connection

from controlplane.alerts import defaults, evaluation
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, AlertRule, AlertTransition
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RoutingPool, RoutingTable
from tests.controlplane.metrics.pages import Page, job, store

T0 = datetime(2026, 4, 1, 12, 0, 0, tzinfo=UTC)
FRAG = "chunkpilot:kv_fragmentation_ratio_seconds_total"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Iterator[Any]:
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def only_my_rules(shipped_rules: None) -> None:
    """The shipped rules are there, switched off, out of each test's way."""


def worker(name: str, pool: str) -> Worker:
    p, _ = Pool.objects.get_or_create(name=pool)
    return Worker.objects.create(name=name, url=f"http://{name}.invalid:8000", pool=p)


def rule(**fields: Any) -> AlertRule:
    fields.setdefault("name", "KVFragHigh")
    fields.setdefault("figure", "kv_fragmentation")
    fields.setdefault("group_by", "worker")
    fields.setdefault("window_seconds", 60)
    fields.setdefault("comparator", ">")
    fields.setdefault("threshold", 0.5)
    r = AlertRule(**fields)
    r.full_clean()
    r.save()
    return r


def scrape_fragmentation(until: float, ratios: dict[Worker, float], since: float = 0.0) -> None:
    """Scrapes every 5 s in (since, until]: each worker's fragmentation integral grows at its ratio."""
    jobs = {w: job(w) for w in ratios}
    t = since + 5
    while t <= until:
        store(at(t), {jobs[w]: Page(counters={FRAG: 100 + ratio * t}) for w, ratio in ratios.items()})
        t += 5


def states() -> dict[str, str]:
    return {a.labels.get("worker", a.labels.get("pool", "")): a.state_label for a in Alert.objects.all()}


def test_a_scraped_figure_goes_pending_then_firing_per_worker_with_the_values_recorded(
    only_my_rules: None, clock: Any
) -> None:
    w1, w2 = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    r = rule(for_seconds=30, summary="{{ $labels.worker }} fragmentation {{ $value }}")
    scrape_fragmentation(120, {w1: 0.8, w2: 0.1})

    seen = []
    for t in (60, 75, 90, 105):
        clock.move_to(at(t))
        evaluation.evaluate(at(t))
        seen.append(states())
    assert seen == [{"w1": "pending"}, {"w1": "pending"}, {"w1": "firing"}, {"w1": "firing"}]

    alert = Alert.objects.get()
    assert alert.labels == {"alertname": "KVFragHigh", "severity": "warning", "worker": "w1"}
    assert alert.rule == r and alert.fired_at == at(90) and alert.active_at == at(60)
    assert alert.value == pytest.approx(0.8)
    assert alert.live_annotations()["summary"] == "w1 fragmentation 0.8"
    transitions = list(AlertTransition.objects.order_by("at").values_list("from_state", "to_state", "at", "value"))
    assert transitions == [
        (AlertState.INACTIVE, AlertState.PENDING, at(60), pytest.approx(0.8)),
        (AlertState.PENDING, AlertState.FIRING, at(90), pytest.approx(0.8)),
    ]
    (event,) = AuditEvent.objects.filter(action="alert.firing")
    assert event.actor_repr == "system:alerts" and event.object_repr == "KVFragHigh"
    (listed,) = event.after["alerts"]
    assert listed["labels"]["worker"] == "w1" and listed["value"] == pytest.approx(0.8)


def test_a_firing_alert_keeps_its_value_current_between_transitions(only_my_rules: None, clock: Any) -> None:
    w1 = worker("w1", "gpu-a")
    rule(summary="fragmentation {{ $value }}")
    scrape_fragmentation(60, {w1: 0.9})
    scrape_fragmentation(120, {w1: 0.6}, since=60)  # the integral keeps growing, more slowly
    clock.move_to(at(60))
    evaluation.evaluate(at(60))
    clock.move_to(at(120))
    result = evaluation.evaluate(at(120))
    assert result.transitions == [] and result.num_alerts_written == 1
    alert = Alert.objects.get()
    assert alert.state == AlertState.FIRING and alert.value == pytest.approx(0.6, rel=0.05)
    assert alert.live_annotations()["summary"] == f"fragmentation {alert.value:.4g}"
    assert alert.annotations["summary"] == "fragmentation 0.9"  # as of the transition


def test_scrapes_that_stop_give_no_data_not_a_resolution(only_my_rules: None, clock: Any) -> None:
    w1 = worker("w1", "gpu-a")
    rule(for_seconds=0, no_data_state="nodata")
    scrape_fragmentation(60, {w1: 0.9})
    clock.move_to(at(60))
    evaluation.evaluate(at(60))
    assert states() == {"w1": "firing"}
    # No scrapes after 60 s: the 60-s window ending at 150 s is empty.
    clock.move_to(at(150))
    evaluation.evaluate(at(150))
    assert states() == {"w1": "nodata"}
    last = AlertTransition.objects.order_by("-at").first()
    assert (last.from_state, last.to_state, last.value) == (AlertState.FIRING, AlertState.NODATA, None)


def test_a_rule_counting_no_data_as_ok_resolves_and_says_why(only_my_rules: None, clock: Any) -> None:
    w1 = worker("w1", "gpu-a")
    rule(no_data_state="ok")
    scrape_fragmentation(60, {w1: 0.9})
    clock.move_to(at(60))
    evaluation.evaluate(at(60))
    clock.move_to(at(150))
    evaluation.evaluate(at(150))
    assert states() == {"w1": "resolved"}
    assert "no data, counted as ok" in AlertTransition.objects.order_by("-at").first().reason


def test_worker_missing_and_drift_come_from_the_fleet(only_my_rules: None, clock: Any) -> None:
    a, b = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    Worker.objects.filter(pk=a.pk).update(state=WorkerState.UNHEALTHY)
    Worker.objects.filter(pk=b.pk).update(drift_since=at(-400))
    AlertRule.objects.filter(key__in=["worker-missing", "profile-drift"]).update(enabled=True)
    evaluation.evaluate(at(0))
    got = {(x.name, x.labels["worker"]): x.state_label for x in Alert.objects.all()}
    # Missing for a minute before it fires: a restart of the whole system
    # finds every worker silent since it stopped, and they are back within it.
    assert got == {("WorkerMissing", "w1"): "pending", ("ProfileDrift", "w2"): "firing"}
    evaluation.evaluate(at(60))
    assert Alert.objects.get(labels__alertname="WorkerMissing").state == AlertState.FIRING
    # The worker comes back: resolved at the next tick.
    Worker.objects.filter(pk=a.pk).update(state=WorkerState.READY)
    evaluation.evaluate(at(75))
    assert Alert.objects.get(labels__alertname="WorkerMissing").state == AlertState.RESOLVED


def test_an_alert_whose_worker_left_the_fleet_resolves(only_my_rules: None, clock: Any) -> None:
    a = worker("w1", "gpu-a")
    Worker.objects.filter(pk=a.pk).update(state=WorkerState.OFFLINE)
    AlertRule.objects.filter(key="worker-missing").update(enabled=True, for_seconds=0)
    evaluation.evaluate(at(0))
    Worker.objects.filter(pk=a.pk).delete()
    evaluation.evaluate(at(15))
    assert Alert.objects.get().state == AlertState.RESOLVED


def test_canary_ttft_against_its_baseline_pool(only_my_rules: None, clock: Any) -> None:
    from controlplane.gateway.models import RequestLog

    pools = {role: Pool.objects.create(name=f"{role}-pool") for role in ("canary", "baseline", "stable")}
    table = RoutingTable.objects.create(model="tiny")
    for role, pool in pools.items():
        RoutingPool.objects.create(
            table=table, pool=pool, role=role, weight_bp={"canary": 1000, "baseline": 1000, "stable": 8000}[role]
        )
    for i in range(100):
        for role, ttft in (("canary", 0.9), ("baseline", 0.4), ("stable", 0.3)):
            RequestLog.objects.create(
                request_id=f"{role}{i}",
                created_at=at(-250 + 2 * i),
                model="tiny",
                cohort=role,
                pool=pools[role],
                ttft_seconds=ttft,
                status=200,
            )
    shipped = AlertRule.objects.get(key="canary-ttft-regression")
    shipped.for_seconds = 0
    shipped.enabled = True
    shipped.save()
    evaluation.evaluate(at(0))
    alert = Alert.objects.get()
    assert alert.state == AlertState.FIRING
    assert alert.labels == {
        "alertname": "CanaryTTFTRegression",
        "severity": "critical",
        "pool": "canary-pool",
        "cohort": "canary",
        "chunkpilot_action": "abort_rollout",
    }
    assert alert.value == pytest.approx(0.9 / 0.4)
    assert alert.live_annotations()["value_detail"] == "canary-pool 0.9 vs baseline-pool 0.4"


def test_the_same_tick_is_evaluated_once(only_my_rules: None, clock: Any) -> None:
    w1 = worker("w1", "gpu-a")
    rule()
    scrape_fragmentation(60, {w1: 0.9})
    first = evaluation.evaluate(at(60))
    again = evaluation.evaluate(at(61))  # the same 15-s tick
    assert (first.num_rules, len(first.transitions)) == (1, 1)
    assert (again.num_rules, len(again.transitions)) == (0, 0)


def test_a_rule_that_fails_to_evaluate_says_why_and_the_others_still_run(only_my_rules: None, clock: Any) -> None:
    worker("w1", "gpu-a")
    broken = rule(name="Broken")
    AlertRule.objects.filter(pk=broken.pk).update(window_seconds=90 * 86400)  # past what the query layer allows
    AlertRule.objects.filter(key="worker-missing").update(enabled=True)
    result = evaluation.evaluate(at(0))
    assert result.num_rules == 2
    assert "window" in AlertRule.objects.get(pk=broken.pk).last_error


@pytest.mark.django_db(transaction=True)
def test_two_evaluators_at_once_make_one_transition(clock: Any) -> None:
    defaults.install(AlertRule)
    AlertRule.objects.update(enabled=False)
    for i in range(20):
        w = worker(f"w{i}", "gpu-a")
        Worker.objects.filter(pk=w.pk).update(state=WorkerState.OFFLINE)
    AlertRule.objects.filter(key="worker-missing").update(enabled=True, for_seconds=0)
    barrier = threading.Barrier(2)
    results: list[Any] = []

    def evaluator() -> None:
        try:
            barrier.wait()
            results.append(evaluation.evaluate(at(0)))
        finally:
            connection.close()

    threads = [threading.Thread(target=evaluator) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.num_rules for r in results) == [0, 1]
    assert AlertTransition.objects.count() == 20
    assert Alert.objects.filter(state=AlertState.FIRING).count() == 20


def _missing_worker_firing() -> AlertRule:
    a = worker("w1", "gpu-a")
    Worker.objects.filter(pk=a.pk).update(state=WorkerState.OFFLINE)
    AlertRule.objects.filter(key="worker-missing").update(enabled=True, for_seconds=0)
    evaluation.evaluate(at(0))
    assert Alert.objects.get().state == AlertState.FIRING
    return AlertRule.objects.get(key="worker-missing")


def test_switching_a_rule_off_resolves_its_alerts(only_my_rules: None, clock: Any) -> None:
    rule = _missing_worker_firing()
    AlertRule.objects.filter(pk=rule.pk).update(enabled=False)
    evaluation.evaluate(at(15))
    alert = Alert.objects.get()
    assert alert.state == AlertState.RESOLVED and alert.resolved_at == at(15)
    assert alert.transitions.first().reason == "the rule was switched off"


def test_deleting_a_rule_resolves_its_alerts_so_receivers_hear_it(only_my_rules: None, clock: Any) -> None:
    rule = _missing_worker_firing()
    rule.delete()
    evaluation.evaluate(at(15))
    alert = Alert.objects.get()
    assert alert.rule is None and alert.state == AlertState.RESOLVED
    assert AuditEvent.objects.filter(action="alert.resolved", object_repr="(a deleted rule)").exists()


def test_editing_a_rules_labels_resolves_the_old_label_sets_and_fires_the_new(only_my_rules: None, clock: Any) -> None:
    rule = _missing_worker_firing()
    rule.severity = "critical"
    rule.save()
    evaluation.evaluate(at(15))
    states = {a.labels["severity"]: a.state_label for a in Alert.objects.all()}
    assert states == {"warning": "resolved", "critical": "firing"}


# ---- worker labels in a selector ------------------------------------------------------------


def test_a_selector_with_worker_labels_only_counts_those_workers(only_my_rules: None, clock: Any) -> None:
    a, b, c = worker("w1", "gpu-a"), worker("w2", "gpu-a"), worker("w3", "gpu-b")
    Worker.objects.filter(pk=a.pk).update(labels={"zone": "eu-1", "gpu": "h100"})
    Worker.objects.filter(pk=b.pk).update(labels={"zone": "us-1", "gpu": "h100"})
    Worker.objects.filter(pk=c.pk).update(labels={"zone": "eu-1", "gpu": "a10"})
    rule(selector={"labels": {"zone": "eu-1", "gpu": "h100"}}, for_seconds=0)
    scrape_fragmentation(60, {a: 0.8, b: 0.9, c: 0.95})  # every one of them fragmented
    evaluation.evaluate(at(60))
    assert states() == {"w1": "firing"}  # only the worker with both labels


def test_a_fleet_figure_with_worker_labels_counts_only_those_workers(only_my_rules: None, clock: Any) -> None:
    a, b = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    Worker.objects.filter(pk=a.pk).update(labels={"zone": "eu-1"}, state=WorkerState.OFFLINE)
    Worker.objects.filter(pk=b.pk).update(labels={"zone": "us-1"}, state=WorkerState.OFFLINE)
    rule(
        name="EUWorkersMissing",
        figure="worker_missing",
        group_by="pool",
        threshold=0,
        window_seconds=60,
        for_seconds=0,
        selector={"labels": {"zone": "eu-1"}},
    )
    evaluation.evaluate(at(0))
    alert = Alert.objects.get()
    assert alert.state == AlertState.FIRING and alert.labels["pool"] == "gpu-a"
    assert alert.value == 1.0  # w1 only: w2 is missing too but not in eu-1


# ---- the shipped rules fire on the data they are about ----------------------------------------


def ship(key: str) -> AlertRule:
    AlertRule.objects.filter(key=key).update(enabled=True)
    return AlertRule.objects.get(key=key)


def log_requests(
    pool: str, *, since: float, until: float, every: float, max_gap: float = 0.1, error_every: int = 0
) -> None:
    """The gateways' request log for one pool: a request each ``every`` s in
    [since, until); each ``error_every``-th failed with a 500."""
    from controlplane.gateway.models import RequestLog

    p, _ = Pool.objects.get_or_create(name=pool)
    rows, t, i = [], since, 0
    while t < until:
        failed = bool(error_every) and i % error_every == 0
        rows.append(
            RequestLog(
                request_id=f"{pool}-{i}",
                created_at=at(t),
                model="tiny",
                cohort="stable",
                pool=p,
                status=500 if failed else 200,
                ttft_seconds=None if failed else 0.2,
                max_gap_seconds=None if failed else max_gap,
                tpot_seconds=0.02,
                e2e_seconds=1.0,
                prompt_tokens=500,
                output_tokens=50,
            )
        )
        t, i = t + every, i + 1
    RequestLog.objects.bulk_create(rows)


def step(ticks: list[float], clock: Any) -> list[dict[str, str]]:
    seen = []
    for t in ticks:
        clock.move_to(at(t))
        evaluation.evaluate(at(t))
        seen.append(states())
    return seen


def test_shipped_stream_stalls_high_fires_after_five_minutes_of_long_gaps(only_my_rules: None, clock: Any) -> None:
    ship("stalls-high")
    log_requests("monolithic", since=-290, until=310, every=3, max_gap=3.5)  # multi-second gaps
    log_requests("chunked", since=-290, until=310, every=3, max_gap=0.3)
    assert step([0, 150, 300], clock) == [{"monolithic": "pending"}] * 2 + [{"monolithic": "firing"}]
    alert = Alert.objects.get()
    assert alert.labels == {"alertname": "StreamStallsHigh", "severity": "warning", "pool": "monolithic"}
    assert alert.value == pytest.approx(3.5)
    assert "longest gap between tokens is 3.5 s" in alert.live_annotations()["summary"]


def test_shipped_error_rate_high_fires_after_two_minutes_over_five_percent(only_my_rules: None, clock: Any) -> None:
    ship("error-rate-high")
    log_requests("broken", since=-290, until=130, every=1, error_every=10)  # 10% fail
    log_requests("healthy", since=-290, until=130, every=1, error_every=100)  # 1% fail
    assert step([0, 60, 120], clock) == [{"broken": "pending"}] * 2 + [{"broken": "firing"}]
    alert = Alert.objects.get()
    assert alert.labels == {"alertname": "ErrorRateHigh", "severity": "critical", "pool": "broken"}
    assert alert.value == pytest.approx(0.1, abs=0.01)


def test_shipped_kv_fragmentation_high_fires_after_ten_minutes_per_worker(only_my_rules: None, clock: Any) -> None:
    ship("kv-fragmentation-high")
    w1, w2 = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    scrape_fragmentation(1200, {w1: 0.7, w2: 0.2})
    assert step([600, 900, 1200], clock) == [{"w1": "pending"}] * 2 + [{"w1": "firing"}]
    alert = Alert.objects.get()
    assert alert.labels == {"alertname": "KVFragmentationHigh", "severity": "warning", "worker": "w1"}
    assert alert.value == pytest.approx(0.7)


def test_shipped_memory_peak_to_mean_high_fires_after_ten_minutes_per_worker(only_my_rules: None, clock: Any) -> None:
    ship("memory-peak-to-mean-high")
    spiky, flat = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    jobs = {spiky: job(spiky), flat: job(flat)}
    mean_bytes = 1e9
    peaks = {spiky: 3e9, flat: 1.5e9}  # 3x and 1.5x the time-weighted mean
    scrape_memory(jobs, peaks, mean_bytes, requests_per_second={spiky: 0.5, flat: 0.5})
    assert step([600, 900, 1200], clock) == [{"w1": "pending"}] * 2 + [{"w1": "firing"}]
    alert = Alert.objects.get()
    assert alert.labels == {"alertname": "MemoryPeakToMeanHigh", "severity": "warning", "worker": "w1"}
    assert alert.value == pytest.approx(3.0, rel=0.02)


def scrape_memory(
    jobs: dict[Worker, Any], peaks: dict[Worker, float], mean_bytes: float, requests_per_second: dict[Worker, float]
) -> None:
    """20 minutes of 5-s scrapes: each worker's memory peaks over a flat mean,
    and the requests it finished at its rate."""
    for t in range(5, 1201, 5):
        store(
            at(t),
            {
                jobs[w]: Page(
                    counters={
                        "chunkpilot:memory_byte_seconds_total": mean_bytes * t,
                        "vllm:request_success_total": requests_per_second[w] * t,
                    },
                    gauges={"chunkpilot:memory_recent_peak_bytes": peaks[w], "chunkpilot:memory_bytes": mean_bytes},
                )
                for w in jobs
            },
        )


def test_shipped_memory_peak_to_mean_high_stays_quiet_on_an_idle_worker(only_my_rules: None, clock: Any) -> None:
    """An idle engine's peak/mean is high by nature (one request's peak over
    an empty mean): the rule needs load before it judges."""
    ship("memory-peak-to-mean-high")
    idle, busy = worker("w1", "gpu-a"), worker("w2", "gpu-a")
    scrape_memory(
        {idle: job(idle), busy: job(busy)},
        {idle: 3e9, busy: 3e9},
        1e9,
        requests_per_second={idle: 0.01, busy: 0.5},
    )
    assert step([600, 900, 1200], clock) == [{"w2": "pending"}] * 2 + [{"w2": "firing"}]
    assert not Alert.objects.filter(labels__worker="w1").exists()


def test_shipped_rules_stay_quiet_on_a_healthy_fleet(only_my_rules: None, clock: Any) -> None:
    for key in ("stalls-high", "error-rate-high", "kv-fragmentation-high", "memory-peak-to-mean-high"):
        ship(key)
    w1 = worker("w1", "gpu-a")
    log_requests("gpu-a", since=-290, until=1210, every=2, max_gap=0.4, error_every=100)
    for t in range(5, 1201, 5):
        store(
            at(t),
            {
                job(w1): Page(
                    counters={
                        FRAG: 100 + 0.2 * t,
                        "chunkpilot:memory_byte_seconds_total": 1e9 * t,
                        "vllm:request_success_total": 0.5 * t,  # under load: judged, and flat
                    },
                    gauges={"chunkpilot:memory_recent_peak_bytes": 1.3e9, "chunkpilot:memory_bytes": 1e9},
                )
            },
        )
    # From 600 s on, when the scrapes fill the rules' 10-minute windows: before that the
    # time-weighted mean is the integral over the whole window, so a worker younger
    # than the window reads a lower mean and a higher peak/mean.
    seen = step([600, 900, 1200], clock)
    assert seen == [{}] * 3, [(a.name, a.labels, a.value) for a in Alert.objects.all()]
    assert not AlertTransition.objects.exists()
