"""The database backend windows only the series the asked figures read
(``figures.narrow``), and answers exactly what windowing every stored series
answers: for the figures pages' sets and every scraped figure, over one
window, over raw scrapes and over minute rollups, per grouping.

The fleet: four workers in two pools and cohorts scraped every 5 s for 15
minutes, every counter, histogram (coarse bounds) and per-prompt histogram
the figures read; one worker restarts (a counter reset to fold) and one
exports other histogram bounds (two stored layouts in one group)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import numpy as np
import pytest
import time_machine

from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import catalogue, figures, promql, query
from controlplane.metrics.models import CounterReset, SeriesLayout, Target
from dashboards.metrics import pages
from tests.controlplane.metrics.pages import Page, job, store

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
END = 15 * 60.0
BOUNDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf]
OTHER_BOUNDS = [0.02, 0.1, 0.5, 2.0, math.inf]
SCRAPED = tuple(n for n, f in figures.FIGURES.items() if f.source == "scrape")
BY_PROMPT = tuple(n for n, f in figures.FIGURES.items() if f.by_prompt is not None)
PANEL = (*pages.PANEL_TABLE, *pages.BESIDE, *pages.samples_of((*pages.PANEL_TABLE, *pages.BESIDE)))
OVERVIEW = (*pages.OVERVIEW_FIGURES, *pages.samples_of(pages.OVERVIEW_FIGURES))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class _Exporter:
    """One worker's cumulative counters and histograms, advanced per scrape."""

    def __init__(self, rng: np.random.Generator, bounds: list[float], scale: float):
        self.rng, self.bounds, self.scale = rng, bounds, scale
        self.restart()

    def restart(self) -> None:
        self.counters = dict.fromkeys(catalogue.COUNTERS, 0.0)
        self.observed: dict[str, list[float]] = {h: [] for h in catalogue.HISTOGRAMS}
        self.by_prompt: dict[str, dict[str, list[float]]] = {
            h: {label: [] for label in catalogue.LENGTH_BUCKET_LABELS} for h in catalogue.BY_PROMPT_HISTOGRAMS
        }

    def page(self) -> Page:
        n = int(self.rng.poisson(6))
        for key in self.counters:
            self.counters[key] += float(self.rng.poisson(40 * n + 5))
        self.counters["chunkpilot:held_seconds_total"] += 5.0
        for values in self.observed.values():
            values.extend(self.rng.lognormal(math.log(self.scale), 0.8, size=n).tolist())
        for per_label in self.by_prompt.values():
            for values in per_label.values():
                values.extend(self.rng.lognormal(math.log(self.scale), 0.8, size=int(self.rng.poisson(1))).tolist())

        def histogram(values: list[float]) -> tuple[list[tuple[float, float]], float]:
            return [(b, float(sum(v <= b for v in values))) for b in self.bounds], float(sum(values))

        return Page(
            counters=dict(self.counters),
            histograms={h: histogram(v) for h, v in self.observed.items()},
            gauges={catalogue.PEAK_MEMORY: float(2e9 + 1e8 * self.rng.random())},
            by_prompt={h: {label: histogram(v) for label, v in d.items()} for h, d in self.by_prompt.items()},
        )


