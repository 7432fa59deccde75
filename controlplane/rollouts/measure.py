"""One analysis measurement's numbers, from the metrics app's query layer.

Every metric of the run is read over the same window ending ``now``,
grouped by pool, and the canary pool's value is paired with the baseline's
(the baseline pool if the rollout has one, else the stable pool). The
sample count of both sides is the number of client requests the gateways
logged for that pool in the window (``request_count``): the figures that
come from scraped histograms count the same requests.

Rates (``*/s`` units) depend on how much traffic a pool gets, so they are
divided by the pool's share of the routing weights: "throughput per 100% of
traffic", comparable between a 10% canary and a 90% stable pool. The
shares are today's, so rates are read only since the current step started
(when that is shorter than the window): a window reaching back before the
last weight change would count the canary's old, smaller share against its
new one.

A metrics backend that does not answer (``METRICS_BACKEND=prometheus`` and
Prometheus down or slow) makes the measurement inconclusive, never failed.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING

from controlplane.metrics import figures, query
from controlplane.rollouts.judge import Check, RunSpec, Sample

if TYPE_CHECKING:
    from controlplane.rollouts.models import Rollout

log = logging.getLogger(__name__)

SAMPLE_FIGURE = "request_count"
MIN_RATE_WINDOW_SECONDS = 5.0  # a shorter read is mostly noise: use the whole window then
TRAFFIC_WINDOW_SECONDS = 300.0  # "the current traffic rate" is the last five minutes'


def sides(rollout: Rollout) -> tuple[tuple[str, str], tuple[str, str]]:
    """((canary pool name, role), (baseline pool name, role))."""
    pool = rollout.baseline_pool
    baseline = (pool.name, "baseline") if pool is not None else (rollout.stable_pool.name, "stable")
    return (rollout.canary_pool.name, "canary"), baseline


def collect(
    rollout: Rollout, spec: RunSpec, weights: dict[str, int], now: datetime, lookback_seconds: float | None = None
) -> dict[str, Sample]:
    """``lookback_seconds``: the window, when not the spec's (a run waiting for samples looks further back)."""
    (canary, canary_role), (baseline, baseline_role) = sides(rollout)
    rates = {rule.figure for rule in spec.metrics if _is_rate(rule.figure)}
    names = sorted({rule.figure for rule in spec.metrics} - rates | {SAMPLE_FIGURE})
    lookback = lookback_seconds or spec.lookback_seconds
    rate_window = lookback
    since_step = (now - rollout.step_started_at).total_seconds() if rollout.step_started_at else 0.0
    if MIN_RATE_WINDOW_SECONDS <= since_step < rate_window:
        rate_window = since_step
    try:
        values = query.query_many(names, lookback, group_by="pool", now=now)
        if rates:
            values.update(query.query_many(sorted(rates), rate_window, group_by="pool", now=now))
    except query.BackendUnavailable as exc:
        log.warning("rollout %s: %s", rollout.pk, exc)
        return {rule.name: Sample(None, None, 0, 0, unavailable=str(exc)) for rule in spec.metrics}
    except Exception as exc:
        log.warning("rollout %s: metrics query failed", rollout.pk, exc_info=True)
        return {rule.name: Sample(None, None, 0, 0, error=f"{type(exc).__name__}: {exc}") for rule in spec.metrics}
    counts = values.get(SAMPLE_FIGURE, {})
    n_canary, n_baseline = int(counts.get(canary) or 0), int(counts.get(baseline) or 0)
    silent: dict[str, int] | None = None
    out = {}
    for rule in spec.metrics:
        by_pool = values.get(rule.figure, {})
        c, b = by_pool.get(canary), by_pool.get(baseline)
        if rule.test is Check.HANGING:
            # Streams that never finish never reach the log: add those silent now.
            if silent is None:
                try:
                    silent = query.silent_streams_by_pool()
                except Exception as exc:
                    log.warning("rollout %s: reading the gateways' silent streams failed", rollout.pk, exc_info=True)
                    out[rule.name] = Sample(None, None, n_canary, n_baseline, error=f"{type(exc).__name__}: {exc}")
                    continue
            c = (c or 0.0) + silent.get(canary, 0)
            b = (b or 0.0) + silent.get(baseline, 0)
        if rule.figure in rates:
            c, b = _per_share(c, weights.get(canary_role, 0)), _per_share(b, weights.get(baseline_role, 0))
        out[rule.name] = Sample(c, b, n_canary, n_baseline)
    return out


def requests_per_second(pool_names: set[str], now: datetime) -> float:
    """The traffic those pools got lately, in client requests per second
    (what the forecast of sample counts divides by)."""
    counts = query.query_many([SAMPLE_FIGURE], TRAFFIC_WINDOW_SECONDS, group_by="pool", now=now).get(SAMPLE_FIGURE, {})
    return sum(float(counts.get(name) or 0) for name in pool_names) / TRAFFIC_WINDOW_SECONDS


def _is_rate(figure: str) -> bool:
    return figures.get(figure).unit.endswith("/s")


def _per_share(value: float | None, weight_bp: int) -> float | None:
    if value is None or weight_bp <= 0:
        return None
    return value * 10_000 / weight_bp
