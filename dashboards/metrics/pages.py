"""What the metric pages show, computed once for the page and for each push.

Each page has a parameters object read from the query string (bad values
fall back to defaults: a page always renders), a context builder, and a
``render_push`` that renders the page's live partial for the websocket. The
figures come from ``controlplane.metrics.query`` alone.

Pushes are cached per (page, parameters, scrape) in this process, so that
many open tabs on one page cost one computation per scrape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import Count
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from controlplane.metrics import backends, catalogue, figures, query
from controlplane.metrics.figures import Figure
from controlplane.metrics.models import ScrapeRound, ScrapeStatus, ServiceObjectives
from controlplane.rollouts.models import RolloutEvent
from dashboards import axes

RANGES: dict[str, float] = {"15m": 900, "1h": 3600, "3h": 10800, "6h": 21600}
WINDOWS: dict[str, float] = {"1m": 60, "5m": 300, "15m": 900, "1h": 3600}
PANEL_GROUPS = ("cohort", "pool", "worker", "fleet")
COHORTS = ("stable", "canary", "baseline")


# The panel's charts and the table beside them: the layout Grafana's export draws too.
PANEL_CHARTS = figures.PANEL_CHARTS
# The charts' figures, in their order: the table's panel columns are the charts' newest points.
PANEL_TABLE = figures.figures_of(PANEL_CHARTS)
BESIDE = figures.BESIDE_FIGURES
COMPARE_SCRAPE = tuple(dict.fromkeys((*PANEL_TABLE, *BESIDE, "requests_per_second")))
COMPARE_REQUESTS = (
    "client_ttft_p99",
    "client_tpot_p99",
    "client_stall_p99",
    "client_e2e_p99",
    "goodput_ratio",
    "error_rate",
    "request_count",
)
OVERVIEW_FIGURES = ("requests_per_second", "output_tokens_per_second", "ttft_p99")
OVERVIEW_CLIENT = ("client_requests_per_second", "goodput", "goodput_ratio", "error_rate")


def _choice(params: Mapping[str, str], key: str, choices: Any, default: str) -> str:
    value = params.get(key, default)
    return value if value in choices else default


@dataclass(frozen=True)
class View:
    """A metric page's parameters."""

    group_by: str = "cohort"
    range: str = "1h"
    window: str = "5m"
    cohort: str = ""  # the length table's filter
    worker: str = ""  # a worker page's worker name

    @classmethod
    def from_params(cls, params: Mapping[str, str], **fixed: str) -> View:
        return cls(
            group_by=_choice(params, "group_by", PANEL_GROUPS, "cohort"),
            range=_choice(params, "range", RANGES, "1h"),
            window=_choice(params, "window", WINDOWS, "5m"),
            cohort=_choice(params, "cohort", COHORTS, ""),
            **fixed,
        )

    @property
    def range_seconds(self) -> float:
        return RANGES[self.range]

    @property
    def window_seconds(self) -> float:
        return WINDOWS[self.window]

    @property
    def step_seconds(self) -> float:
        return max(60.0, self.range_seconds / 120)

    @property
    def selector(self) -> dict[str, str]:
        return {k: v for k, v in (("worker", self.worker), ("cohort", self.cohort)) if v}

    def query_string(self, **changes: str) -> str:
        changed = replace(self, **changes) if changes else self
        params = {"group_by": changed.group_by, "range": changed.range, "window": changed.window}
        if changed.cohort:
            params["cohort"] = changed.cohort
        return urlencode(params)

    def links(self, key: str, choices: Any) -> list[dict[str, Any]]:
        """Plain links for each choice of one parameter (they work without JS)."""
        return [
            {"label": choice, "query": self.query_string(**{key: choice}), "active": getattr(self, key) == choice}
            for choice in choices
        ]


def samples_of(names: tuple[str, ...]) -> tuple[str, ...]:
    """The figures that count what these percentiles rest on, each once."""
    return tuple(dict.fromkeys(f.samples for f in map(figures.get, names) if f.samples))


def _cell(f: Figure, value: float | None, samples: float | None) -> dict[str, Any]:
    """A figure's value as a table shows it, with the samples a percentile rests on."""
    return {
        "figure": f,
        "value": value,
        "text": f.format(value),
        "samples": samples,
        "few_samples": figures.few_samples(f.quantile, samples) if value is not None else False,
        "samples_text": figures.samples_note(f, samples) if value is not None else "",
    }


