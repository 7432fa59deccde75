"""``python manage.py bench_requests``: the Requests page's queries on a big log.

It fills the configured database's request log with ``--rows`` synthetic
rows in one ``INSERT ... SELECT generate_series`` (PostgreSQL only; rows
tagged ``model = 'bench-requests'`` and deleted afterwards unless ``--keep``).
When the log holds nothing but such rows (the benchmark has a database of its
own), the log's secondary indexes are dropped for the insert and built again
after it, in the same transaction: maintaining sixteen B-trees row by row held
the insert to a few thousand rows per second, building them afresh sorts once.
Then it times, for every single filter crossed with every sort, the first page
as the API reads it (``explorer.parse(...).page()``), ``--repeats`` times
each, and reports each combination's P95; then streams the whole log (or
``--export-filter``) through the CSV export and reports rows per second and
the process's peak memory growth, which stays flat: rows come from a
server-side cursor.
"""

from __future__ import annotations

import resource
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction

from controlplane.fleet.models import Pool, Worker
from controlplane.gateway import explorer
from controlplane.gateway.models import RequestLog
from controlplane.profiles.models import Profile, ProfileRevision
from workers.figures import percentile

MODEL = "bench-requests"

FILTERS: list[dict[str, str]] = [
    {},
    {"model": MODEL},
    {"cohort": "canary"},
    {"pool": "bench-requests-canary"},
    {"worker": "bench-requests-w3"},
    {"revision": "{revision}"},
    {"prefill_mode": "monolithic"},
    {"split": "chunked"},
    {"status": "598"},
    {"status": "failed"},
    {"bucket": ">32K"},
    {"slow_by": "ttft", "slow_above": "1.5"},
    {"slow_by": "max_gap", "slow_above": "1.0"},
    {"since": "{since}"},
]


