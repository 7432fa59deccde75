"""An arm's figures from the two sources it has: the workers' exact metrics
(two ``/metrics`` pages, before and after a repeat, differenced) and the
replay client's own timings (loadgen's summary). Pure: no Django, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from controlplane.metrics import catalogue
from controlplane.metrics.promql import histogram_quantile

# Every figure an arm reports: (key, label, unit, display). Display is how
# the page formats it (metrics.js's kinds).
FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("output_throughput", "output throughput", "tokens/s", "number"),
    ("goodput", "goodput", "req/s", "number"),
    ("capacity", "serving capacity", "req/s", "number"),  # from the arm's rate ramp, when measured
    ("ttft_p99", "TTFT P99", "s", "duration"),
    ("stall_p99", "stall P99 (largest gap)", "s", "duration"),
    ("tbt_p99", "TBT P99", "s", "duration"),
    ("tpot_p99", "TPOT P99", "s", "duration"),
    ("memory_peak_bytes", "memory peak", "bytes", "bytes"),
    ("memory_mean_bytes", "memory mean", "bytes", "bytes"),
    ("prefill_wait_p99", "prefill wait P99", "s", "duration"),
    ("kv_fragmentation_mean", "KV fragmentation", "ratio", "percent"),
    ("preemptions", "preemptions", "count", "number"),
    ("prefix_hit_share", "prefix-cache hits", "ratio", "percent"),
    ("failed_requests", "failed requests", "count", "number"),
)
FIGURE_KEYS = tuple(f[0] for f in FIGURES)


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
        "worker_tbt_p99": _quantile_of_increase(pairs, "vllm:inter_token_latency_seconds", 0.99),
        "worker_ttft_p99": _quantile_of_increase(pairs, "vllm:time_to_first_token_seconds", 0.99),
        "prefix_hit_share": hits / queries if queries > 0 else None,
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
        "ttft_p99": p99_seconds("ttft_ms"),
        "stall_p99": p99_seconds("max_gap_ms"),
        "tbt_p99": p99_seconds("itl_ms"),
        "tpot_p99": p99_seconds("tpot_ms"),
        "failed_requests": client["failed_requests"],
        "num_requests": client["num_requests"],
        **{
            k: workers.get(k)
            for k in (
                "memory_peak_bytes",
                "memory_mean_bytes",
                "prefill_wait_p99",
                "kv_fragmentation_mean",
                "preemptions",
                "prefix_hit_share",
                "worker_tbt_p99",
                "worker_ttft_p99",
            )
        },
    }


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per figure over repeats: mean, half range ((max − min) / 2), values."""
    out: dict[str, dict[str, Any]] = {}
    keys = {k for r in results for k in r["figures"]}
    for key in sorted(keys):
        values = [r["figures"][key] for r in results if r["figures"].get(key) is not None]
        if not values:
            out[key] = {"mean": None, "half_range": None, "values": []}
            continue
        out[key] = {"mean": statistics.fmean(values), "half_range": (max(values) - min(values)) / 2, "values": values}
    return out


def empty_scrape() -> catalogue.Scrape:
    layout = catalogue.layout_for({})
    return catalogue.Scrape(layout, np.zeros(len(layout)), {})
