"""The advisor's inputs gathered from stored scrapes and the gateway's log
(PostgreSQL), against hand-computed values; then the kept report, the beat
task's refresh and the API.

Scrapes are stored through the scraper's own ``record`` (tests/controlplane/metrics/pages.py)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.test import override_settings

from controlplane.accounts.roles import Role
from controlplane.advisor import inputs, tasks, verdicts
from controlplane.advisor.models import AdvisorReport
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RequestLog, RoutingPool, RoutingTable
from tests.controlplane.factories import api_client, make_pool, make_profile, make_user
from tests.controlplane.metrics.pages import Page, job, store

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
INF = math.inf
LONG = "chunkpilot:decode_gap_long_prefill_seconds"
OTHER = "chunkpilot:decode_gap_other_seconds"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def clock():
    with time_machine.travel(at(300), tick=False) as traveller:
        yield traveller


def worker(name: str, pool, *, max_num_seqs: int = 4, memory_bytes: int = 10 * 2**30) -> Worker:
    return Worker.objects.create(
        name=name,
        url=f"http://{name}.invalid:8000",
        pool=pool,
        max_model_len=32768,
        running_profile={"max_num_seqs": max_num_seqs},
        hardware={"device": "cpu", "memory_bytes": memory_bytes},
    )


def page(i: int, *, saturated: bool, preempt: bool) -> Page:
    """Scrape ``i``: 10 long-prefill gaps of ~1 s and 90 other gaps of ~50 ms per scrape so far."""
    n = i + 1
    return Page(
        counters={
            "vllm:num_preemptions_total": float(i if preempt else 0),
            "chunkpilot:long_prefill_steps_total": float(i // 2),  # a long prefill every other interval
            "chunkpilot:prefill_seconds_total": 0.5 * n,
            "chunkpilot:step_tokens_total{kind=prefill}": 5000.0 * n,  # 100 µs per prefill token
            "chunkpilot:memory_byte_seconds_total": 5.0 * 1000 * n,
            "chunkpilot:held_seconds_total": 5.0 * n,
        },
        histograms={
            LONG: ([(0.5, 0.0), (1.0, 10.0 * n), (INF, 10.0 * n)], 9.0 * n),
            OTHER: ([(0.05, 90.0 * n), (0.5, 90.0 * n), (1.0, 90.0 * n), (INF, 90.0 * n)], 4.0 * n),
        },
        gauges={
            "vllm:num_requests_waiting": 2.0 if saturated else 0.0,
            "vllm:num_requests_running": 4.0 if saturated else 1.0,
            "vllm:kv_cache_usage_perc": 0.95 if i % 10 == 5 else 0.4,
            "chunkpilot:memory_recent_peak_bytes": 3000.0 if i % 10 == 5 else 1200.0,
            "chunkpilot:weight_bytes": 2.0 * 2**30,
            "chunkpilot:kv_bytes_per_token": 2048.0,
            "chunkpilot:activation_bytes_per_token": 4.0 * 2**20,
        },
    )


def scrape_for_five_minutes(workers: list[Worker]) -> None:
    for i in range(61):  # every 5 s from 0 to 300
        store(
            at(5 * i),
            {job(w): page(i, saturated=(k == 0 and i % 4 == 0), preempt=(k == 0)) for k, w in enumerate(workers)},
        )


def log(
    pool,
    w: Worker,
    created: float,
    prompt: int | None,
    ttft: float | None,
    *,
    cached: int | None = 0,
    e2e: float | None = None,
    max_gap: float | None = 0.05,
    status: int = 200,
) -> None:
    RequestLog.objects.create(
        request_id=f"r{RequestLog.objects.count()}",
        created_at=at(created),
        model="tiny",
        cohort="stable",
        pool=pool,
        worker=w,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=10,
        ttft_seconds=ttft,
        max_gap_seconds=max_gap,
        tpot_seconds=0.05,
        e2e_seconds=e2e if e2e is not None else (ttft + 1.0 if ttft is not None else None),
        status=status,
        stream=True,
    )


def test_inputs_from_scrapes_and_the_request_log(clock) -> None:
    pool = make_pool("chunky", make_profile(prefill_mode="chunked", max_num_batched_tokens=4096, max_num_seqs=4))
    w1, w2 = worker("w1", pool), worker("w2", pool)
    scrape_for_five_minutes([w1, w2])
    for i in range(50):
        log(pool, w1, 10 + i, 100, 0.05, cached=40)
    log(pool, w2, 100, 20_000, 4.0, cached=0)

    got = inputs.gather(pool, 300, at(300))

    s = got.samples
    assert len(s.waiting) == 2 * 60  # the scrape at 0 s sits on the open edge of the window
    assert sorted(set(s.max_num_seqs)) == [4.0]
    # w1 waits at max_num_seqs in every 4th scrape: 5 s .. 300 s holds 15 of them
    saturated = [wt > 0 and r >= seats for wt, r, seats in zip(s.waiting, s.running, s.max_num_seqs, strict=True)]
    assert sum(saturated) == 15
    # preemptions: one per interval on w1 only; long-prefill steps every other interval on both
    assert sum(d for d in s.preemptions_delta if not math.isnan(d)) == 59
    assert got.num_preemptions == pytest.approx(60, rel=0.05)  # Prometheus's extrapolated increase
    assert got.gaps.approximate is False
    assert got.gaps.long_prefill_p99_seconds == pytest.approx(0.5 + 0.5 * 0.99)  # inside (0.5, 1]
    assert got.gaps.other_p99_seconds == pytest.approx(0.05 * 0.99)
    assert got.gaps.num_long_prefill == pytest.approx(2 * 600, rel=0.05)
    e = got.engine
    assert (e.device_memory_bytes, e.weight_bytes, e.kv_bytes_per_token) == (10 * 2**30, 2 * 2**30, 2048)
    assert e.activation_bytes_per_token == 4 * 2**20
    assert e.prefill_seconds_per_token == pytest.approx(0.5 / 5000)
    assert e.max_model_len == 32768
    assert got.profile is not None and got.profile.prefill_mode == "chunked" and got.profile.max_num_seqs == 4
    assert list(got.requests.prompt_tokens) == [100] * 50 + [20_000]
    assert list(got.requests.cached_tokens) == [40] * 50 + [0]
    assert got.memory_peak_to_mean == pytest.approx(3000 / 1000)
    assert s.unit == "scrapes"
    # the decode side: the operator's TPOT objective is the TBT objective; no stall histogram scraped, so
    # the stall P99 is the log's over its 51 successful requests
    assert got.decode.tbt_objective_seconds == pytest.approx(0.1)
    assert got.decode.num_stall_requests == 51
    assert got.decode.stall_p99_seconds == pytest.approx(0.05)
    # "long" by the workers' threshold for their 32,768-token context: a sixteenth
    assert got.gaps.long_prefill_tokens == 2048


def test_model_facts_from_the_workers_gauges_and_refused_requests_have_no_length(clock) -> None:
    pool = make_pool("small", make_profile(prefill_mode="chunked", max_num_batched_tokens=8192, max_num_seqs=4))
    w = worker("s1", pool)  # registered with 32,768 tokens; the engine says 4,096
    for i in range(61):
        p = page(i, saturated=False, preempt=False)
        p.gauges["chunkpilot:max_model_len"] = 4096.0
        p.gauges["chunkpilot:long_prefill_tokens"] = 256.0
        store(at(5 * i), {job(w): p})
    log(pool, w, 10, 734, 0.05)
    log(pool, w, 11, None, None, cached=None, max_gap=None, status=429)
    got = inputs.gather(pool, 300, at(300))
    assert got.engine.max_model_len == 4096
    assert got.gaps.long_prefill_tokens == 256
    assert list(got.requests.prompt_tokens) == [734, None]  # never a 0-token prompt
    assert list(got.requests.ok) == [True, False]
    # the 8,192 budget on the 4,096-token model: flagged as not chunking
    report = verdicts.advise(got, inputs.thresholds())
    budget = next(f for f in report.tuning if f.key == "budget_too_large")
    assert budget.answer == verdicts.Answer.YES and "Not chunking" in budget.reasons[0]
    assert report.knobs.max_num_batched_tokens is not None and report.knobs.max_num_batched_tokens < 4096
    # the refused request is no 0-token prompt: the median is the one successful prompt's (capped by the chunk)
    assert report.knobs.figures["median_tokens_to_compute"] == 734
    assert report.knobs.short_prompt_threshold == min(736, report.knobs.chunk_tokens or 0)


def test_past_ten_minutes_the_samples_are_minute_samples_counted_as_read(clock) -> None:
    pool = make_pool("chunky")
    scrape_for_five_minutes([worker("w1", pool)])
    got = inputs.gather(pool, 1200, at(300))
    s = got.samples
    assert s.unit == "minute samples"
    assert 4 <= len(s.waiting) <= 6  # the minutes 0..5 that have closed rollups, as read
    finding = verdicts.concurrency(got, inputs.thresholds())
    assert finding.reasons[0] == f"Only {len(s.waiting)} minute samples in the window; the answer needs 20."


def test_without_per_step_gaps_head_of_line_is_approximate_from_the_log(clock) -> None:
    pool = make_pool("vllm-pool")
    w = worker("v1", pool)
    # a 5000-token prompt prefills from 100 s to 104 s; requests decoding then saw 1-s gaps, the rest 50 ms
    log(pool, w, 100, 5000, 4.0)
    for i in range(10):
        log(pool, w, 99 + i * 0.1, 100, 0.05, max_gap=1.0)  # decoding 99.05 .. 100.05+: overlaps
    for i in range(40):
        log(pool, w, 150 + i, 100, 0.05, max_gap=0.05)
    # a long prompt mostly cached is no long prefill (4,096-token threshold: 100 left to compute)
    log(pool, w, 200, 9000, 0.2, cached=8900)
    got = inputs.approximate_gaps(inputs._request_log(at(300), 300, pool), 2048)
    assert got.approximate and got.long_prefill_tokens == 2048
    assert (got.num_long_prefill, got.num_other) == (10, 41)
    assert got.long_prefill_p99_seconds == pytest.approx(1.0)
    assert got.other_p99_seconds == pytest.approx(0.05)


@override_settings(ADVISOR_MIN_REQUESTS=20, ADVISOR_MIN_SAMPLES=10, ADVISOR_MIN_GAPS=10)
def test_refresh_keeps_one_report_per_scope_and_tracks_findings_that_appear(clock) -> None:
    pool = make_pool("chunky", make_profile(prefill_mode="chunked", max_num_batched_tokens=4096, max_num_seqs=4))
    w1 = worker("w1", pool)
    scrape_for_five_minutes([w1])
    for i in range(30):
        log(pool, w1, 10 + i, 100, 0.05)

    assert tasks.refresh() == {"reports": 2}
    report = AdvisorReport.objects.get(scope="chunky")
    assert AdvisorReport.objects.filter(scope="fleet").exists()
    # the pool's own long prefills stall its decodes ~20×: budget too large
    assert "budget_too_large" in report.findings and "head_of_line" in report.findings
    body = report.body
    assert body["head_of_line"]["figures"]["ratio"] == pytest.approx((0.5 + 0.5 * 0.99) / (0.05 * 0.99))
    budget = next(f for f in body["tuning"] if f["key"] == "budget_too_large")
    assert (budget["knob"], budget["direction"]) == ("max_num_batched_tokens", "lower")
    first_change = report.findings_changed_at

    clock.shift(60)
    AdvisorReport.refresh(pool)  # nothing new: the findings did not change
    report.refresh_from_db()
    assert report.findings_changed_at == first_change and report.appeared == []

    # a pool gone from the fleet loses its report
    w1.delete()
    AdvisorReport.refresh_all()
    assert list(AdvisorReport.objects.values_list("scope", flat=True)) == ["fleet"]


def test_baseline_is_the_tables_baseline_else_its_stable_pool() -> None:
    table = RoutingTable.objects.create(model="tiny")
    stable, canary, base = make_pool("s"), make_pool("c"), make_pool("b")
    RoutingPool.objects.create(table=table, pool=stable, role="stable", weight_bp=9000)
    RoutingPool.objects.create(table=table, pool=canary, role="canary", weight_bp=1000)
    assert inputs.baseline_of(canary) == stable
    assert inputs.baseline_of(stable) is None
    RoutingPool.objects.create(table=table, pool=base, role="baseline", weight_bp=0)
    assert inputs.baseline_of(canary) == base


def test_api_serves_the_kept_report_and_any_window_on_demand(clock) -> None:
    pool = make_pool("chunky", make_profile(prefill_mode="chunked", max_num_batched_tokens=4096, max_num_seqs=4))
    scrape_for_five_minutes([worker("w1", pool)])
    client = api_client(make_user(Role.VIEWER))

    kept = client.get("/api/v1/advisor/reports/chunky/")
    assert kept.status_code == 200, kept.content
    body = kept.json()
    assert body["kept"] is True and body["scope"] == "chunky"
    assert {q["key"] for q in body["questions"]} == {"long_tail", "concurrency", "memory"}
    assert "formula" in body["pd"]["chart"]
    listed = client.get("/api/v1/advisor/reports/").json()["reports"]
    assert [r["scope"] for r in listed] == ["chunky"]

    live = client.get("/api/v1/advisor/reports/fleet/", {"window": "2m"})
    assert live.status_code == 200 and live.json()["kept"] is False
    assert live.json()["window_seconds"] == 120

    bad = client.get("/api/v1/advisor/reports/chunky/", {"window": "soon"})
    assert bad.status_code == 400 and "window" in bad.json()
    # a past window: it ends where asked, ISO time or epoch seconds
    past = client.get("/api/v1/advisor/reports/chunky/", {"window": "2m", "end": at(150).isoformat()})
    assert past.status_code == 200 and past.json()["computed_at"] == at(150).isoformat()
    epoch = client.get("/api/v1/advisor/reports/chunky/", {"end": str(at(150).timestamp())})
    assert epoch.status_code == 200 and epoch.json()["kept"] is False
    assert epoch.json()["window_seconds"] == 3600  # the kept report's window
    for end in ("yesterday", "nan", "1e20"):
        bad_end = client.get("/api/v1/advisor/reports/chunky/", {"end": end})
        assert bad_end.status_code == 400 and "end" in bad_end.json(), end
    assert client.get("/api/v1/advisor/reports/nope/").status_code == 404
    assert api_client().get("/api/v1/advisor/reports/").status_code == 401


def test_hol_ratio_is_a_figure_an_alert_rule_can_read(clock) -> None:
    from controlplane.alerts import sources
    from controlplane.metrics import query

    pool = make_pool("chunky")
    scrape_for_five_minutes([worker("w1", pool)])
    value = query.query("hol_ratio", 300, group_by="pool", now=at(300))["chunky"]
    assert value == pytest.approx((0.5 + 0.5 * 0.99) / (0.05 * 0.99))
    assert "hol_ratio" in sources.figure_names()


def test_every_threshold_is_a_tunable_named_after_its_field() -> None:
    from controlplane.advisor import conf
    from controlplane.conf import declared

    names = {t.name for t in declared(conf)}
    for row in verdicts.THRESHOLDS:
        assert f"ADVISOR_{row.field.upper()}" in names
    defaults = inputs.thresholds()
    assert defaults == verdicts.Thresholds()
    with override_settings(ADVISOR_ACTIVATION_SHARE_HIGH=0.5, ADVISOR_MIN_GAPS=7):
        changed = inputs.thresholds()
    assert (changed.activation_share_high, changed.min_gaps) == (0.5, 7)
    assert isinstance(changed.min_gaps, int)
