"""Workloads and experiments over the API: capture from the request log
(versioned; an empty window is a 400 with its count), from a loadgen
scenario; experiment creation validated against every worker's engine (an
arm it refuses is a 400 naming the arm and the field), role checks, audit
rows, abort, and adopting the recommended arm as a profile revision."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.experiments.models import Experiment, Phase, Workload
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RequestLog, RoutingPool, RoutingTable
from tests.controlplane.factories import (
    api_client,
    enroll_worker,
    make_pool,
    make_profile,
    make_user,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Any:
    return api_client(make_user(Role.OPERATOR))


def log_requests(num: int, *, start: Any, status: int = 200, pool: Any = None, cached: int = 0) -> None:
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"r{i}",
                created_at=start + timedelta(seconds=i * 0.5),
                model="tiny",
                status=status,
                pool=pool,
                prompt_tokens=100 + 10 * i,
                output_tokens=20 + i,
                cached_tokens=cached,
                error="" if status == 200 else "boom",
            )
            for i in range(num)
        ]
    )


def lab_workers(num: int = 2, **overrides: Any) -> list[Worker]:
    pool = make_pool(revision=make_profile())
    workers = [enroll_worker(pool=pool, **overrides)[0] for _ in range(num)]
    Worker.objects.filter(pk__in=[w.pk for w in workers]).update(state=Worker.State.READY)
    return list(Worker.objects.filter(pk__in=[w.pk for w in workers]))


def scenario_workload() -> Workload:
    return Workload.from_scenario(name="lt", scenario="long-tail", rate=2.0, duration_seconds=60)


def test_a_workload_is_captured_from_the_request_log_and_versioned(operator: Any) -> None:
    start = timezone.now() - timedelta(minutes=10)
    pool = make_pool()
    log_requests(40, start=start, pool=pool, cached=32)
    log_requests(5, start=start + timedelta(seconds=1), status=500, pool=pool)
    body = {
        "name": "prod",
        "source": "request_log",
        "start": start.isoformat(),
        "end": (start + timedelta(seconds=60)).isoformat(),
        "pool": pool.name,
    }
    first = operator.post("/api/v1/workloads/", body, format="json")
    assert first.status_code == 201, first.content
    data = first.json()
    assert (data["version"], data["num_requests"]) == (1, 40)
    assert data["filters"]["requests_in_window"] == 45
    assert abs(data["spec"]["rate_per_second"] - 40 / 60) < 1e-9
    assert data["spec"]["prefix_hit_share"] > 0
    assert sum(data["spec"]["prompt_tokens"]["counts"]) == 40
    assert operator.post("/api/v1/workloads/", body, format="json").json()["version"] == 2
    assert AuditEvent.objects.filter(action="workload.create").count() == 2


def test_an_empty_window_is_a_400_saying_how_many_requests_it_held(operator: Any) -> None:
    start = timezone.now() - timedelta(minutes=10)
    log_requests(3, start=start, status=503)
    response = operator.post(
        "/api/v1/workloads/",
        {
            "name": "empty",
            "source": "request_log",
            "start": start.isoformat(),
            "end": (start + timedelta(seconds=60)).isoformat(),
        },
        format="json",
    )
    assert response.status_code == 400
    assert "held 3 requests" in response.json()["window"][0]
    assert not Workload.objects.exists()


def test_a_workload_from_a_loadgen_scenario(operator: Any) -> None:
    response = operator.post(
        "/api/v1/workloads/",
        {"name": "lt", "source": "loadgen", "scenario": "long-tail", "rate": 2, "duration_seconds": 120},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["num_requests"] > 100
    missing = operator.post("/api/v1/workloads/", {"name": "lt", "source": "loadgen"}, format="json")
    assert missing.status_code == 400 and {"scenario", "rate", "duration_seconds"} <= set(missing.json())


def test_an_experiment_gets_the_default_grid_one_revision_per_arm(operator: Any) -> None:
    workers = lab_workers()
    response = operator.post(
        "/api/v1/experiments/",
        {
            "name": "sweep",
            "workload": scenario_workload().pk,
            "workers": [w.name for w in workers],
            "duration_seconds": 5,
            "warmup_seconds": 1,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    data = response.json()
    # The pool runs a chunked profile (budget 512, no cap): that is the
    # baseline, a monolithic arm goes beside it, and the grid leaves out the
    # arm equal to it (a 512 cap on a 512 budget).
    current = workers[0].pool.desired_revision.fields
    assert [a["name"] for a in data["arms"]] == ["baseline", "monolithic", "chunk-256", "chunk-1024", "chunk-2048"]
    assert data["arms"][0]["fields"] == current and data["baseline"] == "baseline"
    assert data["arms"][1]["fields"]["prefill_mode"] == "monolithic"
    assert [a["chunk_size"] for a in data["arms"]] == [512, None, 256, 1024, 2048]
    assert data["phase"] == "pending" and data["repeats"] == 3
    assert len({a["revision"] for a in data["arms"]}) == 5
    assert AuditEvent.objects.filter(action="experiment.create", object_id=str(data["id"])).exists()


def test_the_default_baseline_is_the_pools_running_profile_with_its_max_num_seqs(operator: Any) -> None:
    # Default arms used max_num_seqs 64 while the pools ran 32: "baseline" was not the fleet's profile.
    running = make_profile(prefill_mode="monolithic", max_num_batched_tokens=2048, max_num_seqs=32)
    pool = make_pool(revision=running)
    workers = [enroll_worker(pool=pool)[0] for _ in range(2)]
    Worker.objects.filter(pk__in=[w.pk for w in workers]).update(state=Worker.State.READY)
    response = operator.post(
        "/api/v1/experiments/",
        {"name": "s", "workload": scenario_workload().pk, "workers": [w.name for w in workers]},
        format="json",
    )
    assert response.status_code == 201, response.content
    arms = response.json()["arms"]
    assert arms[0]["name"] == "baseline" and arms[0]["fields"] == running.fields
    assert [a["name"] for a in arms] == ["baseline", "chunk-256", "chunk-512", "chunk-1024", "chunk-2048"]
    assert {a["fields"]["max_num_seqs"] for a in arms} == {32}


def test_the_operator_can_pick_another_baseline(operator: Any) -> None:
    workers = lab_workers(1)
    other = make_profile(prefill_mode="monolithic", max_num_batched_tokens=4096, max_num_seqs=8)
    response = operator.post(
        "/api/v1/experiments/",
        {
            "name": "s",
            "workload": scenario_workload().pk,
            "workers": [w.name for w in workers],
            "baseline_revision": other.pk,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    arms = response.json()["arms"]
    assert arms[0]["fields"] == other.fields and {a["fields"]["max_num_seqs"] for a in arms} == {8}

    arms_in = [
        {"name": "a", "fields": {"max_num_batched_tokens": 512}},
        {"name": "b", "fields": {"max_num_batched_tokens": 256}},
    ]
    body = {"name": "s", "workload": scenario_workload().pk, "workers": [w.name for w in lab_workers(1)]}
    named = operator.post("/api/v1/experiments/", {**body, "arms": arms_in, "baseline": "b"}, format="json")
    assert named.status_code == 201 and named.json()["baseline"] == "b"
    wrong = operator.post("/api/v1/experiments/", {**body, "arms": arms_in, "baseline": "c"}, format="json")
    assert wrong.status_code == 400 and "baseline" in wrong.json()


@pytest.mark.parametrize(
    "arm, field, says",
    [
        (
            {"name": "tiny-budget", "fields": {"max_num_batched_tokens": 32, "max_num_seqs": 64}},
            "arms[1].max_num_batched_tokens",
            "below max_num_seqs",
        ),
        ({"name": "made-up", "fields": {"chunk_sauce": 3}}, "arms[1].chunk_sauce", "unknown profile field"),
    ],
)
def test_an_arm_the_engine_refuses_is_a_400_naming_arm_and_field(
    operator: Any, arm: dict, field: str, says: str
) -> None:
    workers = lab_workers(1)
    response = operator.post(
        "/api/v1/experiments/",
        {
            "name": "bad",
            "workload": scenario_workload().pk,
            "workers": [workers[0].name],
            "arms": [{"name": "ok", "fields": {}}, arm],
        },
        format="json",
    )
    assert response.status_code == 400
    errors = response.json()
    assert field in errors, errors
    assert arm["name"] in errors[field][0] and says in errors[field][0]
    assert not Experiment.objects.exists()


@pytest.mark.parametrize(
    "body, field, says",
    [
        ({"capacity_rate_scales": [1, 4, 2]}, "capacity_rate_scales", "must rise strictly"),
        ({"capacity_rate_scales": [1, 2], "capacity_seconds": 0.5}, "capacity_seconds", "at least 1"),
        ({"capacity_rate_scales": [0]}, "capacity_rate_scales", "greater than or equal to 0.001"),
    ],
)
def test_a_bad_capacity_ramp_is_a_400_naming_the_field(operator: Any, body: dict, field: str, says: str) -> None:
    response = operator.post(
        "/api/v1/experiments/",
        {"name": "ramp", "workload": scenario_workload().pk, "workers": [lab_workers(1)[0].name], **body},
        format="json",
    )
    assert response.status_code == 400
    assert says in str(response.json()[field]), response.json()
    assert not Experiment.objects.exists()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"duration_seconds": 1.6e308}, "duration_seconds"),  # the fuzzer's call that grew the web process to 18 GB
        ({"rate": 1e9}, "rate"),
        ({"rate": 50, "duration_seconds": 3600}, "duration_seconds"),  # 180,000 requests, drawn in the request
        ({"seed": 2**70}, "seed"),
    ],
)
def test_a_loadgen_workload_past_its_bounds_is_a_400_naming_the_field(operator: Any, change: dict, field: str) -> None:
    body = {"name": "big", "source": "loadgen", "scenario": "long-tail", "rate": 0.5, "duration_seconds": 60, **change}
    response = operator.post("/api/v1/workloads/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not Workload.objects.exists()


def test_the_largest_loadgen_workload_allowed_is_accepted(operator: Any) -> None:
    body = {"name": "largest", "source": "loadgen", "scenario": "long-tail", "rate": 10, "duration_seconds": 1000}
    response = operator.post("/api/v1/workloads/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["num_requests"] > 0


@pytest.mark.parametrize(
    "change, field",
    [
        ({"duration_seconds": 1e300}, "duration_seconds"),
        ({"repeats": 10**6}, "repeats"),
        ({"rate_scale": 1e12}, "rate_scale"),
        ({"capacity_rate_scales": [1.0 + i for i in range(50)]}, "capacity_rate_scales"),
        ({"capacity_seconds": 1e9}, "capacity_seconds"),
    ],
)
def test_an_experiment_past_its_bounds_is_a_400_naming_the_field(operator: Any, change: dict, field: str) -> None:
    response = operator.post(
        "/api/v1/experiments/",
        {"name": "big", "workload": scenario_workload().pk, "workers": [lab_workers(1)[0].name], **change},
        format="json",
    )
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not Experiment.objects.exists()


def test_a_capacity_ramp_is_stored_and_counted_in_the_arm_time(operator: Any) -> None:
    response = operator.post(
        "/api/v1/experiments/",
        {
            "name": "ramp",
            "workload": scenario_workload().pk,
            "workers": [lab_workers(1)[0].name],
            "arms": [{"name": "a", "fields": {}}],
            "duration_seconds": 5,
            "warmup_seconds": 1,
            "capacity_rate_scales": [0.5, 1, 2],
            "capacity_seconds": 10,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    data = response.json()
    assert (data["capacity_rate_scales"], data["capacity_seconds"]) == ([0.5, 1.0, 2.0], 10.0)
    assert data["arms"][0]["ramp"] == [] and data["arms"][0]["capacity"] is None
    # Three repeats (the default), each warmed up afresh (arms interleave), then the ramp.
    assert Experiment.objects.get(pk=data["id"]).seconds_per_arm() == 3 * (1 + 5) + 3 * 10


def test_a_knob_vllm_lacks_is_a_400_for_vllm_workers(operator: Any) -> None:
    workers = lab_workers(1, engine_kind="vllm")
    response = operator.post(
        "/api/v1/experiments/",
        {
            "name": "bad",
            "workload": scenario_workload().pk,
            "workers": [workers[0].name],
            "arms": [{"name": "short", "fields": {"short_prompt_threshold": 128}}],
        },
        format="json",
    )
    assert response.status_code == 400
    assert "vllm engine has no such knob" in response.json()["arms[0].short_prompt_threshold"][0]


def test_workers_whose_pool_carries_traffic_alone_are_refused(operator: Any) -> None:
    workers = lab_workers(1)
    table = RoutingTable.objects.create(model="tiny")
    RoutingPool.objects.create(table=table, pool=workers[0].pool, role="stable", weight_bp=10000)
    response = operator.post(
        "/api/v1/experiments/",
        {"name": "x", "workload": scenario_workload().pk, "workers": [workers[0].name]},
        format="json",
    )
    assert response.status_code == 400
    assert "would have no worker left" in response.json()["workers"][0]


def test_a_worker_in_a_running_experiment_is_refused(operator: Any) -> None:
    workers = lab_workers(1)
    Experiment.create(name="a", workload=scenario_workload(), workers=workers)
    response = operator.post(
        "/api/v1/experiments/",
        {"name": "b", "workload": Workload.objects.first().pk, "workers": [workers[0].name]},
        format="json",
    )
    assert response.status_code == 400 and "already uses" in response.json()["workers"][0]


def test_viewers_may_read_but_not_start_or_abort() -> None:
    viewer = api_client(make_user(Role.VIEWER))
    experiment = Experiment.create(name="a", workload=scenario_workload(), workers=lab_workers(1))
    assert viewer.get(f"/api/v1/experiments/{experiment.pk}/").status_code == 200
    assert viewer.post(f"/api/v1/experiments/{experiment.pk}/abort/", {}, format="json").status_code == 403
    assert viewer.post("/api/v1/experiments/", {}, format="json").status_code == 403


def test_abort_sets_the_flag_once_with_an_audit_row(operator: Any) -> None:
    experiment = Experiment.create(name="a", workload=scenario_workload(), workers=lab_workers(1))
    response = operator.post(f"/api/v1/experiments/{experiment.pk}/abort/", {"reason": "need them"}, format="json")
    assert response.status_code == 200 and response.json()["abort_requested"] is True
    assert AuditEvent.objects.filter(action="experiment.abort").count() == 1
    again = operator.post(f"/api/v1/experiments/{experiment.pk}/abort/", {}, format="json")
    assert again.status_code == 400


def test_adopting_the_recommended_arm_revises_the_profile_the_workers_ran(operator: Any) -> None:
    workers = lab_workers(1)
    previous = workers[0].pool.desired_revision
    experiment = Experiment.create(name="a", workload=scenario_workload(), workers=workers)
    Experiment.objects.filter(pk=experiment.pk).update(
        phase=Phase.SUCCEEDED,
        recommendation={"winner": "chunk-256", "reasons": []},
        previous={str(workers[0].pk): {"desired_revision": None, "running_revision": previous.pk, "cordoned": False}},
    )
    response = operator.post(f"/api/v1/experiments/{experiment.pk}/adopt/", {}, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    assert data["profile"] == previous.profile.name
    assert data["new_rollout_url"] == f"/rollouts/new/?revision={data['revision']}"
    revision = previous.profile.latest_revision()
    assert revision.pk == data["revision"] and revision.fields["long_prefill_token_threshold"] == 256
    assert AuditEvent.objects.filter(action="experiment.adopt").exists()
    unknown = operator.post(f"/api/v1/experiments/{experiment.pk}/adopt/", {"arm": "nope"}, format="json")
    assert unknown.status_code == 400 and "arm" in unknown.json()


def test_create_experiment_captures_the_pools_traffic_and_starts_the_default_grid() -> None:
    from controlplane.experiments.services import create_experiment

    serving = make_pool()
    log_requests(30, start=timezone.now() - timedelta(minutes=2), pool=serving)
    experiment = create_experiment(name="advised", workers=lab_workers(1), pool=serving, actor="advisor")
    assert experiment.workload.filters["pool"] == serving.name and experiment.workload.num_requests == 30
    assert experiment.arms.count() == 5


def test_create_experiment_on_an_empty_window_keeps_nothing() -> None:
    from django.core.exceptions import ValidationError

    from controlplane.experiments.services import create_experiment

    with pytest.raises(ValidationError) as caught:
        create_experiment(name="advised", workers=lab_workers(1), pool=make_pool())
    assert "held 0 requests" in caught.value.message_dict["window"][0]
    assert not Workload.objects.exists()
