"""The gateway's own ``/metrics``: what clients saw, per model and cohort.

Names follow the ``chunkpilot:*`` vocabulary (docs/architecture.md, "Metrics"), with the bucket
boundaries of the workers' matching vLLM histograms so a dashboard can put
the gateway's view beside the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.server.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    MAX_GAP_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model", "cohort"]


class _Live(Collector):
    """Gauges read at scrape time from the gateway's own state."""

    def __init__(self, epochs: Callable[[], dict[str, int]], outstanding: Callable[[], dict[str, int]]):
        self._epochs = epochs
        self._outstanding = outstanding

    def collect(self) -> Iterator[Metric]:
        epoch = GaugeMetricFamily(
            "chunkpilot:gateway_routing_epoch", "Routing table epoch this gateway applied.", labels=["model"]
        )
        for model, value in sorted(self._epochs().items()):
            epoch.add_metric([model], value)
        yield epoch
        outstanding = GaugeMetricFamily(
            "chunkpilot:gateway_outstanding_requests",
            "Requests this gateway has in flight, per worker.",
            labels=["worker"],
        )
        for worker, value in sorted(self._outstanding().items()):
            outstanding.add_metric([worker], value)
        yield outstanding


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "chunkpilot:gateway_requests", "Client requests by outcome.", [*LABELS, "status"], registry=r
        )
        self.ttft = Histogram(
            "chunkpilot:gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first generated text, streamed requests.",
            LABELS,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "chunkpilot:gateway_e2e_request_latency_seconds",
            "Arrival at the gateway to the end of the response.",
            LABELS,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.max_gap = Histogram(
            "chunkpilot:gateway_request_max_gap_seconds",
            "Each streamed request's largest gap between two token events (stalls).",
            LABELS,
            buckets=MAX_GAP_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "chunkpilot:gateway_time_per_output_token_seconds",
            "Each streamed request's time per output token after the first.",
            LABELS,
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "chunkpilot:gateway_upstream_errors",
            "Failed attempts on a worker: connect (before any byte, retried elsewhere), "
            "status (the worker did not admit the request: 429 queue_full or 503 worker_*, retried elsewhere), "
            "timeout (no response head in time, 504) or stream (the reply broke off after it began).",
            ["pool", "worker", "kind"],
            registry=r,
        )
        self.log_dropped = Counter(
            "chunkpilot:gateway_request_log_dropped",
            "Request-log rows dropped because the database fell too far behind.",
            registry=r,
        )

    def watch(self, epochs: Callable[[], dict[str, int]], outstanding: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_Live(epochs, outstanding))

    def render(self) -> bytes:
        return generate_latest(self.registry)
