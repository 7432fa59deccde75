"""What ``bench_fleet`` measures with, apart from driving the stack: CPU time
per process tree, rows written to PostgreSQL, and the cost model that turns
figures at 50-200 workers into cores and database for 1,000 and 10,000.

The cost model is per unit of work, not per worker: web CPU per heartbeat
handled, Celery CPU per worker scraped, gateway CPU per request, rows per
heartbeat and per scrape. On a machine where the simulated workers
themselves run short of CPU, they heartbeat late and miss scrapes; a figure
per worker would then charge the control plane less than it costs, a figure
per unit of work done does not. A loop "misses its interval" where one
process's share of it reaches the interval (or the scrape timeout).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from django.db import connection

from controlplane.fleet.health import fleet_heartbeat_interval

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0-1); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def session_cpu_seconds(leader_pids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, float]:
    """User + system CPU seconds of every live process in each leader's
    session (the launcher starts each process in a session of its own, so
    this counts the children it forks too: uvicorn's, Celery's)."""
    wanted = set(leader_pids)
    out = dict.fromkeys(wanted, 0.0)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # The command name may hold spaces and parentheses; the fields after the last ")" do not.
        rest = stat[stat.rfind(")") + 2 :].split()
        session = int(rest[3])
        if session in wanted:
            out[session] += (int(rest[11]) + int(rest[12])) / CLOCK_TICKS
    return out


def rows_written() -> dict[str, int]:
    """Rows inserted, updated and deleted so far per table of this database
    (PostgreSQL's cumulative statistics; each backend flushes its counts
    within about a second of going idle, so read them over a minute, not a
    second)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables")
        return {name: int(n) for name, n in cursor.fetchall()}


def database_bytes() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_database_size(current_database())")
        return int(cursor.fetchone()[0])


@dataclass
class SizeFigures:
    """One fleet size's figures, as the report prints them."""

    workers: int
    measured_seconds: float
    heartbeats_per_second: float = math.nan
    heartbeats_expected_per_second: float = math.nan
    heartbeat_p99_ms: float = math.nan
    scrape_interval_seconds: float = math.nan
    scrape_timeout_seconds: float = math.nan
    num_scrape_rounds: int = 0
    scrape_round_p50_seconds: float = math.nan
    scrape_round_max_seconds: float = math.nan
    scrape_failed_per_round: float = math.nan
    scrape_round_gap_max_seconds: float = math.nan
    panel_ms: float = math.nan
    advisor_page_ms: float = math.nan
    advisor_refresh_ms: float = math.nan
    fleet_page_ms: float = math.nan
    rollouts_page_ms: float = math.nan
    figures_page_ms: float = math.nan
    page_cpu_ms: dict[str, float] = field(default_factory=dict)  # by URL: CPU in the serving process
    prometheus_targets_up: float = math.nan  # --prometheus: the same fleet scraped by Prometheus
    prometheus_scrape_avg_ms: float = math.nan
    prometheus_scrape_max_ms: float = math.nan
    prometheus_panel_ms: float = math.nan
    prometheus_panel_cpu_ms: float = math.nan
    alert_cycle_ms: float = math.nan
    alert_interval_seconds: float = math.nan
    rollout_step_seconds: float = math.nan
    num_canary_workers: int = 0
    abort_acked_ms: float = math.nan  # the P99 over the size's aborts (one abort: that one)
    abort_all_on_stable_seconds: float = math.nan  # the slowest of them
    abort_acked_samples_ms: list[float] = field(default_factory=list)  # every abort's, in order
    num_requests: int = 0
    num_request_errors: int = 0
    num_marked_unhealthy: int = 0  # live workers the health sweep marked unhealthy in the window
    num_heartbeats: int = 0  # the fleet's and the probes', in the window
    num_worker_scrapes: int = 0  # workers scraped successfully, over the window's rounds
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # per process, over the window
    workers_cpu_seconds: float = math.nan
    rows_per_minute: float = math.nan
    rows_by_table: dict[str, float] = field(default_factory=dict)  # rows per minute
    database_bytes_per_minute: float = math.nan

    def cpu_per_worker_minute(self, name: str) -> float:
        return self.cpu_seconds[name] / self.workers / (self.measured_seconds / 60)

    def cores(self, name: str) -> float:
        return self.cpu_seconds[name] / self.measured_seconds


PROCESSES = ("web", "celery", "beat", "gateway")
# Every figure the report prints for each size (the small-scale test checks them all).
FIGURES = (
    "heartbeats_per_second",
    "heartbeat_p99_ms",
    "scrape_round_p50_seconds",
    "scrape_round_max_seconds",
    "panel_ms",
    "advisor_page_ms",
    "advisor_refresh_ms",
    "fleet_page_ms",
    "rollouts_page_ms",
    "figures_page_ms",
    "alert_cycle_ms",
    "rollout_step_seconds",
    "abort_acked_ms",
    "abort_all_on_stable_seconds",
    "workers_cpu_seconds",
    "rows_per_minute",
)


@dataclass(frozen=True)
class Projection:
    workers: int
    cores: dict[str, float]  # per process kind, at this size
    rows_per_second: float
    database_gib_per_day: float
    scrape_round_cpu_seconds: float  # one round's CPU, whichever Celery processes share its shards


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


