"""Predict, then verify, on a real reference worker on the tiny model (the
ramp tests' worker and agent thread; the runners driven in this process
step by step).

The prediction runs on a step-time table fitted in the test from a handful
of the reference engine's own measured steps (``fit.fit``), kept where
predict mode looks for it under the data dir. "Verify on lab workers"
(the API's verify action) then measures the predicted best arms and the
baseline on that worker, and the verification's API detail and page show
predicted and measured side by side for every arm.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.experiments import prediction, runner
from controlplane.experiments.models import ArmStatus, Experiment, Mode, Phase, Workload
from controlplane.fleet.models import Worker
from tests.controlplane.experiments.test_runner_ramp import MAX_MODEL_LEN, served, worker
from tests.controlplane.factories import make_user
from workers.engines.sim import fit, virtual
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile

pytestmark = pytest.mark.django_db(transaction=True)
__all__ = ["served", "worker"]  # the ramp tests' fixtures, used here
ARMS = [
    {
        "name": "baseline",
        "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": MAX_MODEL_LEN, "max_num_seqs": 16},
    },
    {
        "name": "chunk-64",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 64,
            "max_num_seqs": 16,
        },
    },
    {
        "name": "chunk-128",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 256,
            "long_prefill_token_threshold": 128,
            "max_num_seqs": 16,
        },
    },
]
OBJECTIVES = {"ttft_ms": 600000, "tpot_ms": 600000}


@pytest.fixture(autouse=True)
def fast(settings: Any, tiny_model: Path, tmp_path: Path) -> None:
    settings.GATEWAY_POLL_SECONDS = 0.1
    settings.EXPERIMENT_DRAIN_TIMEOUT_SECONDS = 1.0
    settings.EXPERIMENT_APPLY_TIMEOUT_SECONDS = 10.0
    settings.EXPERIMENT_TOKENIZER_DIR = str(tiny_model)  # the checkpoint the lab worker serves
    settings.DATA_DIR = tmp_path


def small_table(model_dir: Path) -> Path:
    """A step-time table from a handful of the reference engine's measured
    steps, where predict mode looks for the reference workers' table."""
    rng = random.Random(0)
    planned = [
        PlannedRequest(
            0.05 * k,
            "completions",
            rng.randint(4, 24),
            prompt_token_ids=[rng.randrange(100, 300) for _ in range(rng.choice((20, 150, 400)))],
        )
        for k in range(16)
    ]
    profile = EngineProfile(prefill_mode="chunked", max_num_batched_tokens=256, long_prefill_token_threshold=128)
    engine = fit.RecordingEngine(model_dir, profile=profile, max_model_len=MAX_MODEL_LEN)
    recorder, _ = virtual.measure(engine, planned)
    coefficients, r2 = fit.fit(engine.batches, [s.duration_seconds for s in recorder.steps])
    table = {
        "coefficients": coefficients,
        "r2": r2,
        "steps": len(recorder.steps),
        "model_dir": str(model_dir),
        "weight_bytes": engine.memory_facts().weight_bytes,
        "kv_cache_bytes": engine.num_blocks_total * engine.block_bytes,
        "hardware": "test CPU",
    }
    return fit.write(table, prediction.reference_table())