class Command(BaseCommand):
    help = (
        "Time the request log's filtered, sorted first pages and its streaming export on many rows. "
        "Run it against a PostgreSQL database of its own (DATABASE_URL=.../bench): there the log's indexes "
        "are dropped while the rows go in and rebuilt after, which is far faster than inserting under them."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--rows",
            type=int,
            default=10_000_000,
            help="benchmark rows the log must hold (only the missing ones are inserted); default 10,000,000",
        )
        parser.add_argument(
            "--repeats", type=int, default=20, help="timed first pages per filter and sort (default %(default)s)"
        )
        parser.add_argument(
            "--keep",
            action="store_true",
            help="keep the rows (and reuse them next time); without it they are deleted after the run",
        )
        parser.add_argument("--export-limit", type=int, default=0, help="stop the export after this many rows (0: all)")

    def handle(self, *args: Any, **options: Any) -> None:
        if connection.vendor != "postgresql":
            raise CommandError("bench_requests needs PostgreSQL (generate_series).")
        pools, workers, revision = _fleet()
        have = RequestLog.objects.filter(model=MODEL).count()
        if have < options["rows"]:
            started = time.perf_counter()
            _fill(options["rows"] - have, have, pools, workers, revision)
            self.stdout.write(f"inserted {options['rows'] - have} rows in {time.perf_counter() - started:.1f} s")
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {RequestLog._meta.db_table}")
        total = RequestLog.objects.count()
        self.stdout.write(f"request log: {total} rows; {options['repeats']} timed first pages per filter × sort")
        try:
            self._pages(options, revision)
            self._export(options)
        finally:
            if not options["keep"]:
                RequestLog.objects.filter(model=MODEL).delete()
                Worker.objects.filter(name__startswith=MODEL).delete()
                Pool.objects.filter(name__startswith=MODEL).delete()

    def _pages(self, options: dict[str, Any], revision: int) -> None:
        since = (
            RequestLog.objects.filter(model=MODEL)
            .order_by("-created_at")
            .values_list("created_at", flat=True)[RequestLog.objects.filter(model=MODEL).count() // 10]
        )
        worst: tuple[float, str] = (0.0, "")
        p95s = []
        for params in FILTERS:
            params = {k: v.format(revision=revision, since=since.isoformat()) for k, v in params.items()}
            for sort in explorer.SORTS:
                query = explorer.parse({**params, "sort": sort})
                query.page()  # warm
                times = []
                for _ in range(options["repeats"]):
                    started = time.perf_counter()
                    query.page()
                    times.append(time.perf_counter() - started)
                p95 = percentile(times, 95) or 0.0
                p95s.append(p95)
                name = ",".join(f"{k}={v}" for k, v in params.items() if k != "since") or "no filter"
                if "since" in params:
                    name += ",since=(last 10%)"
                if p95 > worst[0]:
                    worst = (p95, f"{name} sort={sort}")
                self.stdout.write(f"  {name:40} sort={sort:8} first page P95 {p95 * 1000:7.1f} ms")
        within = sum(p <= 0.150 for p in p95s)
        self.stdout.write(
            f"first pages: {within}/{len(p95s)} combinations within 150 ms at P95; worst "
            f"{worst[0] * 1000:.1f} ms ({worst[1]}); median of P95s "
            f"{(percentile(p95s, 50) or 0) * 1000:.1f} ms"
        )

    def _export(self, options: dict[str, Any]) -> None:
        query = explorer.parse({"model": MODEL, "sort": "time"})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        num_rows = num_bytes = 0
        for chunk in explorer.csv_lines(query):
            num_bytes += len(chunk)
            num_rows += chunk.count(b"\n")
            if options["export_limit"] and num_rows >= options["export_limit"]:
                break
        seconds = time.perf_counter() - started
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        self.stdout.write(
            f"CSV export: {num_rows - 1} rows, {num_bytes / 1e6:.0f} MB in {seconds:.1f} s = "
            f"{(num_rows - 1) / seconds:,.0f} rows/s (goal >= 50,000); peak memory grew {grown / 1024:.0f} MB"
        )


def _fleet() -> tuple[list[int], list[int], int]:
    pools = [Pool.objects.get_or_create(name=f"{MODEL}-{role}")[0] for role in ("stable", "canary")]
    workers = [
        Worker.objects.get_or_create(
            name=f"{MODEL}-w{i}", defaults={"url": f"http://127.0.0.1:9/{i}", "pool": pools[i % 2]}
        )[0]
        for i in range(8)
    ]
    revision = ProfileRevision.objects.values_list("pk", flat=True).first()
    if revision is None:
        profile = Profile.objects.create(name=f"{MODEL}-profile")
        revision = profile.add_revision({"max_num_batched_tokens": 512}, comment="bench").pk
    return [p.pk for p in pools], [w.pk for w in workers], revision


def _fill(num_rows: int, offset: int, pools: list[int], workers: list[int], revision: int) -> None:
    """One INSERT ... SELECT: rows spread over the last week, every filtered
    attribute varied by arithmetic on the row number (deterministic). With
    no other rows in the log, its secondary indexes and foreign keys are
    rebuilt around it."""
    table = RequestLog._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL maintenance_work_mem = '512MB'")
        indexes: list[tuple[str, str]] = []
        foreign_keys: list[tuple[str, str]] = []
        if not RequestLog.objects.exclude(model=MODEL).exists():
            # Every index but the primary key and those backing a constraint,
            # and the foreign keys, whose deferred per-row checks would both
            # queue 10M trigger events and forbid CREATE INDEX until commit.
            cursor.execute(
                """SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
                WHERE i.indrelid = %s::regclass AND NOT i.indisprimary
                    AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)""",
                [table],
            )
            indexes = cursor.fetchall()
            cursor.execute(
                "SELECT quote_ident(conname), pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = %s::regclass AND contype = 'f'",
                [table],
            )
            foreign_keys = cursor.fetchall()
            for name, _ in foreign_keys:
                cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
            for name, _ in indexes:
                cursor.execute(f"DROP INDEX {name}")
        _insert(cursor, num_rows, offset, pools, workers, revision)
        for _, definition in indexes:
            cursor.execute(definition)
        for name, definition in foreign_keys:  # each checked by one join, not row by row
            cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")


def _insert(cursor: Any, num_rows: int, offset: int, pools: list[int], workers: list[int], revision: int) -> None:
    table = RequestLog._meta.db_table
    sql = f"""
        INSERT INTO {table} (request_id, created_at, model, cohort, pool_id, worker_id, profile_revision_id,
            prompt_tokens, cached_tokens, computed_tokens, output_tokens, ttft_seconds, max_gap_seconds,
            tpot_seconds, e2e_seconds, queue_seconds, prefill_seconds, status, error, stream, prefill_mode,
            prompt_split, num_prefill_chunks, preemptions)
        SELECT 'bench-' || g, now() - (g %% 604800) * interval '1 second' - (g %% 1000) * interval '1 millisecond',
            %(model)s, CASE WHEN g %% 10 = 0 THEN 'canary' ELSE 'stable' END,
            CASE WHEN g %% 10 = 0 THEN %(canary)s ELSE %(stable)s END,
            (%(workers)s::int[])[1 + g %% 8], CASE WHEN g %% 3 = 0 THEN %(revision)s::bigint END,
            (ARRAY[100, 400, 1500, 6000, 20000, 40000])[1 + g %% 6], (g %% 7) * 16, 300 + g %% 5000, 16 + g %% 256,
            CASE WHEN g %% 50 = 7 THEN NULL ELSE (g %% 2003) / 1000.0 END, (g %% 1501) / 1000.0,
            (g %% 97) / 1000.0, 1 + (g %% 4001) / 1000.0, (g %% 211) / 1000.0, (g %% 1999) / 1000.0,
            CASE WHEN g %% 50 = 7 THEN 503 WHEN g %% 997 = 0 THEN 598 ELSE 200 END, '', g %% 4 <> 0,
            CASE WHEN g %% 2 = 0 THEN 'chunked' ELSE 'monolithic' END,
            CASE WHEN g %% 2 = 0 THEN g %% 6 >= 3 ELSE false END, CASE WHEN g %% 6 >= 3 THEN 4 ELSE 1 END, g %% 13 / 12
        FROM generate_series(%(first)s, %(last)s) AS g
    """
    cursor.execute(
        sql,
        {
            "model": MODEL,
            "canary": pools[1],
            "stable": pools[0],
            "workers": workers,
            "revision": revision,
            "first": offset + 1,
            "last": offset + num_rows,
        },
    )
