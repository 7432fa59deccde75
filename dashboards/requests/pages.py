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

CHART_WIDTH = 640
CHART_HEIGHT = 90


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
    x: float
    label: str
    at_seconds: float
    num_tokens: int | None
    row: int  # which text line, so close labels do not overlap


def gap_bars(gaps: list[float]) -> list[Bar]:
    if not gaps:
        return []
    top = max(gaps) or 1.0
    width = CHART_WIDTH / len(gaps)
    return [
        Bar(i * width, CHART_HEIGHT - g / top * CHART_HEIGHT, max(width - 1, 0.5), g / top * CHART_HEIGHT, g)
        for i, g in enumerate(gaps)
    ]


def timeline_marks(events: list[explorer.TimelineEvent]) -> list[Mark]:
    end = max((e.at_seconds for e in events), default=0.0) or 1.0
    return [
        Mark(e.at_seconds / end * (CHART_WIDTH - 8) + 4, e.label, e.at_seconds, e.num_tokens, i % 3)
        for i, e in enumerate(events)
    ]


def detail_context(row: RequestLog) -> dict[str, Any]:
    events = explorer.timeline(row)
    gaps = explorer.gaps(row)
    return {
        "row": row,
        "events": events,
        "marks": timeline_marks(events),
        "bars": gap_bars(gaps),
        "num_gaps": len(gaps),
        "max_gap": max(gaps, default=None),
        "chart_width": CHART_WIDTH,
        "chart_height": CHART_HEIGHT,
        "revision": row.profile_revision,
    }