def test_a_sweep_predicted_on_a_reference_worker_is_verified_on_it_side_by_side(
    worker: Worker, tiny_model: Path
) -> None:
    small_table(tiny_model)
    workload = Workload.from_scenario(name="pv", scenario="long-tail", rate=3.0, duration_seconds=30)
    operator = make_user(Role.OPERATOR)
    api = APIClient()
    api.force_authenticate(operator)
    reply = api.post(
        "/api/v1/experiments/",
        {
            "name": "predicted",
            "workload": workload.pk,
            "workers": [worker.name],
            "arms": ARMS,
            "duration_seconds": 3,
            "warmup_seconds": 1,
            "repeats": 2,
            "objectives": OBJECTIVES,
            "mode": "predict",
        },
        format="json",
    )
    assert reply.status_code == 201, reply.content
    assert reply.json()["mode"] == "predict"
    predicted_id = reply.json()["id"]
    for _ in range(40):
        if not prediction.drive(predicted_id):
            break
    predicted = Experiment.objects.get(pk=predicted_id)
    assert predicted.phase == Phase.SUCCEEDED, predicted.message
    assert predicted.predicted_label == "predicted (simulated test CPU, fitted table)"
    assert set(predicted.arms.values_list("status", flat=True)) == {ArmStatus.SUCCEEDED}
    assert predicted.repeats >= 2 and predicted.recommendation["reasons"]
    worker.refresh_from_db()
    assert not worker.cordoned and worker.desired_revision_id is None  # a prediction never touches the worker

    page = Client()
    page.force_login(operator)
    html = page.get(f"/experiments/{predicted_id}/").content.decode()
    assert "predicted (simulated test CPU, fitted table)" in html and 'data-button="verify"' in html

    # "Verify on lab workers": the best arms and the baseline, measured.
    reply = api.post(f"/api/v1/experiments/{predicted_id}/verify/", {"repeats": 1}, format="json")
    assert reply.status_code == 201, reply.content
    verification = reply.json()
    assert verification["mode"] == "measure" and verification["verifies"] == predicted_id
    names = [a["name"] for a in verification["arms"]]
    assert names == [a.name for a in predicted.arms_to_verify()] and "baseline" in names
    for _ in range(40):
        if not runner.drive(verification["id"]):
            break
    measured = Experiment.objects.get(pk=verification["id"])
    assert measured.phase == Phase.SUCCEEDED, measured.message
    assert set(measured.arms.values_list("status", flat=True)) == {ArmStatus.SUCCEEDED}, [
        a.error for a in measured.arms.all()
    ]
    assert not any(r.get("predicted") for a in measured.arms.all() for r in a.results)

    detail = api.get(f"/api/v1/experiments/{measured.pk}/").json()
    rows = {row["arm"]: row["figures"] for row in detail["predicted"]}
    assert list(rows) == names
    by_name = {a.name: a for a in predicted.arms.all()}
    for name, figures in rows.items():
        for key in ("goodput", "output_throughput", "client_ttft_p99"):
            assert figures[key]["predicted"] == by_name[name].summary[key]["mean"]
            assert figures[key]["measured"] == measured.arms.get(name=name).summary[key]["mean"]
            assert figures[key]["measured"] is not None and figures[key]["predicted"] is not None
    assert api.get(f"/api/v1/experiments/{predicted_id}/").json()["verifications"] == [measured.pk]

    html = page.get(f"/experiments/{measured.pk}/").content.decode()
    table = html.split('id="experiment-comparison"', 1)[1].split("</table>", 1)[0]
    for name in names:
        row = table.split(f'<tr data-arm="{name}"><th>{name}</th>', 1)[1].split("</tr>", 1)[0]
        assert row.count('data-predicted="') == row.count('data-measured="') == 5
        assert "—" not in row.split('data-predicted="client_stall_p99"')[0]  # the figures are there, not dashes


def test_verifying_a_measured_experiment_or_an_unfinished_prediction_is_refused(worker: Worker) -> None:
    workload = Workload.from_scenario(name="pv", scenario="burst", rate=1.0, duration_seconds=30)
    api = APIClient()
    api.force_authenticate(make_user(Role.OPERATOR))
    measured = Experiment.create(name="m", workload=workload, workers=[worker], arms=ARMS, duration_seconds=1)
    reply = api.post(f"/api/v1/experiments/{measured.pk}/verify/", {}, format="json")
    assert reply.status_code == 400 and "mode" in reply.json(), reply.content
    pending = Experiment.create(
        name="p", workload=workload, workers=[worker], arms=ARMS, duration_seconds=1, mode=Mode.PREDICT
    )
    reply = api.post(f"/api/v1/experiments/{pending.pk}/verify/", {}, format="json")
    assert reply.status_code == 400 and "phase" in reply.json(), reply.content
