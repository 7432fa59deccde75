"""Figures over stored scrapes and the gateway's log, against hand-computed values.

Scrapes are stored through the scraper's own ``record`` (so totals, resets
and rollups are the real ones); the pages are built from plain numbers.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import promql, query
from controlplane.metrics.figures import Objectives
from controlplane.metrics.models import CounterReset, Rollup, ScrapeStatus, Snapshot, Target
from tests.controlplane.metrics.pages import Page, cumulative, fine_bounds, job, store

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TTFT = "chunkpilot:time_to_first_token_seconds"
INF = math.inf


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def clock():
    with time_machine.travel(at(3600), tick=False) as traveller:
        yield traveller


def worker(name: str, pool: str) -> Worker:
    p, _ = Pool.objects.get_or_create(name=pool)
    return Worker.objects.create(name=name, url=f"http://{name}.invalid:8000", pool=p)


def ttft_page(n: int, *, slow: bool, base: float = 1000.0) -> Page:
    """After n scrapes: 10 requests per scrape; a slow worker puts one of them in (0.5, 1]."""
    fast = base + (9 if slow else 10) * n
    total = base + 10 * n
    return Page(histograms={TTFT: ([(0.1, fast), (0.5, fast), (1.0, total), (INF, total)], 0.05 * total)})


def test_ttft_p99_by_cohort_sums_buckets_within_each_cohort(clock) -> None:
    canary, stable = worker("c1", "canary-pool"), worker("s1", "stable-pool")
    jobs = {"canary": job(canary, "canary"), "stable": job(stable, "stable")}
    for i in range(1, 13):  # scrapes at 5..60 s
        store(at(5 * i), {jobs["canary"]: ttft_page(i, slow=True), jobs["stable"]: ttft_page(i, slow=False)})

    by_cohort = query.query("ttft_p99", 60, "cohort", now=at(60))
    # canary: increases le0.1 = le0.5 = 99, le1 = +Inf = 110 (all scaled by the
    # same 60/55 extrapolation, which a quantile ignores). rank 0.99 x 110 =
    # 108.9, 9.9 into (0.5, 1] holding 11: 0.5 + 0.5 x 9.9/11 = 0.95.
    assert by_cohort["canary"] == pytest.approx(0.95)
    # stable: all 110 in (0, 0.1]: 0.1 x 108.9/110.
    assert by_cohort["stable"] == pytest.approx(0.099)
    # fleet: 209, 209, 220, 220: rank 217.8, 8.8 into (0.5, 1] of 11: 0.9.
    assert query.query("ttft_p99", 60, now=at(60)) == {"fleet": pytest.approx(0.9)}
    assert query.query("ttft_p99", 60, "pool", {"cohort": "canary"}, now=at(60)) == {"canary-pool": pytest.approx(0.95)}


def test_counter_reset_in_the_window_counts_like_prometheus(clock) -> None:
    w = worker("w1", "p")
    raw = [50, 60, 70, 80, 90, 5, 15, 25, 35, 45, 55, 65]  # the worker restarts after the 5th scrape
    for i, value in enumerate(raw, start=1):
        store(at(5 * i), {job(w): Page(counters={"vllm:request_success_total": value})})
    got = query.query("requests_per_second", 60, now=at(60))["fleet"]
    # 65 - 50 + 90 = 105 over 55 s, extrapolated 5 s back (zero point 26 s): 105 x 60/55, per 60 s.
    assert got == pytest.approx(105 * 60 / 55 / 60)
    assert got == pytest.approx(promql.rate([(5.0 * i, v) for i, v in enumerate(raw, 1)], 0, 60))
    assert CounterReset.objects.count() == 1


def test_reset_just_before_the_window_uses_the_raw_value_for_the_zero_point(clock) -> None:
    # 500 at t=0 (on the window's open edge), restart, then 2, 12, ..., 112.
    w = worker("w1", "p")
    samples = [(0.0, 500.0)] + [(5.0 * i, 2.0 + 10 * (i - 1)) for i in range(1, 13)]
    for t, value in samples:
        store(at(t), {job(w): Page(counters={"vllm:request_success_total": value})})
    # Inside (0, 60]: 2 .. 112, increase 110 over 55 s. The raw first value 2
    # puts the zero point 55 x 2/110 = 1 s back: 110 x 56/55 (stored totals
    # would say 502 and extrapolate the full 5 s).
    got = query.query("requests_per_second", 60, now=at(60))["fleet"]
    assert got == pytest.approx(110 * 56 / 55 / 60)
    assert got == pytest.approx(promql.rate(samples, 0, 60))


def test_window_with_one_scrape_is_no_data_and_a_flat_counter_is_zero(clock) -> None:
    busy, idle, late = worker("busy", "p"), worker("idle", "p"), worker("late", "p")
    for i in range(1, 13):
        pages = {
            job(busy): Page(counters={"vllm:num_preemptions_total": 7.0}),
            job(idle): Page(counters={"vllm:num_preemptions_total": 3.0}),
        }
        if i == 12:
            pages[job(late)] = Page(counters={"vllm:num_preemptions_total": 1.0})
        store(at(5 * i), pages)
    got = query.query("preemptions_per_second", 60, "worker", now=at(60))
    assert got == {"busy": 0.0, "idle": 0.0, "late": None}
    # Nobody scraped in the window at all: no groups, and the fleet is no data.
    assert query.query("preemptions_per_second", 60, "worker", now=at(600)) == {}
    assert query.query("ttft_p99", 60, now=at(60)) == {"fleet": None}  # no observations: no data


def test_memory_peak_to_mean_and_kv_fragmentation_over_five_minutes(clock) -> None:
    w = worker("w1", "p")
    for i in range(0, 61):  # 0..300 s; the scrape at 0 sits on the open edge
        peak = 9999.0 if i == 0 else (800.0 if i == 30 else 300.0 + (i % 3) * 100)  # 800 at 150 s: an inner minute
        store(
            at(5 * i),
            {
                job(w): Page(
                    counters={
                        "chunkpilot:memory_byte_seconds_total": 1e6 + 2000.0 * i,  # 400 bytes held on average
                        "chunkpilot:kv_fragmentation_ratio_seconds_total": 100 + 1.25 * i,
                    },  # 0.25
                    gauges={"chunkpilot:memory_recent_peak_bytes": peak},
                )
            },
        )
    got = query.query_many(["memory_peak_to_mean", "kv_fragmentation"], 300, now=at(300))
    assert got["memory_peak_to_mean"]["fleet"] == pytest.approx(800 / 400)
    assert got["kv_fragmentation"]["fleet"] == pytest.approx(0.25)
    # Only the last minute: peaks 300..500 there, no 800.
    assert query.query("memory_peak_to_mean", 60, now=at(300))["fleet"] == pytest.approx(500 / 400)


def test_time_weighted_means_cover_only_the_time_a_young_worker_was_up(clock) -> None:
    # Started 60 s into a 300-s window, 1000 bytes held steadily, peak 1000:
    # its mean over its own life is 1000, so peak/mean is 1, not 5.
    w = worker("young", "p")
    for i in range(0, 49):  # scrapes at 60..300 s
        held = 5.0 * i
        store(
            at(60 + 5 * i),
            {
                job(w): Page(
                    counters={
                        "chunkpilot:memory_byte_seconds_total": 1000.0 * held,
                        "chunkpilot:kv_fragmentation_ratio_seconds_total": 0.2 * held,
                        "chunkpilot:held_seconds_total": held,
                    },
                    gauges={"chunkpilot:memory_recent_peak_bytes": 1000.0},
                )
            },
        )
    got = query.query_many(["memory_peak_to_mean", "kv_fragmentation"], 300, now=at(300))
    assert got["memory_peak_to_mean"]["fleet"] == pytest.approx(1.0)
    assert got["kv_fragmentation"]["fleet"] == pytest.approx(0.2)


def test_time_series_from_minute_rollups_agree_with_the_one_window_query(clock) -> None:
    w = worker("w1", "p")
    for i in range(1, 12 * 15 + 1):  # 15 minutes, steady 2 requests/s
        store(at(5 * i), {job(w): Page(counters={"vllm:request_success_total": 100 + 10.0 * i})})
    end = at(15 * 60)
    series = query.query_range("requests_per_second", 300, start=end - timedelta(minutes=9), end=end, step_seconds=60)
    assert len(series.times) == 10 and series.times[-1] == end.timestamp()
    assert series.series["fleet"] == [pytest.approx(2.0)] * 10
    assert query.query("requests_per_second", 300, now=end)["fleet"] == pytest.approx(2.0)
    assert Rollup.objects.count() == 16 and Snapshot.objects.count() == 180  # 12:00 .. 12:15
    # Before the first scrape the series has no data, not zeros.
    early = query.query_range("requests_per_second", 60, start=at(-120), end=at(0), step_seconds=60)
    assert early.series == {"fleet": [None, None, None]}


def test_a_worker_that_does_not_answer_is_marked_down_and_the_rest_are_stored(clock) -> None:
    up, down = worker("up", "p"), worker("down", "p")
    assert store(at(5), {job(up): Page(counters={"vllm:request_success_total": 1}), job(down): None}) == 1
    assert store(at(10), {job(up): Page(counters={"vllm:request_success_total": 2}), job(down): None}) == 1
    status = {s.worker.name: s for s in ScrapeStatus.objects.select_related("worker")}
    assert status["up"].up and status["up"].last_success_at == at(10)
    assert not status["down"].up and status["down"].num_consecutive_failures == 2
    assert status["down"].last_error == "connection refused"
    assert list(Target.objects.values_list("worker_name", flat=True)) == ["up"]


def test_moving_to_another_cohort_starts_new_series(clock) -> None:
    w = worker("w1", "p")
    for i in range(1, 13):
        store(
            at(5 * i),
            {job(w, "canary" if i <= 6 else "stable"): Page(counters={"vllm:request_success_total": 10.0 * i})},
        )
    got = query.query("requests_per_second", 60, "cohort", now=at(60))
    # Each cohort's series has 6 samples 25 s apart and is extrapolated by half an interval at its open end.
    assert set(got) == {"canary", "stable"}
    assert got["canary"] == pytest.approx(promql.rate([(5.0 * i, 10.0 * i) for i in range(1, 7)], 0, 60))
    assert got["stable"] == pytest.approx(promql.rate([(5.0 * i, 10.0 * i) for i in range(7, 13)], 0, 60))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"figure": "ttft_p100"}, "figure"),
        ({"figure": "ttft_p99", "group_by": "region"}, "group_by"),
        ({"figure": "itl_p99", "group_by": "length_bucket"}, "group_by"),  # not labelled by prompt length
        ({"figure": "ttft_p99", "window_seconds": -5}, "window"),
        ({"figure": "ttft_p99", "selector": {"zone": "a"}}, "selector"),
    ],
)
def test_bad_input_names_the_parameter(kwargs, field) -> None:
    args = {"window_seconds": 60, **kwargs}
    with pytest.raises(query.QueryError) as caught:
        query.query(args.pop("figure"), args.pop("window_seconds"), **args)
    assert caught.value.field == field


# ---- the gateway's request log --------------------------------------------------------


def log_request(
    created: datetime,
    *,
    prompt_tokens: int,
    ttft: float | None,
    tpot: float | None = 0.05,
    status: int = 200,
    error: str = "",
    cohort: str = "stable",
    w: Worker | None = None,
    stream: bool = True,
    e2e: float | None = None,
):
    from controlplane.gateway.models import RequestLog

    return RequestLog.objects.create(
        request_id=f"r{RequestLog.objects.count()}",
        created_at=created,
        model="tiny",
        cohort=cohort,
        pool=w.pool if w else None,
        worker=w,
        prompt_tokens=prompt_tokens,
        output_tokens=10,
        ttft_seconds=ttft,
        max_gap_seconds=(ttft or 0) / 2,
        tpot_seconds=tpot,
        e2e_seconds=(ttft or 0) + 1 if e2e is None else e2e,
        status=status,
        error=error,
        stream=stream,
    )


def test_exact_percentiles_per_prompt_length_bucket(clock) -> None:
    w = worker("w1", "p")
    for i in range(1, 101):
        log_request(at(i * 0.5), prompt_tokens=100, ttft=i / 100, w=w)  # <=512: ttft 0.01 .. 1.00
    for i in range(1, 5):
        log_request(at(i), prompt_tokens=4000, ttft=float(i), w=w)  # <=8K: 1, 2, 3, 4
    log_request(at(10), prompt_tokens=40000, ttft=9.0, status=503, error="worker gone", w=w)  # >32K, failed
    log_request(at(-30), prompt_tokens=100, ttft=50.0, w=w)  # before the window
    got = query.query("client_ttft_p99", 60, "length_bucket", now=at(60))
    # Nearest rank, ceil(q x n): <=512: rank 99 of 100, 0.99. <=8K: rank ceil(3.96) = 4 of 4, the slowest.
    assert got == {"<=512": pytest.approx(0.99), "<=8K": pytest.approx(4.0), ">32K": None}
    counts = query.query("request_count", 60, "length_bucket", now=at(60))
    assert counts == {"<=512": 100.0, "<=8K": 4.0, ">32K": 1.0}


def test_goodput_counts_requests_meeting_both_objectives(clock) -> None:
    log_request(at(1), prompt_tokens=10, ttft=0.5, tpot=0.05)  # good
    log_request(at(2), prompt_tokens=10, ttft=0.5, tpot=None)  # one token: good
    log_request(at(3), prompt_tokens=10, ttft=3.0, tpot=0.05)  # TTFT missed
    log_request(at(4), prompt_tokens=10, ttft=0.5, tpot=0.5)  # TPOT missed
    log_request(at(5), prompt_tokens=10, ttft=0.1, status=500, error="boom")  # failed
    log_request(at(6), prompt_tokens=10, ttft=None, status=400, error="bad request")  # the client's fault
    objectives = Objectives(ttft_seconds=1.0, tpot_seconds=0.1)
    got = query.query_many(["goodput", "goodput_ratio", "error_rate"], 60, now=at(60), objectives=objectives)
    # Six arrivals a second apart: traffic from the window's start (1 s before the
    # first, within 1.1 intervals) to half an interval after the last, 6.5 s of the 60.
    assert got["goodput"] == {"fleet": pytest.approx(2 / 6.5)}
    assert got["goodput_ratio"] == {"fleet": pytest.approx(2 / 6)}
    assert got["error_rate"] == {"fleet": pytest.approx(1 / 6)}
    assert query.query_many(["goodput", "goodput_ratio", "request_count"], 60, now=at(600)) == {
        "goodput": {"fleet": None},
        "goodput_ratio": {"fleet": None},
        "request_count": {"fleet": 0.0},
    }


def test_each_groups_rate_is_over_the_time_the_whole_stream_had_traffic(clock) -> None:
    # One stream, one request a second for 60 s; three of them, 3 s apart, to the canary.
    for i in range(60):
        log_request(at(0.5 + i), prompt_tokens=10, ttft=0.1, cohort="canary" if i in (30, 33, 36) else "stable")
    log_request(at(200), prompt_tokens=10, ttft=0.1)  # past the window: not in it
    got = query.query("client_requests_per_second", 60, "cohort", now=at(60))
    # 3 and 57 requests over the stream's 60 s, not the canary's 3 over its own 6 s and edges.
    assert got == {"canary": pytest.approx(3 / 60), "stable": pytest.approx(57 / 60)}
    assert query.query("client_requests_per_second", 60, "fleet", now=at(60)) == {"fleet": pytest.approx(1.0)}


def test_goodput_judges_a_request_answered_whole_by_when_its_answer_arrived(clock) -> None:
    # Not streamed: the gateway logs no TTFT or TPOT, only the end-to-end time.
    log_request(
        at(1), prompt_tokens=10, ttft=None, tpot=None, stream=False, e2e=0.8
    )  # answer within the TTFT objective
    log_request(at(2), prompt_tokens=10, ttft=None, tpot=None, stream=False, e2e=3.0)  # the client waited 3 s
    log_request(at(3), prompt_tokens=10, ttft=None, tpot=None, stream=False, e2e=0.2, status=503, error="gone")
    objectives = Objectives(ttft_seconds=1.0, tpot_seconds=0.1)
    got = query.query_many(["goodput", "goodput_ratio"], 60, now=at(60), objectives=objectives)
    # Arrivals at 1, 2, 3 s: 3.5 s of traffic (see traffic_seconds).
    assert got == {"goodput": {"fleet": pytest.approx(1 / 3.5)}, "goodput_ratio": {"fleet": pytest.approx(1 / 3)}}


def test_retention_keeps_raw_scrapes_a_day_and_minutes_two_weeks_and_long_windows_read_minutes(clock) -> None:
    from controlplane.metrics.models import purge_expired

    w = worker("w1", "p")
    day = 86400
    # The counter counts seconds (1 request/s); scraped every 30 s for an
    # hour three days ago and for the last hour.
    samples = [
        (float(start + 30 * i), 1e6 + start + 30 * i + 3 * day) for start in (-3 * day, -3600) for i in range(1, 121)
    ]
    for t, value in samples:
        store(at(t), {job(w): Page(counters={"vllm:request_success_total": value})})
    now = at(0)
    with time_machine.travel(now, tick=False):
        counts = purge_expired(now)
        assert counts["snapshots"] == 120 and counts["rollups"] == 0
        assert not Snapshot.objects.filter(ts__lt=now - timedelta(days=1)).exists()
        # 30 .. 3600 s past the hour: 61 minutes, the first and last with one scrape each.
        assert Rollup.objects.filter(minute__lt=now - timedelta(days=1)).count() == 61
        # A four-day window starts before raw retention, so it reads minute
        # rollups: Prometheus's arithmetic over each minute's last sample.
        last_of_minute = {t // 60: (t, v) for t, v in samples}
        minute_samples = sorted(last_of_minute.values())
        expected = promql.rate(minute_samples, -4 * day, 0)
        assert query.query("requests_per_second", 4 * day, now=now)["fleet"] == pytest.approx(expected)
        # By hand: 122 minute samples from -3d+30 to 0, increase 3d - 30 over as
        # many seconds; the window's start is far: extrapolate half an interval.
        sampled = 3 * day - 30
        assert expected == pytest.approx((sampled + sampled / 121 / 2) / (4 * day))
    with time_machine.travel(now + timedelta(days=15), tick=False):
        purge_expired(now + timedelta(days=15))
        assert not Rollup.objects.exists() and not Target.objects.exists()


def test_p95_sits_beside_p50_and_p99_for_exact_and_scraped_figures(clock) -> None:
    w = worker("w1", "p")
    for i in range(1, 101):
        log_request(at(i * 0.5), prompt_tokens=100, ttft=i / 100, w=w)  # ttft 0.01 .. 1.00
    got = {
        name: query.query(name, 60, now=at(60))["fleet"]
        for name in ("client_ttft_p50", "client_ttft_p95", "client_ttft_p99")
    }
    # nearest ranks 50, 95 and 99 of the 100 values 0.01 .. 1.00
    assert got == {
        "client_ttft_p50": pytest.approx(0.50),
        "client_ttft_p95": pytest.approx(0.95),
        "client_ttft_p99": pytest.approx(0.99),
    }
    canary = worker("c1", "canary-pool")
    for i in range(1, 13):
        store(at(5 * i), {job(canary, "canary"): ttft_page(i, slow=True)})
    # 99, 99, 110, 110 as in the P99 test: rank 0.95 x 110 = 104.5, 5.5 into (0.5, 1] of 11: 0.75.
    assert query.query("ttft_p95", 60, now=at(60))["fleet"] == pytest.approx(0.75)


def test_the_prefill_time_histogram_is_kept_and_read(clock) -> None:
    canary = worker("c1", "canary-pool")
    prefill = "vllm:request_prefill_time_seconds"
    for i in range(1, 13):
        total = 10.0 * i
        store(
            at(5 * i),
            {
                job(canary, "canary"): Page(
                    histograms={prefill: ([(0.1, total / 2), (0.5, total), (INF, total)], 0.2 * total)}
                )
            },
        )
    assert query.query("prefill_time_mean", 60, now=at(60))["fleet"] == pytest.approx(0.2)
    # half in (0, 0.1], half in (0.1, 0.5]: the median at the first half's top.
    assert query.query("prefill_time_p50", 60, now=at(60))["fleet"] == pytest.approx(0.1)
    assert 0.1 < query.query("prefill_time_p99", 60, now=at(60))["fleet"] <= 0.5


class _Exported:
    """A worker's real /metrics page (its exporter fed the engine's records)."""

    def __init__(self, text: str):
        self._text = text

    def text(self) -> str:
        return self._text


def test_scraped_figures_per_prompt_bucket_where_the_worker_labels_them(clock) -> None:
    # The worker's page (workers/server/metrics.py) labels these histograms by
    # prompt_bucket, in the fine buckets; built here from plain values.
    w = worker("w1", "p")
    bounds = fine_bounds(2560.0)

    def page(n: int) -> Page:
        by_bucket = {"<=512": ([0.008] * n, [0.02] * n), "<=32K": ([0.9] * n, [0.02] * n)}
        empty = {label: (cumulative([], bounds), 0.0) for label in ("<=2K", "<=8K", ">32K")}
        return Page(
            by_prompt={
                "chunkpilot:time_to_first_token_by_prompt_seconds": {
                    **empty,
                    **{label: (cumulative(t, bounds), sum(t)) for label, (t, _) in by_bucket.items()},
                },
                "chunkpilot:request_max_gap_by_prompt_seconds": {
                    **empty,
                    **{label: (cumulative(g, bounds), sum(g)) for label, (_, g) in by_bucket.items()},
                },
            }
        )

    store(at(5), {job(w, "stable"): page(0)})
    store(at(60), {job(w, "stable"): page(20)})
    got = query.query("ttft_p99", 60, "length_bucket", now=at(60))
    assert set(got) == {"<=512", "<=32K"}  # the other buckets had no requests: absent, not 0
    # Fine buckets (none wider than 19%) resolve an 8-ms TTFT beside a 0.9-s one.
    assert got == {"<=512": pytest.approx(0.008, rel=0.19), "<=32K": pytest.approx(0.9, rel=0.19)}
    assert query.query("stall_p50", 60, "length_bucket", now=at(60))["<=512"] == pytest.approx(0.02, rel=0.19)
    # What each bucket's percentile rests on: its 20 requests (counted from 0, not extrapolated past it).
    # The buckets the worker shows empty rest on 0.
    assert query.query("ttft_samples", 60, "length_bucket", now=at(60)) == {
        "<=512": 20.0,
        "<=32K": 20.0,
        "<=2K": 0.0,
        "<=8K": 0.0,
        ">32K": 0.0,
    }
    with pytest.raises(query.QueryError) as raised:
        query.query("itl_p99", 60, "length_bucket", now=at(60))
    assert raised.value.field == "group_by"
