"""The runner from stored state, driven in this process step by step, with
a thread playing the worker's agent (it follows its desired revision): a
worker that does not answer fails each arm with the reason while the rest
go on and the worker is restored; abort restores the workers first; a
second runner cannot take a held experiment."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from controlplane.audit.models import AuditEvent
from controlplane.experiments import runner
from controlplane.experiments.models import ArmStatus, Experiment, Phase, Workload
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, make_pool, make_profile
from tests.controlplane.rollouts.factories import follow

pytestmark = pytest.mark.django_db(transaction=True)
ARMS = [
    {"name": "baseline", "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": 512}},
    {"name": "chunk-64", "fields": {"max_num_batched_tokens": 128, "long_prefill_token_threshold": 64}},
]


@pytest.fixture(autouse=True)
def fast(settings: Any) -> None:
    settings.GATEWAY_POLL_SECONDS = 0.1
    settings.EXPERIMENT_DRAIN_TIMEOUT_SECONDS = 2.0
    settings.EXPERIMENT_APPLY_TIMEOUT_SECONDS = 10.0


@pytest.fixture
def worker() -> Iterator[Worker]:
    """A lab worker whose agent follows its desired revision; its OpenAI
    server does not answer (nothing listens on its port)."""
    pool = make_pool(revision=make_profile())
    w, _ = enroll_worker("lab", pool=pool, url="http://127.0.0.1:9")
    stop = threading.Event()

    def agent() -> None:
        try:
            while not stop.wait(0.1):
                follow(only=[w], beat_all=True)
        finally:
            connection.close()

    follow(only=[w])
    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    yield Worker.objects.get(pk=w.pk)
    stop.set()
    thread.join(10)


def experiment(worker: Worker) -> Experiment:
    workload = Workload.from_scenario(name="b", scenario="burst", rate=1.0, duration_seconds=30)
    return Experiment.create(
        name="x", workload=workload, workers=[worker], arms=ARMS, duration_seconds=1, warmup_seconds=0
    )


def run_to_the_end(exp: Experiment, max_steps: int = 20) -> Experiment:
    for _ in range(max_steps):
        if not runner.drive(exp.pk):
            break
    return Experiment.objects.get(pk=exp.pk)


def test_a_worker_that_stops_answering_fails_each_arm_with_the_reason_and_is_restored(worker: Worker) -> None:
    exp = run_to_the_end(experiment(worker))
    assert exp.phase == Phase.SUCCEEDED, exp.message
    arms = list(exp.arms.order_by("index"))
    assert [a.status for a in arms] == [ArmStatus.FAILED, ArmStatus.FAILED]  # the second ran after the first failed
    assert all("worker lab stopped answering" in a.error for a in arms)
    assert exp.recommendation["winner"] is None and "no arm met every objective" in exp.recommendation["reasons"][0]
    worker.refresh_from_db()
    assert (worker.desired_revision_id, worker.cordoned) == (None, False)
    actions = list(AuditEvent.objects.filter(object_type="fleet.worker").values_list("action", flat=True))
    assert "worker.cordon" in actions and actions.count("worker.move") == 2 and "worker.restore" in actions
    assert AuditEvent.objects.filter(action="experiment.succeeded", object_id=str(exp.pk)).exists()


def test_abort_before_it_starts_leaves_the_workers_alone(worker: Worker) -> None:
    exp = experiment(worker)
    assert exp.request_abort("tester", "changed my mind")
    exp = run_to_the_end(exp)
    assert exp.phase == Phase.ABORTED and exp.message == "aborted: changed my mind"
    assert set(exp.arms.values_list("status", flat=True)) == {ArmStatus.SKIPPED}
    worker.refresh_from_db()
    assert not worker.cordoned and worker.desired_revision_id is None


def test_abort_mid_run_restores_the_workers_first(worker: Worker) -> None:
    exp = experiment(worker)
    assert runner.drive(exp.pk)  # out of traffic
    worker.refresh_from_db()
    assert worker.cordoned
    assert runner.drive(exp.pk)  # the first arm
    Experiment.objects.get(pk=exp.pk).request_abort("tester", "need it")
    exp = run_to_the_end(exp)
    assert exp.phase == Phase.ABORTED
    assert exp.arms.get(index=1).status == ArmStatus.SKIPPED
    worker.refresh_from_db()
    assert (worker.desired_revision_id, worker.cordoned) == (None, False)
    restored = AuditEvent.objects.filter(action="worker.restore").latest("time")
    aborted = AuditEvent.objects.filter(action="experiment.aborted").latest("time")
    assert restored.time <= aborted.time


def test_a_held_experiment_cannot_be_claimed_twice(worker: Worker) -> None:
    exp = experiment(worker)
    lease = runner.claim(exp.pk)
    assert lease is not None
    assert runner.claim(exp.pk) is None
    assert not runner.drive(exp.pk)  # a second runner returns at once
    lease.release()
    assert runner.claim(exp.pk) is not None


def test_an_arm_whose_replay_draws_no_requests_fails_saying_so() -> None:
    # 0.001 requests/s over a 1 s arm: no arrival falls inside it. Measured
    # on nothing, the arm would otherwise pass as a success with zeros.
    pool = make_pool(revision=make_profile())
    lab, _ = enroll_worker("quiet-lab", pool=pool, url="http://127.0.0.1:9")
    workload = Workload.from_scenario(name="quiet", scenario="burst", rate=1.0, duration_seconds=30)
    exp = Experiment.create(
        name="quiet",
        workload=workload,
        workers=[lab],
        arms=ARMS,
        duration_seconds=1,
        warmup_seconds=0,
        rate_scale=0.001,
    )
    with pytest.raises(runner.ArmFailed, match="drew no requests in 1 s"):
        runner.drawn_or_failed([], exp)
    assert runner.drawn_or_failed(["a request"], exp) == ["a request"]