def _figure_cells(
    names: tuple[str, ...], values: Mapping[str, Mapping[str, float | None]], group: str
) -> list[dict[str, Any]]:
    out = []
    for name in names:
        f = figures.get(name)
        samples = values.get(f.samples, {}).get(group) if f.samples else None
        out.append(_cell(f, values.get(name, {}).get(group), samples))
    return out


def _freshness(now: datetime) -> dict[str, Any]:
    rules = {"percentile_rules": figures.PERCENTILE_RULES}
    if not backends.scrapes():
        return {"metrics_backend": "Prometheus", "now": now, **rules}  # Prometheus scrapes; no rounds here to date
    latest = ScrapeRound.latest()
    return {"last_scrape": latest, "now": now, **rules}


# ---- annotations: what changed, on the charts' time axis ---------------------------------

STEP, ABORT, PROFILE = "rollout-step", "abort", "profile"
# The rollout timeline's entries marked on the charts: where traffic or the pools moved.
ROLLOUT_MARKS = {
    "started": STEP,
    "weights_set": STEP,
    "step_completed": STEP,
    "promoted": STEP,
    "succeeded": STEP,
    "abort_requested": ABORT,
    "aborting": ABORT,
    "aborted": ABORT,
}
MAX_ANNOTATIONS = 200


