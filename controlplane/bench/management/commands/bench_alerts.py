"""``python manage.py bench_alerts``: one evaluation cycle at fleet scale.

Generates 50 workers x 1 h of 5-second snapshots with the metrics
benchmark's generator (stable and canary pools), a routing table over
them, the gateway's request log for the hour, and 200 alert rules mixing
every kind of figure (scraped, request log, fleet), windows from 1 minute
to 1 hour, every grouping, selectors and canary-vs-stable ratios. Then it
times evaluation cycles: the first (every alert row is new), then one per
tick after it over data that keeps coming (the windows slide, values
change, alerts move on).

The shipped rules are switched off while it runs and put back after.
Everything it makes is named ``bench-*`` / ``Bench*`` and deleted at the end
unless ``--keep``. Quote figures from PostgreSQL.
"""

from __future__ import annotations

import cProfile
import io
import itertools
import os
import pstats
import statistics
import time
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from django.core.management.base import BaseCommand
from django.db import connection
from django.utils import timezone

from controlplane.alerts import conf, evaluation
from controlplane.alerts.models import Alert, AlertRule
from controlplane.bench.management.commands.bench_metrics import PREFIX
from controlplane.bench.management.commands.bench_metrics import Command as MetricsBench
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog, RoutingPool, RoutingTable

RULE_PREFIX = "Bench"
TABLE_MODEL = f"{PREFIX}model"

SCRAPED = [
    "ttft_p99",
    "itl_p99",
    "stall_p99",
    "tpot_p99",
    "prefill_wait_p99",
    "kv_fragmentation",
    "memory_peak_to_mean",
    "requests_per_second",
    "prefix_cache_hit_rate",
    "queue_time_p99",
]
REQUESTS = ["client_ttft_p99", "client_stall_p99", "client_tpot_p99", "error_rate", "goodput_ratio"]
FLEET = ["worker_missing", "profile_drift_seconds"]
WINDOWS = [60.0, 300.0, 900.0, 3600.0]


