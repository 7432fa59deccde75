"""The Advisor pages rendered by Django: the list of kept reports, one
report's verdicts as sentences with their charts, the window choice, the
experiment button for operators, the links from the Fleet and Figures pages,
and the role checks."""

from __future__ import annotations

import pytest
from django.test import Client
from django.test.utils import override_settings
from django.urls import reverse

from controlplane.advisor.models import AdvisorReport
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RequestLog
from dashboards.advisor import pages
from dashboards.advisor.pages import experiment_link
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db


def short_traffic(pool, worker: Worker, n: int) -> None:
    from django.utils import timezone

    now = timezone.now()
    RequestLog.objects.bulk_create(
        [
            RequestLog(
                request_id=f"r{i}",
                created_at=now,
                model="tiny",
                cohort="stable",
                pool=pool,
                worker=worker,
                prompt_tokens=100 + i % 7,
                cached_tokens=32,
                output_tokens=10,
                ttft_seconds=0.05,
                max_gap_seconds=0.05,
                tpot_seconds=0.02,
                e2e_seconds=0.3,
                status=200,
                stream=True,
            )
            for i in range(n)
        ]
    )


@override_settings(ADVISOR_MIN_REQUESTS=20)
def test_report_page_shows_verdicts_as_sentences_expandable_to_their_charts(operator_client: Client) -> None:
    pool = make_pool("chunky", make_profile(prefill_mode="chunked", max_num_batched_tokens=2048, max_num_seqs=8))
    worker, _ = enroll_worker("w1", pool=pool)
    short_traffic(pool, worker, 40)
    html = operator_client.get("/advisor/chunky/").content.decode()
    assert "Advisor: pool chunky" in html
    # short prompts: the long-tail question says no, in a sentence, with its histogram behind a <details>
    assert 'id="finding-long_tail" data-answer="no"' in html
    assert "no long tail" in html
    assert '<span class="bar-label">&lt;=512</span>' in html
    # scrapes are missing: those questions say so rather than guess
    assert 'id="finding-concurrency" data-answer="not_enough_data"' in html
    assert 'id="finding-pd" data-answer="not_enough_data"' in html
    # a chunked pool gets the tuning findings; every report gets the knobs and the PD formula
    assert 'id="finding-budget_too_large"' in html and 'id="finding-short_starved"' in html
    assert "link bandwidth" in html and "25 GB/s" in html
    assert "short_prompt_threshold" in html
    assert 'id="run-experiment"' in html and "?name=advisor-chunky" in html
    assert "short_prompt_thresholds=" in html
    # prefix hits per bucket from the log's cached tokens: 32 of ~103 tokens
    assert 'id="prefix-hits"' in html and "40 of 40 requests" in html
    assert AdvisorReport.objects.filter(scope="chunky").exists(), "the page keeps the report it computed"


def test_viewers_see_no_experiment_button_and_a_window_computes_anew(viewer_client: Client) -> None:
    pool = make_pool("mono", make_profile(prefill_mode="monolithic", max_num_batched_tokens=8192))
    enroll_worker("w2", pool=pool)
    html = viewer_client.get("/advisor/mono/?window=15m").content.decode()
    assert "computed now over 0.25 h" in html
    assert "run-experiment" not in html
    assert 'id="finding-budget_too_large"' not in html, "no tuning findings on a monolithic pool"
    assert not AdvisorReport.objects.exists(), "a chosen window is not kept"
    # a bad window falls back to the kept report
    assert "kept report" in viewer_client.get("/advisor/mono/?window=nope").content.decode()


def test_index_lists_the_fleet_and_every_pool_with_workers(viewer_client: Client) -> None:
    pool = make_pool("a-pool")
    enroll_worker("w3", pool=pool)
    make_pool("empty")
    AdvisorReport.refresh(None)
    html = viewer_client.get("/advisor/").content.decode()
    assert 'data-scope="fleet"' in html and 'data-scope="a-pool"' in html
    assert 'data-scope="empty"' not in html
    assert "No report yet" in html  # a-pool was never computed
    assert viewer_client.get("/advisor/nope/").status_code == 404


