"""The metrics pipeline's tunables (``controlplane.conf``: settings, else environment, else these)."""

from __future__ import annotations

from controlplane.conf import Tunable

SCRAPE_INTERVAL = Tunable(
    "SCRAPE_INTERVAL",
    5.0,
    "seconds between scrapes of every worker's `/metrics` "
    "(with `METRICS_BACKEND=prometheus`: between the live metric pages' re-reads of Prometheus)",
)
SCRAPE_TIMEOUT_SECONDS = Tunable(
    "SCRAPE_TIMEOUT_SECONDS",
    0.0,
    "one scrape round's timeout; 0: derived from the interval",
    shown_default="0.8 × interval (0.5–10)",
)
SCRAPE_SHARD_SIZE = Tunable(
    "SCRAPE_SHARD_SIZE",
    250,
    "the most workers one Celery task of a scrape round fetches, parses and stores (about 6 ms of CPU each, "
    "1.6 s a full shard); a larger fleet's round is split into shards that several Celery processes share. "
    "Up to this many workers a round holds one Celery process, and the others stay free for the rollout "
    "reconciler (an abort waits for a free process)",
)

METRICS_BACKEND = Tunable(
    "METRICS_BACKEND",
    "database",
    "where scraped figures come from: `database` (the control plane scrapes every worker itself) or "
    "`prometheus` (read from `PROMETHEUS_URL`'s HTTP API; the control plane stops scraping)",
)
PROMETHEUS_URL = Tunable(
    "PROMETHEUS_URL",
    "",
    "the Prometheus (or Thanos, Mimir) HTTP API the `prometheus` backend reads, e.g. `http://prometheus:9090`",
)
PROMETHEUS_TIMEOUT_SECONDS = Tunable(
    "PROMETHEUS_TIMEOUT_SECONDS",
    5.0,
    "one Prometheus query's timeout; slower is 'metrics backend unavailable'",
)
