"""An arm's figures from the two sources it has: the workers' exact metrics
(two ``/metrics`` pages, before and after a repeat, differenced) and the
replay client's own timings (loadgen's summary). Pure: no Django, no I/O.

Names are the figure registry's (``controlplane/metrics/figures.py``): a
timing the replay client took is ``client_*`` (``client_ttft_p99``,
``client_itl_p99``, ...), one read from the workers' histograms has the
registry's plain name (``ttft_p99``, ``itl_p99``). Results stored before
the names matched are read through ``upgrade_figures`` (migration 0003
rewrote the stored ones).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from controlplane.metrics import catalogue
from controlplane.metrics.figures import ITL, TTFT
from controlplane.metrics.promql import histogram_quantile

# Every figure an arm reports: (key, label, unit, display). Display is how
# the page formats it (metrics.js's kinds).
FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("output_throughput", "output throughput", "tokens/s", "number"),
    ("goodput", "goodput", "req/s", "number"),
    ("capacity", "serving capacity", "req/s", "number"),  # from the arm's rate ramp, when measured
    ("client_ttft_p99", "TTFT P99 (client)", "s", "duration"),
    ("client_stall_p99", "stall P99 (client, largest gap)", "s", "duration"),
    ("client_itl_p99", "ITL P99 (client)", "s", "duration"),
    ("client_tpot_p99", "TPOT P99 (client)", "s", "duration"),
    ("memory_peak_bytes", "memory peak", "bytes", "bytes"),
    ("memory_mean_bytes", "memory mean", "bytes", "bytes"),
    ("prefill_wait_p99", "prefill wait P99", "s", "duration"),
    ("kv_fragmentation_mean", "KV fragmentation", "ratio", "percent"),
    ("preemptions", "preemptions", "count", "number"),
    ("prefix_hit_share", "prefix-cache hits", "ratio", "percent"),
    ("failed_requests", "failed requests", "count", "number"),
)
FIGURE_KEYS = tuple(f[0] for f in FIGURES)

# The names results were stored under before they matched the registry, in
# the order to rename them: the client's first, since the workers' figures
# take the plain names the client's had.
RENAMED: tuple[tuple[str, str], ...] = (
    ("ttft_p99", "client_ttft_p99"),
    ("stall_p99", "client_stall_p99"),
    ("tbt_p99", "client_itl_p99"),
    ("tpot_p99", "client_tpot_p99"),
    ("worker_ttft_p99", "ttft_p99"),
    ("worker_tbt_p99", "itl_p99"),
)
_OLD_ONLY = {"tbt_p99", "stall_p99", "worker_ttft_p99", "worker_tbt_p99"}
_RAMP_RENAMED = (("ttft_p99", "client_ttft_p99"), ("tpot_p99", "client_tpot_p99"))


def upgrade_figures(figures: dict[str, Any]) -> dict[str, Any]:
    """A repeat's figures (or an arm's summary) under the registry's names;
    ones stored under the old names are renamed, new ones returned as they are."""
    if not _OLD_ONLY & figures.keys() or any(k.startswith("client_") for k in figures):
        return figures
    out = dict(figures)
    for old, new in RENAMED:
        if old in out:
            out[new] = out.pop(old)
    return out


def upgrade_ramp_point(point: dict[str, Any]) -> dict[str, Any]:
    if any(k.startswith("client_") for k in point):
        return point
    out = dict(point)
    for old, new in _RAMP_RENAMED:
        if old in out:
            out[new] = out.pop(old)
    return out


def _value(scrape: catalogue.Scrape, key: str) -> float:
    i = scrape.layout.index.get(key)
    return float(scrape.values[i]) if i is not None else math.nan


def _delta(before: catalogue.Scrape, after: catalogue.Scrape, key: str) -> float:
    return _value(after, key) - _value(before, key)


def _quantile_of_increase(
    pairs: Sequence[tuple[catalogue.Scrape, catalogue.Scrape]], histogram: str, q: float
) -> float | None:
    """histogram_quantile over the summed bucket increases of every worker."""
    counts: dict[float, float] = {}
    for before, after in pairs:
        for bound, i in after.layout.buckets(histogram):
            j = before.layout.index.get(catalogue.bucket_key(histogram, bound))
            start = float(before.values[j]) if j is not None else 0.0
            counts[bound] = counts.get(bound, 0.0) + max(0.0, float(after.values[i]) - start)
    if not counts or counts.get(math.inf, 0.0) <= 0:
        return None
    return histogram_quantile(q, sorted(counts.items()))


def worker_figures(
    pairs: Sequence[tuple[catalogue.Scrape, catalogue.Scrape]], peaks: Sequence[float]
) -> dict[str, Any]:
    """Figures from each worker's page before and after one repeat;
    ``peaks``: the peak-memory gauge read during it (the window's max)."""
    held = sum(_delta(b, a, "chunkpilot:held_seconds_total") for b, a in pairs)
    byte_seconds = sum(_delta(b, a, "chunkpilot:memory_byte_seconds_total") for b, a in pairs)
    frag_seconds = sum(_delta(b, a, "chunkpilot:kv_fragmentation_ratio_seconds_total") for b, a in pairs)
    queries = sum(_delta(b, a, "vllm:prefix_cache_queries_total") for b, a in pairs)
    hits = sum(_delta(b, a, "vllm:prefix_cache_hits_total") for b, a in pairs)
    finite_peaks = [p for p in peaks if not math.isnan(p)]
    return {
        "preemptions": sum(_delta(b, a, "vllm:num_preemptions_total") for b, a in pairs),
        # Mean per worker: the integrals add over workers, so does held time.
        "memory_mean_bytes": byte_seconds / held if held > 0 else None,
        "memory_peak_bytes": max(finite_peaks) if finite_peaks else None,
        "kv_fragmentation_mean": frag_seconds / held if held > 0 else None,
        "prefill_wait_p99": _quantile_of_increase(pairs, "chunkpilot:prefill_chunk_wait_seconds", 0.99),
        "itl_p99": _quantile_of_increase(pairs, ITL, 0.99),
        "ttft_p99": _quantile_of_increase(pairs, TTFT, 0.99),
        "prefix_hit_share": hits / queries if queries > 0 else None,
        "prefix_cache_queries": queries,
        "generation_tokens": sum(_delta(b, a, "vllm:generation_tokens_total") for b, a in pairs),
    }


def peak_memory(scrape: catalogue.Scrape) -> float:
    return _value(scrape, catalogue.PEAK_MEMORY)


def repeat_figures(client: dict[str, Any], workers: dict[str, Any]) -> dict[str, Any]:
    """One repeat's figures: the client's timings, the workers' exact counts."""

    def p99_seconds(name: str) -> float | None:
        ms = (client.get(name) or {}).get("p99")
        return ms / 1000 if ms is not None else None

    return {
        "output_throughput": client["output_throughput"],
        "goodput": client["goodput"],
        "client_ttft_p99": p99_seconds("ttft_ms"),
        "client_stall_p99": p99_seconds("max_gap_ms"),
        "client_itl_p99": p99_seconds("itl_ms"),
        "client_tpot_p99": p99_seconds("tpot_ms"),
        "failed_requests": client["failed_requests"],
        "num_requests": client["num_requests"],
        "successful_requests": client.get("successful_requests"),
        **{
            k: workers.get(k)
            for k in (
                "memory_peak_bytes",
                "memory_mean_bytes",
                "prefill_wait_p99",
                "kv_fragmentation_mean",
                "preemptions",
                "prefix_hit_share",
                "itl_p99",
                "ttft_p99",
            )
        },
    }


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per figure over repeats: mean, half range ((max − min) / 2), values."""
    out: dict[str, dict[str, Any]] = {}
    figures = [upgrade_figures(r["figures"]) for r in results]
    keys = {k for f in figures for k in f}
    for key in sorted(keys):
        values = [f[key] for f in figures if f.get(key) is not None]
        if not values:
            out[key] = {"mean": None, "half_range": None, "values": []}
            continue
        out[key] = {"mean": statistics.fmean(values), "half_range": (max(values) - min(values)) / 2, "values": values}
    return out


def empty_scrape() -> catalogue.Scrape:
    layout = catalogue.layout_for({})
    return catalogue.Scrape(layout, np.zeros(len(layout)), {})


# ---- were the arm's conditions the workload's? ---------------------------------------------

TOLERANCE = 0.10  # an arm more than this far off the workload (relative) is not comparable
PREFIX_SHARE_FLOOR = 0.01  # absolute: a workload without sharing is not flagged by a stray block hit


@dataclass(frozen=True)
class Conditions:
    """What an arm ran, beside the workload's own: requests sent and
    completed (over all repeats), the achieved rate (completed requests per
    second of arrivals, mean over repeats) and the prefix-hit share (the
    workers' hits over their queries, over all repeats)."""

    num_repeats: int
    requests_sent: int
    requests_completed: int
    achieved_rate: float | None
    prefix_hit_share: float | None
    workload_rate: float
    workload_prefix_hit_share: float
    not_comparable: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["not_comparable"] = list(self.not_comparable)
        return data


def _off(value: float, target: float, floor: float = 0.0) -> bool:
    return abs(value - target) > max(TOLERANCE * target, floor)


def arm_conditions(
    results: Sequence[dict[str, Any]], *, arrival_seconds: float, workload_rate: float, workload_prefix_share: float
) -> Conditions:
    """An arm's conditions from its stored repeats; ``not_comparable`` says
    each way they are more than 10% off the workload's."""
    sent = completed = 0
    rates: list[float] = []
    hits = queries = 0.0
    shares: list[float] = []
    for r in results:
        client, figures = r.get("client") or {}, upgrade_figures(r.get("figures") or {})
        n = client.get("num_requests", figures.get("num_requests"))
        if n is not None:  # else a result that kept no count: the rate is unknown, not zero
            ok = client.get("successful_requests")
            ok = int(ok if ok is not None else int(n) - int(figures.get("failed_requests") or 0))
            sent, completed = sent + int(n), completed + ok
            if arrival_seconds > 0:
                rates.append(ok / arrival_seconds)
        share, q = figures.get("prefix_hit_share"), figures.get("prefix_cache_queries")
        if share is not None and q:
            hits, queries = hits + share * q, queries + q
        elif share is not None:  # stored before the query count was: the repeats' mean
            shares.append(share)
    rate = statistics.fmean(rates) if rates else None
    share = hits / queries if queries else (statistics.fmean(shares) if shares else None)
    why = []
    if rate is not None and _off(rate, workload_rate):
        why.append(f"achieved {rate:.3g} requests/s against the workload's {workload_rate:.3g}")
    if share is not None and _off(share, workload_prefix_share, PREFIX_SHARE_FLOOR):
        why.append(f"prefix-hit share {share:.0%} against the workload's {workload_prefix_share:.0%}")
    return Conditions(len(results), sent, completed, rate, share, workload_rate, workload_prefix_share, tuple(why))