def test_fleet_and_figures_pages_link_to_the_advisor(viewer_client: Client) -> None:
    pool = make_pool("linked")
    enroll_worker("w4", pool=pool)
    assert 'href="/advisor/linked/"' in viewer_client.get("/").content.decode()
    assert 'href="/advisor/"' in viewer_client.get("/figures/").content.decode()


def test_signed_out_visitors_go_to_the_login_page() -> None:
    response = Client().get("/advisor/")
    assert response.status_code == 302 and "/login" in response["Location"]


def test_the_experiment_link_carries_the_suggested_arm() -> None:
    body = {"knobs": {"chunk_tokens": 512, "max_num_batched_tokens": 576, "short_prompt_threshold": 96}}
    link = experiment_link(body, "chunky")
    assert link.startswith(reverse("experiment-new") + "?")
    assert "chunk_sizes=512" in link and "budgets=576" in link and "short_prompt_thresholds=96" in link


def test_new_experiment_opens_with_the_advisors_suggested_arm(operator_client: Client) -> None:
    link = experiment_link(
        {"knobs": {"chunk_tokens": 512, "max_num_batched_tokens": 576, "short_prompt_threshold": 96}}, "chunky"
    )
    html = operator_client.get(link).content.decode()
    assert 'name="chunk_sizes" value="512"' in html and 'name="budgets" value="576"' in html
    assert 'name="short_prompt_thresholds" value="96"' in html and 'value="advisor-chunky"' in html


@override_settings(ADVISOR_MIN_REQUESTS=20)
def test_report_page_reads_as_words_with_each_unit_once_and_shows_its_decision_table(
    operator_client: Client,
) -> None:
    pool = make_pool("chunky", make_profile(prefill_mode="chunked", max_num_batched_tokens=2048, max_num_seqs=8))
    worker, _ = enroll_worker("w1", pool=pool)
    short_traffic(pool, worker, 40)
    html = operator_client.get("/advisor/chunky/").content.decode()
    assert 'href="/advisor/" class="active">Advisor</a>' in html, "the Advisor is in the top navigation"
    assert "dashboards/metrics.css" in html, "the window chips are styled as on the figure pages"
    # the decision table the verdict came from, its row marked
    assert 'id="decision-table"' in html and 'class="matched"' in html
    assert "long prefills push the decode gap P99 past the TBT objective" in html
    # no raw slugs where words belong
    for slug in ("notworthit", "notenoughdata", ">not_enough_data<", ">budget_too_large<", "lower max_num_batched"):
        assert slug not in html.replace("lower max_num_batched_tokens", ""), slug
    # thresholds in their unit, written once: a share as a percent, a time in ms, a count with its noun
    assert "<th>chunk too small drop</th><td>15.0%</td>" in html
    assert "<th>min requests</th><td>20 requests</td>" in html
    assert "<th>tbt objective</th><td>100 ms</td>" in html and "tbt objective seconds" not in html

    AdvisorReport.refresh(pool)
    index = operator_client.get("/advisor/").content.decode()
    assert "notworthit" not in index and "notenoughdata" not in index
    report = AdvisorReport.objects.get(scope="chunky")
    assert f">{pages.OVERALL_LABELS[report.overall]}</span>" in index
    for key in report.findings:
        assert key not in index.split('id="advisor-reports"')[1], key


def test_values_are_formatted_by_their_declared_unit() -> None:
    assert pages.format_value(0.15, "share") == "15.0%"
    assert pages.format_value(2.0, "times") == "2.00×"
    assert pages.format_value(0.1, "s") == "100 ms"
    assert pages.format_value(100e-6, "s/token") == "100 µs per token"
    assert pages.format_value(25.0, "GB/s") == "25 GB/s"
    assert pages.format_value(4096, "tokens") == "4,096 tokens"
    assert pages.format_value(None, "s") == "—"
