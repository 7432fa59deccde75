"""The figures ("Metrics" in docs/architecture.md) from the records engines produce.

Pure functions over ``RequestMetrics`` and ``StepMetrics`` (no torch, no
Django), shared by the benchmark, the load generator and the worker server.
Times are ``time.monotonic()`` seconds.

Time-weighted figures are sample-and-hold: what a step leaves behind
(``memory_bytes``, its fragmentation) holds from that step's end to the next
step's end, which is what a scrape between steps would see. Memory peak is
the highest ``peak_memory_bytes`` (which includes the step's transient
tensors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engines.api import RequestMetrics, StepMetrics

# The prompt-length buckets every latency figure is also given for, by their upper bound in tokens.
PROMPT_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<=512", 512),
    ("<=2K", 2048),
    ("<=8K", 8192),
    ("<=32K", 32768),
    (">32K", math.inf),
)

# A prefill of more than ``long_prefill_tokens(max_model_len)`` tokens (left to
# compute after its prefix-cache hit) is long: the exporter splits decode gaps by
# whether one ran during them. Relative to the model's context, so that "long"
# can happen on a 4,096-token model (256) as on a 131,072-token one (8,192).
LONG_PREFILL_MIN_TOKENS = 64
LONG_PREFILL_CONTEXT_SHARE = 16  # a sixteenth of the context

# Deprecated: the old absolute threshold, kept only until the control plane's
# advisor reads ``chunkpilot:long_prefill_tokens`` instead. Use long_prefill_tokens().
LONG_PREFILL_TOKENS = 1024

# Latency buckets fine enough to resolve the figures the product is about:
# log-spaced, FINE_BUCKETS_PER_DOUBLING per doubling (no bucket wider than ~19.6%
# after rounding to three digits), from 0.5 ms, so no quantile is interpolated
# from zero across a 10-ms bucket.
FINE_BUCKETS_LOWEST_SECONDS = 0.0005
FINE_BUCKETS_PER_DOUBLING = 4


def long_prefill_tokens(max_model_len: int) -> int:
    """The long-prefill threshold for a model: max(64, max_model_len // 16)
    (4,096-token context → 256; 131,072 → 8,192)."""
    return max(LONG_PREFILL_MIN_TOKENS, max_model_len // LONG_PREFILL_CONTEXT_SHARE)


def fine_buckets(highest: float, lowest: float = FINE_BUCKETS_LOWEST_SECONDS) -> tuple[float, ...]:
    """Log-spaced bucket upper bounds from ``lowest`` until one reaches
    ``highest``, ``FINE_BUCKETS_PER_DOUBLING`` per doubling, rounded to three
    significant digits (so the ``le`` labels stay readable)."""
    out: list[float] = []
    k = 0
    while not out or out[-1] < highest:
        out.append(float(f"{lowest * 2 ** (k / FINE_BUCKETS_PER_DOUBLING):.3g}"))
        k += 1
    return tuple(out)


# ---- basics ------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0–100), linear between closest ranks (numpy's default); None when empty."""
    data = sorted(values)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100; got {q}")
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def mean(values: Iterable[float]) -> float | None:
    data = list(values)
    return sum(data) / len(data) if data else None


def prompt_bucket(num_prompt_tokens: int) -> str:
    for name, bound in PROMPT_BUCKETS:
        if num_prompt_tokens <= bound:
            return name
    return PROMPT_BUCKETS[-1][0]


# ---- per request -------------------------------------------------------------
def ttft_seconds(m: RequestMetrics) -> float | None:
    """Arrival → first token."""
    return None if m.first_token_time is None else m.first_token_time - m.arrival_time


def queue_seconds(m: RequestMetrics) -> float | None:
    """Arrival → first scheduled."""
    return None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time


def e2e_seconds(m: RequestMetrics) -> float | None:
    return None if m.finished_time is None else m.finished_time - m.arrival_time


def token_gaps(m: RequestMetrics) -> list[float]:
    """Time between consecutive output tokens (ITL / TBT samples)."""
    t = m.token_times
    return [t[i] - t[i - 1] for i in range(1, len(t))]


def max_gap_seconds(m: RequestMetrics) -> float | None:
    """The request's largest gap between two tokens (one stall sample); None under two tokens."""
    gaps = token_gaps(m)
    return max(gaps) if gaps else None


def delivered(m: RequestMetrics, writes: Sequence[tuple[float, int]]) -> RequestMetrics:
    """The request as its client saw it: ``writes`` are the worker's SSE events
    that carried tokens, (write time, tokens in it); every token takes its
    event's write time (tokens merged into one event share it), so the
    per-request figures above read the delivered times. The engine's record
    is left as it is."""
    times = [at for at, n in writes for _ in range(n)]
    return dataclasses.replace(m, token_times=times, first_token_time=times[0] if times else None)


def delivery_lags(m: RequestMetrics, writes: Sequence[tuple[float, int]]) -> list[float]:
    """Per written event, its write time minus the engine's production time of
    its newest token (``m.token_times``); events past the record are left out."""
    out = []
    count = 0
    for at, n in writes:
        count += n
        if 0 < count <= len(m.token_times):
            out.append(at - m.token_times[count - 1])
    return out


def tpot_seconds(m: RequestMetrics) -> float | None:
    """Mean time per output token after the first."""
    t = m.token_times
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


@dataclass(frozen=True)
class SLO:
    ttft_seconds: float
    tpot_seconds: float


def meets_slo(m: RequestMetrics, slo: SLO) -> bool:
    ttft = ttft_seconds(m)
    tpot = tpot_seconds(m)
    return ttft is not None and ttft <= slo.ttft_seconds and (tpot is None or tpot <= slo.tpot_seconds)


def goodput(requests: Sequence[RequestMetrics], slo: SLO, duration_seconds: float) -> float:
    """Requests per second that met both the TTFT and the TPOT objective."""
    if duration_seconds <= 0:
        return 0.0
    return sum(1 for m in requests if meets_slo(m, slo)) / duration_seconds


def stalls_seconds(requests: Sequence[RequestMetrics], q: float = 99) -> float | None:
    """The stall figure: the q-th percentile over requests of each one's largest gap."""
    return percentile((g for m in requests if (g := max_gap_seconds(m)) is not None), q)


# ---- gaps while something else runs -------------------------------------------
def prefill_intervals(requests: Sequence[RequestMetrics], min_prompt_tokens: int) -> list[tuple[float, float]]:
    """(first scheduled, first token) of each request with a prompt of at least ``min_prompt_tokens``."""
    return [
        (m.first_scheduled_time, m.first_token_time)
        for m in requests
        if m.num_prompt_tokens >= min_prompt_tokens
        and m.first_scheduled_time is not None
        and m.first_token_time is not None
    ]


def gaps_overlapping(requests: Sequence[RequestMetrics], intervals: Sequence[tuple[float, float]]) -> list[float]:
    """Gaps between two tokens of a request that overlap any of ``intervals``
    (e.g. while a long prompt was prefilling)."""
    spans = sorted(intervals)
    out = []
    for m in requests:
        t = m.token_times
        for i in range(1, len(t)):
            a, b = t[i - 1], t[i]
            if any(a < end and b > start for start, end in spans):
                out.append(b - a)
    return out


# ---- per step ------------------------------------------------------------------
def _held(steps: Sequence[StepMetrics], value: Any) -> tuple[float, float]:
    """Sample-and-hold integral of ``value(step)`` and the time it covers: a
    step's value holds from its end to the next step's end (the last step's
    for its own duration)."""
    ordered = sorted(steps, key=lambda s: s.start_time)
    ends = [s.start_time + s.duration_seconds for s in ordered]
    total = area = 0.0
    for i, step in enumerate(ordered):
        span = ends[i + 1] - ends[i] if i + 1 < len(ordered) else step.duration_seconds
        v = value(step)
        if v is None or span <= 0:
            continue
        area += v * span
        total += span
    return area, total


def memory_figures(steps: Sequence[StepMetrics]) -> dict[str, float | None]:
    """Peak (with transients), time-weighted mean, and their ratio."""
    if not steps:
        return {"memory_peak_bytes": None, "memory_mean_bytes": None, "memory_peak_over_mean": None}
    peak = max(s.peak_memory_bytes for s in steps)
    area, total = _held(steps, lambda s: s.memory_bytes)
    avg = area / total if total > 0 else float(steps[-1].memory_bytes)
    return {
        "memory_peak_bytes": float(peak),
        "memory_mean_bytes": avg,
        "memory_peak_over_mean": peak / avg if avg else None,
    }


def fragmentation_figures(steps: Sequence[StepMetrics]) -> dict[str, float | None]:
    """KV fragmentation, 1 − tokens stored / (blocks held × block_size): time-weighted mean and max."""
    values = [f for s in steps if (f := s.kv_fragmentation) is not None]
    area, total = _held(steps, lambda s: s.kv_fragmentation)
    return {
        "kv_fragmentation_mean": area / total if total > 0 else mean(values),
        "kv_fragmentation_max": max(values) if values else None,
    }


def prefill_wait_figures(steps: Sequence[StepMetrics]) -> dict[str, float | None]:
    waits = [w for s in steps for w in s.prefill_chunk_waits]
    return {"prefill_wait_mean_seconds": mean(waits), "prefill_wait_p99_seconds": percentile(waits, 99)}


def token_mix(steps: Sequence[StepMetrics]) -> dict[str, float]:
    prefill = sum(s.num_prefill_tokens for s in steps)
    decode = sum(s.num_decode_tokens for s in steps)
    return {
        "prefill_tokens": float(prefill),
        "decode_tokens": float(decode),
        "prefill_share": prefill / (prefill + decode) if prefill + decode else 0.0,
        "steps": float(len(steps)),
    }


# ---- all of it -------------------------------------------------------------------
def summarize(
    requests: Sequence[RequestMetrics],
    steps: Sequence[StepMetrics],
    duration_seconds: float,
    slo: SLO,
) -> dict[str, float | None]:
    """Every figure for one window, keyed by name (seconds, bytes, ratios)."""
    ttfts = [v for m in requests if (v := ttft_seconds(m)) is not None]
    gaps = [g for m in requests for g in token_gaps(m)]
    tpots = [v for m in requests if (v := tpot_seconds(m)) is not None]
    queues = [v for m in requests if (v := queue_seconds(m)) is not None]
    output_tokens = sum(m.num_output_tokens for m in requests)
    prompt_tokens = sum(m.num_prompt_tokens for m in requests)
    cached = sum(m.num_cached_tokens for m in requests)
    queries = sum(s.prefix_cache_queries for s in steps)
    hits = sum(s.prefix_cache_hits for s in steps)
    out: dict[str, float | None] = {
        "requests": float(len(requests)),
        "duration_seconds": duration_seconds,
        "ttft_p50_seconds": percentile(ttfts, 50),
        "ttft_p95_seconds": percentile(ttfts, 95),
        "ttft_p99_seconds": percentile(ttfts, 99),
        "itl_p50_seconds": percentile(gaps, 50),
        "itl_p95_seconds": percentile(gaps, 95),
        "itl_p99_seconds": percentile(gaps, 99),
        "stall_p95_seconds": stalls_seconds(requests, 95),
        "stall_p99_seconds": stalls_seconds(requests, 99),
        "stall_max_seconds": stalls_seconds(requests, 100),
        "tpot_p50_seconds": percentile(tpots, 50),
        "tpot_p95_seconds": percentile(tpots, 95),
        "tpot_p99_seconds": percentile(tpots, 99),
        "queue_p50_seconds": percentile(queues, 50),
        "queue_p95_seconds": percentile(queues, 95),
        "queue_p99_seconds": percentile(queues, 99),
        "output_tokens": float(output_tokens),
        "prompt_tokens": float(prompt_tokens),
        "output_throughput_tps": output_tokens / duration_seconds if duration_seconds > 0 else None,
        "goodput_rps": goodput(requests, slo, duration_seconds),
        "preemptions": float(sum(s.num_preemptions for s in steps)),
        "prefix_hit_rate": hits / queries if queries else (cached / prompt_tokens if prompt_tokens and cached else 0.0),
    }
    out.update(memory_figures(steps))
    out.update(fragmentation_figures(steps))
    out.update(prefill_wait_figures(steps))
    out.update(token_mix(steps))
    return out


def by_prompt_bucket(requests: Sequence[RequestMetrics]) -> dict[str, dict[str, float | None]]:
    """Latency figures per prompt-length bucket (buckets with requests only)."""
    groups: dict[str, list[RequestMetrics]] = {}
    for m in requests:
        groups.setdefault(prompt_bucket(m.num_prompt_tokens), []).append(m)
    out = {}
    for name, _ in PROMPT_BUCKETS:
        if name in groups:
            rs = groups[name]
            out[name] = {
                "requests": float(len(rs)),
                "ttft_p50_seconds": percentile([v for m in rs if (v := ttft_seconds(m)) is not None], 50),
                "ttft_p95_seconds": percentile([v for m in rs if (v := ttft_seconds(m)) is not None], 95),
                "ttft_p99_seconds": percentile([v for m in rs if (v := ttft_seconds(m)) is not None], 99),
                "stall_p99_seconds": stalls_seconds(rs, 99),
                "tpot_p50_seconds": percentile([v for m in rs if (v := tpot_seconds(m)) is not None], 50),
            }
    return out
