"""Simulated GPU workers end to end, exactly as reference workers: they
enroll, serve the OpenAI API through the gateway, are scraped, take a
rollout and a rollback, and run an experiment arm.

One process hosts the two stable workers (``serve --count 2``), another the
canary; all three simulate an H200 serving a Llama-3.1-8B-shaped model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token

from controlplane.accounts.roles import Role
from controlplane.experiments.models import Workload
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway.models import ClientKey, PoolSpec, RequestLog, RoutingTable
from controlplane.launcher import Enrollment, celery_worker_argv, gateway_argv, web_argv, worker_argv
from controlplane.metrics.scrape import scrape_fleet
from controlplane.profiles.models import Profile
from tests.conftest import RUN_ID, control_plane_env
from tests.controlplane.factories import make_user
from tests.support import Process, Traffic, child_env, free_port, running, wait_until
from workers.engines.reference.tiny import SHIPPED_DIR

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
logging.getLogger("httpx").setLevel(logging.WARNING)

MODEL = "llama-8b-sim"
SIM = ("--sim-system", "h200_sxm", "--sim-model", "meta-llama/Meta-Llama-3.1-8B", "--served-model-name", MODEL)
MAX_MODEL_LEN = 8192
WEB_ENV = {"HEARTBEAT_INTERVAL_SECONDS": "0.5"}
GATEWAY_ENV = {
    "GATEWAY_POLL_SECONDS": "0.5",
    "GATEWAY_HEARTBEAT_SECONDS": "0.3",
    "GATEWAY_LIVENESS_TTL_SECONDS": "3",
    "GATEWAY_LOG_FLUSH_SECONDS": "0.2",
}
CELERY_ENV = {
    "ROLLOUT_ACK_WAIT_SECONDS": "2",
    "EXPERIMENT_LEASE_SECONDS": "5",
    "EXPERIMENT_SWEEP_INTERVAL_SECONDS": "1",
    "EXPERIMENT_DRAIN_TIMEOUT_SECONDS": "20",
    "EXPERIMENT_APPLY_TIMEOUT_SECONDS": "90",
}
PROFILES = {
    "monolithic": {"prefill_mode": "monolithic", "max_num_batched_tokens": MAX_MODEL_LEN},
    "chunked": {"prefill_mode": "chunked", "max_num_batched_tokens": 512},
    "chunked-2k": {"prefill_mode": "chunked", "max_num_batched_tokens": 2048},
}


class Stack:
    def __init__(self) -> None:
        self.procs: dict[str, Process] = {}
        self.web = self.gateway = ""
        self.http = httpx.Client(timeout=30)
        self.token = ""

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.output()[-3000:]}" for name, p in self.procs.items())

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.http.request(
            method, f"{self.web}/api/v1{path}", json=body, headers={"Authorization": f"Token {self.token}"}
        )


@contextlib.contextmanager
def stack_up(tmp: Path, pools: dict[str, Pool]) -> Iterator[Stack]:
    s = Stack()
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str], env: dict[str, str]) -> Process:
            s.procs[name] = stack.enter_context(running(argv, env=env, log_path=tmp / f"{name}.log"))
            return s.procs[name]

        web_port, gw_port = free_port(), free_port()
        s.web, s.gateway = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{gw_port}"
        web = start("web", web_argv(web_port, log_level="warning"), control_plane_env(**WEB_ENV))
        gateway = start("gateway", gateway_argv(gw_port, log_level="warning"), control_plane_env(**GATEWAY_ENV))
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        celery = start(
            "celery",
            celery_worker_argv(f"sim-{RUN_ID}@%h", queue=queue, pool="solo", beat_schedule=tmp / "beat"),
            control_plane_env(**CELERY_ENV),
        )
        for role, count in (("stable", 2), ("canary", 1)):
            _, token = EnrollmentToken.issue(f"sim {role}", pool=pools[role], max_uses=count)
            port = free_port(count)
            enrollment = Enrollment(s.web, token, f"sim-{role}", tmp / f"sim-{role}.state")
            argv = worker_argv(
                SHIPPED_DIR,
                port,
                engine="sim",
                max_model_len=MAX_MODEL_LEN,
                log_level="warning",
                enrollment=enrollment,
                extra=(*SIM, "--count", str(count)),
            )
            start(f"sim-{role}", argv, child_env())
        web.wait_http(f"{s.web}/login/", timeout=90)
        gateway.wait_http(f"{s.gateway}/health", timeout=90)
        celery.wait_for_output("ready.", timeout=90)
        yield s


def finished(stack: Stack, path: str, phases: tuple[str, ...]) -> dict[str, Any] | None:
    reply = stack.api("GET", path)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data if data["phase"] in phases else None


def test_simulated_workers_enroll_serve_are_scraped_roll_out_roll_back_and_run_an_experiment_arm(
    tmp_path: Path,
) -> None:
    profile = Profile.objects.create(name="sim-e2e", engine_kind="sim")
    revisions = {name: profile.add_revision(fields, comment=name) for name, fields in PROFILES.items()}
    pools = {role: Pool.objects.create(name=f"sim-{role}") for role in ("stable", "canary")}
    for pool in pools.values():
        pool.set_desired_revision(revisions["monolithic"])
    key = ClientKey.issue("loadgen")[1]

    with stack_up(tmp_path, pools) as stack:
        stack.token = Token.objects.create(user=make_user(Role.OPERATOR)).key
        wait_until(
            lambda: (
                Worker.objects.filter(state=Worker.State.READY, running_revision=revisions["monolithic"]).count() == 3
            ),
            timeout=240,
            what="three simulated workers ready",
            detail=stack.logs,
        )
        workers = list(Worker.objects.order_by("name"))
        assert [w.name for w in workers] == ["sim-canary", "sim-stable-0", "sim-stable-1"]
        for w in workers:
            assert w.engine_kind == "sim" and w.simulated
            assert w.hardware["name"] == "H200 SXM (simulated)" and w.hardware["sim"]["system"] == "h200_sxm"
        listed = stack.api("GET", "/workers/").json()
        rows = listed["results"] if isinstance(listed, dict) else listed
        assert {r["name"]: r["simulated"] for r in rows} == {w.name: True for w in workers}

        table = RoutingTable.create_audited(MODEL, actor="test")
        table.configure([PoolSpec(pools["stable"], "stable", 10000), PoolSpec(pools["canary"], "canary", 0)], actor="t")
        with Traffic(stack.gateway, key, rate=2.0, duration=10, loops=2, stagger=5) as traffic:
            # scraped: the scraper reads each simulated worker's /metrics, with a GPU's memory
            round_ = scrape_fleet()
            assert (round_.num_targets, round_.num_failed) == (3, 0)

            # a rollout to chunked, promoted
            reply = stack.api(
                "POST",
                "/rollouts/",
                {
                    "model": MODEL,
                    "stable_pool": "sim-stable",
                    "canary_pool": "sim-canary",
                    "target_revision": revisions["chunked"].pk,
                    "progress_deadline_seconds": 300,
                    "steps": [{"set_weight": 5000}, {"set_weight": 10000}],
                },
            )
            assert reply.status_code == 201, reply.text
            first = wait_until(
                lambda: finished(stack, f"/rollouts/{reply.json()['id']}/", ("succeeded", "aborted")),
                timeout=300,
                what="the rollout to finish",
                detail=stack.logs,
            )
            assert first["phase"] == "succeeded", json.dumps(first["timeline"], indent=1)
            # then one paused at 50% and rolled back by hand
            reply = stack.api(
                "POST",
                "/rollouts/",
                {
                    "model": MODEL,
                    "stable_pool": "sim-stable",
                    "canary_pool": "sim-canary",
                    "target_revision": revisions["chunked-2k"].pk,
                    "progress_deadline_seconds": 300,
                    "steps": [{"set_weight": 5000}, {"pause": {}}],
                },
            )
            assert reply.status_code == 201, reply.text
            second_id = reply.json()["id"]
            wait_until(
                lambda: finished(stack, f"/rollouts/{second_id}/", ("paused",)),
                timeout=300,
                what="the second rollout to pause",
                detail=stack.logs,
            )
            assert stack.api("POST", f"/rollouts/{second_id}/abort/", {"reason": "rollback"}).status_code == 200
            second = wait_until(
                lambda: finished(stack, f"/rollouts/{second_id}/", ("aborted",)),
                timeout=300,
                what="the rollback",
                detail=stack.logs,
            )
            assert second["weights"]["canary"] == 0
            wait_until(
                lambda: set(Worker.objects.values_list("running_revision", flat=True)) == {revisions["chunked"].pk},
                timeout=120,
                what="every simulated worker back on the promoted revision",
                detail=stack.logs,
            )
        assert traffic.num_requests > 20, traffic.summaries
        assert sum(s["failed_requests"] for s in traffic.summaries) == 0, traffic.summaries
        assert RequestLog.objects.filter(worker__engine_kind="sim", status=200).count() > 20

        # an experiment arm on a simulated lab worker
        lab = Worker.objects.get(name="sim-canary")
        workload = Workload.from_scenario(name="burst-sim", scenario="burst", rate=2.0, duration_seconds=30)
        reply = stack.api(
            "POST",
            "/experiments/",
            {
                "name": "sim-arm",
                "workload": workload.pk,
                "workers": [lab.name],
                "arms": [{"name": "chunk-512", "fields": PROFILES["chunked"]}],
                "duration_seconds": 4,
                "warmup_seconds": 1,
                "repeats": 1,
                "objectives": {"ttft_ms": 60000, "tpot_ms": 10000},
            },
        )
        assert reply.status_code == 201, reply.text
        done = wait_until(
            lambda: finished(stack, f"/experiments/{reply.json()['id']}/", ("succeeded", "aborted", "failed")),
            timeout=300,
            what="the experiment to finish",
            detail=stack.logs,
        )
        assert done["phase"] == "succeeded", json.dumps(done, indent=1)[:3000]
        (arm,) = done["arms"]
        figures = arm["results"][0]["figures"]
        assert figures["failed_requests"] == 0 and figures["output_throughput"] > 0, figures
        assert figures["memory_mean_bytes"] > 10e9, figures  # an 8B model's weights on the simulated GPU