def chart_annotations(start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Rollout steps, aborts and pools' profile changes in ``(start, end]``,
    oldest first, for the charts to mark (metrics.js)."""
    marks = [
        {"t": e.time.timestamp(), "kind": ROLLOUT_MARKS[e.kind], "text": f"rollout {e.rollout_id}: {e.message}"}
        for e in RolloutEvent.objects.filter(time__gt=start, time__lte=end, kind__in=ROLLOUT_MARKS).order_by("-time")[
            :MAX_ANNOTATIONS
        ]
    ]
    changes = AuditEvent.objects.filter(time__gt=start, time__lte=end, object_type="fleet.pool").order_by("-time")
    for a in changes[:MAX_ANNOTATIONS]:
        before, after = a.before or {}, a.after or {}
        if before.get("desired_revision") != after.get("desired_revision"):
            revision, actor = after.get("desired_revision") or "none", a.actor_repr or "system"
            text = f"pool {a.object_repr}: profile revision {revision} (by {actor})"
            marks.append({"t": a.time.timestamp(), "kind": PROFILE, "text": text})
    return sorted(marks, key=lambda m: m["t"])


# ---- the four-figure panel --------------------------------------------------------------


def chart_payload(
    chart_id: str, title: str, names: tuple[str, ...], results: Mapping[str, query.RangeResult]
) -> dict[str, Any]:
    """A uPlot-ready series set: x in epoch seconds, one line per group (and
    per figure when a chart draws two)."""
    first = figures.get(names[0])
    times = results[names[0]].times if names[0] in results else []
    lines = []
    for name in names:
        result = results.get(name)
        if result is None:
            continue
        for group, values in result.series.items():
            label = group if len(names) == 1 else f"{group} · {figures.get(name).label.split()[-1]}"
            lines.append({"label": label, "values": values})
    return axes.with_axes(
        {
            "id": chart_id,
            "title": title,
            "unit": first.unit,
            "display": first.display_kind,
            "direction": first.direction.value,
            "times": times,
            "lines": lines,
        }
    )


def panel_context(view: View, now: datetime | None = None) -> dict[str, Any]:
    """The four charts and the table beside them. The table is the window
    ending now: its panel figures are the charts' newest points (the same
    numbers, not read again), the figures beside them one read of that window."""
    now = now or timezone.now()
    with query.shared_reads():
        results = query.query_range_many(
            PANEL_TABLE,
            view.window_seconds,
            view.group_by,
            view.selector,
            start=now - timedelta(seconds=view.range_seconds),
            end=now,
            step_seconds=view.step_seconds,
            aligned=True,
        )
        beside = query.query_many(
            (*BESIDE, *samples_of((*PANEL_TABLE, *BESIDE))), view.window_seconds, view.group_by, view.selector, now
        )
    newest = {n: {g: values[-1] for g, values in results[n].series.items()} for n in PANEL_TABLE}
    current = {**newest, **beside}
    charts = [chart_payload(chart.id, chart.title, chart.figures, results) for chart in PANEL_CHARTS]
    groups = sorted(
        {g for name in BESIDE for g in beside[name]}
        | {g for series in newest.values() for g, value in series.items() if value is not None}
    )
    rows = [
        {"group": g, "panel": _figure_cells(PANEL_TABLE, current, g), "beside": _figure_cells(BESIDE, current, g)}
        for g in groups
        if view.group_by != "worker" or any(current[n].get(g) is not None for n in (*PANEL_TABLE, *BESIDE))
    ]
    return {
        "view": view,
        "charts": charts,
        "annotations": chart_annotations(now - timedelta(seconds=view.range_seconds), now),
        "rows": rows,
        "panel_figures": [figures.get(n) for n in PANEL_TABLE],
        "beside_figures": [figures.get(n) for n in BESIDE],
        **_freshness(now),
    }


# ---- overview ------------------------------------------------------------------------


def overview_context(view: View, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    # Its cards, its cohorts and its chart's newest point are one window: read it once.
    with query.shared_reads():
        return _overview_context(view, now)


def _overview_context(view: View, now: datetime) -> dict[str, Any]:
    counts = dict(Worker.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    states = [{"label": WorkerState(s).label, "count": counts.get(int(s), 0)} for s in WorkerState]
    statuses = list(ScrapeStatus.objects.select_related("worker").order_by("worker__name"))
    down = [s for s in statuses if not s.up]
    scrape_values = query.query_many(
        (*OVERVIEW_FIGURES, *samples_of(OVERVIEW_FIGURES)), view.window_seconds, "fleet", None, now
    )
    client_values = query.query_many(
        (*OVERVIEW_CLIENT, *samples_of(OVERVIEW_CLIENT)), view.window_seconds, "fleet", None, now
    )
    by_cohort = query.query_many(("requests_per_second",), view.window_seconds, "cohort", None, now)
    start = now - timedelta(seconds=view.range_seconds)
    throughput = query.query_range_many(
        ("requests_per_second",),
        view.window_seconds,
        "fleet",
        None,
        start=start,
        end=now,
        step_seconds=view.step_seconds,
        aligned=True,
    )
    goodput = query.query_range_many(
        ("client_requests_per_second", "goodput"),
        view.window_seconds,
        "fleet",
        None,
        start=start,
        end=now,
        step_seconds=view.step_seconds,
        aligned=True,
    )
    chart = chart_payload("throughput", "Requests/s and goodput", ("requests_per_second",), throughput)
    for name in ("client_requests_per_second", "goodput"):
        chart["lines"].append({"label": figures.get(name).label, "values": goodput[name].series.get("fleet", [])})
    chart["lines"][0]["label"] = "engines"
    axes.with_axes(chart)  # again, over the lines added
    return {
        "view": view,
        "states": states,
        "num_workers": sum(counts.values()),
        "num_up": len(statuses) - len(down),
        "down": down,
        "cards": _figure_cells(OVERVIEW_FIGURES, scrape_values, "fleet")
        + _figure_cells(OVERVIEW_CLIENT, client_values, "fleet"),
        "by_cohort": [
            {"group": g, "text": figures.get("requests_per_second").format(v)}
            for g, v in by_cohort["requests_per_second"].items()
        ],
        "objectives": ServiceObjectives.current(),
        "charts": [chart],
        "annotations": chart_annotations(start, now),
        **_freshness(now),
    }


# ---- cohort comparison --------------------------------------------------------------------


def _ratio(canary: float | None, stable: float | None) -> float | None:
    if canary is None or stable is None or stable == 0:
        return None
    return canary / stable


# What says a cohort had traffic in the window, for each source of figures:
# an idle cohort's figures are zeros that mean nothing, and a ratio against
# them ("0.00×", coloured better or worse) would.
_TRAFFIC = {"scrape": "requests_per_second", "requests": "request_count"}


def compare_context(view: View, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    values = {
        **query.query_many((*COMPARE_SCRAPE, *samples_of(COMPARE_SCRAPE)), view.window_seconds, "cohort", None, now),
        **query.query_many(
            (*COMPARE_REQUESTS, *samples_of(COMPARE_REQUESTS)), view.window_seconds, "cohort", None, now
        ),
    }
    present = {g for name in (*COMPARE_SCRAPE, *COMPARE_REQUESTS) for g in values.get(name, {})}
    cohorts = [c for c in COHORTS if c in present] or ["stable", "canary"]
    busy = {
        source: all((values.get(traffic, {}).get(c) or 0) > 0 for c in ("canary", "stable"))
        for source, traffic in _TRAFFIC.items()
    }
    rows = []
    for name in (*COMPARE_SCRAPE, *COMPARE_REQUESTS):
        f: Figure = figures.get(name)
        by = values.get(name, {})
        ratio = _ratio(by.get("canary"), by.get("stable")) if busy[f.source] else None
        verdict = ""
        if ratio is not None and name != "request_count":
            worse = ratio > 1 if f.direction == figures.Direction.LOWER else ratio < 1
            verdict = "worse" if worse and abs(ratio - 1) > 0.05 else ("better" if abs(ratio - 1) > 0.05 else "same")
        rows.append(
            {
                "figure": f,
                "cells": [
                    {"cohort": c, **_cell(f, by.get(c), values.get(f.samples, {}).get(c) if f.samples else None)}
                    for c in cohorts
                ],
                "ratio": "—" if ratio is None else f"{ratio:.2f}×",
                "verdict": verdict,
            }
        )
    return {"view": view, "cohorts": cohorts, "rows": rows, **_freshness(now)}


# ---- prompt-length buckets ----------------------------------------------------------------


def lengths_context(view: View, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    values = query.query_many(
        (*figures.LENGTH_TABLE_FIGURES, *samples_of(figures.LENGTH_TABLE_FIGURES)),
        view.window_seconds,
        "length_bucket",
        view.selector,
        now,
    )
    columns = [figures.get(n) for n in figures.LENGTH_TABLE_FIGURES]
    rows = [
        {"bucket": bucket, "cells": _figure_cells(figures.LENGTH_TABLE_FIGURES, values, bucket)}
        for bucket in catalogue.LENGTH_BUCKET_LABELS
    ]
    return {
        "view": view,
        "columns": columns,
        "rows": rows,
        "cohort_links": [{"label": "all", "query": view.query_string(cohort=""), "active": not view.cohort}]
        + view.links("cohort", COHORTS),
        **_freshness(now),
    }


# ---- one worker ----------------------------------------------------------------------------


def worker_context(worker: Worker, view: View, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    view = replace(view, worker=worker.name, group_by="fleet", cohort="")
    context = panel_context(view, now)
    context["worker"] = worker
    context["status"] = ScrapeStatus.objects.filter(worker=worker).first()
    return context


# ---- pushes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LivePage:
    """A metric page's live part: what builds its context, and its partial."""

    build: Callable[..., dict[str, Any]]
    partial: str


