"""``python manage.py bench_heartbeats``: heartbeat handling under load.

Simulated workers heartbeat over HTTP, on a fixed schedule, against a real
ASGI server (one this command starts, or ``--url``), on the database the
settings name. Each worker sends the contract's full payload every
``workers / rate`` seconds; one heartbeat in ``--state-change-every``
changes the worker's state (ready ↔ draining), which takes the path that
pushes to the fleet page. Prints throughput and latency percentiles as seen
by the clients, which share the machine with the server.

Run it on a scratch database: the simulated workers are removed afterwards
(unless ``--keep``), their audit rows stay, as audit rows do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import time
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.launcher import ProcessSpec, Running, free_port, web_argv
from controlplane.profiles.models import Profile
from workers import contract

BENCH_PREFIX = "bench-"


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


class Command(BaseCommand):
    help = "Benchmark the heartbeat endpoint with simulated workers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workers", type=int, default=300, help="simulated workers (default 300)")
        parser.add_argument("--rate", type=float, default=400.0, help="heartbeats per second, all workers together")
        parser.add_argument("--duration", type=float, default=20.0, help="seconds of measured load")
        parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
        parser.add_argument("--url", help="an already running control plane; default: start one here")
        parser.add_argument(
            "--server-processes", type=int, default=1, help="uvicorn worker processes when starting one"
        )
        parser.add_argument(
            "--db-pool", type=int, default=0, help="DATABASE_POOL_MAX_SIZE for the server it starts (0: none)"
        )
        parser.add_argument(
            "--connections",
            type=int,
            default=0,
            help="client keep-alive connections (default 0: one per worker, as real agents have)",
        )
        parser.add_argument("--state-change-every", type=int, default=100, help="one heartbeat in N changes state")
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.add_argument("--keep", action="store_true", help="keep the simulated workers afterwards")

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM (a timeout, a CI cancel) must still stop the server we start.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
        call_command("migrate", interactive=False, verbosity=0)
        secrets_by_worker = self._enroll(options["workers"])
        server = None
        url = options["url"]
        try:
            if url is None:
                server, url = self._start_server(options["server_processes"], options["db_pool"])
            result = asyncio.run(self._load(url.rstrip("/"), secrets_by_worker, options))
        finally:
            if server is not None:
                server.stop()
            if not options["keep"]:
                self._cleanup()
        result.update(
            workers=options["workers"],
            target_rate=options["rate"],
            server_processes=options["server_processes"] if options["url"] is None else None,
            db_pool=options["db_pool"] if options["url"] is None else None,
            database=settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
        )
        if options["json"]:
            self.stdout.write(json.dumps(result, indent=2))
            return
        self.stdout.write(
            "heartbeats: {workers} workers, target {target_rate:.0f}/s, {database}, "
            "{duration_seconds:.0f} s measured\n"
            "  sent {sent}, ok {ok}, errors {errors}\n"
            "  throughput {heartbeats_per_second:.1f} heartbeats/s\n"
            "  latency ms: p50 {p50_ms:.1f}  p90 {p90_ms:.1f}  p99 {p99_ms:.1f}  max {max_ms:.1f}  mean {mean_ms:.1f}\n"
            "  schedule lag p99 {lag_p99_ms:.1f} ms (how late clients sent; high means the client side "
            "saturated)".format(**result)
        )

    # ---- setup -------------------------------------------------------------------
    def _enroll(self, num_workers: int) -> dict[str, str]:
        self._cleanup()
        profile = Profile.objects.create(name=f"{BENCH_PREFIX}profile")
        revision = profile.add_revision({"max_num_batched_tokens": 512}, comment="benchmark")
        pool = Pool.objects.create(name=f"{BENCH_PREFIX}pool")
        pool.set_desired_revision(revision)
        _, plaintext = EnrollmentToken.issue(f"{BENCH_PREFIX}token", actor="system:bench", pool=pool)
        secrets_by_worker = {}
        for i in range(num_workers):
            req = contract.parse_register(
                {
                    "contract_version": contract.CONTRACT_VERSION,
                    "enroll_token": plaintext,
                    "name": f"{BENCH_PREFIX}{i:05d}",
                    "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                    "engine_kind": "reference",
                    "model": "bench",
                    "max_model_len": 4096,
                    "hardware": {"device": "cpu", "cpu_count": 2},
                    "labels": {"bench": "1"},
                }
            )
            worker, secret = Worker.register(req)
            secrets_by_worker[worker.name] = secret
        self._revision_id = revision.pk
        return secrets_by_worker

    def _cleanup(self) -> None:
        Worker.objects.filter(name__startswith=BENCH_PREFIX).delete()
        EnrollmentToken.objects.filter(name__startswith=BENCH_PREFIX).delete()
        Pool.objects.filter(name__startswith=BENCH_PREFIX).delete()
        Profile.objects.filter(name__startswith=BENCH_PREFIX).delete()

    def _start_server(self, processes: int, db_pool: int) -> tuple[Running, str]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = web_argv(
            port, host="127.0.0.1", log_level="warning", extra=["--no-access-log", "--workers", str(processes)]
        )
        log_dir = settings.DATA_DIR / "bench"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {"CHUNKPILOT_DATA_DIR": str(settings.DATA_DIR), "DATABASE_POOL_MAX_SIZE": str(db_pool)}
        spec = ProcessSpec("bench-web", argv, env=env, ready_url=f"{url}/login/")
        server = Running(spec, log_dir, echo=lambda line: None)
        import threading

        try:
            server.wait_ready(threading.Event())
        except Exception as exc:
            server.stop()
            raise CommandError(str(exc)) from exc
        return server, url

    # ---- load --------------------------------------------------------------------
    async def _load(self, url: str, secrets_by_worker: dict[str, str], options: dict[str, Any]) -> dict[str, Any]:
        """Open-loop load from a lean HTTP/1.1 client (raw asyncio streams,
        keep-alive, requests prebuilt): a general-purpose client costs more
        CPU per request than the server does, and both share this machine.

        Each connection carries a fixed share of the workers and sends each
        one's heartbeat when it falls due; a late send is counted as lag."""
        from urllib.parse import urlsplit

        target = urlsplit(url)
        host, port = target.hostname or "127.0.0.1", target.port or 80
        num_workers = len(secrets_by_worker)
        num_connections = min(options["connections"] or num_workers, num_workers)
        interval = num_workers / options["rate"]
        warmup, duration = options["warmup"], options["duration"]
        change_every = max(1, options["state_change_every"])
        rng = random.Random(0)
        latencies: list[float] = []
        lags: list[float] = []
        counts = {"sent": 0, "ok": 0, "errors": 0}
        error_samples: list[str] = []
        start = time.perf_counter() + 0.5
        measure_from, stop_at = start + warmup, start + warmup + duration
        sequence = 0

        def request(secret: str, state: str) -> bytes:
            body = json.dumps(
                {
                    "contract_version": contract.CONTRACT_VERSION,
                    "state": state,
                    "load": {
                        "num_requests_running": rng.randint(0, 8),
                        "num_requests_waiting": rng.randint(0, 3),
                        "kv_cache_usage_perc": round(rng.random(), 3),
                    },
                    "running_revision_id": self._revision_id,
                    "running_profile": {},
                    "hardware": {"device": "cpu", "cpu_count": 2},
                    "apply_error": None,
                }
            ).encode()
            head = (
                f"POST {contract.HEARTBEAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            return head.encode() + body

        async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if "content-length" in headers:
                return status, await reader.readexactly(int(headers["content-length"]))
            body = b""
            while True:  # chunked
                size = int((await reader.readline()).strip() or b"0", 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    return status, body
                body += chunk[:-2]

        async def connection(workers: list[tuple[str, float]]) -> None:
            nonlocal sequence
            reader, writer = await asyncio.open_connection(host, port)
            states = {secret: "ready" for secret, _ in workers}
            schedule = sorted((start + offset, secret) for secret, offset in workers)
            try:
                while schedule and schedule[0][0] < stop_at:
                    due, secret = schedule.pop(0)
                    now = time.perf_counter()
                    if due > now:
                        await asyncio.sleep(due - now)
                    sequence += 1
                    if sequence % change_every == 0:
                        states[secret] = "draining" if states[secret] == "ready" else "ready"
                    sent_at = time.perf_counter()
                    writer.write(request(secret, states[secret]))
                    await writer.drain()
                    status, body = await read_response(reader)
                    done_at = time.perf_counter()
                    if measure_from <= sent_at and done_at <= stop_at + 5.0:
                        counts["sent"] += 1
                        if status == 200:
                            counts["ok"] += 1
                            latencies.append(done_at - sent_at)
                        else:
                            counts["errors"] += 1
                            if len(error_samples) < 5:
                                error_samples.append(f"{status} {body[:200]!r}")
                        lags.append(sent_at - due)
                    # the next heartbeat of this worker; keep the list ordered
                    next_due = due + interval
                    index = next((i for i, (d, _) in enumerate(schedule) if d > next_due), len(schedule))
                    schedule.insert(index, (next_due, secret))
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

        secrets = list(secrets_by_worker.values())
        shares: list[list[tuple[str, float]]] = [[] for _ in range(num_connections)]
        for i, secret in enumerate(secrets):
            shares[i % num_connections].append((secret, rng.random() * interval))
        await asyncio.gather(*(connection(share) for share in shares))
        wall_seconds = max(duration, time.perf_counter() - measure_from)
        latencies.sort()
        lags.sort()
        ms = 1000.0
        return {
            **counts,
            "duration_seconds": duration,
            # over the wall time the measured heartbeats took: a server that
            # falls behind stretches it, and the rate drops below the target
            "heartbeats_per_second": counts["ok"] / wall_seconds,
            "p50_ms": percentile(latencies, 0.50) * ms,
            "p90_ms": percentile(latencies, 0.90) * ms,
            "p99_ms": percentile(latencies, 0.99) * ms,
            "max_ms": (latencies[-1] if latencies else float("nan")) * ms,
            "mean_ms": (statistics.fmean(latencies) if latencies else float("nan")) * ms,
            "lag_p99_ms": percentile(lags, 0.99) * ms,
            "error_samples": error_samples,
        }
