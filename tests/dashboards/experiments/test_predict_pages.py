"""A prediction's page and its "Verify on lab workers" button: the curve and
recommendation are labelled with the simulated device, the button starts a
measure-mode experiment of the best arms and the baseline, and that
experiment's page sets the prediction beside its own figures, arm by arm
(a table, and the prediction on the plot)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client

from controlplane.experiments.models import ArmStatus, Experiment, Mode, Phase, Workload
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db
ARMS = [
    {"name": "baseline", "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": 512}},
    {"name": "chunk-64", "fields": {"max_num_batched_tokens": 128, "long_prefill_token_threshold": 64}},
    {"name": "chunk-128", "fields": {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 128}},
    {"name": "chunk-256", "fields": {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}},
]
GOODPUT = {"baseline": 1.0, "chunk-64": 1.4, "chunk-128": 1.6, "chunk-256": 1.2}


def summary(goodput: float) -> dict[str, Any]:
    figures = {"goodput": goodput, "output_throughput": 100 * goodput, "client_ttft_p99": 0.5 / goodput}
    figures |= {"client_stall_p99": 0.2, "client_tpot_p99": 0.05}
    return {k: {"mean": v, "half_range": 0.0, "values": [v, v]} for k, v in figures.items()}


@pytest.fixture
def prediction() -> Experiment:
    """A finished prediction on a reference lab worker, its figures set by hand."""
    worker, _ = enroll_worker("lab", pool=make_pool(revision=make_profile()))
    workload = Workload.from_scenario(name="w", scenario="burst", rate=1.0, duration_seconds=30)
    exp = Experiment.create(name="sweep", workload=workload, workers=[worker], arms=ARMS, mode=Mode.PREDICT)
    for arm in exp.arms.all():
        arm.status, arm.summary = ArmStatus.SUCCEEDED, summary(GOODPUT[arm.name])
        arm.results = [{"repeat": r, "predicted": True, "figures": {}, "client": {"num_requests": 20}} for r in (0, 1)]
        arm.save()
    exp.phase, exp.simulation = Phase.SUCCEEDED, {"label": "H200 SXM", "worker": "lab"}
    exp.recommendation = {"winner": "chunk-128", "basis": "goodput", "reasons": ["chunk-128 has the highest goodput"]}
    exp.save()
    return exp


def test_a_prediction_is_labelled_with_its_simulated_gpu_and_offers_verification(
    prediction: Experiment, operator_client: Client
) -> None:
    html = operator_client.get(f"/experiments/{prediction.pk}/").content.decode()
    assert html.count("predicted (simulated H200 SXM)") >= 3  # the heading, the plot, the results
    assert "Predicted recommendation" in html
    assert re.search(r'data-button="verify">Verify on lab workers</button>\s*<span[^>]*>measures ', html)
    # The best two that met the objectives, and the baseline.
    assert [a.name for a in prediction.arms_to_verify()] == ["baseline", "chunk-64", "chunk-128"]
    listing = operator_client.get("/experiments/").content.decode()
    assert 'data-mode="predict">predicted (simulated H200 SXM)' in listing


def test_verify_starts_a_measured_experiment_that_shows_predicted_beside_measured(
    prediction: Experiment, operator_client: Client, viewer_client: Client
) -> None:
    assert viewer_client.post(f"/experiments/{prediction.pk}/verify/").status_code == 403
    reply = operator_client.post(f"/experiments/{prediction.pk}/verify/")
    verification = Experiment.objects.get(verifies=prediction)
    assert reply.status_code == 302 and reply["Location"] == f"/experiments/{verification.pk}/"
    assert verification.mode == Mode.MEASURE and verification.phase == Phase.PENDING
    assert list(verification.arms.values_list("name", flat=True)) == ["baseline", "chunk-64", "chunk-128"]
    assert [a.fields for a in verification.arms.order_by("index")] == [
        a.fields for a in prediction.arms.filter(name__in=["baseline", "chunk-64", "chunk-128"]).order_by("index")
    ]
    # Measured so far: chunk-128 only.
    arm = verification.arms.get(name="chunk-128")
    arm.status, arm.summary = ArmStatus.SUCCEEDED, summary(1.2)
    arm.save()

    html = operator_client.get(f"/experiments/{verification.pk}/").content.decode()
    table = html.split('id="experiment-comparison"', 1)[1].split("</table>", 1)[0]
    row = table.split('<tr data-arm="chunk-128">', 1)[1].split("</tr>", 1)[0]
    assert re.search(r'data-predicted="goodput">1\.60\s*<', row) and re.search(
        r'data-measured="goodput">1\.20\s*<', row
    )
    assert "0.75×" in row  # measured ÷ predicted
    pending = table.split('<tr data-arm="chunk-64">', 1)[1].split("</tr>", 1)[0]
    assert re.search(r'data-predicted="goodput">1\.40\s*<', pending) and re.search(
        r'data-measured="goodput">—\s*<', pending
    )
    plot = json.loads(html.split('id="experiment-plot-data">', 1)[1].split("</script>", 1)[0])
    assert plot["x"] == [128] and plot["predicted"]["goodput"] == [1.6]
    prediction_page = operator_client.get(f"/experiments/{prediction.pk}/").content.decode()
    assert f'data-verification="{verification.pk}"' in prediction_page


def test_a_measured_experiment_offers_no_verification(prediction: Experiment, operator_client: Client) -> None:
    Experiment.objects.filter(pk=prediction.pk).update(mode=Mode.MEASURE)
    assert 'data-button="verify"' not in operator_client.get(f"/experiments/{prediction.pk}/").content.decode()
    reply = operator_client.post(f"/experiments/{prediction.pk}/verify/", follow=True)
    assert "only a prediction can be verified" in reply.content.decode()
    assert not Experiment.objects.filter(verifies=prediction).exists()
