"""``python manage.py bench_metrics``: the metrics store at fleet scale.

Generates 50 workers x 24 h of 5-second snapshots (864 000 rows, plus their
minute rollups) of realistic counters and histograms in the configured
database — PostgreSQL is what the figures are quoted for — then times:

* the two figures pages (server time: view + queries + template) over
  ``--repeat`` renders each, wall-clock and CPU (``time.process_time`` plus
  the local database backend's): the four-figure panel, 1 h of 1-minute
  points per cohort, and the ``/figures/`` overview, 1 h of the fleet's;
* the query endpoint (``/api/v1/metrics/query``) over a mix of figures,
  windows (1m .. 24h) and groupings: P50 and P95 over ``--queries`` calls.

Everything it makes is named ``bench-*`` and deleted at the end unless
``--keep``; ``--reuse`` skips generation when the data is already there.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import zlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import numpy as np
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.utils import timezone

from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import catalogue, query, scrape
from controlplane.metrics.models import (
    CounterReset,
    Rollup,
    SeriesLayout,
    Snapshot,
    Target,
    minute_of,
    pack,
    raw_bytes,
    unpack,
)
from dashboards.metrics.views import overview, panel
from workers.server.metrics import MetricsExporter

PREFIX = "bench-"


def _example_layout() -> catalogue.Layout:
    """The layout a real reference worker serves (its exporter's bucket bounds)."""
    return catalogue.parse(MetricsExporter(model_name="bench", max_model_len=32768).render().decode()).layout


class Command(BaseCommand):
    help = "Benchmark the metrics store: 50 workers x 24 h of 5-s snapshots; panel and query endpoint timings."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--workers", type=int, default=50)
        parser.add_argument("--hours", type=float, default=24.0)
        parser.add_argument("--interval", type=float, default=5.0, help="seconds between snapshots")
        parser.add_argument("--queries", type=int, default=200, help="query endpoint calls to time")
        parser.add_argument("--repeat", type=int, default=20, help="panel renders to time")
        parser.add_argument("--keep", action="store_true", help="leave the generated data in place")
        parser.add_argument("--reuse", action="store_true", help="use bench data already there")
        parser.add_argument("--seed", type=int, default=7)
        parser.add_argument(
            "--against-raw",
            action="store_true",
            help="also time each page with its charts read from raw scrapes, render by render, and print the ratio",
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tails: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}

    def handle(self, *args: Any, **opts: Any) -> None:
        self.against_raw = opts["against_raw"]
        if connection.vendor != "postgresql":
            self.stderr.write(self.style.WARNING("not PostgreSQL: the figures are quoted for PostgreSQL"))
        # Scrape times carry the clock's fraction of a second, as a live
        # scraper's do (a scrape on a whole minute would make the charts' reads
        # take the raw path: see query._edge_windows).
        now = timezone.now()
        have = Target.objects.filter(worker_name__startswith=PREFIX).exists()
        if not (opts["reuse"] and have):
            self.cleanup()
            started = time.perf_counter()
            rows = self.generate(now, opts["workers"], opts["hours"], opts["interval"], opts["seed"])
            self.stdout.write(f"generated {rows} snapshots in {time.perf_counter() - started:.1f} s")
            self.stdout.write(f"caught up to now with {self.catch_up(opts['interval'])} live scrape rounds")
        else:
            newest = (
                Target.objects.filter(worker_name__startswith=PREFIX)
                .order_by("-last_at")
                .values_list("last_at", flat=True)
                .first()
            )
            if newest is not None and now - newest > timedelta(minutes=30):
                self.stderr.write(
                    self.style.WARNING(
                        f"the reused data ends {now - newest} ago: catching up through so many rounds takes a while"
                    )
                )
            self._load_tails()
            self.stdout.write(f"caught up to now with {self.catch_up(opts['interval'])} live scrape rounds")
        if connection.vendor == "postgresql":
            # What autovacuum does for a live database (catching up rewrites
            # each target and its minute's rollup every round; this machine's
            # test server runs with autovacuum off).
            with connection.cursor() as cursor:
                for table in ("metrics_snapshot", "metrics_rollup", "metrics_target"):
                    cursor.execute(f"VACUUM ANALYZE {table}")
        self.report_storage()
        load = os.getloadavg()
        self.stdout.write(f"load average {load[0]:.1f} on {os.cpu_count()} CPUs (timings are wall-clock)")
        try:
            self.time_panel(opts["repeat"])
            self.time_page("overview (1 h, fleet)", overview, "/figures/", opts["repeat"])
            if self._tails:
                self.catch_up(opts["interval"])
            self.time_queries(opts["queries"], opts["seed"])
        finally:
            if not opts["keep"]:
                self.cleanup()

    # ---- data --------------------------------------------------------------------------

    def cleanup(self) -> None:
        Target.objects.filter(worker_name__startswith=PREFIX).delete()
        Worker.objects.filter(name__startswith=PREFIX).delete()
        Pool.objects.filter(name__startswith=PREFIX).delete()

    def generate(self, now: datetime, num_workers: int, hours: float, interval: float, seed: int) -> int:
        rng = np.random.default_rng(seed)
        layout = _example_layout()
        layout_row = SeriesLayout.for_layout(layout)
        num_samples = int(hours * 3600 / interval)
        times = [now - timedelta(seconds=interval * (num_samples - 1 - i)) for i in range(num_samples)]
        epoch = np.array([t.timestamp() for t in times])
        pools = {
            "stable": Pool.objects.create(name=f"{PREFIX}stable"),
            "canary": Pool.objects.create(name=f"{PREFIX}canary"),
        }
        total_rows = 0
        for w in range(num_workers):
            cohort = "canary" if w % 5 == 0 else "stable"
            worker = Worker.objects.create(
                name=f"{PREFIX}w{w:02d}", url=f"http://bench-{w}.invalid", pool=pools[cohort], state=1
            )
            raw, peak = self._series(rng, layout, num_samples, interval, slow=(cohort == "canary"))
            # Restart one worker in five once, mid-day: a counter reset to fold.
            restart = int(rng.integers(num_samples // 4, 3 * num_samples // 4)) if w % 5 == 1 else None
            if restart is not None:
                raw[restart:, layout.is_counter] -= raw[restart - 1, layout.is_counter]
            offsets = np.zeros(len(layout))
            totals = raw.copy()
            target = Target.objects.create(
                worker=worker,
                worker_name=worker.name,
                pool_name=pools[cohort].name,
                cohort=cohort,
                layout=layout_row,
                first_at=times[0],
                last_at=times[-1],
                num_samples=num_samples,
                last_raw=pack(raw[-1]),
                offsets=pack(offsets),
            )
            if restart is not None:
                # What the scraper's fold does at the drop: add the value before it.
                dropped = layout.is_counter & (raw[restart] < raw[restart - 1])
                offsets = np.where(dropped, raw[restart - 1], 0.0)
                totals[restart:] = raw[restart:] + offsets
                CounterReset.objects.create(target=target, ts=times[restart], offsets=pack(offsets))
                Target.objects.filter(pk=target.pk).update(offsets=pack(offsets))
            total_rows += self._write(target, times, epoch, totals, peak)
            # Where the data ends, for catch_up: the last raw vector and the
            # last minute's average step per scrape.
            self._tails[worker.pk] = (raw[-1].copy(), (raw[-1] - raw[-13]) / 12 * layout.is_counter, float(peak[-1]))
        return total_rows

    def _load_tails(self) -> None:
        """catch_up's starting point from stored data (``--reuse``)."""
        layout = _example_layout()
        for t in Target.objects.filter(worker_name__startswith=PREFIX, worker__isnull=False):
            recent = list(Snapshot.objects.filter(target=t).order_by("-ts").values_list("values", flat=True)[:13])
            if t.worker_id is None or len(recent) < 13 or len(unpack(recent[0])) != len(layout):
                continue
            step = (unpack(recent[0]) - unpack(recent[12])) / 12 * layout.is_counter
            self._tails[t.worker_id] = (unpack(t.last_raw).copy(), step, 0.0)

    def catch_up(self, interval: float) -> int:
        """Generation takes minutes; scrape the generated fleet on through the
        real write path (``scrape.record``) until now, so the timed windows end
        at fresh data as a live fleet's do."""
        layout = _example_layout()
        workers = {w.pk: w for w in Worker.objects.filter(pk__in=list(self._tails)).select_related("pool")}
        targets = {t.worker_id: t for t in Target.objects.filter(worker_id__in=list(workers))}
        rounds = 0
        while True:
            last = max(t.last_at for t in Target.objects.filter(worker_id__in=list(workers)))
            at = last + timedelta(seconds=interval)
            if at > timezone.now():
                return rounds
            parsed = []
            for pk, (raw, step, peak) in self._tails.items():
                raw = raw + step
                self._tails[pk] = (raw, step, peak)
                w, t = workers[pk], targets[pk]
                job = scrape.Job(pk, w.name, w.url, t.pool_name, t.cohort)
                parsed.append((scrape.Fetched(job, "", "", 0.01), catalogue.Scrape(layout, raw, {}), ""))
            scrape.record(at, parsed)
            rounds += 1

    def _series(
        self, rng: np.random.Generator, layout: catalogue.Layout, n: int, interval: float, slow: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Raw cumulative values [n, len(layout)] and the peak-memory gauge [n]."""
        raw = np.zeros((n, len(layout)))
        load = 1 + 0.5 * np.sin(np.linspace(0, 2 * np.pi, n))  # a daily swing
        requests = rng.poisson(8 * load)
        for histogram in catalogue.HISTOGRAMS:
            buckets = layout.buckets(histogram)
            bounds = np.array([b for b, _ in buckets])
            scale = {
                "vllm:time_to_first_token_seconds": 0.3,
                "chunkpilot:time_to_first_token_seconds": 0.3,
                "chunkpilot:request_max_gap_seconds": 0.2,
                "chunkpilot:prefill_chunk_wait_seconds": 0.02,
            }.get(histogram, 0.05) * (1.3 if slow else 1.0)
            token_gaps = ("vllm:inter_token_latency_seconds", "chunkpilot:inter_token_latency_seconds")
            per_scrape = requests * (20 if histogram in token_gaps else 1)
            values = rng.lognormal(np.log(scale), 0.8, size=int(per_scrape.sum()))
            owner = np.repeat(np.arange(n), per_scrape)
            which = np.searchsorted(bounds, values)  # bucket index (le: value <= bound)
            counts = np.zeros((n, len(bounds)))
            np.add.at(counts, (owner, which), 1)
            cumulative = np.cumsum(np.cumsum(counts, axis=1), axis=0)
            for j, (_, position) in enumerate(buckets):
                raw[:, position] = cumulative[:, j]
            sums = np.zeros(n)
            np.add.at(sums, owner, values)
            raw[:, layout.index[f"{histogram}_sum"]] = np.cumsum(sums)
            raw[:, layout.index[f"{histogram}_count"]] = cumulative[:, -1]
        tokens_out = rng.poisson(requests * 120)
        tokens_in = rng.poisson(requests * 900)
        steps = rng.poisson(interval / 0.03, size=n)
        for key, per in (
            ("vllm:request_success_total", requests),
            ("vllm:generation_tokens_total", tokens_out),
            ("vllm:prompt_tokens_total", tokens_in),
            ("vllm:prefix_cache_queries_total", tokens_in),
            ("vllm:prefix_cache_hits_total", (tokens_in * 0.3).astype(int)),
            ("vllm:num_preemptions_total", rng.poisson(0.05, size=n)),
            ("chunkpilot:steps_total", steps),
            ("chunkpilot:step_tokens_total{kind=prefill}", tokens_in),
            ("chunkpilot:step_tokens_total{kind=decode}", tokens_out),
        ):
            raw[:, layout.index[key]] = np.cumsum(per)
        memory = 2e9 * (0.6 + 0.2 * load + 0.05 * rng.standard_normal(n))
        raw[:, layout.index["chunkpilot:memory_byte_seconds_total"]] = np.cumsum(memory * interval)
        raw[:, layout.index["chunkpilot:held_seconds_total"]] = interval * np.arange(1, n + 1)
        raw[:, layout.index["chunkpilot:kv_fragmentation_ratio_seconds_total"]] = np.cumsum(
            np.clip(0.08 + 0.03 * rng.standard_normal(n), 0, 1) * interval
        )
        peak = memory * (1.2 + (0.6 if slow else 0.2) * rng.random(n))
        for key, value in (
            ("chunkpilot:memory_bytes", memory),
            ("chunkpilot:memory_recent_peak_bytes", peak),
            ("chunkpilot:kv_fragmentation_ratio", np.full(n, 0.08)),
            ("vllm:kv_cache_usage_perc", 0.3 * load),
            ("vllm:num_requests_running", 4 * load),
            ("vllm:num_requests_waiting", load),
        ):
            raw[:, layout.index[key]] = value
        return raw, peak

    def _write(
        self, target: Target, times: list[datetime], epoch: np.ndarray, totals: np.ndarray, peak: np.ndarray
    ) -> int:
        packed = [zlib.compress(row.tobytes(), 1) for row in totals]
        head = target.layout.as_layout().head
        heads = [raw_bytes(row[:head]) for row in totals]
        minutes = (epoch // 60).astype(np.int64)
        last_of_minute = np.flatnonzero(np.append(minutes[1:] != minutes[:-1], True))
        first_of_minute = np.append(0, last_of_minute[:-1] + 1)
        snapshot_rows: list[tuple[Any, ...]] = [
            (target.pk, times[i], i + 1, float(peak[i]), packed[i]) for i in range(len(times))
        ]
        rollup_rows: list[tuple[Any, ...]] = [
            (
                target.pk,
                minute_of(times[last]),
                times[last],
                k + 1,
                int(last - first + 1),
                float(peak[first : last + 1].max()),
                packed[last],
                times[first],
                heads[first],
                heads[last],
            )
            for k, (first, last) in enumerate(zip(first_of_minute, last_of_minute, strict=True))
        ]
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    raw_cursor = cursor.cursor
                    with raw_cursor.copy(
                        'COPY metrics_snapshot (target_id, ts, seq, peak_memory_bytes, "values") FROM STDIN'
                    ) as copy:
                        for row in snapshot_rows:
                            copy.write_row(row)
                    with raw_cursor.copy(
                        "COPY metrics_rollup (target_id, minute, last_ts, seq, num_samples, peak_memory_bytes, "
                        '"values", first_ts, head_first, head_last) FROM STDIN'
                    ) as copy:
                        for row in rollup_rows:
                            copy.write_row(row)
            else:
                Snapshot.objects.bulk_create(
                    [
                        Snapshot(target_id=a, ts=b, seq=c, peak_memory_bytes=d, values=e)
                        for a, b, c, d, e in snapshot_rows
                    ],
                    batch_size=2000,
                )
                Rollup.objects.bulk_create(
                    [
                        Rollup(
                            target_id=a,
                            minute=b,
                            last_ts=c,
                            seq=d,
                            num_samples=e,
                            peak_memory_bytes=f,
                            values=g,
                            first_ts=h,
                            head_first=i,
                            head_last=j,
                        )
                        for a, b, c, d, e, f, g, h, i, j in rollup_rows
                    ],
                    batch_size=2000,
                )
        Target.objects.filter(pk=target.pk).update(
            num_rollups=len(rollup_rows),
            rollup_minute=minute_of(times[-1]),
            rollup_peak_bytes=float(peak[first_of_minute[-1] :].max()),
            rollup_num_samples=int(last_of_minute[-1] - first_of_minute[-1] + 1),
        )
        return len(snapshot_rows)

    def report_storage(self) -> None:
        snapshots = Snapshot.objects.filter(target__worker_name__startswith=PREFIX).count()
        rollups = Rollup.objects.filter(target__worker_name__startswith=PREFIX).count()
        line = f"stored: {snapshots} snapshots, {rollups} rollups"
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_total_relation_size('metrics_snapshot'), pg_total_relation_size('metrics_rollup'), "
                    '(SELECT avg(octet_length("values")) FROM (SELECT "values" FROM metrics_snapshot LIMIT 5000) s)'
                )
                snap_bytes, rollup_bytes, avg_blob = cursor.fetchone()
            line += (
                f"; tables {snap_bytes / 2**20:.0f} MiB + {rollup_bytes / 2**20:.0f} MiB; "
                f"{snap_bytes / max(snapshots, 1):.0f} B per snapshot (vector {float(avg_blob or 0):.0f} B packed)"
            )
        self.stdout.write(line)

    # ---- timings ----------------------------------------------------------------------

    def _user(self) -> Any:
        from django.contrib.auth import get_user_model

        user, _ = get_user_model().objects.get_or_create(username=f"{PREFIX}viewer", defaults={"is_superuser": True})
        return user

    # ---- CPU: the server's work, which a busy shared machine does not inflate ----------------

    def _db_pid(self) -> int | None:
        if connection.vendor != "postgresql":
            return None
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = int(cursor.fetchone()[0])
        return pid if os.path.exists(f"/proc/{pid}/stat") else None  # a local database only

    @staticmethod
    def _cpu_seconds(pid: int | None) -> float:
        """This process's CPU plus the database backend's (when local)."""
        total = time.process_time()
        if pid is not None:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def _timed(self, call: Any) -> tuple[Any, float, float]:
        pid = self._db_pid()
        started, cpu_started = time.perf_counter(), self._cpu_seconds(pid)
        result = call()
        return result, time.perf_counter() - started, self._cpu_seconds(pid) - cpu_started

    @staticmethod
    def _p95(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[int(0.95 * (len(ordered) - 1))]

    store = "database"  # whose CPU the timings add to this process's

    def time_panel(self, repeat: int) -> None:
        self.time_page("four-figure panel (1 h, per cohort)", panel, "/figures/panel/", repeat)

    def time_page(self, title: str, view: Any, path: str, repeat: int) -> None:
        """One figures page rendered whole ``repeat`` times, as its view
        answers a GET: wall-clock, this process's CPU (``time.process_time``:
        the web server's share) and that plus the database backend's. With
        ``--against-raw``, each render is followed by one whose charts read
        raw scrapes (``query._edge_windows`` turned off: the read before
        minute rollups kept heads), and the ratio of the medians is printed."""
        from django.test import RequestFactory
        from django_htmx.middleware import HtmxDetails

        factory = RequestFactory()
        user = self._user()
        paths: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
            "rollup heads": contextlib.nullcontext
        }
        if self.against_raw:
            paths["raw scrapes"] = lambda: mock.patch.object(query, "_on_minutes", return_value=False)
        timings: dict[str, dict[str, list[float]]] = {name: {"wall": [], "web": [], "cpu": []} for name in paths}

        def render() -> Any:
            web_started = time.process_time()
            request = factory.get(path, {"group_by": "cohort", "range": "1h"})
            request.user = user
            request.htmx = HtmxDetails(request)  # type: ignore[attr-defined]
            response = view(request)
            if hasattr(response, "render"):
                response.render()
            return response, time.process_time() - web_started

        for i in range(repeat + 1):
            for name, reading in paths.items():
                with reading():
                    (response, web), elapsed, cpu_elapsed = self._timed(render)
                if response.status_code != 200:
                    raise CommandError(f"{path} answered {response.status_code}")
                if i:  # the first render warms caches
                    timings[name]["wall"].append(elapsed)
                    timings[name]["cpu"].append(cpu_elapsed)
                    timings[name]["web"].append(web)
        self.stdout.write(f"{title}, {repeat} renders (goal < 300 ms server time):")
        for name, t in timings.items():
            label = f" [{name}]" if len(paths) > 1 else ""
            self.stdout.write(
                f" {label} wall-clock median {statistics.median(t['wall']) * 1000:.0f} ms, "
                f"max {max(t['wall']) * 1000:.0f} ms; "
                f"CPU web median {statistics.median(t['web']) * 1000:.0f} ms, max {max(t['web']) * 1000:.0f} ms; "
                f"CPU (web + {self.store}) median {statistics.median(t['cpu']) * 1000:.0f} ms, "
                f"max {max(t['cpu']) * 1000:.0f} ms"
            )
        if len(paths) > 1:
            new, old = timings["rollup heads"], timings["raw scrapes"]
            ratios = {k: statistics.median(old[k]) / statistics.median(new[k]) for k in ("wall", "web", "cpu")}
            self.stdout.write(
                f"  raw scrapes / rollup heads: wall {ratios['wall']:.2f}x, CPU web {ratios['web']:.2f}x, "
                f"CPU (web + {self.store}) {ratios['cpu']:.2f}x"
            )

    def time_queries(self, count: int, seed: int) -> None:
        from rest_framework.test import APIClient

        rng = np.random.default_rng(seed)
        client = APIClient()
        client.force_authenticate(self._user())
        scrape_figures = [
            "ttft_p99",
            "memory_peak_to_mean",
            "prefill_wait_p99",
            "kv_fragmentation",
            "itl_p99",
            "stall_p99",
            "tpot_p99",
            "requests_per_second",
            "prefix_cache_hit_rate",
        ]
        windows = ["1m", "5m", "15m", "1h", "6h", "24h"]
        groups = ["fleet", "cohort", "pool", "worker"]
        durations, cpu = [], []
        by_window: dict[str, list[float]] = {w: [] for w in windows}
        for i in range(count + 5):
            params = {
                "figure": scrape_figures[i % len(scrape_figures)],
                "window": windows[i % len(windows)],
                "group_by": groups[int(rng.integers(len(groups)))],
            }
            response, elapsed, cpu_elapsed = self._timed(lambda p=params: client.get("/api/v1/metrics/query", p))
            if response.status_code != 200:
                raise CommandError(f"query {params} answered {response.status_code}: {response.content[:200]!r}")
            if i >= 5:
                durations.append(elapsed)
                cpu.append(cpu_elapsed)
                by_window[params["window"]].append(elapsed)
        self.stdout.write(
            f"query endpoint, {count} calls (goal P95 < 100 ms):\n"
            f"  wall-clock P50 {statistics.median(durations) * 1000:.0f} ms, P95 {self._p95(durations) * 1000:.0f} ms; "
            f"CPU (web + {self.store}) P50 {statistics.median(cpu) * 1000:.0f} ms, P95 {self._p95(cpu) * 1000:.0f} ms"
        )
        self.stdout.write(
            "  wall-clock median by window: "
            + ", ".join(f"{w} {statistics.median(v) * 1000:.0f} ms" for w, v in by_window.items() if v)
        )