@dataclass(frozen=True)
class CostModel:
    web_seconds_per_heartbeat: float
    celery_seconds_per_scrape: float  # all of the Celery worker's CPU, charged to the scrapes
    gateway_seconds_per_request: float
    beat_cores: float
    rows_per_heartbeat: float
    rows_per_scrape: float
    bytes_per_scrape: float
    heartbeat_interval_seconds: float
    scrape_interval_seconds: float
    scrape_timeout_seconds: float
    requests_per_worker_second: float
    alert_cycle_seconds_per_worker: float
    alert_interval_seconds: float
    # The control plane's scaling of the heartbeat interval with the fleet (infinite: none).
    heartbeat_target_rate: float = math.inf
    heartbeat_interval_max_seconds: float = math.inf

    def heartbeat_interval_at(self, workers: int) -> float:
        """The interval a fleet of ``workers`` is told (``health.fleet_heartbeat_interval``)."""
        if not math.isfinite(self.heartbeat_target_rate):
            return self.heartbeat_interval_seconds
        return fleet_heartbeat_interval(
            workers,
            target_rate=self.heartbeat_target_rate,
            floor_seconds=self.heartbeat_interval_seconds,
            ceiling_seconds=self.heartbeat_interval_max_seconds,
        )

    @classmethod
    def fit(
        cls,
        sizes: Sequence[SizeFigures],
        *,
        heartbeat_interval_seconds: float,
        heartbeat_target_rate: float = math.inf,
        heartbeat_interval_max_seconds: float = math.inf,
    ) -> CostModel:
        def total(get: Callable[[SizeFigures], float]) -> float:
            return sum(get(s) for s in sizes)

        heartbeats = total(lambda s: s.num_heartbeats)
        scrapes = total(lambda s: s.num_worker_scrapes)
        seconds = total(lambda s: s.measured_seconds)
        last = sizes[-1]
        worker_rows = total(lambda s: s.rows_by_table.get("fleet_worker", 0.0) * s.measured_seconds / 60)
        metric_rows = total(
            lambda s: sum(n for t, n in s.rows_by_table.items() if t.startswith("metrics_")) * s.measured_seconds / 60
        )
        return cls(
            web_seconds_per_heartbeat=_ratio(total(lambda s: s.cpu_seconds["web"]), heartbeats),
            celery_seconds_per_scrape=_ratio(total(lambda s: s.cpu_seconds["celery"]), scrapes),
            gateway_seconds_per_request=_ratio(
                total(lambda s: s.cpu_seconds["gateway"]), total(lambda s: s.num_requests)
            ),
            beat_cores=_ratio(total(lambda s: s.cpu_seconds["beat"]), seconds),
            rows_per_heartbeat=_ratio(worker_rows, heartbeats),
            rows_per_scrape=_ratio(metric_rows, scrapes),
            bytes_per_scrape=_ratio(total(lambda s: s.database_bytes_per_minute * s.measured_seconds / 60), scrapes),
            heartbeat_interval_seconds=heartbeat_interval_seconds,
            scrape_interval_seconds=last.scrape_interval_seconds,
            scrape_timeout_seconds=last.scrape_timeout_seconds,
            requests_per_worker_second=_ratio(
                total(lambda s: s.num_requests), total(lambda s: s.workers * s.measured_seconds)
            ),
            alert_cycle_seconds_per_worker=max(s.alert_cycle_ms / 1000 / s.workers for s in sizes),
            alert_interval_seconds=last.alert_interval_seconds,
            heartbeat_target_rate=heartbeat_target_rate,
            heartbeat_interval_max_seconds=heartbeat_interval_max_seconds,
        )

    def project(self, workers: int, *, heartbeat_interval_seconds: float | None = None) -> Projection:
        """The cost at ``workers``, heartbeating every ``heartbeat_interval_seconds``
        (None: the interval the control plane tells a fleet that size)."""
        heartbeats = workers / (heartbeat_interval_seconds or self.heartbeat_interval_at(workers))
        scrapes = workers / self.scrape_interval_seconds
        return Projection(
            workers=workers,
            cores={
                "web": heartbeats * self.web_seconds_per_heartbeat,
                "celery": scrapes * self.celery_seconds_per_scrape,
                "beat": self.beat_cores,
                "gateway": workers * self.requests_per_worker_second * self.gateway_seconds_per_request,
            },
            rows_per_second=heartbeats * self.rows_per_heartbeat + scrapes * self.rows_per_scrape,
            database_gib_per_day=scrapes * self.bytes_per_scrape * 86400 / 2**30,
            scrape_round_cpu_seconds=workers * self.celery_seconds_per_scrape,
        )

    def web_process_full_at(self, limit: int = 1_000_000) -> float:
        """The smallest fleet whose heartbeats fill one web process's core, at
        the interval that fleet is told (scaled: the rate stays near the
        target until the interval's ceiling, then grows again)."""
        cost = self.web_seconds_per_heartbeat
        if not cost > 0:
            return math.inf
        if not math.isfinite(self.heartbeat_target_rate):
            return self.heartbeat_interval_seconds / cost
        for workers in range(10, limit + 1, 10):
            if workers / self.heartbeat_interval_at(workers) * cost >= 1.0:
                return float(workers)
        return math.inf

    def misses(self) -> list[tuple[str, float]]:
        """Each loop and the fleet size where one process of it misses its
        interval, first first. A scrape round runs in shards, one Celery task
        each, spread over the Celery processes: the figure is what one
        process's share holds within the scrape timeout, so P processes hold
        P times it."""
        out = [
            (
                "one Celery process's share of a scrape round reaches the scrape timeout",
                _ratio(self.scrape_timeout_seconds, self.celery_seconds_per_scrape),
            ),
            (
                "one web process's heartbeats fill a core",
                self.web_process_full_at(),
            ),
            (
                "one alert cycle reaches ALERT_EVAL_INTERVAL",
                _ratio(self.alert_interval_seconds, self.alert_cycle_seconds_per_worker),
            ),
        ]
        return sorted(((what, at if math.isfinite(at) else math.inf) for what, at in out), key=lambda item: item[1])
