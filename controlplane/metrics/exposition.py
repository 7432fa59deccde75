"""The control plane's own ``/metrics``: fleet and routing gauges, read from
the database at scrape time, plus whatever other apps register.

    from controlplane.metrics import exposition

    @exposition.register
    def rollout_gauges():
        g = GaugeMetricFamily("chunkpilot_rollout_step", "Current step of each rollout.", labels=["rollout"])
        for r in Rollout.objects.active():
            g.add_metric([r.name], r.step_index)
        yield g

A provider is a function yielding prometheus-client metric families; it runs
on every scrape of the control plane, so it should be one or two queries. A
provider that raises is logged and skipped: one broken gauge must not take
the whole page down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway import bus
from controlplane.gateway.models import RoutingPool, RoutingTable
from controlplane.metrics.models import ScrapeRound, ScrapeStatus, ServiceObjectives

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Provider = Callable[[], Iterable[Metric]]
_providers: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    """Add a provider (usable as a decorator); registering a name twice replaces it."""
    _providers[f"{provider.__module__}.{provider.__qualname__}"] = provider
    return provider


def unregister(provider: Provider) -> None:
    _providers.pop(f"{provider.__module__}.{provider.__qualname__}", None)


class _Providers(Collector):
    def collect(self) -> Iterator[Metric]:
        for name, provider in list(_providers.items()):
            try:
                yield from provider()
            except Exception:
                log.exception("metrics provider %s failed", name)


def render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Providers())
    return generate_latest(registry)


# ---- the built-in providers ------------------------------------------------------------


@register
def fleet_gauges() -> Iterator[Metric]:
    from django.db.models import Count

    workers = GaugeMetricFamily("chunkpilot_fleet_workers", "Workers by state and pool.", labels=["state", "pool"])
    counts = Worker.objects.values_list("state", "pool__name").annotate(n=Count("id"))
    seen = set()
    for state, pool, n in counts:
        workers.add_metric([WorkerState(state).label, pool or ""], n)
        seen.add(WorkerState(state).label)
    for state in WorkerState:  # every state present, so rules can compare against 0
        if state.label not in seen:
            workers.add_metric([state.label, ""], 0)
    yield workers
    pools = GaugeMetricFamily("chunkpilot_fleet_pools", "Pools defined.")
    pools.add_metric([], Pool.objects.count())
    yield pools
    drifting = GaugeMetricFamily(
        "chunkpilot_fleet_workers_drifting", "Workers not running their desired revision past the grace period."
    )
    drifting.add_metric([], Worker.objects.drifting().count())
    yield drifting


@register
def scrape_gauges() -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "chunkpilot_worker_scrape_up", "1 if the worker's last scrape answered.", labels=["worker", "pool"]
    )
    duration = GaugeMetricFamily(
        "chunkpilot_worker_scrape_duration_seconds", "How long the worker's last scrape took.", labels=["worker"]
    )
    for s in ScrapeStatus.objects.select_related("worker__pool"):
        pool = s.worker.pool.name if s.worker.pool else ""
        up.add_metric([s.worker.name, pool], 1.0 if s.up else 0.0)
        if s.last_duration_seconds is not None:
            duration.add_metric([s.worker.name], s.last_duration_seconds)
    yield up
    yield duration
    latest = ScrapeRound.latest()
    if latest is not None:
        last = GaugeMetricFamily("chunkpilot_scrape_last_round_timestamp_seconds", "When the last scrape round began.")
        last.add_metric([], latest.started_at.timestamp())
        yield last
    objectives = ServiceObjectives.current()
    for name, value, doc in (
        ("chunkpilot_objective_ttft_seconds", objectives.ttft_seconds, "Goodput's TTFT objective."),
        ("chunkpilot_objective_tpot_seconds", objectives.tpot_seconds, "Goodput's TPOT objective."),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        yield g


@register
def routing_gauges() -> Iterator[Metric]:
    """Traffic shares as rollouts move them: the canary's weight over time."""
    weight = GaugeMetricFamily(
        "chunkpilot_routing_weight_basis_points",
        "Share of a model's traffic routed to a pool (10000 = all).",
        labels=["model", "pool", "role"],
    )
    for model, pool, role, bp in RoutingPool.objects.values_list("table__model", "pool__name", "role", "weight_bp"):
        weight.add_metric([model, pool, role], bp)
    yield weight
    epoch = GaugeMetricFamily("chunkpilot_routing_epoch", "The routing table's epoch.", labels=["model"])
    for model, value in RoutingTable.objects.values_list("model", "epoch"):
        epoch.add_metric([model], value)
    yield epoch


@register
def gateway_stream_gauges() -> Iterator[Metric]:
    """Streams in flight that went silent, as every live gateway's liveness
    record reports them (Redis, refreshed each GATEWAY_HEARTBEAT_SECONDS):
    what the shipped ChunkpilotCanaryStreamsSilent alert watches."""
    gateways = bus.live_gateways()
    silent = GaugeMetricFamily(
        "chunkpilot_gateway_streams_silent",
        "Streams in flight with no token for more than GATEWAY_STREAM_SILENCE_SECONDS, over all gateways.",
        labels=["model", "cohort", "pool", "worker"],
    )
    for item in bus.silent_streams(gateways):
        silent.add_metric([item["model"], item["cohort"], item["pool"], item["worker"]], item["streams"])
    yield silent
    longest = GaugeMetricFamily(
        "chunkpilot_gateway_stream_longest_silence_seconds",
        "The longest time any stream in flight on any gateway has gone without a token.",
    )
    longest.add_metric([], max((float(g.streams.get("longest_silence_seconds") or 0.0) for g in gateways), default=0.0))
    yield longest
