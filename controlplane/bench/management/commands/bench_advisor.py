"""``python manage.py bench_advisor``: one advisor report at fleet scale.

Reuses the metrics benchmark's data (``bench_metrics``: 50 workers x 24 h of
5-second snapshots and their minute rollups, ``bench-*``), adds a day of the
gateway's request log for them, then times the advisor's report over the
last 24 h for the whole 50-worker fleet and for its 40-worker stable pool:
wall-clock and CPU (this process plus the local database backend), median
and max over ``--repeat`` computations. Goal: under 500 ms server time.

Everything it makes is named ``bench-*`` and deleted at the end unless
``--keep``; ``--reuse`` keeps data already there.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import numpy as np
from django.core.management.base import BaseCommand
from django.db import connection
from django.utils import timezone

from controlplane.advisor.models import compute
from controlplane.bench.management.commands import bench_metrics
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog
from controlplane.metrics.models import Target

PREFIX = bench_metrics.PREFIX


class Command(BaseCommand):
    help = "Benchmark the advisor: a 24-h report for 50 workers (the metrics benchmark's data plus a request log)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--workers", type=int, default=50)
        parser.add_argument("--hours", type=float, default=24.0)
        parser.add_argument("--requests", type=int, default=200_000, help="request-log rows over the window")
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--keep", action="store_true")
        parser.add_argument("--reuse", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        metrics = bench_metrics.Command(stdout=self.stdout, stderr=self.stderr)
        now = timezone.now().replace(microsecond=0)
        if not (opts["reuse"] and Target.objects.filter(worker_name__startswith=PREFIX).exists()):
            metrics.cleanup()
            started = time.perf_counter()
            rows = metrics.generate(now, opts["workers"], opts["hours"], 5.0, 7)
            self.stdout.write(f"generated {rows} snapshots in {time.perf_counter() - started:.1f} s")
            self.stdout.write(f"caught up to now with {metrics.catch_up(5.0)} live scrape rounds")
        if not RequestLog.objects.filter(request_id__startswith=PREFIX).exists():
            started = time.perf_counter()
            self._request_log(timezone.now(), opts["hours"], opts["requests"])
            self.stdout.write(f"logged {opts['requests']} requests in {time.perf_counter() - started:.1f} s")
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("VACUUM ANALYZE gateway_requestlog")
        window = opts["hours"] * 3600
        try:
            for label, pool in (
                ("fleet (50 workers)", None),
                ("stable pool (40 workers)", Pool.objects.get(name=f"{PREFIX}stable")),
            ):
                wall, cpu = [], []
                for i in range(opts["repeat"] + 1):
                    report, elapsed, cpu_elapsed = metrics._timed(lambda p=pool: compute(p, window, timezone.now()))
                    if i:  # the first warms caches
                        wall.append(elapsed)
                        cpu.append(cpu_elapsed)
                self.stdout.write(
                    f"advisor report, {label}, {opts['hours']:g} h window, {opts['repeat']} runs (goal < 500 ms):\n"
                    f"  wall-clock median {statistics.median(wall) * 1000:.0f} ms, max {max(wall) * 1000:.0f} ms; "
                    f"CPU (web + database) median {statistics.median(cpu) * 1000:.0f} ms, "
                    f"max {max(cpu) * 1000:.0f} ms; verdict {report['overall']}, "
                    f"{report['questions'][1]['num_samples']} scrape samples, "
                    f"{report['questions'][0]['num_samples']} requests read"
                )
        finally:
            if not opts["keep"]:
                RequestLog.objects.filter(request_id__startswith=PREFIX).delete()
                metrics.cleanup()

    def _request_log(self, now: Any, hours: float, count: int) -> None:
        rng = np.random.default_rng(11)
        workers = list(Worker.objects.filter(name__startswith=PREFIX).select_related("pool"))
        offsets = np.sort(rng.uniform(0, hours * 3600, size=count))
        prompts = np.where(rng.random(count) < 0.1, rng.integers(8000, 30000, count), rng.integers(50, 800, count))
        ttft = 0.05 + prompts * 2e-5 * rng.lognormal(0, 0.3, count)
        rows = []
        for i in range(count):
            w = workers[i % len(workers)]
            rows.append(
                RequestLog(
                    request_id=f"{PREFIX}{i}",
                    created_at=now - timedelta(seconds=float(offsets[-1 - i])),
                    model="bench",
                    cohort="stable",
                    pool=w.pool,
                    worker=w,
                    prompt_tokens=int(prompts[i]),
                    cached_tokens=int(prompts[i] * 0.3),
                    output_tokens=120,
                    ttft_seconds=float(ttft[i]),
                    max_gap_seconds=0.05,
                    tpot_seconds=0.02,
                    e2e_seconds=float(ttft[i]) + 2.4,
                    status=200,
                    stream=True,
                )
            )
            if len(rows) == 10_000:
                RequestLog.objects.bulk_create(rows)
                rows = []
        RequestLog.objects.bulk_create(rows)
