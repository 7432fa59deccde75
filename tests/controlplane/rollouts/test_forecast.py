"""How long each analysis needs to reach its minimum sample count at the
current traffic rate: the pure forecast as a table of cases, then the
rollout's own forecast from the request log, in the API's create reply and
on the rollout page."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.gateway.models import RequestLog
from controlplane.rollouts import steps as plan
from controlplane.rollouts.forecast import forecast
from controlplane.rollouts.judge import MetricRule, RunSpec
from controlplane.rollouts.measure import TRAFFIC_WINDOW_SECONDS
from controlplane.rollouts.models import AnalysisTemplate
from tests.controlplane.rollouts.factories import Fleet, make_fleet

SPEC = RunSpec(
    metrics=(
        MetricRule("ttft", "client_ttft_p99", min_samples=20),
        MetricRule("errors", "client_error_rate", min_samples=10),
    ),
    interval_seconds=60.0,
)
ROLES = frozenset({"stable", "canary"})


@pytest.mark.parametrize(
    ("rate", "canary_bp", "seconds", "conclusive"),
    [
        (2.0, 1000, 100.0, False),  # the case: 0.2 requests/s to a 10% canary; 20 take 100 s > 60 s
        (2.0, 5000, 20.0, True),  # half the traffic each: 1 request/s per side
        (2.0, 9000, 100.0, False),  # now the stable side is the small one
        (1 / 3, 5000, 120.0, False),  # 120 s is past the 60 s window
        (0.0, 1000, None, False),  # no traffic: never
    ],
)
def test_the_slower_side_sets_the_time_to_the_largest_min_samples(
    rate: float, canary_bp: int, seconds: float | None, conclusive: bool
) -> None:
    steps = [plan.SetWeight(canary_bp), plan.Analysis("default")]
    [f] = forecast(steps, {"default": SPEC}, rate, roles=ROLES, has_baseline=False)
    assert f.min_samples == 20
    assert f.step_index == 1 and f.canary_bp == canary_bp and f.baseline_role == "stable"
    assert f.seconds_to_min_samples == (pytest.approx(seconds) if seconds is not None else None)
    assert f.conclusive is conclusive
    assert f.to_json()["conclusive"] is conclusive


def test_a_baseline_takes_the_canarys_share_so_both_sides_need_the_same_time() -> None:
    steps = [plan.SetWeight(2500), plan.Analysis("default")]
    [f] = forecast(steps, {"default": SPEC}, 4.0, roles=ROLES | {"baseline"}, has_baseline=True)
    assert (f.baseline_role, f.baseline_bp) == ("baseline", 2500)
    assert f.canary_seconds == f.baseline_seconds == pytest.approx(20.0)


def test_each_analysis_of_the_default_plan_gets_the_weight_set_before_it() -> None:
    result = forecast(plan.default_plan(), {"default": SPEC}, 2.0, roles=ROLES, has_baseline=False)
    assert [(f.step_index, f.canary_bp) for f in result] == [(1, 1000), (3, 2500), (5, 5000)]
    assert [f.conclusive for f in result] == [False, True, True]  # 10%: 100 s; 25%: 40 s; 50%: 20 s


def test_an_analysis_with_an_unknown_template_or_no_metrics_has_no_forecast() -> None:
    steps = [plan.SetWeight(1000), plan.Analysis("gone"), plan.Analysis("empty")]
    assert forecast(steps, {"empty": RunSpec(metrics=())}, 2.0, roles=ROLES, has_baseline=False) == []


def test_the_message_says_how_long_against_the_window() -> None:
    [f] = forecast(
        [plan.SetWeight(1000), plan.Analysis("default")], {"default": SPEC}, 2.0, roles=ROLES, has_baseline=False
    )
    assert f.describe() == (
        "analysis at step 2 (default, canary 10%): 20 samples per side take about 100 s, longer than its 60 s window"
    )


# ---- the rollout's forecast, from the request log -----------------------------------------------
@pytest.fixture
def fleet(db: Any) -> Fleet:
    fleet = make_fleet(num_stable=2, num_canary=1)
    AnalysisTemplate.default()
    # 2 requests/s to the model over the traffic window, all to the stable pool so far.
    now = timezone.now()
    num_requests = int(2 * TRAFFIC_WINDOW_SECONDS)
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"r{i}",
                created_at=now - timedelta(seconds=i * 0.5),
                model=fleet.table.model,
                cohort="stable",
                pool=fleet.stable,
                worker=fleet.workers["stable"][0],
                status=200,
                ttft_seconds=0.1,
                max_gap_seconds=0.1,
                tpot_seconds=0.01,
                e2e_seconds=0.2,
                prompt_tokens=10,
                output_tokens=8,
            )
            for i in range(num_requests)
        ]
    )
    return fleet


def _create(api: APIClient, fleet: Fleet) -> Any:
    body = {
        "model": fleet.table.model,
        "stable_pool": fleet.stable.name,
        "canary_pool": fleet.canary.name,
        "target_revision": fleet.target_revision.pk,
        "gate": {"enabled": False},
    }
    response = api.post("/api/v1/rollouts/", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def test_the_create_reply_forecasts_each_default_analysis_at_the_logged_rate(
    operator_api: APIClient, fleet: Fleet
) -> None:
    rollout = _create(operator_api, fleet)
    forecasts = rollout["sample_forecast"]
    assert [f["canary_bp"] for f in forecasts] == [1000, 2500, 5000]
    first = forecasts[0]
    assert first["requests_per_second"] == pytest.approx(2.0, rel=0.01)
    assert first["min_samples"] == 20
    # The default template measures over 60 s: 20 requests at 0.2/s take 100 s.
    assert first["seconds_to_min_samples"] == pytest.approx(100.0, rel=0.01)
    assert first["conclusive"] is False
    assert forecasts[2]["conclusive"] is True


def test_the_rollout_page_shows_the_forecast(operator_api: APIClient, operator_client: Client, fleet: Fleet) -> None:
    rollout = _create(operator_api, fleet)
    html = operator_client.get(f"/rollouts/{rollout['id']}/").content.decode()
    assert 'id="rollout-forecast"' in html
    assert 'data-step="1" data-conclusive="false"' in html
    assert 'data-step="5" data-conclusive="true"' in html
    assert "will be inconclusive" in html


def test_a_sample_wait_long_enough_makes_a_slow_analysis_conclusive() -> None:
    waiting = RunSpec(metrics=SPEC.metrics, interval_seconds=60.0, sample_wait_seconds=300.0)
    [f] = forecast(
        [plan.SetWeight(1000), plan.Analysis("default")], {"default": waiting}, 2.0, roles=ROLES, has_baseline=False
    )
    assert f.seconds_to_min_samples == pytest.approx(100.0) and f.conclusive
    assert f.describe().endswith("within its 5 min wait")
