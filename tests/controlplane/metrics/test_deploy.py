"""The shipped Grafana dashboard and Prometheus rules: generated from the
registry, reading only names the workers serve, and the service discovery
that gives their series the pool and cohort labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from controlplane.accounts.roles import Role
from controlplane.metrics import deploy, figures, shipped
from tests.controlplane.factories import api_client, make_user
from workers.server.metrics import MetricsExporter

ROOT = Path(__file__).resolve().parents[3]


def served_names() -> set[str]:
    """Every sample name a reference worker serves (histograms' _bucket/_sum/_count included)."""
    text = MetricsExporter(model_name="m", max_model_len=2048).render().decode()
    names = set(re.findall(r"^((?:vllm|chunkpilot):[a-z_]+)", text, re.MULTILINE))
    # Counters with a label beyond the worker's appear once observed.
    return names | {"chunkpilot:step_tokens_total", "vllm:request_success_total"}


def all_expressions() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/chunkpilot.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


@pytest.mark.parametrize(("relative", "text"), shipped.files().items())
def test_checked_in_files_are_what_the_registry_generates(relative: str, text: str) -> None:
    assert (ROOT / "deploy" / relative).read_text() == text, "run `python manage.py export_deploy`"


def test_every_series_they_read_is_served_by_a_worker() -> None:
    served = served_names()
    recorded = {r["record"] for g in deploy.prometheus_rules()["groups"] for r in g["rules"] if "record" in r}
    for expr in all_expressions():
        for name in deploy.metric_names(expr):
            assert name in served or name in recorded, (name, expr)


@pytest.mark.parametrize("expr", all_expressions())
def test_expressions_are_well_formed(expr: str) -> None:
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        assert depth >= 0, expr
    assert depth == 0 and expr.count("{") == expr.count("}") and expr.count("[") == expr.count("]"), expr
    for call in re.findall(r"(?:rate|max_over_time)\(([^()]*)\)", expr):
        assert re.search(r"\[[^\]]+\]$", call), f"{call!r} is not a range selector"
    assert "G)" not in expr and "$__range" not in expr


def test_the_dashboard_has_the_four_figures_first_and_filters_by_pool() -> None:
    dashboard = deploy.grafana_dashboard()
    titles = [p["title"] for p in dashboard["panels"] if p["type"] == "timeseries"]
    assert titles[:4] == ["TTFT P99", "Memory peak/mean", "Prefill wait (mean, P99)", "KV fragmentation"]
    ttft = next(p for p in dashboard["panels"] if p["title"] == "TTFT P99")
    assert ttft["targets"][0]["expr"] == (
        "histogram_quantile(0.99, sum by (le, $group) "
        '(rate(chunkpilot:time_to_first_token_seconds_bucket{pool=~"$pool"}[$window])))'
    )
    mix = next(p for p in dashboard["panels"] if p["title"] == "Token mix per step")
    assert 'chunkpilot:step_tokens_total{kind="prefill", pool=~"$pool"}[$window]' in mix["targets"][0]["expr"]


def test_every_recorded_figure_is_in_the_registry_with_its_promql() -> None:
    for name in deploy.RECORDED:
        assert figures.get(name).promql


@pytest.mark.django_db
def test_service_discovery_labels_each_worker_with_pool_and_cohort() -> None:
    from controlplane.fleet.models import Pool, Worker
    from controlplane.gateway.models import RoutingPool, RoutingTable

    canary = Pool.objects.create(name="gpu-canary")
    RoutingPool.objects.create(table=RoutingTable.objects.create(model="m"), pool=canary, role="canary", weight_bp=0)
    Worker.objects.create(name="a", url="http://10.0.0.5:8000", pool=canary)
    Worker.objects.create(name="b", url="https://gpu-b.example.com/prefix/")
    body = api_client(make_user(Role.VIEWER)).get("/api/v1/metrics/prometheus-sd").json()
    assert body == [
        {
            "targets": ["10.0.0.5:8000"],
            "labels": {
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "worker": "a",
                "pool": "gpu-canary",
                "cohort": "canary",
            },
        },
        {
            "targets": ["gpu-b.example.com:443"],
            "labels": {
                "__scheme__": "https",
                "__metrics_path__": "/prefix/metrics",
                "worker": "b",
                "pool": "",
                "cohort": "",
            },
        },
    ]


def test_grafana_draws_the_panel_layout_the_pages_draw() -> None:
    """One layout table: Grafana's first two rows are the panel's charts and
    the charts beside them, in order, each reading the figures it names."""
    charts = [p for p in deploy.grafana_dashboard()["panels"] if p["type"] == "timeseries"]
    layout = (*figures.PANEL_CHARTS, *figures.BESIDE_CHARTS)
    for panel, chart in zip(charts, layout, strict=False):
        assert panel["title"] == chart.title
        assert [t["expr"] for t in panel["targets"]] == [
            deploy.expression(figures.get(n), grouping="$group", window="$window", selector='pool=~"$pool"')
            for n in chart.figures
        ]
    assert len(charts) > len(layout)  # the workers' row follows


def test_the_pages_table_shows_every_figure_grafana_charts_beside_the_panel() -> None:
    counts = {f.samples for f in figures.FIGURES.values() if f.samples}
    charted = [n for n in figures.figures_of(figures.BESIDE_CHARTS) if n not in counts]
    assert list(figures.BESIDE_FIGURES) == charted
    assert {"tpot_mean", "queue_time_mean", "requests_per_second"} <= set(figures.BESIDE_FIGURES)
    assert figures.PANEL_FIGURES == ("ttft_p99", "memory_peak_to_mean", "prefill_wait_p99", "kv_fragmentation")
