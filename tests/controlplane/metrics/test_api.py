"""The metrics API: figures, one-window queries, time series, objectives,
scrape status and the control plane's Prometheus page."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import exposition
from controlplane.metrics.models import ServiceObjectives
from tests.controlplane.factories import api_client, make_user
from tests.controlplane.metrics.pages import Page, job, store

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer():
    return api_client(make_user(Role.VIEWER))


def scraped(now, cohort: str = "stable") -> Worker:
    w = Worker.objects.create(
        name=f"w-{cohort}", url="http://w.invalid", pool=Pool.objects.get_or_create(name=cohort)[0]
    )
    for i in range(12):
        store(
            now - timedelta(seconds=55 - 5 * i),
            {job(w, cohort): Page(counters={"vllm:request_success_total": 10.0 * i})},
        )
    return w


def test_the_query_endpoint_answers_per_group(viewer) -> None:
    now = timezone.now()
    scraped(now, "stable")
    scraped(now, "canary")
    reply = viewer.get("/api/v1/metrics/query", {"figure": "requests_per_second", "window": "5m", "group_by": "cohort"})
    assert reply.status_code == 200
    body = reply.json()
    assert body["figure"] == "requests_per_second" and body["window_seconds"] == 300 and body["group_by"] == "cohort"
    assert body["unit"] == "requests/s" and body["direction"] == "higher"
    assert set(body["values"]) == {"stable", "canary"} and all(v > 0 for v in body["values"].values())
    only = viewer.get("/api/v1/metrics/query/", {"figure": "requests_per_second", "window": "5m", "cohort": "canary"})
    assert list(only.json()["values"]) == ["fleet"]


def test_empty_windows_answer_null_not_zero(viewer) -> None:
    body = viewer.get("/api/v1/metrics/query", {"figure": "ttft_p99", "window": "1m"}).json()
    assert body["values"] == {"fleet": None}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"window": "5m"}, "figure"),
        ({"figure": "ttft_p98"}, "figure"),
        ({"figure": "ttft_p99", "window": "5 minutes"}, "window"),
        ({"figure": "ttft_p99", "window": "0s"}, "window"),
        ({"figure": "ttft_p99", "window": "30d"}, "window"),
        ({"figure": "ttft_p99", "group_by": "zone"}, "group_by"),
        ({"figure": "itl_p99", "group_by": "length_bucket"}, "group_by"),  # not labelled by prompt length
        ({"figure": "goodput", "ttft_slo": "-1"}, "ttft_slo"),
    ],
)
def test_bad_parameters_answer_400_naming_the_field(viewer, params, field) -> None:
    reply = viewer.get("/api/v1/metrics/query", params)
    assert reply.status_code == 400
    assert list(reply.json()) == [field]


def test_a_time_series_has_one_value_per_step_and_group(viewer) -> None:
    scraped(timezone.now())
    reply = viewer.get(
        "/api/v1/metrics/query_range", {"figure": "requests_per_second", "window": "1m", "range": "10m", "step": "1m"}
    )
    assert reply.status_code == 200
    body = reply.json()
    assert len(body["times"]) == 11 and body["step_seconds"] == 60
    assert len(body["series"]["fleet"]) == 11
    assert body["series"]["fleet"][0] is None and body["series"]["fleet"][-1] > 0  # no data before the first scrape
    assert viewer.get("/api/v1/metrics/query_range", {"figure": "ttft_p99", "range": "1d", "step": "1s"}).json() == {
        "step": ["at most 1500 points; use a larger step"]
    }


def test_length_buckets_group_exact_client_figures(viewer) -> None:
    from controlplane.gateway.models import RequestLog

    now = timezone.now()
    for tokens, ttft in ((100, 0.2), (100, 0.4), (5000, 2.0)):
        RequestLog.objects.create(
            request_id=f"r{tokens}{ttft}",
            created_at=now - timedelta(seconds=10),
            model="tiny",
            cohort="stable",
            prompt_tokens=tokens,
            ttft_seconds=ttft,
            tpot_seconds=0.01,
            e2e_seconds=1.0,
            status=200,
        )
    body = viewer.get(
        "/api/v1/metrics/query", {"figure": "client_ttft_p50", "window": "1m", "group_by": "length_bucket"}
    ).json()
    # Nearest rank: the median of two is the lower one (rank ceil(0.5 * 2) = 1).
    assert body["values"] == {"<=512": pytest.approx(0.2), "<=8K": pytest.approx(2.0)}
    slo = viewer.get("/api/v1/metrics/query", {"figure": "goodput_ratio", "window": "1m", "ttft_slo": "1"}).json()
    assert slo["values"] == {"fleet": pytest.approx(2 / 3)}


def test_the_registry_lists_every_figure_with_unit_direction_and_promql(viewer) -> None:
    body = viewer.get("/api/v1/metrics/figures").json()
    names = {f["name"]: f for f in body["figures"]}
    assert body["panel"] == ["ttft_p99", "memory_peak_to_mean", "prefill_wait_p99", "kv_fragmentation"]
    assert names["ttft_p99"]["direction"] == "lower" and names["ttft_p99"]["unit"] == "s"
    assert "histogram_quantile(0.99" in names["ttft_p99"]["promql"]
    assert (
        "length_bucket" in names["client_ttft_p99"]["group_by"] and "length_bucket" not in names["itl_p99"]["group_by"]
    )
    assert "length_bucket" in names["ttft_p99"]["group_by"]  # the workers label TTFT by prompt length


def test_operators_set_objectives_and_viewers_may_only_read_them() -> None:
    viewer, operator = api_client(make_user(Role.VIEWER)), api_client(make_user(Role.OPERATOR))
    assert viewer.get("/api/v1/metrics/objectives").json()["ttft_seconds"] == 2.0
    assert (
        viewer.put("/api/v1/metrics/objectives", {"ttft_seconds": 1, "tpot_seconds": 0.05}, format="json").status_code
        == 403
    )
    reply = operator.put("/api/v1/metrics/objectives", {"ttft_seconds": 1, "tpot_seconds": 0.05}, format="json")
    assert reply.status_code == 200 and reply.json()["ttft_seconds"] == 1
    assert ServiceObjectives.current().tpot_seconds == 0.05
    bad = operator.put("/api/v1/metrics/objectives", {"ttft_seconds": -1, "tpot_seconds": 0.05}, format="json")
    assert bad.status_code == 400 and list(bad.json()) == ["ttft_seconds"]


def test_scrape_status_lists_each_worker(viewer) -> None:
    w = Worker.objects.create(name="silent", url="http://silent.invalid")
    store(timezone.now(), {job(w): None})
    body = viewer.get("/api/v1/metrics/targets").json()
    assert body["workers"][0]["worker"] == "silent" and body["workers"][0]["up"] is False


def test_the_control_planes_prometheus_page_has_fleet_scrape_and_routing_gauges() -> None:
    from controlplane.gateway.models import RoutingPool, RoutingTable

    scraped(timezone.now())
    table = RoutingTable.objects.create(model="tiny")
    RoutingPool.objects.create(table=table, pool=Pool.objects.get(name="stable"), role="stable", weight_bp=10000)
    assert api_client().get("/metrics").status_code == 401  # a Prometheus job authenticates with a token
    reply = api_client(make_user(Role.VIEWER)).get("/metrics", HTTP_ACCEPT="text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    assert reply.status_code == 200 and reply["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(reply.content.decode())}
    workers = {(s.labels["state"], s.labels["pool"]): s.value for s in families["chunkpilot_fleet_workers"].samples}
    assert workers[("registering", "stable")] == 1
    assert families["chunkpilot_worker_scrape_up"].samples[0].value == 1.0
    weight = families["chunkpilot_routing_weight_basis_points"].samples[0]
    assert weight.labels == {"model": "tiny", "pool": "stable", "role": "stable"} and weight.value == 10000


def test_apps_register_their_own_gauges_and_a_broken_one_does_not_break_the_page() -> None:
    from prometheus_client.core import GaugeMetricFamily

    def rollout_gauges():
        g = GaugeMetricFamily("chunkpilot_rollout_step", "Current step.", labels=["rollout"])
        g.add_metric(["r1"], 3)
        yield g

    def broken():
        raise RuntimeError("boom")
        yield  # pragma: no cover

    exposition.register(rollout_gauges)
    exposition.register(broken)
    try:
        text = exposition.render().decode()
    finally:
        exposition.unregister(rollout_gauges)
        exposition.unregister(broken)
    assert 'chunkpilot_rollout_step{rollout="r1"} 3.0' in text and "chunkpilot_fleet_pools" in text
