"""``python manage.py bench_abort``: from the abort API call until every
gateway has acked canary weight 0, over ``--trials`` aborts.

It makes throwaway rows (a profile, two pools, workers, a routing table, an
operator and a token; all named ``bench-abort-<id>`` and deleted
afterwards) in the configured database and starts the real processes the
path crosses: the web server (the API), a Celery worker (the reconciler)
and ``--gateways`` gateway processes, on a queue and a Redis namespace of
their own. The workers are rows whose agents this command plays (each
follows its desired revision), since no request is served here.

Each trial starts a rollout that sets the canary to 10% and pauses, waits
until every gateway routes by it, then times ``POST /rollouts/<id>/abort/``
until the routing table holds canary weight 0 and every live gateway has
acked that epoch; then waits for the rollout to finish aborting.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from controlplane.accounts.roles import Role, grant_role
from controlplane.celery import app
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway import bus
from controlplane.gateway.models import PoolSpec, RequestLog, RoutingTable
from controlplane.launcher import (
    celery_worker_argv,
    child,
    free_port,
    gateway_argv,
    wait_http,
    wait_until,
    web_argv,
)
from controlplane.profiles.models import Profile
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import Rollout
from workers import contract

GOAL_P99_MS = 1000.0


class _Rows:
    """The throwaway fleet: stable (2 workers) and canary (1) pools in one table."""

    def __init__(self, tag: str):
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        self.tag = tag
        self.profile = Profile.objects.create(name=tag)
        self.stable_revision = self.profile.add_revision({"prefill_mode": "monolithic", "max_num_batched_tokens": 512})
        self.target_revision = self.profile.add_revision(
            {"prefill_mode": "chunked", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64}
        )
        self.pools = {role: Pool.objects.create(name=f"{tag}-{role}") for role in ("stable", "canary")}
        self.workers: list[Any] = []
        for role, count in (("stable", 2), ("canary", 1)):
            pool = self.pools[role]
            pool.set_desired_revision(self.stable_revision)
            _, secret = EnrollmentToken.issue(tag, actor="system:bench", pool=pool, max_uses=count)
            for i in range(count):
                req = contract.parse_register(
                    {
                        "contract_version": contract.CONTRACT_VERSION,
                        "enroll_token": secret,
                        "name": f"{pool.name}-{i}",
                        "url": "http://127.0.0.1:9",
                        "engine_kind": "reference",
                        "model": tag,
                        "max_model_len": 512,
                        "hardware": {},
                        "labels": {},
                    }
                )
                self.workers.append(Worker.register(req)[0])
        self.follow()
        self.table = RoutingTable.create_audited(tag, actor="bench")
        self.table.configure(
            [PoolSpec(self.pools["stable"], "stable", 10000), PoolSpec(self.pools["canary"], "canary", 0)],
            actor="bench",
        )
        self.user = get_user_model().objects.create_user(username=tag)
        grant_role(self.user, Role.OPERATOR)
        self.token = Token.objects.create(user=self.user).key

    def follow(self) -> None:
        """Each worker does what its agent would: run its desired revision, ready."""
        for worker in Worker.objects.for_heartbeat().filter(pk__in=[w.pk for w in self.workers]):
            worker.record_heartbeat(
                contract.parse_heartbeat(
                    {
                        "contract_version": contract.CONTRACT_VERSION,
                        "state": "ready",
                        "load": {},
                        "running_revision_id": worker.effective_desired_revision_id(),
                        "running_profile": {},
                        "hardware": {},
                        "apply_error": None,
                    }
                )
            )

    def delete(self) -> None:
        Rollout.objects.filter(routing_table=self.table).delete()
        RequestLog.objects.filter(model=self.tag).delete()
        self.table.delete()
        Worker.objects.filter(pk__in=[w.pk for w in self.workers]).delete()
        for pool in self.pools.values():
            pool.enrollment_tokens.all().delete()
            pool.delete()
        self.profile.delete()
        self.user.delete()


class Command(BaseCommand):
    help = "Time one-click abort: from the API call until every gateway has acked canary weight 0."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--trials", type=int, default=20)
        parser.add_argument("--gateways", type=int, default=2, help="gateway processes that must ack")
        parser.add_argument("--json", action="store_true", help="print the figures as JSON too")

    def handle(self, *args: Any, **options: Any) -> None:
        tag = f"bench-abort-{uuid.uuid4().hex[:6]}"
        # A queue and a Redis namespace of their own: nobody else's gateways
        # or workers take part.
        settings.CELERY_TASK_DEFAULT_QUEUE = app.conf.task_default_queue = tag
        settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = tag  # type: ignore[index]
        rows = _Rows(tag)
        try:
            with tempfile.TemporaryDirectory(prefix="bench-abort-") as tmp:
                self._run(rows, Path(tmp), options)
        finally:
            rows.delete()

    def _child_env(self, tag: str) -> dict[str, str]:
        db = connection.settings_dict
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CELERY_QUEUE": tag,
            "CHANNELS_PREFIX": tag,
            "REDIS_URL": settings.REDIS_URL,
        }
        if db["ENGINE"].endswith("postgresql"):
            auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
            env["DATABASE_URL"] = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
        return env

    def _run(self, rows: _Rows, workdir: Path, options: dict[str, Any]) -> None:
        env = self._child_env(rows.tag)
        with contextlib.ExitStack() as stack:
            web_port = free_port()
            web_url = f"http://127.0.0.1:{web_port}"
            web = stack.enter_context(child(web_argv(web_port, log_level="warning"), workdir / "web.log", env))
            celery_argv = celery_worker_argv(f"{rows.tag}@%h", queue=rows.tag, pool="solo", log_level="WARNING")
            celery = stack.enter_context(child(celery_argv, workdir / "celery.log", env))
            for i in range(options["gateways"]):
                port = free_port()
                log = workdir / f"gateway-{i}.log"
                gw = stack.enter_context(child(gateway_argv(port, log_level="warning"), log, env))
                wait_http(f"http://127.0.0.1:{port}/health", gw, log)
            wait_http(f"{web_url}/login/", web, workdir / "web.log")
            wait_until(lambda: len(bus.live_gateways()) == options["gateways"], 30, "every gateway registered")
            if celery.poll() is not None:
                raise CommandError(f"the Celery worker exited:\n{(workdir / 'celery.log').read_text()[-2000:]}")
            stop = threading.Event()
            agents = threading.Thread(target=self._agents, args=(rows, stop), daemon=True)
            agents.start()
            stack.callback(agents.join, 5)
            stack.callback(stop.set)
            self.stdout.write(
                f"{options['gateways']} gateways, web API, one Celery worker; {options['trials']} "
                f"aborts at canary 10%; {os.cpu_count()} CPUs"
            )
            timings, api_ms = [], []
            self.reconciler_start: list[float] = []
            with httpx.Client(
                base_url=f"{web_url}/api/v1", timeout=30, headers={"Authorization": f"Token {rows.token}"}
            ) as client:
                for trial in range(options["trials"]):
                    total, call = self._trial(rows, client, trial)
                    timings.append(total)
                    api_ms.append(call)
                    self.stderr.write(
                        f"trial {trial + 1}: {total * 1000:.1f} ms (API call {call * 1000:.1f} ms, "
                        f"reconciler started at {self.reconciler_start[-1] * 1000:.1f} ms)"
                    )
        self._report(timings, api_ms, options)

    def _agents(self, rows: _Rows, stop: threading.Event) -> None:
        try:
            while not stop.wait(0.2):
                rows.follow()
        finally:
            connection.close()

    def _trial(self, rows: _Rows, client: httpx.Client, trial: int) -> tuple[float, float]:
        reply = client.post(
            "/rollouts/",
            json={
                "model": rows.tag,
                "stable_pool": rows.pools["stable"].name,
                "canary_pool": rows.pools["canary"].name,
                "target_revision": rows.target_revision.pk,
                "gate": {"enabled": False},
                "steps": [{"set_weight": 1000}, {"pause": {}}],
            },
        )
        if reply.status_code != 201:
            raise CommandError(f"could not start a rollout: {reply.status_code} {reply.text}")
        rollout_id = reply.json()["id"]

        def phase() -> Phase:
            return Phase(Rollout.objects.values_list("phase", flat=True).get(pk=rollout_id))

        wait_until(lambda: phase() == Phase.PAUSED, 60, f"trial {trial + 1}: the canary at 10%")
        table_id = rows.table.pk
        start, wall = time.perf_counter(), time.time()
        reply = client.post(f"/rollouts/{rollout_id}/abort/", json={"reason": "bench"})
        call = time.perf_counter() - start
        if reply.status_code != 200:
            raise CommandError(f"abort answered {reply.status_code}: {reply.text}")

        def canary_off() -> int | None:
            table = RoutingTable.objects.get(pk=table_id)
            return table.epoch if table.weights().get("canary") == 0 else None

        epoch = wait_until(canary_off, 30, "canary weight 0", interval=0.002)
        status = bus.wait_for_acks(table_id, epoch, 30)
        total = time.perf_counter() - start
        if not status.complete:
            raise CommandError(f"gateways never acked epoch {epoch}: {status.as_dict()}")
        wait_until(lambda: phase() == Phase.ABORTED, 60, f"trial {trial + 1}: the abort to finish")
        ticked = Rollout.objects.get(pk=rollout_id).events.filter(kind="aborting").values_list("time", flat=True)[0]
        self.reconciler_start.append(ticked.timestamp() - wall)
        return total, call

    def _report(self, timings: list[float], api_ms: list[float], options: dict[str, Any]) -> None:
        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000

        figures = {
            "trials": len(timings),
            "gateways": options["gateways"],
            "p50_ms": pct(timings, 0.5),
            "p99_ms": pct(timings, 0.99),
            "max_ms": max(timings) * 1000,
            "api_call_p50_ms": pct(api_ms, 0.5),
            "reconciler_start_p50_ms": pct(self.reconciler_start, 0.5),
        }
        self.stdout.write(
            f"abort API call → canary weight 0 acked by all {figures['gateways']} gateways ({figures['trials']} "
            f"trials): P50 {figures['p50_ms']:.1f} ms, P99 {figures['p99_ms']:.1f} ms, max {figures['max_ms']:.1f} ms "
            f"(goal: P99 <= {GOAL_P99_MS:.0f} ms); the API call itself P50 {figures['api_call_p50_ms']:.1f} ms, the "
            f"reconciler's abort tick began at P50 {figures['reconciler_start_p50_ms']:.1f} ms"
        )
        if options["json"]:
            self.stdout.write(json.dumps(figures))