TITLES = {
    "overview": "Metrics",
    "panel": "Four-figure panel",
    "cohorts": "Cohorts",
    "lengths": "Prompt lengths",
    "worker": "Worker metrics",
}
PAGES: dict[str, LivePage] = {
    "overview": LivePage(overview_context, "metrics/partials/overview_live.html"),
    "panel": LivePage(panel_context, "metrics/partials/panel_live.html"),
    "cohorts": LivePage(compare_context, "metrics/partials/cohorts_live.html"),
    "lengths": LivePage(lengths_context, "metrics/partials/lengths_live.html"),
    "worker": LivePage(worker_context, "metrics/partials/panel_live.html"),
}

_cache: OrderedDict[tuple[Any, ...], str] = OrderedDict()
_cache_lock = threading.Lock()
_CACHE_SIZE = 64


def render_push(page: str, view: View, scraped_at: float, worker: Worker | None = None) -> str:
    """The page's live partial as an out-of-band swap, for the websocket."""
    key = (page, view, scraped_at, getattr(worker, "pk", None))
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    live_page = PAGES[page]
    context = live_page.build(worker, view) if page == "worker" else live_page.build(view)
    html = render_to_string(live_page.partial, {**context, "oob": True})
    with _cache_lock:
        _cache[key] = html
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return html
