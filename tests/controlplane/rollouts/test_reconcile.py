"""reconcile(rollout_id) on a real Celery worker and Redis, and what happens
when things overlap: an abort while a weight step waits for its acks, two
reconciles at once, a worker killed mid-step.

The workers are enrolled rows whose agents a thread plays (``Agents``); a
gateway whose acks the test times itself is a ``FakeGateway`` (its liveness
record in Redis, exactly as ``rungateway`` writes it)."""

from __future__ import annotations

import re
import signal
import threading
from typing import Any

import pytest
from django.db import connection

from controlplane.rollouts import controller
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout
from tests.controlplane.rollouts.factories import (
    Agents,
    FakeGateway,
    Fleet,
    kinds,
    make_fleet,
    table_weights,
)
from tests.support import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def fleet(transactional_db: Any) -> Fleet:
    return make_fleet(num_stable=2, num_canary=1)


@pytest.fixture
def gateway(transactional_db: Any) -> Any:
    gw = FakeGateway()
    yield gw
    gw.withdraw()


def start(fleet: Fleet, steps: list[dict[str, Any]]) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=steps,
        gate={"enabled": False},
        actor="tester",
        progress_deadline_seconds=120,
    )


def phase_of(rollout: Rollout) -> Phase:
    return Phase(Rollout.objects.values_list("phase", flat=True).get(pk=rollout.pk))


def test_reconcile_drives_a_rollout_to_success_on_a_real_worker(celery_worker, fleet) -> None:
    with Agents(fleet):
        r = start(fleet, [{"set_weight": 5000}, {"pause": {"duration_seconds": 1}}, {"set_weight": 10000}])
        wait_until(lambda: phase_of(r) == Phase.SUCCEEDED, timeout=60, what="success")
    r.refresh_from_db()
    events = kinds(r)
    assert events.count("weights_set") == 3  # 50%, 100% (which promotion keeps), back to stable
    assert events.count("worker_moved") == 2 and events[-1] == "succeeded"
    assert table_weights(fleet.table) == {"canary": 0, "stable": 10000}
    assert r.next_run_at is None  # finished: nothing scheduled


def test_abort_while_a_weight_step_is_being_applied(celery_worker, fleet, gateway) -> None:
    with Agents(fleet):
        r = start(fleet, [{"set_weight": 2500}, {"pause": {}}])
        # the weights are in the table, but this gateway has not applied them
        wait_until(lambda: table_weights(fleet.table)["canary"] == 2500, what="weights 25%")
        wait_until(lambda: "waiting for every gateway to ack" in Rollout.objects.get(pk=r.pk).message, what="ack wait")
        assert r.request_abort("tester", "wrong profile", source="ui")
        wait_until(lambda: table_weights(fleet.table)["canary"] == 0, what="canary weight 0")
        # the abort waits for the gateway's ack of weight 0 before the canary moves
        assert Rollout.objects.get(pk=r.pk).phase == Phase.ABORTING
        assert fleet.canary.__class__.objects.get(pk=fleet.canary.pk).desired_revision_id == fleet.target_revision.pk
        gateway.ack(fleet.table)
        wait_until(lambda: phase_of(r) == Phase.ABORTED, timeout=30, what="aborted")
    events = kinds(r)
    assert "step_completed" not in events  # the 25% step never completed
    after = events[events.index("abort_requested") :]
    assert after.index("weights_set") < after.index("canary_revision") < after.index("aborted")
    assert fleet.canary.__class__.objects.get(pk=fleet.canary.pk).desired_revision_id == fleet.stable_revision.pk


def test_two_reconciles_at_once_do_each_step_once(celery_worker, fleet) -> None:
    r = start(fleet, [{"set_weight": 2500}, {"pause": {}}])
    wait_until(lambda: "canary workers" in Rollout.objects.get(pk=r.pk).message, what="waiting for the canary")
    from tests.controlplane.rollouts.factories import follow

    follow(fleet)
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(10)
            controller.drive(r.pk)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    from controlplane.rollouts.tasks import reconcile

    barrier.wait(10)
    reconcile.delay(r.pk)  # and the Celery worker, at the same moment
    for t in threads:
        t.join(60)
    assert not errors, errors
    wait_until(lambda: phase_of(r) == Phase.PAUSED, what="paused at step 2")
    epoch_before = fleet.table.__class__.objects.get(pk=fleet.table.pk).epoch
    events = kinds(r)
    assert events.count("weights_set") == 1 and events.count("step_completed") == 1 and events.count("paused") == 1
    assert events.count("canary_revision") == 1
    # and they collapsed into one chain: nothing more happens while paused
    controller.drive(r.pk)
    assert kinds(r) == events
    assert fleet.table.__class__.objects.get(pk=fleet.table.pk).epoch == epoch_before


def test_a_worker_killed_mid_step_resumes_on_another(start_celery, fleet, gateway) -> None:
    with Agents(fleet):
        with start_celery() as first:
            r = start(fleet, [{"set_weight": 2500}, {"set_weight": 5000}])
            wait_until(lambda: table_weights(fleet.table)["canary"] == 2500, what="weights 25%")
            # its task is inside the step, waiting for this gateway's ack
            wait_until(
                lambda: "waiting for every gateway to ack" in Rollout.objects.get(pk=r.pk).message, what="ack wait"
            )
            first.kill(signal.SIGKILL)
            first.popen.wait(10)
        gateway.ack(fleet.table)
        # a fresh worker with beat: the sweeper finds the rollout overdue and resumes it
        with start_celery(beat=True) as second:
            wait_until(
                lambda: gateway.ack(fleet.table) and phase_of(r) == Phase.SUCCEEDED,
                timeout=90,
                interval=0.3,
                what="success",
            )
            swept = re.search(rf"rollouts\.sweep\[[^\]]+\] succeeded in [^:]+: \[[^\]]*\b{r.pk}\b", second.output())
            assert swept, "the sweeper never restarted the rollout"
    events = kinds(r)
    assert events.count("step_completed") == 2  # each step once, despite the kill
    assert events.count("worker_moved") == 2
