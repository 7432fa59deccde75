"""The rules Chunkpilot ships. A migration installs them once (found again
by ``key``); operators may edit them, switch them off or delete them, and
an upgrade never puts them back.

What no data counts as, rule by rule: figures from requests have no data
when nobody sends any (an idle pool, a canary at weight 0), which is not a
problem, so those rules count it as ok; figures from scrapes have data
whenever scrapes work, so there "no data" is news and gets its own state.
"""

from __future__ import annotations

from typing import Any

# A whole-system restart (the demo's) finds every worker silent since it
# stopped; each is back well within this.
WORKER_MISSING_FOR_SECONDS = 60.0
# Below this load, memory peak/mean says nothing (one request on an idle
# engine is a peak over an empty mean).
MEMORY_RULE_MIN_REQUESTS_PER_SECOND = 0.1

DEFAULT_RULES: list[dict[str, Any]] = [
    {
        "key": "canary-ttft-regression",
        "name": "CanaryTTFTRegression",
        "figure": "client_ttft_p99",
        "selector": {"cohort": "canary"},
        "group_by": "pool",
        "compare_to": "baseline",
        "window_seconds": 300.0,
        "comparator": ">",
        "threshold": 1.5,
        "floor": 0.25,
        "for_seconds": 120.0,
        "keep_firing_for_seconds": 300.0,
        "no_data_state": "ok",
        "severity": "critical",
        "action": "abort_rollout",
        "summary": "Canary {{ $labels.pool }}: TTFT P99 is {{ $value }}x its baseline's",
        "description": "The canary's exact TTFT P99 over 5 minutes is more than 1.5 times its baseline pool's "
        "(its stable pool where the table has no baseline) and above 250 ms, for 2 minutes. "
        "This aborts the rollout that owns the canary. No data (no canary traffic) counts as ok.",
    },
    {
        "key": "stalls-high",
        "name": "StreamStallsHigh",
        "figure": "client_stall_p99",
        "group_by": "pool",
        "window_seconds": 300.0,
        "comparator": ">",
        "threshold": 2.0,
        "for_seconds": 300.0,
        "no_data_state": "ok",
        "severity": "warning",
        "summary": "Pool {{ $labels.pool }}: P99 of each stream's longest gap between tokens is {{ $value }} s",
        "description": "Head-of-line blocking: a long prefill (monolithic, or chunks too large) holds running "
        "streams. Look at the pool's profile: chunked prefill with a smaller "
        "long_prefill_token_threshold spreads prefills out. No data (no requests) counts as ok.",
    },
    {
        "key": "error-rate-high",
        "name": "ErrorRateHigh",
        "figure": "error_rate",
        "group_by": "pool",
        "window_seconds": 300.0,
        "comparator": ">",
        "threshold": 0.05,
        "for_seconds": 120.0,
        "no_data_state": "ok",
        "severity": "critical",
        "summary": "Pool {{ $labels.pool }}: {{ $value }} of requests failed (5xx, 429 or a broken stream)",
        "description": "More than 5% of the pool's requests failed over 5 minutes, for 2 minutes. "
        "No data (no requests) counts as ok.",
    },
    {
        "key": "worker-missing",
        "name": "WorkerMissing",
        "figure": "worker_missing",
        "group_by": "worker",
        "window_seconds": 60.0,
        "comparator": ">",
        "threshold": 0.0,
        "for_seconds": WORKER_MISSING_FOR_SECONDS,
        "no_data_state": "nodata",
        "severity": "warning",
        "summary": "Worker {{ $labels.worker }} stopped answering heartbeats",
        "description": "The worker is unhealthy or offline: it missed heartbeats for a minute, and the gateway "
        "no longer routes to it. (A restart of the whole system finds every worker silent since it stopped; "
        "they are back within the minute.)",
        "dashboard_url": "/",
    },
    {
        "key": "profile-drift",
        "name": "ProfileDrift",
        "figure": "profile_drift_seconds",
        "group_by": "worker",
        "window_seconds": 60.0,
        "comparator": ">",
        "threshold": 300.0,
        "for_seconds": 0.0,
        "no_data_state": "nodata",
        "severity": "warning",
        "summary": "Worker {{ $labels.worker }} has not run its desired profile for {{ $value }} s",
        "description": "The worker runs a profile revision other than the one it should for more than 5 "
        "minutes: its agent failed to apply it (see the worker's apply error) or cannot.",
        "dashboard_url": "/",
    },
    {
        "key": "kv-fragmentation-high",
        "name": "KVFragmentationHigh",
        "figure": "kv_fragmentation",
        "group_by": "worker",
        "window_seconds": 600.0,
        "comparator": ">",
        "threshold": 0.5,
        "for_seconds": 600.0,
        "no_data_state": "nodata",
        "severity": "warning",
        "summary": "Worker {{ $labels.worker }}: KV fragmentation {{ $value }} over 10 minutes",
        "description": "More than half of the KV blocks' token slots stand empty: the block size is large for "
        "the prompts served, or chunks end mid-block. No data means its scrapes stopped.",
    },
    {
        "key": "memory-peak-to-mean-high",
        "name": "MemoryPeakToMeanHigh",
        "figure": "memory_peak_to_mean",
        "group_by": "worker",
        "window_seconds": 600.0,
        "comparator": ">",
        "threshold": 2.0,
        "min_requests_per_second": MEMORY_RULE_MIN_REQUESTS_PER_SECOND,
        "for_seconds": 600.0,
        "no_data_state": "nodata",
        "severity": "warning",
        "summary": "Worker {{ $labels.worker }}: memory peak is {{ $value }}x its mean",
        "description": "Engine memory spikes to more than twice its time-weighted mean: whole-prompt prefills' "
        "activations. Chunked prefill with a smaller budget flattens the peaks. Judged only while the worker "
        "serves at least 0.1 requests/s: an idle engine's peak/mean is high by nature. No data means its "
        "scrapes stopped.",
    },
]


def install(rule_model: Any) -> int:
    """Create the shipped rules whose key no rule has. The migration calls it
    once; calling it again restores deleted ones (and nothing else)."""
    created = 0
    # An early migration's model lacks the fields later ones add; a later
    # migration sets those on the shipped rules.
    known = {f.name for f in rule_model._meta.get_fields()}
    for spec in DEFAULT_RULES:
        fields = {k: v for k, v in spec.items() if k in known or k == "key"}
        key = fields.pop("key")
        if rule_model.objects.filter(key=key).exists():
            continue
        fields.setdefault("selector", {})
        rule_model.objects.create(key=key, **fields)
        created += 1
    return created
