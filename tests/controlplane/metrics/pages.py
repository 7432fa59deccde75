"""Prometheus text pages as a worker serves them, built from plain numbers,
and a helper that stores them as scrapes.

Only the series the figures read are written; everything else a real page
has is ignored by the parser anyway (the scraper test reads real workers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from controlplane.metrics import catalogue, scrape

LABELS = 'engine="0",model_name="tiny"'


def le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


@dataclass
class Page:
    counters: dict[str, float] = field(default_factory=dict)  # sample name (…_total, or with {kind=…}) → value
    histograms: dict[str, tuple[Sequence[tuple[float, float]], float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    # histogram → prompt_bucket label → (cumulative buckets, sum), as the worker labels them
    by_prompt: dict[str, dict[str, tuple[Sequence[tuple[float, float]], float]]] = field(default_factory=dict)

    def text(self) -> str:
        lines: list[str] = []
        for base, per_bucket in self.by_prompt.items():
            lines.append(f"# TYPE {base} histogram")
            for label, (buckets, total) in per_bucket.items():
                labels = f'{LABELS},prompt_bucket="{label}"'
                for bound, count in buckets:
                    lines.append(f'{base}_bucket{{{labels},le="{le(bound)}"}} {count!r}')
                lines.append(f"{base}_sum{{{labels}}} {total!r}")
                lines.append(f"{base}_count{{{labels}}} {buckets[-1][1]!r}")
        for name, value in self.counters.items():
            if name.startswith("chunkpilot:step_tokens_total{kind="):
                kind = name.split("=", 1)[1].rstrip("}")
                lines.append(f'chunkpilot:step_tokens_total{{{LABELS},kind="{kind}"}} {value!r}')
                continue
            base = name.removesuffix("_total")
            lines += [f"# TYPE {base} counter", f"{name}{{{LABELS}}} {value!r}"]
        for base, (buckets, total) in self.histograms.items():
            lines.append(f"# TYPE {base} histogram")
            for bound, count in buckets:
                lines.append(f'{base}_bucket{{{LABELS},le="{le(bound)}"}} {count!r}')
            lines.append(f"{base}_sum{{{LABELS}}} {total!r}")
            lines.append(f"{base}_count{{{LABELS}}} {buckets[-1][1]!r}")
        for name, value in self.gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name}{{{LABELS}}} {value!r}"]
        return "\n".join(lines) + "\n"


def fine_bounds(top: float) -> list[float]:
    """The workers' fine latency buckets (docs: 4 per doubling from 0.5 ms, to past ``top``)."""
    bounds = [0.0005 * 2 ** (i / 4) for i in range(200)]
    return [b for b in bounds if b < top * 2**0.25] + [math.inf]


def cumulative(values: Sequence[float], bounds: Sequence[float]) -> list[tuple[float, float]]:
    """Observed values as a histogram's cumulative (upper bound, count) pairs."""
    return [(b, float(sum(1 for v in values if v <= b))) for b in bounds]


def job(worker, cohort: str = "") -> scrape.Job:
    return scrape.Job(worker.pk, worker.name, worker.url, worker.pool.name if worker.pool else "", cohort)


def store(at: datetime, pages: Mapping[scrape.Job, Page | None]) -> int:
    """Record one scrape round; a None page is a worker that did not answer."""
    parsed = []
    for j, page in pages.items():
        fetched = scrape.Fetched(j, None if page is None else page.text(), "" if page else "connection refused", 0.01)
        parsed.append(
            (fetched, None if page is None else catalogue.parse(page.text()), "" if page else "connection refused")
        )
    return scrape.record(at, parsed)
