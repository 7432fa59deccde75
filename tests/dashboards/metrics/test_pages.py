"""The metric pages render for viewers from stored scrapes, with every choice
a plain link, and operators set goodput's objectives from the overview."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from django.utils.html import escape

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import figures, query
from controlplane.metrics.models import ServiceObjectives
from dashboards.metrics import pages
from tests.controlplane.metrics.pages import Page, job, store

pytestmark = pytest.mark.django_db

TTFT = "chunkpilot:time_to_first_token_seconds"


def fill(now: Any) -> tuple[Worker, Worker]:
    """Two workers, canary and stable, scraped every 5 s for the last 10 minutes."""
    canary = Worker.objects.create(name="gpu-c", url="http://c.invalid", pool=Pool.objects.create(name="canary-pool"))
    stable = Worker.objects.create(name="gpu-s", url="http://s.invalid", pool=Pool.objects.create(name="stable-pool"))
    for i in range(120):
        n = 1000 + 10 * i
        pages = {}
        for w, cohort, slow in ((canary, "canary", 1), (stable, "stable", 0)):
            pages[job(w, cohort)] = Page(
                counters={"vllm:request_success_total": n, "chunkpilot:memory_byte_seconds_total": 1e9 + 2e6 * i},
                histograms={TTFT: ([(0.1, n - slow * i), (1.0, n), (float("inf"), n)], 0.05 * n)},
                gauges={"chunkpilot:memory_recent_peak_bytes": 5e5},
            )
        store(now - timedelta(seconds=5 * (119 - i)), pages)
    return canary, stable


@pytest.mark.parametrize("path", ["/figures/", "/figures/panel/", "/figures/cohorts/", "/figures/lengths/"])
def test_pages_send_visitors_without_a_session_to_log_in(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_panel_shows_the_four_figures_per_cohort_with_charts_and_plain_links(viewer_client: Client) -> None:
    fill(timezone.now())
    response = viewer_client.get("/figures/panel/?group_by=cohort&range=1h&window=5m")
    assert response.status_code == 200
    html = response.content.decode()
    for chart in ("ttft", "memory", "prefill_wait", "kv_fragmentation"):
        assert f'data-chart="{chart}"' in html and f'id="chart-data-{chart}"' in html
    assert 'data-group="canary"' in html and 'data-group="stable"' in html
    assert "vendor/uplot/dist/uPlot.iife.min.js" in html
    assert 'href="?group_by=pool&amp;range=1h&amp;window=5m"' in html  # a choice without JavaScript
    assert 'ws-connect="/ws/metrics/panel/?group_by=cohort&amp;range=1h&amp;window=5m"' in html
    # canary: 1 in 10 requests over 0.1 s, so its TTFT P99 sits in (0.1, 1]; stable under 0.1 s.
    canary_row = html.split('data-group="canary"', 1)[1].split("</tr>", 1)[0]
    assert 'data-figure="ttft_p99">' in canary_row and "ms" in canary_row


def test_the_panel_table_has_a_column_for_every_figure_of_the_layout(viewer_client: Client) -> None:
    fill(timezone.now())
    html = viewer_client.get("/figures/panel/").content.decode()
    head = html.split('id="panel-table"', 1)[1].split("</thead>", 1)[0]
    for name in (*figures.figures_of(figures.PANEL_CHARTS), *figures.BESIDE_FIGURES):
        assert f">{escape(figures.get(name).label)}</th>" in head, name
    row = html.split('<tr data-group="canary"', 1)[1].split("</tr>", 1)[0]
    assert 'data-figure="requests_per_second"' in row and 'data-figure="tpot_mean"' in row


def test_the_panel_table_is_each_charts_newest_point_and_the_window_ending_now() -> None:
    now = timezone.now()
    fill(now)
    view = pages.View.from_params({"group_by": "cohort", "range": "1h", "window": "5m"})
    context = pages.panel_context(view, now)
    newest = {(c["id"], line["label"]): line["values"][-1] for c in context["charts"] for line in c["lines"]}
    instant = query.query_many(pages.PANEL_TABLE, view.window_seconds, view.group_by, view.selector, now)
    assert [row["group"] for row in context["rows"]] == ["canary", "stable"]
    for row in context["rows"]:
        cells = {cell["figure"].name: cell["value"] for cell in row["panel"]}
        assert cells == {name: instant[name][row["group"]] for name in pages.PANEL_TABLE}
        for chart in ("ttft", "memory", "kv_fragmentation"):
            (name,) = next(c.figures for c in pages.PANEL_CHARTS if c.id == chart)
            assert cells[name] == newest[(chart, row["group"])]
        assert cells["ttft_p99"] is not None and cells["memory_peak_to_mean"] is not None


def test_htmx_asks_get_the_live_partial_alone(viewer_client: Client) -> None:
    response = viewer_client.get("/figures/panel/", HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="metrics-panel-live">') and "<html" not in html


def test_cohort_page_puts_stable_and_canary_side_by_side_with_the_ratio(viewer_client: Client) -> None:
    fill(timezone.now())
    html = viewer_client.get("/figures/cohorts/").content.decode()
    row = html.split('data-figure="requests_per_second"', 1)[1].split("</tr>", 1)[0]
    assert 'data-cohort="stable"' in row and 'data-cohort="canary"' in row
    assert "1.00×" in row  # same request rate in both cohorts
    ttft = html.split('<tr data-figure="ttft_p99"', 1)[1].split("</tr>", 1)[0]
    assert 'class="ratio worse"' in ttft  # the canary's TTFT P99 is higher: worse


def test_ratios_against_a_cohort_without_traffic_read_a_dash(viewer_client: Client) -> None:
    canary = Worker.objects.create(name="gpu-c", url="http://c.invalid", pool=Pool.objects.create(name="canary-pool"))
    stable = Worker.objects.create(name="gpu-s", url="http://s.invalid", pool=Pool.objects.create(name="stable-pool"))
    now = timezone.now()
    for i in range(60):
        pages = {}
        for w, cohort, n in ((canary, "canary", 1000), (stable, "stable", 1000 + 10 * i)):  # the canary idles
            pages[job(w, cohort)] = Page(
                counters={"vllm:request_success_total": n, "chunkpilot:memory_byte_seconds_total": 1e9 + 2e6 * i},
                histograms={TTFT: ([(0.1, n), (1.0, n), (float("inf"), n)], 0.05 * n)},
                gauges={"chunkpilot:memory_recent_peak_bytes": 5e5},
            )
        store(now - timedelta(seconds=5 * (59 - i)), pages)
    html = viewer_client.get("/figures/cohorts/").content.decode()
    table = html.split('id="cohort-table"', 1)[1].split("</table>", 1)[0]
    rps = table.split('<tr data-figure="requests_per_second"', 1)[1].split("</tr>", 1)[0]
    assert 'data-cohort="canary">0' in rps  # scraped, and idle
    memory = table.split('<tr data-figure="memory_peak_to_mean"', 1)[1].split("</tr>", 1)[0]
    assert 'data-cohort="canary">—' not in memory  # a figure of its own, yet no ratio against it
    assert 'class="ratio worse"' not in table and 'class="ratio better"' not in table
    assert table.count('<td class="ratio ">—</td>') == table.count("<tr data-figure=") > 10


def test_a_lab_workers_traffic_is_named_for_what_it_is(viewer_client: Client) -> None:
    lab = Worker.objects.create(name="lab-1", url="http://lab.invalid", pool=Pool.objects.create(name="lab-pool"))
    now = timezone.now()
    for i in range(24):
        n = 1000 + 10 * i
        page = Page(
            counters={"vllm:request_success_total": n},
            histograms={TTFT: ([(0.1, n), (1.0, n), (float("inf"), n)], 0.05 * n)},
        )
        store(now - timedelta(seconds=5 * (23 - i)), {job(lab): page})  # its pool is in no routing table
    html = viewer_client.get("/figures/panel/?group_by=cohort").content.decode()
    assert '<tr data-group="lab (no routing table)">' in html and "unrouted" not in html


def test_annotations_mark_rollout_steps_aborts_and_profile_changes_in_the_range() -> None:
    from controlplane import audit
    from controlplane.rollouts.models import Rollout
    from tests.controlplane.rollouts.factories import make_fleet

    fleet = make_fleet(num_stable=1, num_canary=1)
    now = timezone.now()
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )
    r.record("weights_set", "weights set: canary 10%", now=now - timedelta(seconds=300))
    r.record("measurement", "measurement 1/3", now=now - timedelta(seconds=250))  # not a mark
    r.record("aborting", "aborting: asked by tester", now=now - timedelta(seconds=200))
    r.record("weights_set", "long ago", now=now - timedelta(hours=2))  # before the range
    pool = fleet.canary
    before = {"desired_revision": None}
    audit.record("ops", "pool.update", pool, before, {"desired_revision": 7}, time=now - timedelta(seconds=100))
    audit.record("ops", "pool.update", pool, before, {**before, "description": "x"}, time=now - timedelta(seconds=50))
    marks = pages.chart_annotations(now - timedelta(hours=1), now)
    assert [(m["kind"], m["text"]) for m in marks if m["t"] < now.timestamp() - 60] == [
        ("rollout-step", f"rollout {r.pk}: weights set: canary 10%"),
        ("abort", f"rollout {r.pk}: aborting: asked by tester"),
        ("profile", f"pool {pool.name}: profile revision 7 (by ops)"),
    ]


def test_length_table_lists_every_bucket_even_without_requests(viewer_client: Client) -> None:
    html = viewer_client.get("/figures/lengths/").content.decode()
    for bucket in ("<=512", "<=2K", "<=8K", "<=32K", ">32K"):
        assert f'data-bucket="{escape(bucket)}"' in html
    assert "—" in html  # no data, never 0


def test_percentiles_show_the_samples_they_rest_on_and_mark_a_p99_over_too_few(viewer_client: Client) -> None:
    from controlplane.gateway.models import RequestLog

    now = timezone.now()
    for i in range(90):  # 90 requests of short prompts: a P99 over them is the slowest alone
        RequestLog.objects.create(
            request_id=f"r{i}",
            created_at=now - timedelta(seconds=1 + i),
            model="tiny",
            cohort="stable",
            prompt_tokens=100,
            output_tokens=10,
            ttft_seconds=0.01 * (i + 1),
            tpot_seconds=0.01,
            max_gap_seconds=0.02,
            e2e_seconds=1.0,
            status=200,
        )
    html = viewer_client.get("/figures/lengths/?window=5m").content.decode()
    row = html.split(f'data-bucket="{escape("<=512")}"', 1)[1].split("</tr>", 1)[0]
    p99 = row.split('data-figure="client_ttft_p99">', 1)[1].split("</td>", 1)[0]
    assert p99.startswith("900 ms")  # nearest rank: the slowest of 90
    assert "data-few-samples" in p99 and "n = 90: rests on the 1 slowest request" in p99
    p50 = row.split('data-figure="client_ttft_p50">', 1)[1].split("</td>", 1)[0]
    assert "n = 90" in p50 and "data-few-samples" not in p50
    assert "nearest rank" in html and "histogram_quantile" in html  # the rule, said on the page
    fill(now)
    panel = viewer_client.get("/figures/panel/?group_by=cohort&window=5m").content.decode()
    canary = panel.split('data-group="canary"', 1)[1].split("</tr>", 1)[0]
    ttft = canary.split('data-figure="ttft_p99">', 1)[1].split("</td>", 1)[0]
    assert 'data-samples="' in ttft and "n = " in ttft


def test_worker_page_shows_its_scrape_status_and_its_own_charts(viewer_client: Client) -> None:
    canary, _ = fill(timezone.now())
    html = viewer_client.get(f"/figures/worker/{canary.pk}/").content.decode()
    assert "gpu-c" in html and 'class="badge ok">up' in html
    assert f'ws-connect="/ws/metrics/worker/{canary.pk}/' in html and 'data-chart="ttft"' in html
    assert viewer_client.get("/figures/worker/999999/").status_code == 404


def test_overview_shows_fleet_state_and_goodput(viewer_client: Client) -> None:
    fill(timezone.now())
    html = viewer_client.get("/figures/").content.decode()
    assert "<strong>2</strong> workers" in html and "2 answering scrapes" in html
    assert 'data-figure="goodput"' in html and 'data-chart="throughput"' in html
    assert "Save objectives" not in html  # a viewer cannot change them


def test_an_operator_sets_the_objectives_and_the_change_is_audited(operator_client: Client) -> None:
    response = operator_client.post("/figures/objectives/", {"ttft_seconds": "0.5", "tpot_seconds": "0.05"})
    assert response.status_code == 302
    assert ServiceObjectives.current().as_dict() == {"ttft_seconds": 0.5, "tpot_seconds": 0.05}
    event = AuditEvent.objects.get(action="metrics.objectives")
    assert event.after == {"ttft_seconds": 0.5, "tpot_seconds": 0.05}
    assert operator_client.post("/figures/objectives/", {"ttft_seconds": "-1", "tpot_seconds": "x"}).status_code == 302
    assert ServiceObjectives.current().ttft_seconds == 0.5


def test_a_viewer_cannot_set_the_objectives(viewer_client: Client) -> None:
    assert viewer_client.post("/figures/objectives/", {"ttft_seconds": "1", "tpot_seconds": "1"}).status_code == 403


def test_nav_links_to_the_metric_pages(viewer_client: Client) -> None:
    html = viewer_client.get("/figures/cohorts/").content.decode()
    assert 'href="/figures/"' in html and 'href="/figures/panel/?' in html and 'href="/figures/lengths/?' in html
