"""The reconciler in-process, tick by tick, on the test database: what each
decision does to the routing table, the pools, the timeline and the audit
log. Workers are enrolled rows whose heartbeats the test sends (``follow``:
each does what its agent would); the clock is time-machine's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.utils import timezone

from controlplane.alerts.models import Alert
from controlplane.audit.models import AuditEvent
from controlplane.gateway.models import RequestLog
from controlplane.rollouts import controller
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import AnalysisTemplate, Measurement, Rollout
from tests.controlplane.rollouts.factories import Fleet, follow, kinds, make_fleet, table_weights

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> Any:
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def fleet(clock: Any) -> Fleet:
    return make_fleet(num_stable=2, num_canary=1)


def template(name: str = "quick", **kw: Any) -> AnalysisTemplate:
    fields: dict[str, Any] = {
        "metrics": [
            {"name": "ttft", "figure": "client_ttft_p99", "max_ratio": 1.5, "floor": 0.05, "min_samples": 5},
            {"name": "errors", "figure": "error_rate", "test": "error_rate", "floor": 0.01, "min_samples": 5},
        ],
        "interval_seconds": 10,
        "count": 2,
        "initial_delay_seconds": 0,
        "window_seconds": 30,
        **kw,
    }
    return AnalysisTemplate.objects.create(name=name, **fields)


def traffic(fleet: Fleet, *, canary_ttft: float, stable_ttft: float = 0.2, n: int = 20, canary_errors: int = 0) -> None:
    """Client requests as the gateways log them, over the last few seconds."""
    now = timezone.now()
    rows = []
    for role, pool, ttft in (("canary", fleet.canary, canary_ttft), ("stable", fleet.stable, stable_ttft)):
        worker = fleet.workers[role][0]
        for i in range(n):
            failed = role == "canary" and i < canary_errors
            rows.append(
                RequestLog(
                    request_id=f"{role}-{now.timestamp()}-{i}",
                    created_at=now - timedelta(seconds=i * 0.5),
                    model=fleet.table.model,
                    cohort=role,
                    pool=pool,
                    worker=worker,
                    status=500 if failed else 200,
                    ttft_seconds=None if failed else ttft,
                    max_gap_seconds=ttft,
                    tpot_seconds=0.01,
                    e2e_seconds=ttft + 0.1,
                    prompt_tokens=100,
                    output_tokens=8,
                )
            )
    RequestLog.objects.bulk_create(rows)


def start(fleet: Fleet, steps: list[dict[str, Any]], **kw: Any) -> Rollout:
    kw.setdefault("gate", {"enabled": False})
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=steps,
        actor="tester",
        **kw,
    )


def reload(rollout: Rollout) -> Rollout:
    return Rollout.objects.get(pk=rollout.pk)


def settle(fleet: Fleet, rollout: Rollout, rounds: int = 6) -> Rollout:
    """Reconcile, let the agents follow, again, until nothing changes."""
    for _ in range(rounds):
        controller.drive(rollout.pk)
        if not follow(fleet):
            break
    controller.drive(rollout.pk)
    return reload(rollout)


def test_a_rollout_promotes_through_its_steps_one_worker_at_a_time(clock, fleet) -> None:
    template()
    r = start(
        fleet,
        [
            {"set_weight": 5000},
            {"analysis": {"template": "quick"}},
            {"pause": {"duration_seconds": 30}},
            {"set_weight": 10000},
        ],
    )
    controller.drive(r.pk)
    r = reload(r)
    # the canary pool is pointed at the target while it carries nothing, and waited for
    assert r.phase == Phase.PROGRESSING and "canary workers" in r.message
    assert fleet.canary.__class__.objects.get(pk=fleet.canary.pk).desired_revision_id == fleet.target_revision.pk
    assert table_weights(fleet.table)["canary"] == 0

    follow(fleet)
    traffic(fleet, canary_ttft=0.22)
    controller.drive(r.pk)
    r = reload(r)
    assert table_weights(fleet.table) == {"canary": 5000, "stable": 5000}
    assert r.step_index == 1 and r.current_analysis().measurements.count() == 1

    clock.shift(10)
    traffic(fleet, canary_ttft=0.21)
    controller.drive(r.pk)
    r = reload(r)
    run = r.analysis_runs.get()
    assert run.phase_label == "successful" and run.measurements.count() == 2
    assert r.phase == Phase.PAUSED and r.step_index == 2

    clock.shift(31)
    controller.drive(r.pk)
    r = reload(r)
    # set_weight 100 done, promotion started: stable workers move one at a time
    assert r.phase == Phase.PROMOTING
    assert table_weights(fleet.table) == {"canary": 10000, "stable": 0}
    moved = [w for w in fleet.stable.workers.all() if w.desired_revision_id == fleet.target_revision.pk]
    assert len(moved) == 1
    for _ in range(4):
        follow(fleet)
        controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.SUCCEEDED, r.message
    stable = fleet.stable.__class__.objects.get(pk=fleet.stable.pk)
    assert stable.desired_revision_id == fleet.target_revision.pk
    assert not stable.workers.exclude(desired_revision=None).exists()
    assert table_weights(fleet.table) == {"canary": 0, "stable": 10000}
    events = kinds(r)
    assert events.count("worker_moved") == 2 and "pool_finalized" in events and events[-1] == "succeeded"
    # one worker at a time: the second move only after the first reported ready on the target
    moves = list(AuditEvent.objects.filter(action="worker.move").order_by("time", "id"))
    assert [m.after["desired_revision"] for m in moves] == [fleet.target_revision.pk] * 2
    assert AuditEvent.objects.filter(action="rollout.succeeded", object_id=str(r.pk)).exists()


def test_a_regression_fails_the_analysis_and_aborts_with_its_numbers(clock, fleet) -> None:
    template()
    r = start(fleet, [{"set_weight": 2500}, {"analysis": {"template": "quick"}}, {"set_weight": 10000}])
    follow(fleet)
    controller.drive(r.pk)
    follow(fleet)
    traffic(fleet, canary_ttft=0.9)
    controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.ABORTING or r.phase == Phase.ABORTED
    assert table_weights(fleet.table)["canary"] == 0
    measurement = Measurement.objects.get()
    ttft = next(v for v in measurement.verdicts if v["metric"] == "ttft")
    assert ttft["phase"] == "failed" and ttft["canary"] == pytest.approx(0.9) and ttft["baseline"] == pytest.approx(0.2)
    assert "ttft" in r.abort_reason
    follow(fleet)
    controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.ABORTED, (r.message, r.last_error, list(r.events.values_list("kind", "message")))
    canary_pool = fleet.canary.__class__.objects.get(pk=fleet.canary.pk)
    assert canary_pool.desired_revision_id == fleet.stable_revision.pk


def test_too_few_samples_pause_for_a_person_and_promote_accepts(
    clock, fleet, django_capture_on_commit_callbacks
) -> None:
    template(inconclusive_limit=0)
    r = start(fleet, [{"set_weight": 1000}, {"analysis": {"template": "quick"}}, {"set_weight": 2000}, {"pause": {}}])
    follow(fleet)
    controller.drive(r.pk)
    traffic(fleet, canary_ttft=9.0, n=3)  # awful, but only 3 requests: never a failure
    follow(fleet)
    with django_capture_on_commit_callbacks(execute=True):
        controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.PAUSED and "inconclusive" in r.message
    assert Alert.objects.get(labels__alertname="RolloutPaused", labels__rollout=str(r.pk)).labels["step"] == "2"
    assert r.pause_conditions[0]["reason"] == "inconclusive_analysis"
    r.request("promote", "tester")
    controller.drive(r.pk)
    r = reload(r)
    assert (r.phase, r.step_index) == (Phase.PAUSED, 3) and table_weights(fleet.table)["canary"] == 2000


def test_abort_sets_canary_weight_to_zero_before_the_canary_moves(
    clock, fleet, django_capture_on_commit_callbacks
) -> None:
    r = settle(fleet, start(fleet, [{"set_weight": 2500}, {"pause": {}}]))
    assert r.phase == Phase.PAUSED and table_weights(fleet.table)["canary"] == 2500, (r.message, kinds(r))
    assert r.request_abort("tester", "looks slow", source="ui")
    controller.drive(r.pk)
    r = reload(r)
    assert table_weights(fleet.table)["canary"] == 0
    events = kinds(r)
    # weight first (and acked), the canary's revision after
    assert events.index("weights_set", events.index("aborting")) < events.index(
        "canary_revision", events.index("aborting")
    )
    assert r.phase == Phase.ABORTING and "canary workers" in r.message
    follow(fleet)
    with django_capture_on_commit_callbacks(execute=True):
        controller.drive(r.pk)
    r = reload(r)
    assert r.phase == Phase.ABORTED and "looks slow" in r.message
    # receivers hear of it: an Alertmanager-style event through the alerts app
    notice = Alert.objects.get(labels__alertname="RolloutAborted", labels__rollout=str(r.pk))
    # the operator's own abort is news, not a page: no critical banner on every page
    assert notice.labels["severity"] == "info" and "looks slow" in notice.annotations["description"]
    assert notice.annotations["dashboard_url"].endswith(f"/rollouts/{r.pk}/")
    assert not r.abort_requested
    audit = AuditEvent.objects.get(action="rollout.abort", object_id=str(r.pk))
    assert audit.actor_repr == "tester" and audit.after["source"] == "ui"


def test_a_succeeded_rollout_notifies_its_completion(clock, fleet, django_capture_on_commit_callbacks) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        r = settle(fleet, start(fleet, [{"set_weight": 10000}]))
    assert r.phase == Phase.SUCCEEDED, r.message
    # receivers hear of it: an Alertmanager-style event through the alerts app, once
    notice = Alert.objects.get(labels__alertname="RolloutCompleted", labels__rollout=str(r.pk))
    assert notice.labels["severity"] == "info"
    assert notice.labels["pool"] == fleet.stable.name and notice.labels["target_revision"] == str(fleet.target_revision)
    assert "succeeded" in notice.annotations["summary"]
    assert notice.annotations["dashboard_url"].endswith(f"/rollouts/{r.pk}/")
    assert not Alert.objects.filter(labels__alertname__in=["RolloutAborted", "RolloutPaused"]).exists()


def test_a_retry_starts_again_from_the_first_step(clock, fleet) -> None:
    r = settle(fleet, start(fleet, [{"set_weight": 2500}, {"pause": {}}]))
    r.request_abort("tester")
    r = settle(fleet, r)
    assert r.phase == Phase.ABORTED
    r.request("retry", "tester")
    r = settle(fleet, r)
    assert (r.attempt, r.phase, r.step_index) == (2, Phase.PAUSED, 1)
    assert table_weights(fleet.table)["canary"] == 2500


def test_rolling_back_a_finished_rollout_moves_the_pool_back_one_worker_at_a_time(clock, fleet) -> None:
    r = settle(fleet, start(fleet, [{"set_weight": 10000}]))
    assert r.phase == Phase.SUCCEEDED
    back = r.rollback("tester")
    assert back.fast_track and back.target_revision_id == fleet.stable_revision.pk
    controller.drive(back.pk)
    # the stable pool keeps all the traffic throughout
    assert table_weights(fleet.table) == {"canary": 0, "stable": 10000}
    assert fleet.stable.workers.filter(desired_revision=fleet.stable_revision).count() == 1
    for _ in range(5):
        follow(fleet)
        controller.drive(back.pk)
    back = reload(back)
    assert back.phase == Phase.SUCCEEDED, back.message
    for pool in (fleet.stable, fleet.canary):
        assert pool.__class__.objects.get(pk=pool.pk).desired_revision_id == fleet.stable_revision.pk
    assert table_weights(fleet.table) == {"canary": 0, "stable": 10000}


def test_a_superseded_run_does_nothing(clock, fleet) -> None:
    r = start(fleet, [{"set_weight": 2500}])
    out = controller.tick(r.pk)
    assert out is not None
    assert controller.tick(r.pk, token="not-the-current-one") is None
    assert controller.tick(r.pk, token=out.token) is not None


def test_a_deleted_rollout_is_a_quiet_return(clock, fleet) -> None:
    assert controller.tick(999_999) is None
    controller.drive(999_999)
