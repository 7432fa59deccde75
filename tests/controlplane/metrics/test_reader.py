"""The batched reader (what alert evaluation reads through) answers what ``metrics.query.query_many`` answers, for
every figure, grouping, selector and window, while reading each window once.

The fleet has workers in two pools and three cohorts, one worker that
changes cohort inside the window (a group of two targets), one that stops
being scraped, and a request log with failures and a pool without traffic."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
import time_machine

from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import catalogue, figures, query
from controlplane.metrics.reader import Reader
from tests.controlplane.metrics.pages import Page, job, store

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
INF = math.inf
BOUNDS = [0.05, 0.1, 0.5, 1.0, 5.0, INF]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def page(i: int, speed: float, rng: np.random.Generator) -> Page:
    """A worker's page after ``i`` scrapes; ``speed`` scales its latencies."""
    histograms = {}
    for h in catalogue.HISTOGRAMS:
        counts = np.cumsum(rng.integers(0, 6, len(BOUNDS))) * i * speed
        histograms[h] = (list(zip(BOUNDS, counts.tolist(), strict=True)), float(counts[-1]) * 0.2 * speed)
    counters = {name: float(i * (10 + 3 * k) * speed) for k, name in enumerate(catalogue.COUNTERS)}
    counters["chunkpilot:kv_fragmentation_ratio_seconds_total"] = 0.3 * speed * 5 * i
    counters["chunkpilot:memory_byte_seconds_total"] = 1e9 * 5 * i
    return Page(
        counters=counters,
        histograms=histograms,
        gauges={"chunkpilot:memory_recent_peak_bytes": 1.5e9 + 1e8 * (i % 7) * speed},
    )


@pytest.fixture
def fleet(db: Any) -> dict[str, Worker]:
    from controlplane.gateway.models import RequestLog

    pools = {name: Pool.objects.create(name=name) for name in ("gpu-a", "gpu-b", "idle")}
    workers = {}
    for name, pool in (("w1", "gpu-a"), ("w2", "gpu-a"), ("w3", "gpu-b"), ("w4", "gpu-b"), ("w5", "gpu-b")):
        workers[name] = Worker.objects.create(name=name, url=f"http://{name}.invalid", pool=pools[pool])
    cohorts = {"w1": "canary", "w2": "stable", "w3": "stable", "w4": "baseline", "w5": "stable"}
    rng = np.random.default_rng(3)
    for i in range(1, 73):  # 6 minutes of 5-s scrapes
        pages = {}
        for name, w in workers.items():
            cohort = cohorts[name]
            if name == "w3" and i > 60:
                cohort = "canary"  # moved 60 s before the end: two targets in a 5-minute window
            if name == "w5" and i > 30:
                continue  # stopped answering
            pages[job(w, cohort)] = page(i, {"w1": 2.0, "w4": 0.5}.get(name, 1.0), rng)
        store(at(5 * i), pages)
    for i in range(400):
        name = ["w1", "w2", "w3", "w4"][i % 4]
        w = workers[name]
        RequestLog.objects.create(
            request_id=f"r{i}",
            created_at=at(360 - 0.9 * i),
            model="tiny",
            cohort=cohorts[name],
            pool=w.pool,
            worker=w,
            ttft_seconds=float(rng.lognormal(-1, 0.5)),
            tpot_seconds=float(rng.lognormal(-3, 0.3)),
            max_gap_seconds=float(rng.lognormal(-2, 0.5)),
            e2e_seconds=3.0,
            status=[200, 200, 200, 503, 429, 400][i % 6],
            error="" if i % 17 else "stream broke",
        )
    return workers


SELECTORS = [{}, {"pool": "gpu-b"}, {"cohort": "canary"}, {"cohort": "stable"}, {"worker": "w3"}, {"pool": "idle"}]


@pytest.mark.parametrize("window", [60.0, 300.0])
def test_the_reader_agrees_with_query_many_everywhere(fleet: dict[str, Worker], window: float) -> None:
    now = at(360)
    with time_machine.travel(now, tick=False):
        reader = Reader(now, peak_windows={60.0, 300.0}, request_window=300.0)
        checked = 0
        for source in ("scrape", "requests"):
            names = sorted(n for n, f in figures.FIGURES.items() if f.source == source)
            for group_by in ("fleet", "worker", "pool", "cohort"):
                for selector in SELECTORS:
                    expected = query.query_many(names, window, group_by, selector, now)
                    got = reader.read(names, window, group_by, selector)
                    assert got.keys() == expected.keys()
                    for name in names:
                        assert got[name].keys() == expected[name].keys(), (name, group_by, selector)
                        for group, value in expected[name].items():
                            assert got[name][group] == (None if value is None else pytest.approx(value, rel=1e-9)), (
                                name,
                                group_by,
                                selector,
                                group,
                            )
                            checked += 1
        assert checked > 800


def test_the_reader_reads_each_window_once(fleet: dict[str, Worker], django_assert_max_num_queries: Any) -> None:
    now = at(360)
    with time_machine.travel(now, tick=False):
        reader = Reader(now, peak_windows={300.0}, request_window=300.0)
        reader.read(["ttft_p99"], 300.0, "worker", {})
        reader.read(["client_ttft_p99"], 300.0, "pool", {})
        with django_assert_max_num_queries(0):
            for group_by in ("fleet", "worker", "pool", "cohort"):
                for selector in SELECTORS:
                    reader.read(["ttft_p99", "memory_peak_to_mean", "kv_fragmentation"], 300.0, group_by, selector)
                    reader.read(["client_ttft_p99", "error_rate"], 60.0, group_by, selector)


def test_the_request_log_is_kept_between_cycles_and_read_afresh_when_its_past_changes(db: Any) -> None:
    from controlplane.gateway.models import RequestLog
    from controlplane.metrics import request_log

    def log(at_seconds: float, name: str) -> RequestLog:
        return RequestLog.objects.create(
            request_id=name, created_at=at(at_seconds), model="tiny", status=200, ttft_seconds=0.1
        )

    for i in range(10):
        log(10 * i + 1, f"r{i}")
    cache = request_log._cache
    first = request_log.window(at(0).timestamp(), at(100).timestamp())
    full_reads = cache.num_full_reads
    assert len(first) == 10

    log(105, "new")
    second = request_log.window(at(5).timestamp(), at(110).timestamp())  # the window slid 10 s
    assert cache.num_full_reads == full_reads, "only the new rows were read"
    assert len(second) == 10 and second.created[-1] == at(105).timestamp()
    assert second.created[0] == at(11).timestamp()  # r0 (at 1 s) left the window

    log(50, "late")  # a gateway's batch committed late, into the kept range
    third = request_log.window(at(5).timestamp(), at(115).timestamp())
    assert cache.num_full_reads == full_reads + 1
    assert len(third) == 11 and at(50).timestamp() in third.created.tolist()

    RequestLog.objects.filter(request_id="r5").delete()
    assert len(request_log.window(at(5).timestamp(), at(115).timestamp())) == 10
