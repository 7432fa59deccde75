"""``python manage.py bench_fleet --workers 50,100,200``: the control plane
against a fleet of live simulated workers, and what each size costs.

Run it on a database of its own (``DATABASE_URL=.../bench_fleet``; it is
migrated first) and PostgreSQL: the scrape round and the pages read every
worker in the database, not only this run's.

Setup, once: the web server, one Celery worker (solo: one process holds every
beat task, as a small deployment's does), beat, one gateway, on a Celery
queue and a Redis namespace of their own; a profile with a stable and a
target revision, a stable and a canary pool in one routing table (half the
workers each), a client key and an operator. Then, per size, ascending, it
starts simulated workers (``workers serve --engine sim --count``, a few
processes) until the fleet has that many, waits until all are ready, and:

1. Measures ``--duration`` seconds of steady state with light traffic through
   the gateway (``--rate-per-worker``): heartbeats handled per second (each
   worker's ``last_heartbeat_at`` changes, polled), the P99 of a few probe
   workers' heartbeats sent amid the fleet's, the scrape rounds beat ran
   (``ScrapeRound`` rows), CPU seconds of each control-plane process tree and
   of the workers' processes apart, rows written (PostgreSQL's statistics).
2. Times, in this process (server time, no network): the fleet, rollouts,
   figures, panel and advisor pages, one alert-evaluation cycle and one
   advisor refresh.
3. Starts a rollout whose first step moves the whole canary pool to the
   target revision at 50% weight, then aborts it: weight 0 acked by every
   gateway, and every canary worker back on the stable revision.

Then it prints one table over the sizes and the cost model fitted to them
(``controlplane/bench/fleet.py``): cores per process and rows per second at
1,000 and 10,000 workers, and which loop misses its interval first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections, connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.roles import Role, grant_role
from controlplane.advisor.models import AdvisorReport
from controlplane.alerts import conf as alerts_conf
from controlplane.alerts import evaluation
from controlplane.audit.models import AuditEvent
from controlplane.bench import fleet
from controlplane.celery import app
from controlplane.fleet import conf as fleet_conf
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway import bus
from controlplane.gateway.models import ClientKey, PoolSpec, RoutingTable
from controlplane.launcher import (
    Enrollment,
    celery_beat_argv,
    celery_worker_argv,
    child,
    free_port,
    gateway_argv,
    wait_http,
    wait_until,
    web_argv,
    worker_argv,
)
from controlplane.metrics import conf as metrics_conf
from controlplane.metrics import deploy
from controlplane.metrics.models import ScrapeRound
from controlplane.metrics.scrape import scrape_timeout_seconds
from controlplane.profiles.models import Profile
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout
from workers import contract

MAX_MODEL_LEN = 4096
PROMETHEUS = "/usr/bin/prometheus"  # Debian's
NUM_PROBES = 4
PROJECT_TO = (1_000, 10_000)


class Stack:
    """The throwaway rows and the running processes of one benchmark run."""

    def __init__(self, tag: str, workdir: Path, options: dict[str, Any]):
        self.tag, self.workdir, self.options = tag, workdir, options
        self.model = tag
        self.profile = Profile.objects.create(name=tag, engine_kind="sim")
        self.stable_revision = self.profile.add_revision(
            {"prefill_mode": "monolithic", "max_num_batched_tokens": MAX_MODEL_LEN}
        )
        self.target_revision = self.profile.add_revision(
            {"prefill_mode": "chunked", "max_num_batched_tokens": 512, "long_prefill_token_threshold": 128}
        )
        self.pools = {role: Pool.objects.create(name=f"{tag}-{role}") for role in ("stable", "canary", "probe")}
        self.tokens: dict[str, str] = {}
        for role in ("stable", "canary"):
            self.pools[role].set_desired_revision(self.stable_revision)
            self.tokens[role] = EnrollmentToken.issue(f"{tag}-{role}", actor="system:bench", pool=self.pools[role])[1]
        self.tokens["probe"] = EnrollmentToken.issue(f"{tag}-probe", actor="system:bench", pool=self.pools["probe"])[1]
        # Configured once the first workers are ready: a pool with weight needs a ready worker.
        self.table = RoutingTable.create_audited(self.model, actor="bench")
        self.key_row, self.client_key = ClientKey.issue(tag, actor="system:bench")
        self.user = get_user_model().objects.create_user(username=tag)
        grant_role(self.user, Role.OPERATOR)
        from rest_framework.authtoken.models import Token  # only the API's token table; apps loaded by now

        self.api_token = Token.objects.create(user=self.user).key
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_procs: list[subprocess.Popen[bytes]] = []
        self.worker_names: list[list[str]] = []  # each process's workers
        self.ports_given: set[int] = set()
        self.num_by_pool = {"stable": 0, "canary": 0}
        self.probes: list[tuple[int, str]] = []  # (worker id, secret)

    # ---- processes --------------------------------------------------------------

    def env(self) -> dict[str, str]:
        db = connection.settings_dict
        auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
        return {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CELERY_QUEUE": self.tag,
            "CHANNELS_PREFIX": self.tag,
            "REDIS_URL": settings.REDIS_URL,
            "DATABASE_URL": f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        }

    def start_control_plane(self, stack: contextlib.ExitStack) -> None:
        env, tmp = self.env(), self.workdir
        self.web_port = free_port()
        self.web_url = f"http://127.0.0.1:{self.web_port}"
        web = web_argv(self.web_port, log_level="warning", extra=["--no-access-log"])
        self.procs["web"] = stack.enter_context(child(web, tmp / "web.log", env))
        # Solo: one process runs every beat task in turn, so a long scrape
        # round delays the reconciler's abort tick; more: a prefork pool.
        num_celery = self.options["celery_concurrency"]
        celery = celery_worker_argv(
            f"{self.tag}@%h",
            queue=self.tag,
            pool="solo" if num_celery == 1 else "prefork",
            concurrency=None if num_celery == 1 else num_celery,
            log_level="WARNING",
        )
        self.procs["celery"] = stack.enter_context(child(celery, tmp / "celery.log", env))
        beat = celery_beat_argv(tmp / "beat-schedule", log_level="WARNING")
        self.procs["beat"] = stack.enter_context(child(beat, tmp / "beat.log", env))
        self.gateway_port = free_port()
        gateway = gateway_argv(self.gateway_port, log_level="warning")
        self.procs["gateway"] = stack.enter_context(child(gateway, tmp / "gateway.log", env))
        wait_http(f"http://127.0.0.1:{self.gateway_port}/health", self.procs["gateway"], tmp / "gateway.log")
        wait_http(f"{self.web_url}/login/", self.procs["web"], tmp / "web.log")
        wait_until(lambda: len(bus.live_gateways()) >= 1, 30, "the gateway registered")
        if self.options["prometheus"]:
            self.start_prometheus(stack)
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise CommandError(f"{name} exited:\n{(tmp / f'{name}.log').read_text()[-2000:]}")

    def start_prometheus(self, stack: contextlib.ExitStack) -> None:
        """Debian's Prometheus, scraping the fleet every 5 s as the shipped
        config does (the control plane's service discovery), beside the
        database backend's own scrape: the pages' figures are then read
        from it in this process (``prometheus_figures``)."""
        (self.workdir / deploy.TOKEN_FILE).write_text(self.api_token)
        config = {
            "global": {"scrape_interval": "5s"},
            "scrape_configs": [
                {
                    "job_name": deploy.WORKERS_JOB,
                    "scrape_interval": "5s",
                    "http_sd_configs": [
                        {
                            "url": self.web_url + deploy.SD_PATH,
                            "refresh_interval": "5s",
                            "authorization": {"type": "Token", "credentials_file": deploy.TOKEN_FILE},
                        }
                    ],
                }
            ],
        }
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        argv = [PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}", "--log.level=warn"]
        argv += [f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
        self.procs["prometheus"] = stack.enter_context(child(argv, self.workdir / "prometheus.log", self.env()))
        wait_http(f"{self.prometheus_url}/-/ready", self.procs["prometheus"], self.workdir / "prometheus.log")

    def prometheus_query(self, promql: str) -> float:
        reply = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": promql}, timeout=30).json()
        result = reply["data"]["result"]
        return float(result[0]["value"][1]) if result else math.nan

    def grow_to(self, num_workers: int, stack: contextlib.ExitStack) -> None:
        """Start simulated workers until the fleet has ``num_workers``, half in
        each pool, at most ``--per-process`` to a process; wait until every one is ready."""
        per = self.options["per_process"]
        for role in ("stable", "canary"):
            want = num_workers // 2 + (num_workers % 2 if role == "stable" else 0)
            while self.num_by_pool[role] < want:
                count = min(per, want - self.num_by_pool[role])
                index = len(self.worker_procs)
                port = self.free_ports(count)
                enrollment = Enrollment(
                    self.web_url, self.tokens[role], f"{self.tag}-{role}-{index}", self.workdir / f"w{index}.json"
                )
                argv = worker_argv(
                    None,
                    port,
                    engine="sim",
                    sim_system=self.options["sim_system"],
                    sim_model=self.options["sim_model"],
                    max_model_len=MAX_MODEL_LEN,
                    served_model_name=self.model,
                    count=count,
                    log_level="warning",
                    profile=self.stable_revision.fields,
                    enrollment=enrollment,
                )
                log = self.workdir / f"workers-{index}.log"
                self.worker_procs.append(stack.enter_context(child(argv, log, self.env())))
                # serve --count N names its workers NAME-0..; one alone is NAME
                names = [f"{enrollment.name}-{j}" for j in range(count)] if count > 1 else [enrollment.name]
                self.worker_names.append(names)
                self.num_by_pool[role] += count

        def ready() -> int | None:
            for i, proc in enumerate(self.worker_procs):
                if proc.poll() is not None:
                    tail = (self.workdir / f"workers-{i}.log").read_text()[-2000:]
                    raise CommandError(f"simulated workers {i} exited:\n{tail}")
            n = self.fleet().filter(state=WorkerState.READY, running_revision=self.stable_revision).count()
            return n if n >= num_workers else None

        wait_until(ready, 120 + num_workers, f"{num_workers} simulated workers ready", interval=1.0)
        if not self.table.pools.exists():
            self.table.configure(
                [PoolSpec(self.pools["stable"], "stable", 10000), PoolSpec(self.pools["canary"], "canary", 0)],
                actor="bench",
            )

    def free_ports(self, count: int) -> int:
        """The first of ``count`` free ports in a row that no process started
        before has been given: a simulated worker binds its ports only once
        its device has loaded, seconds after it starts."""
        for _ in range(100):
            first = free_port(count, below_ephemeral=True)
            ports = set(range(first, first + count))
            if not ports & self.ports_given:
                self.ports_given |= ports
                return first
        raise CommandError(f"no {count} free ports in a row that no worker was given")

    def fleet(self) -> Any:
        return Worker.objects.filter(pool__in=[self.pools["stable"], self.pools["canary"]])

    def add_probes(self) -> None:
        """A few workers this command plays, to time heartbeats amid the fleet's.
        Their URL is a real worker's, so the scraper reads a page for them too."""
        url = self.fleet().order_by("pk").values_list("url", flat=True).first() or "http://127.0.0.1:9"
        for i in range(NUM_PROBES):
            req = contract.parse_register(
                {
                    "contract_version": contract.CONTRACT_VERSION,
                    "enroll_token": self.tokens["probe"],
                    "name": f"{self.tag}-probe-{i}",
                    "url": url,
                    "engine_kind": "sim",
                    "model": f"{self.tag}-probe",
                    "max_model_len": MAX_MODEL_LEN,
                    "hardware": {},
                    "labels": {},
                }
            )
            worker, secret = Worker.register(req)
            self.probes.append((worker.pk, secret))

    def cpu_pids(self) -> dict[str, list[int]]:
        return {
            **{name: [proc.pid] for name, proc in self.procs.items()},
            "workers": [p.pid for p in self.worker_procs],
        }

    def delete(self) -> None:
        Rollout.objects.filter(routing_table=self.table).delete()
        self.table.delete()
        Worker.objects.filter(pool__in=self.pools.values()).delete()
        for pool in self.pools.values():
            pool.enrollment_tokens.all().delete()
            pool.delete()
        self.profile.delete()
        self.key_row.delete()
        self.user.delete()


class Load(threading.Thread):
    """Light traffic through the gateway, heartbeat probes and a poll of every
    worker's last heartbeat, in the background while a window is measured."""

    def __init__(self, stack: Stack, rate: float):
        super().__init__(daemon=True)
        self.stack, self.rate = stack, rate
        self.stop = threading.Event()
        self.probe_seconds: list[float] = []
        self.seen: set[tuple[int, Any]] = set()
        self.num_requests = self.num_errors = 0
        self.threads = [
            threading.Thread(target=self._traffic, daemon=True),
            threading.Thread(target=self._probes, daemon=True),
            threading.Thread(target=self._poll, daemon=True),
        ]

    def run(self) -> None:
        for t in self.threads:
            t.start()
        for t in self.threads:
            t.join()

    def _traffic(self) -> None:
        url = f"http://127.0.0.1:{self.stack.gateway_port}/v1/completions"
        headers = {"Authorization": f"Bearer {self.stack.client_key}"}
        rng = random.Random(0)
        lock = threading.Lock()

        def one(i: int) -> None:
            body = {"model": self.stack.model, "prompt": f"hello {i} " * 8, "max_tokens": 4, "user": f"u{i}"}
            try:
                reply = httpx.post(url, json=body, headers=headers, timeout=30)
                ok = reply.status_code == 200
            except httpx.HTTPError:
                ok = False
            with lock:
                self.num_requests += 1
                self.num_errors += 0 if ok else 1

        i = 0
        while not self.stop.wait(rng.expovariate(self.rate)):
            threading.Thread(target=one, args=(i,), daemon=True).start()
            i += 1

    def _probes(self) -> None:
        interval = fleet_conf.HEARTBEAT_INTERVAL_SECONDS.get()
        body = {
            "contract_version": contract.CONTRACT_VERSION,
            "state": "ready",
            "load": {},
            "running_revision_id": None,
            "running_profile": {},
            "hardware": {},
            "apply_error": None,
        }
        with httpx.Client(base_url=self.stack.web_url, timeout=30) as client:
            while not self.stop.wait(interval / NUM_PROBES):
                for _, secret in self.stack.probes:
                    started = time.perf_counter()
                    reply = client.post(
                        contract.HEARTBEAT_PATH, json=body, headers={"Authorization": f"Bearer {secret}"}
                    )
                    if reply.status_code == 200:
                        self.probe_seconds.append(time.perf_counter() - started)
                    if self.stop.wait(interval / NUM_PROBES / len(self.stack.probes)):
                        return

    def _poll(self) -> None:
        try:
            fleet_ids = list(self.stack.fleet().values_list("pk", flat=True))
            while not self.stop.wait(0.5):
                rows = Worker.objects.filter(pk__in=fleet_ids).values_list("pk", "last_heartbeat_at")
                self.seen.update(rows)
        finally:
            connection.close()


def _num(value: float, fmt: str = ".1f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _pair(a: float, b: float, fmt: str = ".0f") -> str:
    return f"{_num(a, fmt)}/{_num(b, fmt)}"


def _cpu(r: fleet.SizeFigures, url_name: str) -> float:
    return r.page_cpu_ms.get(reverse(url_name), math.nan)


# The report's rows: a label, and what each size's column says.
REPORT_ROWS: tuple[tuple[str, Callable[[fleet.SizeFigures], str]], ...] = (
    (
        "heartbeats handled /s (expected)",
        lambda r: f"{r.heartbeats_per_second:.0f} ({r.heartbeats_expected_per_second:.0f})",
    ),
    ("heartbeat P99 ms (probes amid the fleet)", lambda r: _num(r.heartbeat_p99_ms)),
    ("live workers marked unhealthy (false alarms)", lambda r: str(r.num_marked_unhealthy)),
    ("scrape round P50 / max s", lambda r: _pair(r.scrape_round_p50_seconds, r.scrape_round_max_seconds, ".2f")),
    ("  interval / timeout s", lambda r: f"{r.scrape_interval_seconds:g}/{r.scrape_timeout_seconds:g}"),
    (
        "  rounds; largest gap between starts s",
        lambda r: f"{r.num_scrape_rounds}; {_num(r.scrape_round_gap_max_seconds)}",
    ),
    ("  workers failed per round", lambda r: _num(r.scrape_failed_per_round, ".2f")),
    ("panel (4 figures) ms", lambda r: _num(r.panel_ms, ".0f")),
    ("figures overview page ms", lambda r: _num(r.figures_page_ms, ".0f")),
    ("advisor page ms / refresh ms", lambda r: _pair(r.advisor_page_ms, r.advisor_refresh_ms)),
    ("fleet / rollouts page ms", lambda r: _pair(r.fleet_page_ms, r.rollouts_page_ms)),
    (
        "  CPU ms: panel / figures",
        lambda r: _pair(_cpu(r, "metrics-panel"), _cpu(r, "metrics-overview")),
    ),
    (
        "  CPU ms: fleet / rollouts",
        lambda r: _pair(_cpu(r, "fleet"), _cpu(r, "rollouts")),
    ),
    ("alert evaluation cycle ms (interval s)", lambda r: f"{_num(r.alert_cycle_ms)} ({r.alert_interval_seconds:g})"),
    (
        "rollout step, whole canary pool s (workers)",
        lambda r: f"{_num(r.rollout_step_seconds)} ({r.num_canary_workers})",
    ),
    (
        "abort: weight 0 acked ms, P50 / P99 (aborts)",
        lambda r: (
            f"{_pair(fleet.percentile(r.abort_acked_samples_ms or [r.abort_acked_ms], 0.5), r.abort_acked_ms)}"
            f" ({max(1, len(r.abort_acked_samples_ms))})"
        ),
    ),
    ("abort: every canary worker on stable s (max)", lambda r: _num(r.abort_all_on_stable_seconds)),
    (
        "Prometheus: targets up; scrape avg / max ms",
        lambda r: (
            f"{_num(r.prometheus_targets_up, '.0f')}; {_pair(r.prometheus_scrape_avg_ms, r.prometheus_scrape_max_ms)}"
        ),
    ),
    (
        "Prometheus: panel ms (CPU here)",
        lambda r: f"{_num(r.prometheus_panel_ms, '.0f')} ({_num(r.prometheus_panel_cpu_ms, '.0f')})",
    ),
    ("Prometheus cores", lambda r: _num(r.cpu_seconds.get("prometheus", math.nan) / r.measured_seconds, ".2f")),
    ("workers' own CPU, cores (apart)", lambda r: _num(r.workers_cpu_seconds / r.measured_seconds, ".2f")),
    ("DB rows written per minute", lambda r: _num(r.rows_per_minute, ".0f")),
    ("DB growth MiB per minute", lambda r: _num(r.database_bytes_per_minute / 2**20)),
    ("requests through the gateway (errors)", lambda r: f"{r.num_requests} ({r.num_request_errors})"),
)


class Command(BaseCommand):
    help = "The control plane against 50-200+ live simulated workers: per-loop figures and a cost model."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workers", default="50,100,200", help="fleet sizes, comma-separated, ascending")
        parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per size")
        parser.add_argument("--settle", type=float, default=10.0, help="seconds after all are ready, before")
        parser.add_argument("--per-process", type=int, default=25, help="simulated workers per process")
        parser.add_argument("--rate-per-worker", type=float, default=0.04, help="requests per second per worker")
        parser.add_argument(
            "--celery-concurrency", type=int, default=1, help="Celery worker processes (1: the solo pool)"
        )
        parser.add_argument("--sim-system", default="h200_sxm")
        parser.add_argument("--sim-model", default="meta-llama/Meta-Llama-3.1-8B")
        parser.add_argument("--json", type=Path, help="also write the figures here, as JSON")
        parser.add_argument(
            "--kill-fraction",
            type=float,
            default=0.0,
            help="after the last size, SIGKILL whole worker processes until this share of the fleet is dead",
        )
        parser.add_argument(
            "--prometheus",
            action="store_true",
            help=f"also run {PROMETHEUS} scraping the fleet, and time the panel read from it",
        )
        parser.add_argument(
            "--aborts",
            type=int,
            default=1,
            help="rollout steps and aborts per size: the report gives the weight-0 ack's P50 and P99 over them",
        )
        parser.add_argument("--report-from", type=Path, help="print the report of an earlier run's --json, run nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["report_from"] is not None:
            sizes = json.loads(options["report_from"].read_text())["sizes"]
            self._report([fleet.SizeFigures(**size) for size in sizes], {**options, "json": None})
            return
        if connection.vendor != "postgresql":
            raise CommandError("bench_fleet measures PostgreSQL: set DATABASE_URL to a database of its own")
        sizes = sorted({int(s) for s in str(options["workers"]).split(",") if s.strip()})
        if not sizes or sizes[0] < 2:
            raise CommandError("--workers: sizes of 2 or more")
        call_command("migrate", verbosity=0)
        # SIGTERM unwinds like Ctrl-C: the processes started and the rows made go with the run.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
        tag = f"bench-fleet-{uuid.uuid4().hex[:6]}"
        # A queue and a Redis namespace of their own: nobody else's gateways or workers take part.
        settings.CELERY_TASK_DEFAULT_QUEUE = app.conf.task_default_queue = tag
        settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = tag  # type: ignore[index]
        results: list[fleet.SizeFigures] = []
        fault: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            stack = Stack(tag, Path(tmp), options)
            try:
                with contextlib.ExitStack() as processes:
                    stack.start_control_plane(processes)
                    self.stdout.write(
                        f"web, a Celery worker ({options['celery_concurrency']} process(es)), beat, one gateway; "
                        f"sizes {sizes}; "
                        f"{options['duration']:g}s measured each; {os.cpu_count()} CPUs"
                    )
                    for size in sizes:
                        stack.grow_to(size, processes)
                        if not stack.probes:
                            stack.add_probes()
                        self.stderr.write(f"{size} workers ready; settling {options['settle']:g}s")
                        time.sleep(options["settle"])
                        results.append(self._measure(stack, size, options))
                        self.stderr.write(json.dumps(dataclasses.asdict(results[-1]), default=str))
                    if options["kill_fraction"] > 0:
                        fault = self._kill(stack, options)
                        self.stderr.write(json.dumps(fault))
            finally:
                close_old_connections()
                stack.delete()
        self._report(results, options)
        if fault:
            self._report_fault(fault)
            if options.get("json") is not None:
                payload = json.loads(options["json"].read_text())
                options["json"].write_text(json.dumps({**payload, "fault": fault}, indent=2, default=str))

    # ---- one size ---------------------------------------------------------------------

    def _measure(self, stack: Stack, size: int, options: dict[str, Any]) -> fleet.SizeFigures:
        duration = options["duration"]
        figures = fleet.SizeFigures(workers=size, measured_seconds=duration)
        pids = stack.cpu_pids()
        leaders = [pid for group in pids.values() for pid in group]
        load = Load(stack, max(0.2, options["rate_per_worker"] * size))
        rows_before, bytes_before = fleet.rows_written(), fleet.database_bytes()
        cpu_before = fleet.session_cpu_seconds(leaders)
        started_at, started = timezone.now(), time.monotonic()
        load.start()
        before_window = set(Worker.objects.filter(pk__in=stack.fleet()).values_list("pk", "last_heartbeat_at"))
        time.sleep(duration)
        cpu_after = fleet.session_cpu_seconds(leaders)
        elapsed = time.monotonic() - started
        load.stop.set()
        load.join(10)
        rows_after, bytes_after = fleet.rows_written(), fleet.database_bytes()
        figures.measured_seconds = elapsed

        for name, group in pids.items():
            seconds = sum(cpu_after.get(p, 0.0) - cpu_before.get(p, 0.0) for p in group)
            if name == "workers":
                figures.workers_cpu_seconds = seconds
            else:
                figures.cpu_seconds[name] = seconds
        per_table = {t: (n - rows_before.get(t, 0)) * 60 / elapsed for t, n in rows_after.items()}
        figures.rows_per_minute = sum(per_table.values())
        figures.rows_by_table = {t: n for t, n in sorted(per_table.items(), key=lambda x: -x[1]) if n > 0}
        figures.database_bytes_per_minute = (bytes_after - bytes_before) * 60 / elapsed

        new_beats = {seen for seen in load.seen if seen[1] is not None} - before_window
        figures.heartbeats_per_second = len(new_beats) / elapsed
        figures.num_heartbeats = len(new_beats) + len(load.probe_seconds)
        figures.heartbeats_expected_per_second = size / fleet_conf.HEARTBEAT_INTERVAL_SECONDS.get()
        figures.heartbeat_p99_ms = fleet.percentile(load.probe_seconds, 0.99) * 1000
        figures.num_requests, figures.num_request_errors = load.num_requests, load.num_errors
        # Every worker of the fleet stays up: any the health sweep marks unhealthy is a false alarm.
        figures.num_marked_unhealthy = AuditEvent.objects.filter(
            action="worker.state_change",
            time__gte=started_at,
            object_id__in=[str(pk) for pk in stack.fleet().values_list("pk", flat=True)],
            after__state=WorkerState.UNHEALTHY.label,
        ).count()

        figures.scrape_interval_seconds = metrics_conf.SCRAPE_INTERVAL.get()
        figures.scrape_timeout_seconds = scrape_timeout_seconds()
        rounds = list(
            ScrapeRound.objects.filter(started_at__gte=started_at, finished_at__isnull=False)
            .order_by("started_at")
            .values_list("started_at", "finished_at", "num_targets", "num_failed")
        )
        if rounds:
            durations = [(f - s).total_seconds() for s, f, _, _ in rounds if f is not None]
            figures.num_scrape_rounds = len(rounds)
            figures.scrape_round_p50_seconds = statistics.median(durations)
            figures.scrape_round_max_seconds = max(durations)
            figures.scrape_failed_per_round = statistics.mean(r[3] for r in rounds)
            figures.num_worker_scrapes = sum(r[2] - r[3] for r in rounds)
            starts = [r[0] for r in rounds]
            gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:], strict=False)]
            figures.scrape_round_gap_max_seconds = max(gaps) if gaps else math.nan

        self._time_pages(stack, figures)
        if options["prometheus"]:
            self._time_prometheus(stack, figures, size)
        acked, on_stable = [], []
        for _ in range(max(1, options["aborts"])):
            self._time_rollout(stack, figures)
            acked.append(figures.abort_acked_ms)
            on_stable.append(figures.abort_all_on_stable_seconds)
        figures.abort_acked_samples_ms = acked
        figures.abort_acked_ms = fleet.percentile(acked, 0.99)
        figures.abort_all_on_stable_seconds = max(on_stable)
        return figures

    def _time_prometheus(self, stack: Stack, figures: fleet.SizeFigures, size: int) -> None:
        job = f'job="{deploy.WORKERS_JOB}"'
        wait_until(
            lambda: stack.prometheus_query(f"sum(up{{{job}}})") >= size,
            120,
            f"Prometheus scraping all {size} workers",
            interval=1.0,
        )
        figures.prometheus_targets_up = stack.prometheus_query(f"sum(up{{{job}}})")
        figures.prometheus_scrape_avg_ms = stack.prometheus_query(f"avg(scrape_duration_seconds{{{job}}})") * 1000
        figures.prometheus_scrape_max_ms = (
            stack.prometheus_query(f"max(max_over_time(scrape_duration_seconds{{{job}}}[1m]))") * 1000
        )
        client = Client()
        client.force_login(stack.user)
        url = reverse("metrics-panel")
        saved = (getattr(settings, "METRICS_BACKEND", None), getattr(settings, "PROMETHEUS_URL", None))
        settings.METRICS_BACKEND, settings.PROMETHEUS_URL = "prometheus", stack.prometheus_url
        try:
            client.get(url)
            times, cpu = [], []
            for _ in range(3):
                started, cpu_started = time.perf_counter(), time.process_time()
                reply = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
                cpu.append((time.process_time() - cpu_started) * 1000)
                if reply.status_code != 200:
                    raise CommandError(f"{url} on Prometheus answered {reply.status_code}")
        finally:
            settings.METRICS_BACKEND, settings.PROMETHEUS_URL = saved
        figures.prometheus_panel_ms = statistics.median(times)
        figures.prometheus_panel_cpu_ms = statistics.median(cpu)

    def _kill(self, stack: Stack, options: dict[str, Any]) -> dict[str, Any]:
        """SIGKILL whole worker processes of the stable pool, the newest
        first, until at least ``--kill-fraction`` of the fleet is dead, with
        traffic on; then watch
        for three unhealthy-after periods: the dead marked unhealthy, no
        survivor marked, scrape rounds bounded by their timeout, the gateway
        ejecting the dead and the clients seeing no error."""
        total = stack.fleet().count()
        victims: list[subprocess.Popen[bytes]] = []
        dead_ids: set[int] = set()
        for proc, names in reversed(list(zip(stack.worker_procs, stack.worker_names, strict=True))):
            if len(dead_ids) >= options["kill_fraction"] * total:
                break
            if not names[0].startswith(f"{stack.tag}-stable-"):
                continue  # the stable pool's: the canary takes no traffic after the abort, so none to eject
            victims.append(proc)
            dead_ids |= set(stack.fleet().filter(name__in=names).values_list("pk", flat=True))
        dead_names = set(Worker.objects.filter(pk__in=dead_ids).values_list("name", flat=True))
        gateway_log = stack.workdir / "gateway.log"
        log_offset = gateway_log.stat().st_size
        window = max(30.0, 3 * fleet_conf.WORKER_UNHEALTHY_AFTER_SECONDS.get())
        load = Load(stack, max(0.5, options["rate_per_worker"] * total))
        load.start()
        killed_at, started = timezone.now(), time.monotonic()
        for proc in victims:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        def all_dead_marked() -> bool:
            return not Worker.objects.filter(pk__in=dead_ids, state__lt=WorkerState.UNHEALTHY).exists()

        wait_until(all_dead_marked, window, "every killed worker marked unhealthy", interval=0.2)
        dead_marked_seconds = time.monotonic() - started
        time.sleep(max(0.0, window - (time.monotonic() - started)))
        load.stop.set()
        load.join(10)
        survivors = [str(pk) for pk in stack.fleet().exclude(pk__in=dead_ids).values_list("pk", flat=True)]
        falsely_marked = AuditEvent.objects.filter(
            action="worker.state_change",
            time__gte=killed_at,
            object_id__in=survivors,
            after__state=WorkerState.UNHEALTHY.label,
        ).count()
        rounds = [
            ((f - s).total_seconds(), failed)
            for s, f, failed in ScrapeRound.objects.filter(started_at__gte=killed_at, finished_at__isnull=False)
            .order_by("started_at")
            .values_list("started_at", "finished_at", "num_failed")
            if f is not None
        ]
        with open(gateway_log, errors="replace") as log:
            log.seek(log_offset)
            ejections = [line for line in log if "ejected for" in line]
        ejected = {name for name in dead_names if any(f" {name} " in line for line in ejections)}
        return {
            "killed_workers": len(dead_ids),
            "fleet": total,
            "window_seconds": window,
            "dead_all_marked_unhealthy_seconds": dead_marked_seconds,
            "survivors_marked_unhealthy": falsely_marked,
            "scrape_rounds": len(rounds),
            "scrape_round_max_seconds": max((d for d, _ in rounds), default=math.nan),
            "scrape_timeout_seconds": scrape_timeout_seconds(),
            "scrape_failed_per_round": statistics.mean(n for _, n in rounds) if rounds else math.nan,
            "dead_ejected_by_gateway": len(ejected),
            "requests": load.num_requests,
            "request_errors": load.num_errors,
        }

    def _report_fault(self, fault: dict[str, Any]) -> None:
        self.stdout.write(
            f"fault: {fault['killed_workers']} of {fault['fleet']} workers killed at once; within "
            f"{fault['window_seconds']:g}s: all marked unhealthy after "
            f"{fault['dead_all_marked_unhealthy_seconds']:.1f}s, {fault['survivors_marked_unhealthy']} survivors "
            f"marked unhealthy; {fault['scrape_rounds']} scrape rounds, "
            f"longest {fault['scrape_round_max_seconds']:.2f}s (timeout {fault['scrape_timeout_seconds']:g}s), "
            f"{fault['scrape_failed_per_round']:.1f} failed per round; {fault['dead_ejected_by_gateway']} of the dead "
            f"ejected by the gateway; {fault['requests']} requests, {fault['request_errors']} errors"
        )

    def _time_pages(self, stack: Stack, figures: fleet.SizeFigures) -> None:
        client = Client()
        client.force_login(stack.user)

        def server_ms(url: str, trials: int = 3) -> float:
            """The median wall-clock time of ``trials`` requests; their median
            CPU time in this process (the database's apart) into ``figures.page_cpu_ms``:
            on a machine others share, wall-clock time is mostly waiting for a core."""
            times, cpu = [], []
            for _ in range(trials):
                started, cpu_started = time.perf_counter(), time.process_time()
                reply = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
                cpu.append((time.process_time() - cpu_started) * 1000)
                if reply.status_code != 200:
                    raise CommandError(f"{url} answered {reply.status_code}")
            figures.page_cpu_ms[url] = statistics.median(cpu)
            return statistics.median(times)

        figures.fleet_page_ms = server_ms(reverse("fleet"))
        figures.rollouts_page_ms = server_ms(reverse("rollouts"))
        figures.figures_page_ms = server_ms(reverse("metrics-overview"))
        figures.panel_ms = server_ms(reverse("metrics-panel"))
        started = time.perf_counter()
        AdvisorReport.refresh_all()
        figures.advisor_refresh_ms = (time.perf_counter() - started) * 1000
        figures.advisor_page_ms = server_ms(reverse("advisor"))
        figures.alert_interval_seconds = alerts_conf.ALERT_EVAL_INTERVAL.get()
        cycles = []
        for _ in range(3):
            started = time.perf_counter()
            evaluation.evaluate(timezone.now())
            cycles.append((time.perf_counter() - started) * 1000)
        figures.alert_cycle_ms = statistics.median(cycles)

    def _time_rollout(self, stack: Stack, figures: fleet.SizeFigures) -> None:
        canary = Worker.objects.filter(pool=stack.pools["canary"])
        figures.num_canary_workers = canary.count()
        with httpx.Client(
            base_url=f"{stack.web_url}/api/v1", timeout=30, headers={"Authorization": f"Token {stack.api_token}"}
        ) as client:
            started = time.perf_counter()
            reply = client.post(
                "/rollouts/",
                json={
                    "model": stack.model,
                    "stable_pool": stack.pools["stable"].name,
                    "canary_pool": stack.pools["canary"].name,
                    "target_revision": stack.target_revision.pk,
                    "gate": {"enabled": False},
                    "steps": [{"set_weight": 5000}, {"pause": {}}],
                },
            )
            if reply.status_code != 201:
                raise CommandError(f"could not start a rollout: {reply.status_code} {reply.text}")
            rollout_id = reply.json()["id"]

            def phase() -> Phase:
                return Phase(Rollout.objects.values_list("phase", flat=True).get(pk=rollout_id))

            timeout = 120 + figures.num_canary_workers
            wait_until(lambda: phase() == Phase.PAUSED, timeout, "the canary pool on the target at 50%", interval=0.1)
            figures.rollout_step_seconds = time.perf_counter() - started

            started = time.perf_counter()
            reply = client.post(f"/rollouts/{rollout_id}/abort/", json={"reason": "bench"})
            if reply.status_code != 200:
                raise CommandError(f"abort answered {reply.status_code}: {reply.text}")
            table_id = stack.table.pk

            def canary_off() -> int | None:
                table = RoutingTable.objects.get(pk=table_id)
                return table.epoch if table.weights().get("canary") == 0 else None

            epoch = wait_until(canary_off, 30, "canary weight 0", interval=0.01)
            status = bus.wait_for_acks(table_id, epoch, 30)
            if not status.complete:
                raise CommandError(f"gateways never acked epoch {epoch}: {status.as_dict()}")
            figures.abort_acked_ms = (time.perf_counter() - started) * 1000

            def all_on_stable() -> bool:
                return not canary.exclude(running_revision=stack.stable_revision).exists()

            wait_until(all_on_stable, timeout, "every canary worker back on stable", interval=0.1)
            figures.abort_all_on_stable_seconds = time.perf_counter() - started
            wait_until(lambda: phase() == Phase.ABORTED, 60, "the abort to finish", interval=0.2)

    # ---- the report ---------------------------------------------------------------------

    def _report(self, results: list[fleet.SizeFigures], options: dict[str, Any]) -> None:
        self.stdout.write(f"{'workers':<52}" + "".join(f"{r.workers:>14}" for r in results))
        for label, cell in REPORT_ROWS:
            self.stdout.write(f"{label:<52}" + "".join(f"{cell(r):>14}" for r in results))
        for name in fleet.PROCESSES:
            per_worker = "".join(f"{_num(r.cpu_per_worker_minute(name), '.3f'):>14}" for r in results)
            self.stdout.write(f"{'CPU s per worker per minute: ' + name:<52}" + per_worker)
            self.stdout.write(
                f"{'  ' + name + ' cores':<52}" + "".join(f"{_num(r.cores(name), '.2f'):>14}" for r in results)
            )
        for r in results:
            tables = ", ".join(f"{t} {n:.0f}" for t, n in list(r.rows_by_table.items())[:5])
            self.stdout.write(f"{r.workers} workers: rows/min by table: {tables}")

        heartbeat_interval = fleet_conf.HEARTBEAT_INTERVAL_SECONDS.get()
        model = fleet.CostModel.fit(
            results,
            heartbeat_interval_seconds=heartbeat_interval,
            heartbeat_target_rate=fleet_conf.HEARTBEAT_TARGET_RATE.get(),
            heartbeat_interval_max_seconds=fleet_conf.HEARTBEAT_INTERVAL_MAX_SECONDS.get(),
        )
        self.stdout.write(
            f"cost model, per unit of work: web {model.web_seconds_per_heartbeat * 1000:.2f} ms CPU per heartbeat, "
            f"Celery {model.celery_seconds_per_scrape * 1000:.2f} ms per worker scraped, gateway "
            f"{model.gateway_seconds_per_request * 1000:.2f} ms per request; {model.rows_per_heartbeat:.2f} rows per "
            f"heartbeat, {model.rows_per_scrape:.2f} rows and {model.bytes_per_scrape / 1024:.1f} KiB per scrape"
        )
        for size in PROJECT_TO:
            # as told by the control plane (scaled with the fleet), and fixed at the configured interval
            for interval in (None, heartbeat_interval):
                p = model.project(size, heartbeat_interval_seconds=interval)
                cores = ", ".join(f"{name} {c:.2f}" for name, c in p.cores.items())
                every = f"{model.heartbeat_interval_at(size):g}s (scaled)" if interval is None else f"{interval:g}s"
                self.stdout.write(
                    f"  {size:>6} workers, heartbeat every {every}: cores {cores}; DB {p.rows_per_second:.0f} "
                    f"rows/s, {p.database_gib_per_day:.1f} GiB/day of snapshots before retention; one scrape round "
                    f"{p.scrape_round_cpu_seconds:.1f} CPU s (timeout {model.scrape_timeout_seconds:g}s)"
                )
        self.stdout.write("  where one process of each loop misses its interval:")
        for what, at in model.misses():
            self.stdout.write(f"    {what}: at {'never' if math.isinf(at) else f'~{at:,.0f}'} workers")
        if options.get("json") is not None:
            payload = {
                "sizes": [dataclasses.asdict(r) for r in results],
                "model": dataclasses.asdict(model),
                "projections": [dataclasses.asdict(model.project(n)) for n in PROJECT_TO],
                "misses": model.misses(),
            }
            options["json"].write_text(json.dumps(payload, indent=2, default=str))