@pytest.fixture
def fleet():
    rng = np.random.default_rng(11)
    stable, canary = Pool.objects.create(name="stable"), Pool.objects.create(name="canary")
    workers = [
        (Worker.objects.create(name=f"w{i}", url=f"http://w{i}.invalid:8000", pool=pool), cohort)
        for i, (pool, cohort) in enumerate(((stable, "stable"), (stable, "stable"), (canary, "canary"), (stable, "")))
    ]
    exporters = [
        _Exporter(rng, BOUNDS, 0.2),
        _Exporter(rng, OTHER_BOUNDS, 0.3),  # another layout in the stable cohort
        _Exporter(rng, BOUNDS, 0.4),
        _Exporter(rng, BOUNDS, 0.1),
    ]
    with time_machine.travel(at(0), tick=False) as clock:
        for i in range(int(END // 5) + 1):
            clock.move_to(at(5 * i))
            if i == 150:
                exporters[0].restart()
            store(at(5 * i), {job(w, cohort): e.page() for (w, cohort), e in zip(workers, exporters, strict=True)})
        assert CounterReset.objects.exists()
        assert len({t.layout_id for t in Target.objects.all()}) == 2
        yield clock


def _full_width(names: tuple[str, ...], window: float, by: str, points: np.ndarray, dense: bool) -> Any:
    """The figures over windows of every stored series: the readers told nothing about the figures."""
    chosen = [figures.get(n) for n in names]
    if not dense:
        parts = [(points, query.point_windows(points, window, {}, True))]
    elif window < query.RAW_DENSE_WINDOW_SECONDS:
        parts = [(points, query._raw_dense_windows(points, window, {}, True))]
    else:
        parts = [
            (points[:-1], query._dense_windows(points[:-1], window, {}, True)),
            (points[-1:], query.point_windows(points[-1:], window, {}, True)),
        ]
    return query._join_parts(chosen, parts, by)


def test_the_narrowed_read_answers_what_windowing_every_series_answers(fleet) -> None:
    now = at(END)
    point = np.array([now.timestamp()])
    for names in (PANEL, OVERVIEW, SCRAPED):
        for by in ("fleet", "cohort", "pool", "worker"):
            assert query.query_many(names, 300, by, now=now) == {
                name: {g: values[0] for g, values in series.items()}
                for name, series in _full_width(names, 300, by, point, dense=False).items()
            }, (names, by)
            for window in (300.0, 600.0):  # raw scrapes; minute rollups with the live point raw
                ranged = query.query_range_many(
                    names, window, by, start=now - timedelta(minutes=5), end=now, step_seconds=60
                )
                points = np.array(ranged[names[0]].times)
                expected = _full_width(names, window, by, points, dense=True)
                assert {name: result.series for name, result in ranged.items()} == expected, (names, by, window)
                assert any(v is not None for series in expected.values() for values in series.values() for v in values)
    # Per prompt-length bucket, the figures the workers label by it.
    expected = _full_width(BY_PROMPT, 300, "length_bucket", point, dense=False)
    assert query.query_many(BY_PROMPT, 300, "length_bucket", now=now) == {
        name: {g: values[0] for g, values in series.items()} for name, series in expected.items()
    }
    assert any(expected[name] for name in BY_PROMPT)


def test_a_figure_reads_only_its_own_series() -> None:
    layout = catalogue.parse(
        Page(
            counters=dict.fromkeys(catalogue.COUNTERS, 1.0),
            histograms={h: ([(b, 1.0) for b in BOUNDS], 1.0) for h in catalogue.HISTOGRAMS},
        ).text()
    ).layout

    def keys(name: str) -> set[str]:
        columns = figures.series_read([figures.get(name)], layout)
        assert columns is not None
        return {layout.keys[i] for i in columns}

    ttft = "chunkpilot:time_to_first_token_seconds"
    assert keys("ttft_p99") == {catalogue.bucket_key(ttft, b) for b in BOUNDS}
    assert keys("ttft_samples") == {f"{ttft}_count"}
    assert keys("requests_per_second") == {"vllm:request_success_total"}
    assert keys("kv_fragmentation") == {
        "chunkpilot:kv_fragmentation_ratio_seconds_total",
        "chunkpilot:held_seconds_total",
    }
    narrowed, columns = figures.narrow(layout, [figures.get("ttft_p99")])
    assert columns is not None and list(narrowed.keys) == [layout.keys[i] for i in columns]
    assert narrowed.digest != layout.digest


def test_the_figures_pages_window_only_the_series_their_figures_read(fleet) -> None:
    """Every windowing call of the panel and the overview gets the columns
    of its figures, a fraction of the stored layout's."""
    stored = max(len(SeriesLayout.layout_by_id(t.layout_id)) for t in Target.objects.all())
    widths: list[int] = []
    range_windows, extrapolated_increase = promql.range_windows, promql.extrapolated_increase

    def spy_range(times: Any, totals: np.ndarray, *args: Any) -> Any:
        widths.append(totals.shape[1])
        return range_windows(times, totals, *args)

    def spy_point(window: promql.CounterWindow, *args: Any, **kwargs: Any) -> Any:
        widths.append(np.asarray(window.increases).shape[-1])
        return extrapolated_increase(window, *args, **kwargs)

    wanted = max(
        len(figures.narrow(SeriesLayout.layout_by_id(t.layout_id), [figures.get(n) for n in names])[0])
        for names in (PANEL, OVERVIEW)
        for t in Target.objects.all()
    )
    for window in ("5m", "15m"):  # raw scrapes; minute rollups
        view = pages.View.from_params({"group_by": "cohort", "range": "1h", "window": window})
        widths.clear()
        with (
            mock.patch.object(promql, "range_windows", autospec=True, side_effect=spy_range),
            mock.patch.object(promql, "extrapolated_increase", autospec=True, side_effect=spy_point),
        ):
            pages.panel_context(view, now=at(END))
            pages.overview_context(view, now=at(END))
        assert widths, window
        assert max(widths) <= wanted < stored / 2


@pytest.mark.parametrize(
    ("window", "step", "offset"),
    [
        (300.0, 60.0, 0.0),  # the panel's: edges on scrape times exactly
        (120.0, 15.0, 2.5),  # edges between scrapes
        (60.0, 60.0, 0.3),  # one step per window
        (300.0, 45.0, 0.0),  # a window that is no whole number of steps: every scrape's row
    ],
)
def test_windows_from_the_scrapes_at_their_edges_equal_windows_from_every_scrape(
    fleet, window: float, step: float, offset: float
) -> None:
    """The database picks each grid slice's first and last scrape (and its
    peak), and the windows over those rows are the windows over every row."""
    points = np.arange(at(END).timestamp() - 10 * step, at(END).timestamp() + 1, step) - offset
    returned: list[int] = []
    window_edges = query._window_edges

    def counted(*args: Any) -> Any:
        rows, blobs = window_edges(*args)
        returned.append(sum(len(r) for r in rows.values()))
        assert blobs is None or set(blobs) == {r[0] for target in rows.values() for r in target}
        return rows, blobs

    with mock.patch.object(query, "_window_edges", side_effect=counted):
        edges = query._raw_dense_windows(points, window, {}, True)
        with mock.patch.object(query, "_grid", return_value=None):
            every = query._raw_dense_windows(points, window, {}, True)
    assert len(edges) == len(every) == 4
    for a, b in zip(edges, every, strict=True):
        assert a.labels == b.labels and a.layout.keys == b.layout.keys
        assert np.array_equal(a.increases, b.increases, equal_nan=True)
        assert np.array_equal(a.peak_memory, b.peak_memory, equal_nan=True)
        assert np.isfinite(a.increases).any() and np.isfinite(a.peak_memory).any()
    on_grid = query._grid(points, window) is not None
    assert on_grid == (window % step == 0)
    if on_grid:  # two rows a slice at most, where every scrape's row is several
        assert returned[0] <= 2 * 4 * (len(points) + window / step) < returned[1]
    else:
        assert returned[0] == returned[1]