class Command(BaseCommand):
    help = "Benchmark alert evaluation: 200 rules over 50 workers, seconds per cycle."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--rules", type=int, default=200)
        parser.add_argument("--workers", type=int, default=50)
        parser.add_argument("--cycles", type=int, default=10, help="steady-state cycles to time")
        parser.add_argument("--keep", action="store_true", help="leave the generated data in place")
        parser.add_argument("--seed", type=int, default=11)
        parser.add_argument("--profile", action="store_true", help="print where the steady cycles spend their time")
        parser.add_argument(
            "--healthy",
            action="store_true",
            help="thresholds nothing crosses: a quiet fleet (default: a storm, ~2000 alerts active)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        if connection.vendor != "postgresql":
            self.stderr.write(self.style.WARNING("not PostgreSQL: the figure is quoted for PostgreSQL"))
        interval = conf.ALERT_EVAL_INTERVAL.get()
        now = evaluation.tick_of(timezone.now())
        # Data runs to the last cycle's tick, so every cycle sees fresh windows.
        data_end = now + timedelta(seconds=interval * opts["cycles"])
        metrics = MetricsBench()
        metrics.stdout, metrics.stderr = self.stdout, self.stderr
        others = list(
            AlertRule.objects.filter(enabled=True).exclude(name__startswith=RULE_PREFIX).values_list("pk", flat=True)
        )
        self.cleanup(metrics)
        try:
            AlertRule.objects.filter(pk__in=others).update(enabled=False)
            started = time.perf_counter()
            rows = metrics.generate(data_end, opts["workers"], 1.0, 5.0, opts["seed"])
            num_requests = self.generate_requests(data_end, opts["seed"])
            self.routing_table()
            rules = self.make_rules(opts["rules"], opts["seed"], healthy=opts["healthy"])
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    for table in ("metrics_snapshot", "metrics_rollup", "gateway_requestlog", "alerts_alert"):
                        cursor.execute(f"VACUUM ANALYZE {table}")
            self.stdout.write(
                f"generated {rows} snapshots, {num_requests} logged requests and {rules} rules "
                f"in {time.perf_counter() - started:.1f} s"
            )
            self.time_cycles(now, interval, opts["cycles"], opts["profile"])
        finally:
            AlertRule.objects.filter(pk__in=others).update(enabled=True)
            if not opts["keep"]:
                self.cleanup(metrics)

    # ---- data ---------------------------------------------------------------------------

    def cleanup(self, metrics: MetricsBench) -> None:
        Alert.objects.filter(rule__name__startswith=RULE_PREFIX).delete()
        AlertRule.objects.filter(name__startswith=RULE_PREFIX).delete()
        RequestLog.objects.filter(model=TABLE_MODEL).delete()
        RoutingTable.objects.filter(model=TABLE_MODEL).delete()
        metrics.cleanup()

    def routing_table(self) -> None:
        table = RoutingTable.objects.create(model=TABLE_MODEL)
        for role, weight in (("canary", 2000), ("stable", 8000)):
            RoutingPool.objects.create(
                table=table, pool=Pool.objects.get(name=f"{PREFIX}{role}"), role=role, weight_bp=weight
            )

    def generate_requests(self, now: datetime, seed: int) -> int:
        """An hour of the gateway's log: 10 requests/s, canary a little slower."""
        rng = np.random.default_rng(seed)
        workers = list(Worker.objects.filter(name__startswith=PREFIX).select_related("pool"))
        count = 36_000
        offsets = np.sort(rng.uniform(0, 3600, count))
        rows = []
        for i, offset in enumerate(offsets):
            w = workers[i % len(workers)]
            assert w.pool is not None
            cohort = "canary" if w.pool.name.endswith("canary") else "stable"
            ttft = float(rng.lognormal(np.log(0.3 if cohort == "stable" else 0.45), 0.6))
            failed = rng.random() < 0.01
            rows.append(
                RequestLog(
                    request_id=f"{PREFIX}{i}",
                    created_at=now - timedelta(seconds=3600 - float(offset)),
                    model=TABLE_MODEL,
                    cohort=cohort,
                    pool=w.pool,
                    worker=w,
                    prompt_tokens=int(rng.integers(16, 8000)),
                    output_tokens=128,
                    ttft_seconds=ttft,
                    max_gap_seconds=ttft / 2,
                    tpot_seconds=float(rng.lognormal(np.log(0.03), 0.3)),
                    e2e_seconds=ttft + 4,
                    status=503 if failed else 200,
                    stream=True,
                )
            )
        RequestLog.objects.bulk_create(rows, batch_size=5000)
        return count

    def make_rules(self, count: int, seed: int, *, healthy: bool = False) -> int:
        """A mix an operator might write: every figure kind, window, grouping."""
        rng = np.random.default_rng(seed)
        figures = itertools.cycle(SCRAPED + REQUESTS + FLEET)
        made = []
        for i in range(count):
            figure = next(figures)
            window = WINDOWS[i % len(WINDOWS)]
            fields: dict[str, Any] = {
                "figure": figure,
                "window_seconds": window,
                "comparator": ">",
                "for_seconds": float(rng.choice([0, 60, 300])),
                "no_data_state": "nodata",
            }
            kind = i % 5
            if figure in FLEET:
                fields.update(group_by=["worker", "pool", "fleet"][i % 3], threshold=0.0)
            elif kind == 0:
                fields.update(group_by="worker")
            elif kind == 1:
                fields.update(group_by="pool")
            elif kind == 2:
                fields.update(group_by="cohort")
            elif kind == 3:
                fields.update(group_by="worker", selector={"pool": f"{PREFIX}stable"})
            else:
                fields.update(
                    group_by="pool",
                    selector={"cohort": "canary"},
                    compare_to="stable",
                    threshold=1.1,
                    action="abort_rollout",
                    severity="critical",
                )
            fields.setdefault("threshold", float(rng.choice([0.0, 0.05, 0.5, 1.0])))
            if healthy:
                fields.update(threshold=1e6, no_data_state="ok")
            rule = AlertRule(name=f"{RULE_PREFIX}{i:03d}", **fields)
            rule.full_clean()
            made.append(rule)
        AlertRule.objects.bulk_create(made)
        return len(made)

    # ---- timing ----------------------------------------------------------------------------

    def time_cycles(self, now: datetime, interval: float, cycles: int, profile: bool) -> None:
        first = evaluation.evaluate(now)
        if first.errors:
            self.stderr.write(f"rules that failed: {first.errors}")
        num_active = Alert.objects.filter(rule__name__startswith=RULE_PREFIX, state__gte=2).count()
        self.stdout.write(
            f"first cycle: {first.num_rules} rules in {first.seconds * 1000:.0f} ms, of which reading figures "
            f"{first.read_seconds * 1000:.0f} ms ({len(first.transitions)} transitions, "
            f"{first.num_alerts_written} alert rows written, {num_active} active)"
        )
        results, cpu = [], []
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        for k in range(1, cycles + 1):
            cpu_started = time.process_time()
            result = evaluation.evaluate(now + timedelta(seconds=interval * k))
            cpu.append(time.process_time() - cpu_started)
            assert result.num_rules == first.num_rules, result
            results.append(result)
        if profiler is not None:
            profiler.disable()
            buffer = io.StringIO()
            pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(30)
            self.stdout.write(buffer.getvalue())
        durations = [r.seconds for r in results]
        reads = [r.read_seconds for r in results]
        writes = [r.num_alerts_written for r in results]
        self.stdout.write(
            f"next {cycles} cycles, one tick apart: median {statistics.median(durations) * 1000:.0f} ms, "
            f"max {max(durations) * 1000:.0f} ms per cycle of {first.num_rules} rules (goal < 1000 ms); "
            f"reading figures median {statistics.median(reads) * 1000:.0f} ms; "
            f"median {statistics.median(writes):.0f} alert rows written per cycle"
        )
        self.stdout.write(
            f"  this process's CPU per cycle: median {statistics.median(cpu) * 1000:.0f} ms (the rest of the wall "
            f"time is the database and waiting for a core; load average now {os.getloadavg()[0]:.1f})"
        )
