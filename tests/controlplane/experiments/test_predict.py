"""Predict mode on a simulated worker, driven in this process step by step:
the arms of a 10-minute workload run in virtual time on the H200 the worker
reported (a replay that could never finish in a test in real time), stored
in the shape of measured repeats with a recommendation; and a worker no
simulation can stand for is refused, naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.experiments import prediction, runner
from controlplane.experiments.models import ArmStatus, Experiment, Mode, Phase, Workload
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, make_pool, make_profile, make_user
from workers import predict

pytestmark = pytest.mark.django_db(transaction=True)
WORKLOAD_SECONDS = 600.0
H200 = {"kind": "aiconfigurator", "system": "h200_sxm", "backend": "vllm", "model": "meta-llama/Meta-Llama-3.1-8B"}
ARMS = [
    {"name": "baseline", "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": 8192}},
    {
        "name": "chunk-512",
        "fields": {"prefill_mode": "chunked", "max_num_batched_tokens": 2048, "long_prefill_token_threshold": 512},
    },
]


def sim_worker(name: str = "sim-lab", **hardware: Any) -> Worker:
    pool = make_pool(revision=make_profile(engine_kind="sim"))
    w, _ = enroll_worker(
        name,
        pool=pool,
        engine_kind="sim",
        max_model_len=8192,
        hardware={"device": "cuda", "name": "H200 SXM (simulated)", "simulated": True, "sim": H200, **hardware},
    )
    return w


def predicted(worker: Worker, **options: Any) -> Experiment:
    workload = Workload.from_scenario(
        name="ten-minutes", scenario="long-tail", rate=0.2, duration_seconds=WORKLOAD_SECONDS
    )
    return Experiment.create(
        name="predicted",
        workload=workload,
        workers=[worker],
        arms=ARMS,
        duration_seconds=WORKLOAD_SECONDS,
        warmup_seconds=10,
        repeats=2,
        mode=Mode.PREDICT,
        **options,
    )


def run_to_the_end(exp: Experiment, max_steps: int = 30) -> Experiment:
    for _ in range(max_steps):
        if not prediction.drive(exp.pk):
            break
    return Experiment.objects.get(pk=exp.pk)


def test_a_prediction_runs_a_ten_minute_workload_in_virtual_time_on_the_worker_s_own_gpu() -> None:
    worker = sim_worker()
    exp = run_to_the_end(predicted(worker))
    assert exp.phase == Phase.SUCCEEDED, exp.message
    assert exp.simulation["label"] == "H200 SXM" and exp.simulation["device"]["system"] == "h200_sxm"
    assert exp.predicted_label == "predicted (simulated H200 SXM)"
    # The workers were never taken out of traffic.
    worker.refresh_from_db()
    assert not worker.cordoned and worker.desired_revision_id is None
    arms = list(exp.arms.order_by("index"))
    assert [a.status for a in arms] == [ArmStatus.SUCCEEDED] * 2, [a.error for a in arms]
    for arm in arms:
        assert len(arm.results) == exp.repeats >= 2
        for result in arm.results:
            assert result["predicted"] is True
            # Repeat r is the measured runner's repeat r: the same requests.
            planned = runner.planner(exp, arm, [worker])(result["repeat"], exp.duration_seconds, exp.rate_scale)
            last_arrival = max(p.start_seconds for p in planned)
            assert last_arrival > 0.9 * WORKLOAD_SECONDS
            # The run spans the workload's ten minutes of virtual time: from the first
            # arrival to the last request's finish, a few GPU seconds after the last arrival.
            span = result["client"]["duration_seconds"]
            assert last_arrival < span < last_arrival + 60, (last_arrival, span)
            assert result["figures"]["num_requests"] == len(planned) == result["figures"]["successful_requests"]
            assert result["figures"]["output_throughput"] > 0 and result["figures"]["client_ttft_p99"] > 0
        assert arm.summary["goodput"]["mean"] > 0
        assert not arm.conditions(exp).not_comparable
    assert exp.recommendation["outcome"] in ("winner", "no_significant_winner", "none_met")
    assert exp.recommendation["reasons"]


def test_a_worker_that_cannot_be_simulated_is_refused_naming_the_mode() -> None:
    pool = make_pool(revision=make_profile(engine_kind="vllm"))
    vllm, _ = enroll_worker("gpu-lab", pool=pool, engine_kind="vllm", hardware={"device": "cuda"})
    with pytest.raises(ValidationError) as refused:
        predicted(vllm)
    assert "worker gpu-lab cannot be simulated: its engine (vllm)" in refused.value.message_dict["mode"][0]
    old = sim_worker("old-sim", sim=None)
    with pytest.raises(ValidationError) as refused:
        predicted(old)
    assert "reports no simulated device" in refused.value.message_dict["mode"][0]


def test_a_prediction_runs_no_capacity_ramp() -> None:
    with pytest.raises(ValidationError) as refused:
        predicted(sim_worker(), capacity_rate_scales=[1.0, 2.0])
    assert "capacity_rate_scales" in refused.value.message_dict


def test_a_prediction_leaves_workers_busy_with_a_measured_experiment_alone() -> None:
    worker = sim_worker()
    workload = Workload.from_scenario(name="w", scenario="burst", rate=1.0, duration_seconds=30)
    Experiment.create(name="measured", workload=workload, workers=[worker], arms=ARMS, duration_seconds=1)
    assert predicted(worker).mode == Mode.PREDICT  # it does not use the worker


def test_the_api_refuses_a_prediction_on_a_vllm_worker_naming_the_mode_and_reads_the_mode_back() -> None:
    pool = make_pool(revision=make_profile(engine_kind="vllm"))
    enroll_worker("gpu-lab", pool=pool, engine_kind="vllm", hardware={"device": "cuda"})
    workload = Workload.from_scenario(name="w", scenario="burst", rate=1.0, duration_seconds=30)
    api = APIClient()
    api.force_authenticate(make_user(Role.OPERATOR))
    body = {"name": "p", "workload": workload.pk, "workers": ["gpu-lab"], "arms": ARMS, "mode": "predict"}
    reply = api.post("/api/v1/experiments/", body, format="json")
    assert reply.status_code == 400 and "its engine (vllm)" in reply.json()["mode"][0], reply.content
    reply = api.post("/api/v1/experiments/", {**body, "workers": [sim_worker().name]}, format="json")
    assert reply.status_code == 201 and reply.json()["mode"] == "predict", reply.content
    assert api.get(f"/api/v1/experiments/{reply.json()['id']}/").json()["mode"] == "predict"


def test_the_reference_fit_runs_profiles_the_engine_accepts_at_the_model_s_own_length() -> None:
    # The fit runs the reference engine at the checkpoint's native length: a monolithic
    # budget under it was refused there, and the task failed before any prediction.
    model_dir = predict.shipped_model_dir()
    native = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    profiles = predict.fit_profiles(model_dir)
    assert {p.prefill_mode for p in profiles} == {"monolithic", "chunked"}
    for profile in profiles:
        profile.validate(engine_kind="reference", max_model_len=native)
