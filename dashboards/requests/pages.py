"""Context builders of the Requests pages: the filter form's choices and
links, one request's timeline and gap chart as SVG geometry (drawn by the
template, no script)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.urls import reverse

from controlplane.fleet.pools import ROLES
from controlplane.gateway import explorer
from controlplane.gateway.facts import PREFILL_MODES
from controlplane.gateway.models import RequestLog
from workers.figures import PROMPT_BUCKETS

# The charts' drawing units; the SVGs scale to the page's width (viewBox).
CHART_WIDTH = 1000
CHART_HEIGHT = 110
# The gap chart's left margin, for its axis labels.
GAP_AXIS_WIDTH = 64
# Label layout: the timeline's labels are set in rows below its axis, each
# in the first row where it overlaps no other; widths are estimated from the
# number of characters at the template's font size (12 px).
LABEL_CHAR_PX = 7.2  # DejaVu Sans, the widest likely default, averages 0.6 em
LABEL_GAP_PX = 8
TIMELINE_AXIS_Y = 12
TIMELINE_ROW_PX = 16
TIMELINE_MARGIN_PX = 4
MAX_LABEL_SHIFT_PX = 320


def _kept(params: Mapping[str, str]) -> dict[str, str]:
    return {k: params[k] for k in explorer.FILTER_PARAMS if params.get(k)}


def list_context(params: Mapping[str, str]) -> dict[str, Any]:
    kept = _kept(params)
    query = urlencode(kept)
    export = reverse("api-request-export")
    return {
        "params": kept,
        "cohorts": ROLES,
        "prefill_modes": PREFILL_MODES,
        "splits": explorer.SPLITS,
        "buckets": [name for name, _ in PROMPT_BUCKETS],
        "sorts": list(explorer.SORTS),
        "slow_by": list(explorer.SLOW_BY),
        "statuses": ["ok", "failed", "200", "429", "499", "502", "503", "598"],
        "csv_url": f"{export}?{urlencode({**kept, 'as': 'csv'})}",
        "jsonl_url": f"{export}?{urlencode({**kept, 'as': 'jsonl'})}",
        "api_url": f"{reverse('api-request-list')}?{query}",
        "rows": [],
        "errors": {},
        "next_url": None,
    }


def next_url(params: Mapping[str, str], cursor: str | None) -> str | None:
    if cursor is None:
        return None
    return f"{reverse('requests')}?{urlencode({**_kept(params), 'cursor': cursor})}"


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    seconds: float


@dataclass(frozen=True)
class Mark:
    x: float  # the tick
    label: str
    at_seconds: float
    num_tokens: int | None
    row: int  # which text line, so that no two labels overlap
    text_x: float  # where the label is anchored, kept inside the chart
    anchor: str  # SVG text-anchor: start, middle or end
    text_y: float

    @property
    def text_span(self) -> tuple[float, float]:
        width = label_width(self.label)
        left = {"start": self.text_x, "middle": self.text_x - width / 2, "end": self.text_x - width}[self.anchor]
        return left, left + width


@dataclass(frozen=True)
class Timeline:
    marks: list[Mark]
    height: int
    end_seconds: float


@dataclass(frozen=True)
class GapChart:
    bars: list[Bar]
    top_seconds: float  # the y axis' top
    plot_left: int
    plot_width: int
    height: int


def label_width(label: str) -> float:
    return len(label) * LABEL_CHAR_PX


def gap_chart(gaps: list[float]) -> GapChart:
    """One bar per gap between tokens, to scale from 0 to the largest, right
    of a y axis labelled 0 and the largest gap."""
    top = max(gaps, default=0.0) or 1.0
    plot_width = CHART_WIDTH - GAP_AXIS_WIDTH
    width = plot_width / len(gaps) if gaps else 0.0
    bars = [
        Bar(
            GAP_AXIS_WIDTH + i * width,
            CHART_HEIGHT - g / top * CHART_HEIGHT,
            max(width - 1, 0.5),
            g / top * CHART_HEIGHT,
            g,
        )
        for i, g in enumerate(gaps)
    ]
    return GapChart(bars, top, GAP_AXIS_WIDTH, plot_width, CHART_HEIGHT)


def gap_bars(gaps: list[float]) -> list[Bar]:
    return gap_chart(gaps).bars


def timeline_marks(events: list[explorer.TimelineEvent]) -> list[Mark]:
    return timeline_layout(events).marks


def timeline_layout(events: list[explorer.TimelineEvent]) -> Timeline:
    """Ticks on a time axis across the chart and each event's label below
    it, in the first row where it fits: centred on its tick (kept inside the
    chart's edges), or pushed right past the row's last label by at most
    ``MAX_LABEL_SHIFT_PX``, so that a burst of events (arrival, queue and
    the first chunks within a millisecond) reads left to right on one line
    instead of piling up; no two labels overlap."""
    end = max((e.at_seconds for e in events), default=0.0) or 1.0
    span = CHART_WIDTH - 2 * TIMELINE_MARGIN_PX
    rows: list[list[tuple[float, float]]] = []
    marks = []
    for e in events:
        x = e.at_seconds / end * span + TIMELINE_MARGIN_PX
        width = label_width(e.label)
        natural = min(max(x - width / 2, 0.0), CHART_WIDTH - width)
        row, left = len(rows), natural
        for i, placed in enumerate(rows):
            candidate = max([natural, *(b + LABEL_GAP_PX for a, b in placed if b + LABEL_GAP_PX > natural)])
            fits = candidate + width <= CHART_WIDTH and candidate - natural <= MAX_LABEL_SHIFT_PX
            if fits and all(candidate + width + LABEL_GAP_PX <= a or candidate >= b + LABEL_GAP_PX for a, b in placed):
                row, left = i, candidate
                break
        if row == len(rows):
            rows.append([])
        rows[row].append((left, left + width))
        text_y = TIMELINE_AXIS_Y + 8 + (row + 1) * TIMELINE_ROW_PX
        marks.append(Mark(x, e.label, e.at_seconds, e.num_tokens, row, left, "start", text_y))
    height = TIMELINE_AXIS_Y + 8 + (len(rows) + 1) * TIMELINE_ROW_PX + 6  # the rows, then the axis' ends
    return Timeline(marks, height, end)


def detail_context(row: RequestLog) -> dict[str, Any]:
    events = explorer.timeline(row)
    gaps = explorer.gaps(row)
    layout = timeline_layout(events)
    chart = gap_chart(gaps)
    return {
        "row": row,
        "events": events,
        "timeline": layout,
        "marks": layout.marks,
        "gap_chart": chart,
        "bars": chart.bars,
        "num_gaps": len(gaps),
        "max_gap": max(gaps, default=None),
        "chart_width": CHART_WIDTH,
        "chart_height": CHART_HEIGHT,
        "revision": row.profile_revision,
    }
