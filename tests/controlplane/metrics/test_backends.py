"""Prometheus as the metrics backend (``METRICS_BACKEND=prometheus``).

* Parity: two real reference workers (a chunked stable pool, a monolithic
  canary) under loadgen traffic, scraped at once by the control plane and
  by Debian's Prometheus with the shipped config (through the control
  plane's HTTP service discovery); the same rollout analysis, run once on
  each backend over the same window, reaches the same verdict, metric by
  metric; and the advisor, reading its windows, counters and per-scrape
  samples through each backend, reads alike and answers the same.
* Every scraped figure of the registry compiles to PromQL a real
  Prometheus accepts, for every grouping and with a selector, in one
  window and as a series.
* A Prometheus that stops answering (killed) or answers too slowly makes
  the analysis inconclusive, never failed; the API answers 503 and the
  pages say "metrics backend unavailable" (the advisor's too, and beat's
  advisor round keeps what it had); the control plane scrapes nothing while
  Prometheus is the backend.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from django.test import override_settings
from django.urls import reverse

from controlplane.advisor import inputs
from controlplane.advisor import tasks as advisor_tasks
from controlplane.advisor.models import AdvisorReport, compute
from controlplane.advisor.verdicts import Inputs
from controlplane.alerts import evaluation
from controlplane.alerts.models import AlertRule
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import backends, deploy, figures, query, tasks
from controlplane.metrics.models import ScrapeRound
from controlplane.rollouts import measure
from controlplane.rollouts.judge import AnalysisPhase, MetricRule, RunSpec, take_round
from controlplane.rollouts.models import Rollout
from tests.controlplane.metrics.test_real_prometheus import (
    PROFILES,
    Scraper,
    loadgen,
    token,
    wait_for,
)
from tests.controlplane.rollouts.factories import Fleet, make_fleet
from tests.monitoring import prometheus, prometheus_config
from tests.workers.server.support import worker

logging.getLogger("httpx").setLevel(logging.WARNING)

SCRAPE_INTERVAL_SECONDS = 0.5
PANEL = figures.PANEL_FIGURES
# Per figure of the four-figure panel and stalls, a lenient rule and a strict
# one: whichever way the traffic makes each go, both backends must agree.
RULES = tuple(
    MetricRule(f"{name}-{kind}", name, max_ratio=ratio, min_samples=0)
    for name in (*PANEL, "stall_p99", "itl_p99")
    for kind, ratio in (("lenient", 50.0), ("strict", 1.0))
)
SPEC = RunSpec(metrics=RULES, interval_seconds=60, count=1, window_seconds=60, inconclusive_limit=0)


# The advisor's thresholds lowered to what two tiny workers' minute reaches, so its
# answers rest on the figures read (an operator would set them for a small fleet).
ADVISOR_SETTINGS = {"ADVISOR_MIN_SAMPLES": 10, "ADVISOR_MIN_GAPS": 10, "ADVISOR_MIN_REQUESTS": 10}


def answers(report: dict[str, Any]) -> dict[str, str]:
    return {f["key"]: f["answer"] for f in [*report["questions"], report["head_of_line"], *report["tuning"]]}


def compare_advisor_inputs(db: Inputs, prom: Inputs, pool: Pool) -> None:
    """What the advisor read for one pool on each backend, scraped independently at
    the same interval: the same workers' facts exactly, counters and rates within a
    few percent (Prometheus extrapolates increase() to the window's edges), and
    per-scrape samples alike in number, mean and extremes."""
    detail = f"{pool.name}:\n database   {db}\n prometheus {prom}"
    print(detail)
    exact = dataclasses.replace(db.engine, prefill_seconds_per_token=None)
    assert dataclasses.replace(prom.engine, prefill_seconds_per_token=None) == exact, detail
    assert exact.weight_bytes and exact.kv_bytes_per_token and exact.activation_bytes_per_token, detail
    assert prom.engine.prefill_seconds_per_token == pytest.approx(db.engine.prefill_seconds_per_token, rel=0.1)
    a, b = db.samples, prom.samples
    assert len(a.running) >= 20 and abs(len(b.running) - len(a.running)) <= 0.2 * len(a.running), detail
    assert set(b.worker) == {w.pk for w in Worker.objects.filter(pool=pool)}, detail
    assert np.array_equal(np.unique(b.max_num_seqs), np.unique(a.max_num_seqs), equal_nan=True), detail
    assert max(b.memory_peak_bytes) == max(a.memory_peak_bytes), detail
    # Two scrapers sample the gauge at their own instants: a busiest moment one of them
    # catches (all max_num_seqs running, for a step or two) the other may miss by a request.
    assert abs(max(b.running) - max(a.running)) <= 1, detail
    assert np.mean(b.running) == pytest.approx(np.mean(a.running), abs=0.5), detail
    assert np.nansum(b.long_prefill_steps_delta) == pytest.approx(np.nansum(a.long_prefill_steps_delta), rel=0.1)
    assert (prom.gaps.num_long_prefill, prom.gaps.num_other) == pytest.approx(
        (db.gaps.num_long_prefill, db.gaps.num_other), rel=0.05, abs=2
    ), detail
    assert prom.gaps.approximate is False and db.gaps.approximate is False
    assert prom.num_preemptions == pytest.approx(db.num_preemptions, rel=0.05, abs=1), detail
    assert prom.memory_peak_to_mean == pytest.approx(db.memory_peak_to_mean, rel=0.05), detail
    assert prom.pool is not None and db.pool is not None
    assert prom.pool.output_tokens_per_second_per_worker == pytest.approx(
        db.pool.output_tokens_per_second_per_worker, rel=0.05
    ), detail


def prometheus_backend(url: str, timeout_seconds: float = 5.0) -> Any:
    return override_settings(
        METRICS_BACKEND="prometheus", PROMETHEUS_URL=url, PROMETHEUS_TIMEOUT_SECONDS=timeout_seconds
    )


def start_rollout(fleet: Fleet) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 5000}],
        actor="tester",
        gate={"enabled": False},
    )


def analyse(rollout: Rollout, spec: RunSpec, now: datetime) -> tuple[AnalysisPhase, dict[str, Any]]:
    """One measurement round of the analysis, as the controller takes it."""
    samples = measure.collect(rollout, spec, {"canary": 5000, "stable": 5000}, now)
    taken = take_round(spec, {}, samples)
    return taken.phase, {name: (v.phase, v.reason, samples[name]) for name, v in taken.verdicts.items()}


@pytest.fixture
def real_fleet(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Fleet, dict[str, str]]]:
    extra = ["--max-model-len", "1024", "--served-model-name", "tiny"]
    with (
        worker(tiny_model, tmp_path / "stable.log", profile=json.dumps(PROFILES["stable"]), extra=extra) as (a, _),
        worker(tiny_model, tmp_path / "canary.log", profile=json.dumps(PROFILES["canary"]), extra=extra) as (b, _),
    ):
        fleet = make_fleet("tiny", num_stable=1, num_canary=1, urls={"stable": [a], "canary": [b]}, max_model_len=1024)
        yield fleet, {"stable": a, "canary": b}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_same_analysis_on_each_backend_over_the_same_traffic_reaches_the_same_verdict(
    web: str, real_fleet: tuple[Fleet, dict[str, str]], tmp_path: Path, viewer_client: Any
) -> None:
    fleet, urls = real_fleet
    rollout = start_rollout(fleet)
    viewer = token("prometheus", "viewer")
    config = prometheus_config(control_plane=web, scrape_interval=f"{SCRAPE_INTERVAL_SECONDS * 1000:.0f}ms")
    with (
        Scraper(SCRAPE_INTERVAL_SECONDS),
        prometheus(tmp_path / "prometheus", config, {deploy.TOKEN_FILE: viewer}) as prom,
    ):

        def workers_up() -> list[dict[str, Any]] | None:
            found = prom.active_targets(deploy.WORKERS_JOB)
            return found if len(found) == 2 and all(t["health"] == "up" for t in found) else None

        found = wait_for(workers_up, 60, "both workers scraped by Prometheus")
        assert {t["labels"]["pool"] for t in found} == {fleet.stable.name, fleet.canary.name}
        time.sleep(6 * SCRAPE_INTERVAL_SECONDS)
        started = time.time()
        runs = [loadgen(urls["stable"], 1), loadgen(urls["canary"], 1)]
        for run in runs:
            _, err = run.communicate(timeout=300)
            assert run.returncode == 0, err[-3000:]
        time.sleep(6 * SCRAPE_INTERVAL_SECONDS)  # both have scraped the last requests
        now = datetime.now(UTC)
        spec = RunSpec(
            metrics=RULES,
            interval_seconds=60,
            count=1,
            inconclusive_limit=0,
            window_seconds=int(time.time() - started) + 5,
        )

        db_phase, db_verdicts = analyse(rollout, spec, now)
        with prometheus_backend(prom.url):
            prom_phase, prom_verdicts = analyse(rollout, spec, now)
            # The pages read the same figures, and say where from.
            for name in ("panel", "cohorts"):
                page = viewer_client.get(reverse(f"metrics-{name}"), {"group_by": "cohort"})
                text = page.content.decode()
                assert page.status_code == 200 and "read from Prometheus" in text, name
                assert fleet.canary.name in text or "canary" in text, name
        report = "\n".join(
            f"{name}: database {db_verdicts[name][0].label} ({db_verdicts[name][2].canary:.4g} vs "
            f"{db_verdicts[name][2].baseline:.4g}), prometheus {prom_verdicts[name][0].label} "
            f"({prom_verdicts[name][2].canary:.4g} vs {prom_verdicts[name][2].baseline:.4g})"
            for name in db_verdicts
        )
        print(f"\nwindow {spec.window_seconds} s\n{report}")
        # Every metric had data on both sides on both backends: a verdict, not "no data".
        for verdicts in (db_verdicts, prom_verdicts):
            assert all(
                phase in (AnalysisPhase.SUCCESSFUL, AnalysisPhase.FAILED) for phase, _, _ in verdicts.values()
            ), report
        # The two agree on each value to within about 2% (test_real_prometheus says why they
        # differ at all), so a canary within 5% of its baseline may fall on either side of a
        # 1.0 limit: those rules are reported, not compared. The others must agree.
        clear = {
            n
            for n, (_, _, sample) in db_verdicts.items()
            if abs(sample.canary - sample.baseline) > 0.05 * abs(sample.baseline) or n.endswith("-lenient")
        }
        assert len(clear) > len(RULES) // 2, report
        assert {n: prom_verdicts[n][0] for n in clear} == {n: db_verdicts[n][0] for n in clear}, report
        if len(clear) == len(RULES):
            assert prom_phase == db_phase, report

        # An alert rule reads the same groups through Prometheus (the evaluator's batched reader).
        rule = AlertRule(
            name="CanaryTTFT",
            figure="ttft_p99",
            group_by="cohort",
            window_seconds=spec.window_seconds,
            comparator=">",
            threshold=0.0,
        )
        rule.full_clean()
        rule.save()
        db_groups = evaluation.preview(rule, now)
        with prometheus_backend(prom.url):
            prom_groups = evaluation.preview(rule, now)
        assert [(g["labels"], g["condition"]) for g in prom_groups] == [
            (g["labels"], g["condition"]) for g in db_groups
        ]
        assert {g["labels"]["cohort"] for g in db_groups} == {"stable", "canary"}
        assert [g["value"] for g in prom_groups] == pytest.approx([g["value"] for g in db_groups], rel=0.02)

        # The advisor reads its windows, counters and per-scrape samples through Prometheus too.
        pools = {"stable": fleet.stable, "canary": fleet.canary}
        with override_settings(**ADVISOR_SETTINGS):
            db_inputs = {n: inputs.gather(p, spec.window_seconds, now) for n, p in pools.items()}
            db_reports = {n: answers(compute(p, spec.window_seconds, now)) for n, p in pools.items()}
            with prometheus_backend(prom.url):
                prom_inputs = {n: inputs.gather(p, spec.window_seconds, now) for n, p in pools.items()}
                prom_reports = {n: answers(compute(p, spec.window_seconds, now)) for n, p in pools.items()}
                # Past ten minutes the samples are query_range steps, a minute apart; the newest
                # step sees the traffic's last scrapes (Prometheus looks back five minutes).
                stepped = inputs.gather(fleet.stable, 1800, now).samples
        for name in pools:
            compare_advisor_inputs(db_inputs[name], prom_inputs[name], pools[name])
        assert prom_reports == db_reports
        assert 1 <= len(stepped.running) <= 30 and set(stepped.worker) == {w.pk for w in fleet.workers["stable"]}
        assert max(stepped.memory_peak_bytes) > 0, stepped
        # The answers that rest on per-scrape samples are answers, not "not enough data" (the
        # request log, which stays on the database, is empty: these workers have no gateway in front;
        # no prompt is long enough for head-of-line blocking, whose gap counts are compared above).
        for name in pools:
            assert {prom_reports[name]["concurrency"], prom_reports[name]["memory"]} <= {"yes", "no"}, prom_reports

        # Prometheus stops answering: the same analysis is inconclusive, never failed.
        prom.proc.stop()
        with prometheus_backend(prom.url):
            phase, verdicts = analyse(rollout, spec, now)
            assert phase is AnalysisPhase.INCONCLUSIVE, verdicts
            assert all(v[0] is AnalysisPhase.INCONCLUSIVE and backends.UNAVAILABLE in v[1] for v in verdicts.values())
            page = viewer_client.get(reverse("metrics-panel"))
            assert page.status_code == 503 and "Metrics backend unavailable" in page.content.decode()


@pytest.mark.django_db(transaction=True)
def test_every_scraped_figure_compiles_to_promql_that_prometheus_accepts(tmp_path: Path) -> None:
    config: dict[str, Any] = {"global": {"scrape_interval": "15s"}, "scrape_configs": []}
    scraped = [f for f in figures.FIGURES.values() if f.source == "scrape"]
    now = time.time()
    with prometheus(tmp_path / "prometheus", config) as prom:
        backend = backends.Prometheus(prom.url, 10.0)
        for group_by in figures.GROUP_BY_SCRAPE:
            for selector in ({}, {"pool": 'odd "pool"\\name', "cohort": "canary"}):
                one = backend.scrape_figures(scraped, 300.0, group_by, selector, np.array([now]), dense=False)
                series = backend.scrape_figures(
                    scraped, 90.5, group_by, selector, np.array([now - 120, now - 60, now]), dense=True
                )
                # No series scraped: no data (None), never 0, and the fleet group always exists.
                expected = {"fleet": [None]} if group_by == "fleet" else {}
                assert one == {f.name: expected for f in scraped}
                assert series == {f.name: {g: [None] * 3 for g in expected} for f in scraped}


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A port that accepts connections and never answers: a Prometheus too slow to wait for."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.mark.django_db
def test_a_slow_prometheus_makes_the_analysis_inconclusive_and_the_pages_say_so(
    silent_server: str, viewer_client: Any
) -> None:
    fleet = make_fleet("tiny", num_stable=1, num_canary=1)
    rollout = start_rollout(fleet)
    with prometheus_backend(silent_server, timeout_seconds=0.3):
        phase, verdicts = analyse(rollout, SPEC, datetime.now(UTC))
        assert phase is AnalysisPhase.INCONCLUSIVE
        assert {v[0] for v in verdicts.values()} == {AnalysisPhase.INCONCLUSIVE}
        assert all("did not answer within 0.3 s" in v[1] for v in verdicts.values()), verdicts

        api = viewer_client.get("/api/v1/metrics/query/", {"figure": "ttft_p99", "window": "5m"})
        assert api.status_code == 503 and api.json()["unavailable"] == "metrics_backend", api.content
        ranged = viewer_client.get("/api/v1/metrics/query_range/", {"figure": "kv_fragmentation", "range": "15m"})
        assert ranged.status_code == 503
        worker = fleet.workers["stable"][0]
        for path in [reverse(f"metrics-{name}") for name in ("overview", "panel", "cohorts")] + [
            reverse("metrics-worker", args=[worker.pk])
        ]:
            page = viewer_client.get(path)
            assert page.status_code == 503 and "Metrics backend unavailable" in page.content.decode(), path
        live = viewer_client.get(reverse("metrics-panel"), HTTP_HX_REQUEST="true")
        assert live.status_code == 503 and "Metrics backend unavailable" in live.content.decode()
        # An alert rule's evaluation records the outage as its error and changes no alert.
        rule = AlertRule(
            name="KVFragHigh",
            figure="kv_fragmentation",
            group_by="worker",
            window_seconds=60,
            comparator=">",
            threshold=0.5,
        )
        rule.full_clean()
        rule.save()
        cycle = evaluation.evaluate()
        assert backends.UNAVAILABLE in cycle.errors["KVFragHigh"] and cycle.transitions == []
        # Request-log figures stay on the database and still answer (the prompt-length page is all of them).
        lengths = viewer_client.get(reverse("metrics-lengths"))
        assert lengths.status_code == 200 and "Metrics backend unavailable" not in lengths.content.decode()
        exact = viewer_client.get("/api/v1/metrics/query/", {"figure": "client_ttft_p99", "window": "5m"})
        assert exact.status_code == 200, exact.content
        # The advisor reads the same backend: its API, its page and beat's round say so, and keep nothing.
        pool = fleet.stable.name
        advice = viewer_client.get(f"/api/v1/advisor/reports/{pool}/", {"window": "15m"})
        assert advice.status_code == 503 and advice.json()["unavailable"] == "metrics_backend", advice.content
        page = viewer_client.get(reverse("advisor-report", args=[pool]), {"window": "1h"})
        assert page.status_code == 503 and "Metrics backend unavailable" in page.content.decode()
        skipped = advisor_tasks.refresh()
        assert skipped["reports"] == 0 and "did not answer within 0.3 s" in skipped["unavailable"], skipped
        assert not AdvisorReport.objects.exists()


@pytest.mark.django_db
def test_the_control_plane_does_not_scrape_while_prometheus_is_the_backend(silent_server: str) -> None:
    make_fleet("tiny", num_stable=1, num_canary=0)
    with prometheus_backend(silent_server):
        assert tasks.scrape() == {"targets": 0, "failed": 0}
    assert not ScrapeRound.objects.exists()
    with override_settings(METRICS_BACKEND="database"):
        assert tasks.scrape()["targets"] == 1  # the database backend scrapes (this worker does not answer)


def test_a_backend_name_other_than_the_two_is_refused() -> None:
    with override_settings(METRICS_BACKEND="graphite"), pytest.raises(ValueError, match="METRICS_BACKEND"):
        query.backend()


def test_the_query_layer_compiles_a_figure_as_the_shipped_rules_do() -> None:
    f = figures.get("ttft_p99")
    assert backends.compile_figure(f, 300, "cohort", {}) == deploy.expression(f, grouping="cohort", window="300000ms")
    fleet = backends.compile_figure(f, 60, "fleet", {"pool": "a"})
    assert fleet == (
        'histogram_quantile(0.99, sum by (le) (rate(chunkpilot:time_to_first_token_seconds_bucket{pool="a"}[60000ms])))'
    )
