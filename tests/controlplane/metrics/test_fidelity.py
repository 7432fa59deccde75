"""Figures that match what clients measure (issue 29) and short windows that
have a point at every step (issue 26, item 5).

Scrapes are the workers' pages built from plain values (``pages.Page``) in
the names and fine buckets the workers expose (docs/architecture.md,
"Metrics"), stored through the scraper's own ``record``; request-log rows
are written as the gateway writes them.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import time_machine

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog
from controlplane.metrics import figures, query
from tests.controlplane.factories import api_client, make_user
from tests.controlplane.metrics.pages import Page, cumulative, fine_bounds, job, store

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TTFT = "chunkpilot:time_to_first_token_seconds"
ITL = "chunkpilot:inter_token_latency_seconds"
TPOT = "chunkpilot:request_time_per_output_token_seconds"
MAX_GAP = "chunkpilot:request_max_gap_seconds"
# vLLM's buckets, which the workers' chunkpilot:* histograms used to copy.
VLLM_ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, math.inf]
FINE = fine_bounds(2560.0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def clock():
    with time_machine.travel(at(3600), tick=False) as traveller:
        yield traveller


@pytest.fixture
def viewer():
    return api_client(make_user(Role.VIEWER))


def worker(name: str, pool: str = "p") -> Worker:
    p, _ = Pool.objects.get_or_create(name=pool)
    return Worker.objects.create(name=name, url=f"http://{name}.invalid:8000", pool=p)


def histogram(values: list[float] | np.ndarray, bounds: list[float] = FINE) -> tuple[list[tuple[float, float]], float]:
    return cumulative(list(values), bounds), float(sum(values))


def log(created: datetime, *, ttft: float = 0.1, status: int = 200, error: str = "", tpot: float = 0.01) -> None:
    RequestLog.objects.create(
        request_id=f"r{RequestLog.objects.count()}",
        created_at=created,
        model="tiny",
        cohort="stable",
        prompt_tokens=100,
        output_tokens=10,
        ttft_seconds=ttft if status == 200 else None,
        tpot_seconds=tpot if status == 200 else None,
        max_gap_seconds=ttft / 2 if status == 200 else None,
        e2e_seconds=ttft + 1,
        status=status,
        error=error,
    )


# ---- buckets that resolve milliseconds -------------------------------------------------


def test_itl_and_tpot_under_10_ms_through_the_fine_buckets_are_within_10_percent_of_exact(clock) -> None:
    rng = np.random.default_rng(29)
    gaps = np.exp(rng.uniform(math.log(0.0012), math.log(0.009), 2000))  # 1.2 .. 9 ms, as a GPU streams
    tpots = np.exp(rng.uniform(math.log(0.0015), math.log(0.004), 300))
    w = worker("w1")
    store(at(5), {job(w): Page(histograms={ITL: histogram([]), TPOT: histogram([])})})
    store(at(60), {job(w): Page(histograms={ITL: histogram(gaps), TPOT: histogram(tpots)})})
    got = query.query_many(["itl_p50", "itl_p99", "tpot_p50", "tpot_p99"], 60, now=at(60))
    for name, values in (("itl", gaps), ("tpot", tpots)):
        exact_p50 = figures.nearest_rank(values, 0.5)
        assert got[f"{name}_p50"]["fleet"] == pytest.approx(exact_p50, rel=0.10)
        # No bucket is wider than 19%: a P99 is within its bucket.
        assert got[f"{name}_p99"]["fleet"] == pytest.approx(figures.nearest_rank(values, 0.99), rel=0.19)
    # The same gaps through vLLM's buckets (lowest edge 10 ms) read as
    # interpolated from zero: the P50 the dashboards used to show.
    store(at(65), {job(w, "old"): Page(histograms={ITL: histogram([], VLLM_ITL_BOUNDS)})})
    store(at(120), {job(w, "old"): Page(histograms={ITL: histogram(gaps, VLLM_ITL_BOUNDS)})})
    coarse = query.query("itl_p50", 60, "cohort", now=at(120))["old"]
    assert coarse == pytest.approx(0.005)  # half of the 10-ms bucket, whatever the gaps
    assert abs(coarse - figures.nearest_rank(gaps, 0.5)) / figures.nearest_rank(gaps, 0.5) > 0.10


def test_old_snapshots_with_other_names_or_bounds_are_read_or_skipped_cleanly(clock) -> None:
    old, new = worker("old"), worker("new")
    slow = [0.5] * 10 + [1.5]  # stalls as the old worker's coarse buckets held them
    for i, t in enumerate((5.0, 60.0)):
        n = i  # 0 then 1 times the values
        store(
            at(t),
            {
                # A worker from before the chunkpilot:* latencies: vLLM's TTFT,
                # stalls in the former coarse buckets.
                job(old): Page(
                    histograms={
                        "vllm:time_to_first_token_seconds": histogram([0.3] * 50 * n, VLLM_ITL_BOUNDS),
                        MAX_GAP: histogram(slow * n, [0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, math.inf]),
                    }
                ),
                job(new): Page(histograms={TTFT: histogram([0.2] * 50 * n), MAX_GAP: histogram([0.04] * 100 * n)}),
            },
        )
    ttft = query.query("ttft_p99", 60, "worker", now=at(60))
    # The old worker's layout has no chunkpilot TTFT: no data, not 0 and no error.
    assert ttft == {"new": pytest.approx(0.2, rel=0.19), "old": None}
    assert query.query("ttft_p99", 60, now=at(60)) == {"fleet": ttft["new"]}
    # Stalls in two bucket layouts merge at the union of their bounds, each
    # read at a bound it lacks from its own bound below: the P99 of the 111
    # (nearest rank 110, one of the old worker's 0.5 s) within a bucket.
    # (Summing only the series that have a bound, as Prometheus does, puts
    # the rank in +Inf here: 2,966 s.)
    stall = query.query("stall_p99", 60, now=at(60))["fleet"]
    assert stall == pytest.approx(figures.nearest_rank(np.array(slow + [0.04] * 100), 0.99), rel=0.19)
    assert query.query("stall_samples", 60, now=at(60)) == {"fleet": pytest.approx(111)}


def test_a_worker_that_changes_layout_reads_each_layout_over_its_own_time(clock) -> None:
    w = worker("w1")
    for i in range(1, 13):  # the old page: vLLM names only
        store(at(5 * i), {job(w): Page(histograms={"vllm:time_to_first_token_seconds": histogram([0.3] * 10 * i)})})
    for i in range(13, 25):  # the new page: the chunkpilot latencies too
        store(at(5 * i), {job(w): Page(histograms={TTFT: histogram([0.05] * 10 * i)})})
    result = query.query_range("ttft_p99", 30, start=at(30), end=at(120), step_seconds=30)
    assert result.series["fleet"][:2] == [None, None]  # windows of the old layout only
    assert result.series["fleet"][-1] == pytest.approx(0.05, rel=0.19)


# ---- one percentile rule, with the samples it rests on ------------------------------------


def test_exact_percentiles_use_nearest_rank_and_the_api_says_how_many_samples(clock, viewer) -> None:
    with time_machine.travel(at(3600), tick=False):
        now = at(3600)
        for i in range(1, 91):
            log(now - timedelta(seconds=i * 0.5), ttft=i / 1000)  # 1 .. 90 ms
        body = viewer.get("/api/v1/metrics/query", {"figure": "client_ttft_p99", "window": "1m"}).json()
        # Nearest rank of 90: rank ceil(89.1) = 90, the slowest (linear interpolation would say 89.91 ms).
        assert body["values"] == {"fleet": pytest.approx(0.090)}
        assert body["samples"] == {"fleet": 90.0} and body["few_samples"] == {"fleet": True}
        assert body["quantile"] == 0.99 and "nearest rank" in body["percentile_rule"]
        assert body["samples_figure"] == "client_ttft_samples"
        for i in range(91, 151):
            log(now - timedelta(seconds=i * 0.3), ttft=i / 1000)
        body = viewer.get("/api/v1/metrics/query", {"figure": "client_ttft_p99", "window": "1m"}).json()
        # 150 requests: rank ceil(148.5) = 149.
        assert body["values"] == {"fleet": pytest.approx(0.149)}
        assert body["samples"] == {"fleet": 150.0} and body["few_samples"] == {"fleet": False}
        # A figure that is no percentile carries none of it.
        rate = viewer.get("/api/v1/metrics/query", {"figure": "client_requests_per_second", "window": "1m"}).json()
        assert "samples" not in rate and "few_samples" not in rate


def test_scraped_percentiles_carry_their_histograms_sample_count_in_query_and_query_range(clock, viewer) -> None:
    w = worker("w1")
    now = at(3600)
    with time_machine.travel(now, tick=False):
        store(now - timedelta(seconds=55), {job(w, "stable"): Page(histograms={TTFT: histogram([])})})
        store(now, {job(w, "stable"): Page(histograms={TTFT: histogram([0.1] * 89 + [0.9])})})
        body = viewer.get("/api/v1/metrics/query", {"figure": "ttft_p99", "window": "1m", "group_by": "cohort"}).json()
        assert body["values"] == {"stable": pytest.approx(0.9, rel=0.19)}
        # Counted from 0 (the zero point): exactly the 90 observations.
        assert body["samples"] == {"stable": pytest.approx(90)} and body["few_samples"] == {"stable": True}
        assert "histogram_quantile" in body["percentile_rule"]
        ranged = viewer.get(
            "/api/v1/metrics/query_range",
            {"figure": "ttft_p99", "window": "1m", "group_by": "cohort", "range": "2m", "step": "1m"},
        ).json()
        assert len(ranged["samples"]["stable"]) == len(ranged["times"]) == 3
        assert ranged["samples"]["stable"][-1] == pytest.approx(90)
        assert ranged["few_samples"]["stable"][-1] is True
        described = {f["name"]: f for f in viewer.get("/api/v1/metrics/figures").json()["figures"]}
        assert described["ttft_p99"]["samples_figure"] == "ttft_samples"
        assert described["client_stall_p95"]["quantile"] == 0.95


def test_few_samples_marks_a_percentile_decided_by_its_slowest_few() -> None:
    assert figures.few_samples(0.99, 99) and not figures.few_samples(0.99, 100)
    assert figures.few_samples(0.95, 19) and not figures.few_samples(0.95, 20)
    assert not figures.few_samples(None, 3)
    p99 = figures.get("client_ttft_p99")
    assert figures.samples_note(p99, 90) == "n = 90: rests on the 1 slowest request"
    assert figures.samples_note(p99, 250) == "n = 250"
    assert figures.samples_note(figures.get("itl_p99"), 40) == "n = 40: rests on the 1 slowest token gap"
    assert figures.slowest_behind(0.95, 10) == 1 and figures.slowest_behind(0.5, 10) == 6


# ---- rates over the time with traffic; cancelled apart from served ------------------------


def test_two_requests_in_a_30_s_window_read_over_the_time_they_were_sent_in(clock) -> None:
    end = at(3600)
    log(end - timedelta(seconds=18))  # arrivals 12 s and 16 s into the 30-s window
    log(end - timedelta(seconds=14))
    got = query.query("client_requests_per_second", 30, now=end)["fleet"]
    # One arrival every 4 s: traffic for 4 s between them and half an
    # interval at each quiet edge, 8 s; the client that sent them reads 0.25/s.
    assert got == pytest.approx(2 / 8)
    assert got != pytest.approx(2.4 / 30) and got != pytest.approx(2 / 30)
    assert figures.traffic_seconds(np.array([12.0, 16.0]), 0.0, 30.0) == 8.0


def test_steady_traffic_reads_its_rate_over_the_whole_window(clock) -> None:
    end = at(3600)
    for i in range(30):
        log(end - timedelta(seconds=29.5 - i))  # one a second, 0.5 s in from each edge
    assert query.query("client_requests_per_second", 30, now=end)["fleet"] == pytest.approx(1.0)


def test_requests_the_client_cancelled_count_apart_from_served_ones(clock) -> None:
    end = at(3600)
    for i in range(20):
        log(end - timedelta(seconds=20 - i))  # served, one a second
    for i in range(5):
        log(end - timedelta(seconds=10.5 - i), status=499, error="client went away")
    log(end - timedelta(seconds=3.5), status=500, error="boom")
    got = query.query_many(
        [
            "client_requests_per_second",
            "client_cancelled_per_second",
            "request_count",
            "cancelled_requests",
            "error_rate",
        ],
        30,
        now=end,
    )
    counted = {name: values["fleet"] for name, values in got.items()}
    # 21 served arrivals from 20 s to 0 s before the end, one each 1 s (the
    # failed one among them), and 5 cancelled among them: traffic over every
    # arrival.
    arrivals = [-(20.0 - i) for i in range(20)] + [-3.5] + [-(10.5 - i) for i in range(5)]
    traffic = figures.traffic_seconds(np.sort(np.array(arrivals)), -30.0, 0.0)
    assert counted == {
        "client_requests_per_second": pytest.approx(21 / traffic),
        "client_cancelled_per_second": pytest.approx(5 / traffic),
        "request_count": 21.0,
        "cancelled_requests": 5.0,
        "error_rate": pytest.approx(1 / 21),
    }


def test_requests_cancelled_at_the_clients_cut_off_still_count_as_time_with_traffic(clock) -> None:
    """A benchmark client sends at 1/s for 20 s and gives up on the last 10
    requests at its cut-off: it served 10 requests in 20 s of sending, 0.5/s.
    Over the served arrivals only the log read 10 requests in 10 s, 1.0/s."""
    end = at(3600)
    for i in range(20):
        cancelled = i >= 10
        log(end - timedelta(seconds=20 - i), status=499 if cancelled else 200, error="gone" if cancelled else "")
    got = query.query("client_requests_per_second", 30, now=end)["fleet"]
    assert got == pytest.approx(10 / figures.traffic_seconds(np.arange(-20.0, 0.0), -30.0, 0.0))
    assert got == pytest.approx(0.5, rel=0.05)


# ---- a short window over real scrapes has a point at every step ---------------------------


def _steady_fleet(end: datetime, minutes: int) -> Worker:
    """A worker scraped about every 5 s (jittered as a real scrape loop is)
    with 2 requests/s of steady traffic, TTFT 40..120 ms."""
    w = worker("w1", "gpu-a")
    seconds = minutes * 60
    requests = 0
    ttfts: list[float] = []
    for i in range(seconds // 5 + 1):
        t = -seconds + 5 * i + 0.3 * math.sin(i)  # within ±0.3 s of the 5-s grid
        new = 10
        ttfts.extend(0.04 + 0.08 * ((requests + k) % 17) / 16 for k in range(new))
        requests += new
        store(
            end + timedelta(seconds=t),
            {
                job(w, "stable"): Page(
                    counters={"vllm:request_success_total": float(requests)},
                    histograms={TTFT: histogram(ttfts)},
                )
            },
        )
    return w


def test_a_one_minute_window_over_5_s_scrapes_has_a_point_at_every_step(viewer) -> None:
    end = at(3600)
    with time_machine.travel(end, tick=False):
        _steady_fleet(end, 17)
        result = query.query_range("ttft_p99", 60, start=end - timedelta(minutes=15), end=end, step_seconds=15)
        values = result.series["fleet"]
        assert len(values) == 61 and all(v is not None for v in values)
        assert all(0.04 < v <= 0.12 * 1.19 for v in values)
        rates = query.query_range(
            "requests_per_second", 60, start=end - timedelta(minutes=15), end=end, step_seconds=15
        ).series["fleet"]
        assert all(r == pytest.approx(2.0, rel=0.05) for r in rates)
        # The newest point is the window ending now, as the query API says.
        assert values[-1] == pytest.approx(query.query("ttft_p99", 60, now=end)["fleet"])
        body = viewer.get(
            "/api/v1/metrics/query_range", {"figure": "ttft_p99", "window": "60", "range": "15m", "step": "15s"}
        ).json()
        assert len(body["times"]) == 61
        assert sum(v is not None for v in body["series"]["fleet"]) == 61
        assert all(n == pytest.approx(120, rel=0.15) for n in body["samples"]["fleet"])  # 2/s over 60 s


def test_a_five_minute_window_with_a_minute_step_reads_raw_scrapes_too(viewer) -> None:
    end = at(3600)
    with time_machine.travel(end, tick=False):
        _steady_fleet(end, 25)
        values = query.query_range("ttft_p99", 300, start=end - timedelta(minutes=20), end=end, step_seconds=60).series[
            "fleet"
        ]
        assert len(values) == 21 and all(v is not None for v in values)


# ---- the scrape parser keeps up with fine buckets ------------------------------------------


def test_the_page_parser_reads_the_kept_samples_as_prometheus_client_does() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.metrics import catalogue
    from workers.engines.api import RequestMetrics
    from workers.server.metrics import MetricsExporter

    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    for i in range(5):
        m = RequestMetrics(
            arrival_time=0.0,
            first_scheduled_time=0.001,
            first_token_time=0.01 * (i + 1),
            token_times=[0.01 * (i + 1), 0.01 * (i + 1) + 0.002, 0.01 * (i + 1) + 0.005],
            finished_time=0.01 * (i + 1) + 0.005,
            num_prompt_tokens=100 * (i + 1),
            num_output_tokens=3,
        )
        exporter.on_request_finished(f"r{i}", m, "length")
    page = exporter.render().decode() + (
        # a label value with the characters the text format escapes
        'chunkpilot:profile_info{engine="0",model_name="tiny",profile="a \\"b\\", {c}\\\\d",revision="3"} 1.0\n'
    )
    expected = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in catalogue._KEPT_NAMES
    ]
    assert list(catalogue.samples(page)) == expected
    # The reduction, by the general parser's samples, against parse (twice:
    # the second reads each series' key from the per-process cache).
    sums: dict[str, float] = {}
    for name, labels, value in expected:
        key = catalogue._sample_key(name, labels)
        if key is not None and name != catalogue.PROFILE_INFO:
            sums[key] = sums.get(key, 0.0) + value
    for _ in range(2):
        parsed = catalogue.parse(page)
        assert parsed.profile == {"profile": 'a "b", {c}\\d', "revision": "3"}
        assert {k: v for k, v in zip(parsed.layout.keys, parsed.values, strict=True) if k in sums} == sums
        assert all(
            parsed.values[parsed.layout.index[k]] == 0 for k in parsed.layout.keys if "_bucket{" in k and k not in sums
        )
