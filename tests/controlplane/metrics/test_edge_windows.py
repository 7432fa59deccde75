"""A chart's windows from minute rollups (``query._edge_windows``) are the
windows over every raw scrape, and a page's aligned chart says at each point
what the query API says at that time.

The fleet: three workers scraped every 5 s for 20 minutes, at a fraction of a
second past whole seconds as a live scraper's times are (so no scrape sits on
a whole minute), one of them restarting (a counter reset), one missing a
minute and a half of scrapes (a gap inside windows), one with another
histogram layout."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import numpy as np
import pytest
import time_machine

from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import catalogue, figures, query
from controlplane.metrics.models import CounterReset, Rollup, Target
from dashboards.metrics import pages
from tests.controlplane.metrics.pages import Page, cumulative, job, store
from workers.server.metrics import MetricsExporter

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 6, 1, 12, 0, 0, 370_000, tzinfo=UTC)  # 0.37 s past the minute
MINUTES = 20
BOUNDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf]
OTHER_BOUNDS = [0.02, 0.1, 0.5, 2.0, math.inf]
SCRAPED = tuple(n for n, f in figures.FIGURES.items() if f.source == "scrape" and f.by_prompt is None)
# The figures the pages chart: every one reads only the head of the vector.
CHARTED = (*pages.PANEL_TABLE, *pages.OVERVIEW_FIGURES, "output_tokens_per_second")


def charted(layout: catalogue.Layout) -> Any:
    return figures.narrow(layout, [figures.get(n) for n in CHARTED])


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _page(rng: np.random.Generator, totals: dict[str, float], observed: dict[str, list[float]], bounds: Any) -> Page:
    n = int(rng.poisson(5))
    for key in catalogue.COUNTERS:
        totals[key] = totals.get(key, 0.0) + float(rng.poisson(30 * n + 3))
    totals["chunkpilot:held_seconds_total"] += 5.0
    for h in catalogue.HISTOGRAMS:
        observed.setdefault(h, []).extend(rng.lognormal(math.log(0.2), 0.8, size=n).tolist())
    return Page(
        counters=dict(totals),
        histograms={h: (cumulative(v, bounds), float(sum(v))) for h, v in observed.items()},
        gauges={catalogue.PEAK_MEMORY: float(2e9 + 1e8 * rng.random())},
    )


def _scrape_fleet(offset_seconds: float = 0.0) -> None:
    rng = np.random.default_rng(5)
    stable, canary = Pool.objects.create(name="stable"), Pool.objects.create(name="canary")
    workers = [
        (Worker.objects.create(name="w0", url="http://w0.invalid:8000", pool=stable), "stable", BOUNDS),
        (Worker.objects.create(name="w1", url="http://w1.invalid:8000", pool=stable), "stable", OTHER_BOUNDS),
        (Worker.objects.create(name="w2", url="http://w2.invalid:8000", pool=canary), "canary", BOUNDS),
    ]
    state: list[tuple[dict[str, float], dict[str, list[float]]]] = [({}, {}) for _ in workers]
    with time_machine.travel(at(offset_seconds), tick=False) as clock:
        for i in range(MINUTES * 12 + 1):
            now = at(5 * i + offset_seconds)
            clock.move_to(now)
            if i == 100:
                state[0] = ({}, {})  # w0 restarts: its counters start again from zero
            round_pages: dict[Any, Page | None] = {}
            for k, (worker, cohort, bounds) in enumerate(workers):
                missing = k == 2 and 150 <= i < 168  # w2 answers nothing for 90 s
                round_pages[job(worker, cohort)] = None if missing else _page(rng, *state[k], bounds)
            store(now, round_pages)


@pytest.fixture
def fleet():
    _scrape_fleet()
    assert CounterReset.objects.exists() and len({t.layout_id for t in Target.objects.all()}) == 2
    assert not Rollup.objects.filter(first_ts__isnull=True).exists()
    return at(MINUTES * 60)


def _minute_points(end: datetime, count: int) -> np.ndarray:
    last = math.floor(end.timestamp() / 60) * 60.0
    return last - 60.0 * np.arange(count)[::-1]


@pytest.mark.parametrize("window", [60.0, 120.0, 300.0, 900.0])
def test_windows_from_minute_rollups_equal_windows_from_every_scrape(fleet, window: float) -> None:
    points = _minute_points(fleet, 10 if window < 900 else 5)
    assert query._on_minutes(points, window)
    with time_machine.travel(fleet, tick=False):
        edges = query._edge_windows(points, window, {}, True, charted)
        every = query._raw_dense_windows(points, window, {}, True, charted)
    assert edges is not None and len(edges) == len(every) == 3

    def by_worker(windows: list[Any]) -> list[Any]:
        return sorted(windows, key=lambda w: w.labels["worker"])

    for a, b in zip(by_worker(edges), by_worker(every), strict=True):
        assert a.labels == b.labels and a.layout.keys == b.layout.keys
        assert np.allclose(a.increases, b.increases, rtol=1e-12, atol=0, equal_nan=True)
        assert np.array_equal(np.isnan(a.increases), np.isnan(b.increases))
        assert np.array_equal(a.peak_memory, b.peak_memory, equal_nan=True)
        assert np.isfinite(a.increases).any()
    # The gap: a one-minute window inside w2's silence has no data, as from raw rows.
    if window == 60.0:
        silent = [w for w in edges if w.labels["worker"] == "w2"][0]
        assert np.isnan(silent.increases).all(axis=1).any()


@pytest.mark.parametrize(
    "names",
    [CHARTED, ("requests_per_second",)],  # every charted series; the overview's one counter (a narrow span)
)
def test_an_aligned_range_says_at_each_point_what_the_query_api_says_then(fleet, names: tuple[str, ...]) -> None:
    start = fleet - timedelta(minutes=10)
    now = fleet + timedelta(seconds=17)  # the live point, off the grid
    returned: list[Any] = []
    edge_windows = query._edge_windows

    def spy(*args: Any) -> Any:
        returned.append(edge_windows(*args))
        return returned[-1]

    with time_machine.travel(now, tick=False), mock.patch.object(query, "_edge_windows", side_effect=spy):
        result = query.query_range_many(
            names, 300.0, "cohort", None, start=start, end=now, step_seconds=60.0, aligned=True
        )
        times = result[names[0]].times
        assert times[-1] == now.timestamp()
        assert all(t % 60 == 0 for t in times[:-1]) and np.all(np.diff(times[:-1]) == 60.0)
        assert times[0] >= start.timestamp() and len(times) == 11  # 12:11 .. 12:20, then now
        assert len(returned) == 1 and returned[0] is not None  # every point but the live one from rollups
        for j, t in enumerate(times):
            expected = query.query_many(names, 300.0, "cohort", None, datetime.fromtimestamp(t, tz=UTC))
            for name in names:
                for group, values in result[name].series.items():
                    want, got = expected[name].get(group), values[j]
                    assert (want is None) == (got is None), (name, group, t)
                    if want is not None:
                        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (name, group, t)
    assert any(v is not None for v in result[names[0]].series["canary"])


def test_the_page_chart_reads_minute_rollups_not_every_scrape(fleet) -> None:
    view = pages.View.from_params({"group_by": "cohort", "range": "1h", "window": "5m"})
    with (
        time_machine.travel(fleet + timedelta(seconds=3), tick=False),
        mock.patch.object(query, "_window_edges", wraps=query._window_edges) as raw,
        mock.patch.object(query, "_edge_windows", wraps=query._edge_windows) as edges,
    ):
        context = pages.panel_context(view)
    assert edges.call_count == 1 and raw.call_count == 0
    chart = context["charts"][0]
    assert chart["times"][-1] == pytest.approx((fleet + timedelta(seconds=3)).timestamp())
    assert all(t % 60 == 0 for t in chart["times"][:-1])


def test_rollups_that_cannot_say_it_exactly_send_the_read_elsewhere(fleet) -> None:
    points = _minute_points(fleet, 5)
    with time_machine.travel(fleet, tick=False):
        assert query._edge_windows(points, 300.0, {}, True, charted) is not None
        # Series past the head: the whole vector, or a histogram the charts do not read.
        assert query._edge_windows(points, 300.0, {}, True) is None
        queue = figures.get("queue_time_p99")
        assert query._edge_windows(points, 300.0, {}, True, lambda lay: figures.narrow(lay, [queue])) is None
        # A row written before rollups kept their first scrape.
        inside = Rollup.objects.filter(minute=datetime.fromtimestamp(points[-1] - 60, tz=UTC))
        assert inside.update(first_ts=None, head_first=None) == 3
        assert query._edge_windows(points, 300.0, {}, True, charted) is None
        expected = query._raw_dense_windows(points, 300.0, {}, True)
        evaluated = query._scrape_from_database(
            [figures.get("requests_per_second")], 300.0, "fleet", {}, np.append(points, points[-1] + 7), True
        )
    got = evaluated["requests_per_second"]["fleet"][:-1]
    want = query._join_parts([figures.get("requests_per_second")], [(points, expected)], "fleet")[
        "requests_per_second"
    ]["fleet"]
    assert got == pytest.approx(want)


def test_a_scrape_on_a_whole_minute_sends_the_read_elsewhere() -> None:
    _scrape_fleet(offset_seconds=-0.37)  # every twelfth scrape at hh:mm:00.000000
    end = at(MINUTES * 60 - 0.37)
    points = _minute_points(end, 5)
    with time_machine.travel(end, tick=False):
        assert query._edge_windows(points, 300.0, {}, True, charted) is None
        result = query.query_range_many(
            SCRAPED[:3],
            300.0,
            "fleet",
            None,
            start=end - timedelta(minutes=5),
            end=end,
            step_seconds=60.0,
            aligned=True,
        )
        for j, t in enumerate(result[SCRAPED[0]].times):
            expected = query.query_many(SCRAPED[:3], 300.0, "fleet", None, datetime.fromtimestamp(t, tz=UTC))
            for name in SCRAPED[:3]:
                got, want = result[name].series["fleet"][j], expected[name]["fleet"]
                assert (got is None) == (want is None)
                if want is not None:
                    assert got == pytest.approx(want, rel=1e-9)


def test_the_charted_figures_read_only_the_head_a_rollup_keeps() -> None:
    """The pages' charts read the counters and the charted histograms only,
    the head of a worker's layout (catalogue.HISTOGRAMS' order)."""
    layout = catalogue.parse(MetricsExporter(model_name="t", max_model_len=131072).render().decode()).layout
    assert len(layout) > 1000 and 0 < layout.head < len(layout) // 8
    _, columns = charted(layout)
    assert columns is not None and int(columns[-1]) < layout.head
    assert catalogue.bucket_key(catalogue.CHARTED_HISTOGRAMS[-1], math.inf) in layout.keys[: layout.head]
