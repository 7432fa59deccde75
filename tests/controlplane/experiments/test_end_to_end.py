"""End to end on a real stack: the control plane's web server, a gateway,
a Celery worker with beat, and two reference workers on the tiny model in
one pool that takes all of a model's traffic, with ``loadgen`` traffic
through the gateway the whole time.

1. An experiment with short arms on one of the two workers runs every arm,
   the worker ends on its previous revision and cordon, and the gateway
   routed no client request to it meanwhile (the other worker took them).
2. A second experiment: the Celery worker is killed mid-arm; another one
   (its beat sweeper) resumes it, and no arm and no repeat runs twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.experiments.models import Experiment, Workload
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway.models import ClientKey, PoolSpec, RequestLog, RoutingTable
from controlplane.launcher import Enrollment, celery_worker_argv, gateway_argv, web_argv, worker_argv
from controlplane.profiles.models import Profile
from tests.conftest import RUN_ID, control_plane_env
from tests.controlplane.factories import make_user
from tests.support import Process, Traffic, child_env, free_port, running, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
logging.getLogger("httpx").setLevel(logging.WARNING)

MAX_MODEL_LEN = 1024
MODEL = "tiny-model"
WEB_ENV = {"HEARTBEAT_INTERVAL_SECONDS": "0.5"}
GATEWAY_ENV = {
    "GATEWAY_POLL_SECONDS": "0.5",
    "GATEWAY_HEARTBEAT_SECONDS": "0.3",
    "GATEWAY_LIVENESS_TTL_SECONDS": "3",
    "GATEWAY_LOG_FLUSH_SECONDS": "0.2",
}
CELERY_ENV = {
    "EXPERIMENT_LEASE_SECONDS": "3",
    "EXPERIMENT_SWEEP_INTERVAL_SECONDS": "1",
    "EXPERIMENT_DRAIN_TIMEOUT_SECONDS": "20",
    "EXPERIMENT_APPLY_TIMEOUT_SECONDS": "90",
}
ARMS = [
    {
        "name": "baseline",
        "fields": {"prefill_mode": "monolithic", "max_num_batched_tokens": MAX_MODEL_LEN, "max_num_seqs": 16},
    },
    {
        "name": "chunk-64",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 64,
            "max_num_seqs": 16,
        },
    },
    {
        "name": "chunk-128",
        "fields": {
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 256,
            "long_prefill_token_threshold": 128,
            "max_num_seqs": 16,
        },
    },
]


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


def celery_argv(n: int, tmp: Path) -> list[str]:
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    return celery_worker_argv(f"exp-{RUN_ID}-{n}@%h", queue=queue, pool="solo", beat_schedule=tmp / f"beat-{n}")


@contextlib.contextmanager
def stack_up(tmp: Path, tiny_model: Path, pool: Pool) -> Iterator[Stack]:
    s = Stack()
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str], env: dict[str, str]) -> Process:
            s.procs[name] = stack.enter_context(running(argv, env=env, log_path=tmp / f"{name}.log"))
            return s.procs[name]

        web_port, gw_port = free_port(), free_port()
        s.web, s.gateway = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{gw_port}"
        web = start(
            "web",
            web_argv(web_port, log_level="warning"),
            control_plane_env(**WEB_ENV),
        )
        gateway = start(
            "gateway",
            gateway_argv(gw_port, log_level="warning"),
            control_plane_env(**GATEWAY_ENV),
        )
        for i in range(2):
            _, token = EnrollmentToken.issue(f"exp {i}", pool=pool, max_uses=1)
            port = free_port()
            name = f"exp-{i}"
            enrollment = Enrollment(s.web, token, name, tmp / f"{name}.state", advertise_url=f"http://127.0.0.1:{port}")
            argv = worker_argv(
                tiny_model, port, max_model_len=MAX_MODEL_LEN, device="cpu", log_level="warning", enrollment=enrollment
            )
            start(name, argv, child_env())
        web.wait_http(f"{s.web}/login/", timeout=90)
        gateway.wait_http(f"{s.gateway}/health", timeout=90)
        yield s


def state(stack: Stack, experiment_id: int) -> dict[str, Any]:
    reply = stack.api("GET", f"/experiments/{experiment_id}/")
    assert reply.status_code == 200, reply.text
    return reply.json()


def finished(stack: Stack, experiment_id: int) -> dict[str, Any] | None:
    data = state(stack, experiment_id)
    return data if data["phase"] in ("succeeded", "aborted", "failed") else None


def start_experiment(stack: Stack, workload: Workload, worker: str, name: str, repeats: int = 1) -> int:
    reply = stack.api(
        "POST",
        "/experiments/",
        {
            "name": name,
            "workload": workload.pk,
            "workers": [worker],
            "arms": ARMS,
            "duration_seconds": 4,
            "warmup_seconds": 1,
            "repeats": repeats,
            "objectives": {"ttft_ms": 60000, "tpot_ms": 10000},
        },
    )
    assert reply.status_code == 201, reply.text
    return int(reply.json()["id"])


def test_an_experiment_runs_every_arm_out_of_traffic_and_resumes_after_its_worker_is_killed(
    tiny_model: Path, tmp_path: Path
) -> None:
    profile = Profile.objects.create(name="exp-e2e", engine_kind="reference")
    serving = profile.add_revision({"prefill_mode": "chunked", "max_num_batched_tokens": 256, "max_num_seqs": 16})
    pool = Pool.objects.create(name="exp-serving")
    pool.set_desired_revision(serving)
    key = ClientKey.issue("loadgen")[1]
    workload = Workload.from_scenario(name="burst", scenario="burst", rate=1.0, duration_seconds=60)

    with stack_up(tmp_path, tiny_model, pool) as stack:
        stack.token = Token.objects.create(user=make_user(Role.OPERATOR)).key
        wait_until(
            lambda: Worker.objects.filter(state=Worker.State.READY, running_revision=serving).count() == 2,
            timeout=240,
            what="two workers ready",
            detail=stack.logs,
        )
        table = RoutingTable.create_audited(MODEL, actor="test")
        table.configure([PoolSpec(pool, "stable", 10000)], actor="test")
        lab, other = Worker.objects.get(name="exp-1"), Worker.objects.get(name="exp-0")
        n = 0
        celery = stack.procs["celery-0"] = Process(
            celery_argv(n, tmp_path), env=control_plane_env(**CELERY_ENV), log_path=tmp_path / "celery-0.log"
        )
        try:
            celery.wait_for_output("ready.", timeout=90)
            with Traffic(stack.gateway, key, rate=0.5, duration=8, timeout=300) as traffic:
                # 1. every arm, out of traffic, and back
                first_id = start_experiment(stack, workload, lab.name, "sweep")
                first = wait_until(
                    lambda: finished(stack, first_id),
                    timeout=600,
                    what="the first experiment to finish",
                    detail=stack.logs,
                )
                assert first["phase"] == "succeeded", json.dumps(first, indent=1)
                assert [a["status"] for a in first["arms"]] == ["succeeded"] * 3, first["arms"]
                for arm in first["arms"]:
                    assert arm["attempts"] == 1 and len(arm["results"]) == 1
                    figures = arm["results"][0]["figures"]
                    assert figures["output_throughput"] > 0 and figures["failed_requests"] == 0, figures
                    assert figures["client_ttft_p99"] is not None and figures["memory_mean_bytes"], figures
                assert first["recommendation"]["reasons"], first["recommendation"]
                lab.refresh_from_db()
                assert (lab.desired_revision_id, lab.cordoned) == (None, False)
                assert lab.running_revision_id == serving.pk  # back on what it ran before
                exp = Experiment.objects.get(pk=first_id)
                assert exp.started_at is not None and exp.finished_at is not None
                routed = RequestLog.objects.filter(created_at__gte=exp.started_at, created_at__lte=exp.finished_at)
                assert routed.filter(worker=other).exists(), "client traffic flowed meanwhile"
                # Out of traffic from started_at until the runner put it back
                # (uncordoned, then waited for its revision before finished_at):
                # requests after the restore may reach it, as they should.
                restored = (
                    AuditEvent.objects.filter(action="worker.restore", object_id=str(lab.pk), time__gte=exp.started_at)
                    .order_by("time")
                    .values_list("time", flat=True)
                    .first()
                )
                out = routed.filter(created_at__lt=restored) if restored is not None else routed
                reached = list(out.filter(worker=lab).values_list("created_at", "status", "error"))
                assert not reached, f"no client request reached the lab worker (out at {exp.started_at}): {reached}"
                print(
                    "e2e experiment: "
                    + "; ".join(
                        f"{a['name']} {a['results'][0]['figures']['output_throughput']:.1f} tok/s"
                        for a in first["arms"]
                    )
                    + f"; recommendation: {first['recommendation']['reasons'][0]}"
                )

                # 2. the Celery worker killed mid-run: another resumes, no repeat twice
                second_id = start_experiment(stack, workload, lab.name, "killed", repeats=2)
                wait_until(
                    lambda: any(a["index"] == 1 and a["results"] for a in state(stack, second_id)["arms"]),
                    timeout=600,
                    what="the second arm's first repeat",
                    detail=stack.logs,
                )
                celery.kill(signal.SIGKILL)
                celery.stop()
                before = {a["name"]: a for a in state(stack, second_id)["arms"]}
                n += 1
                celery = stack.procs[f"celery-{n}"] = Process(
                    celery_argv(n, tmp_path), env=control_plane_env(**CELERY_ENV), log_path=tmp_path / f"celery-{n}.log"
                )
                celery.wait_for_output("ready.", timeout=90)
                second = wait_until(
                    lambda: finished(stack, second_id),
                    timeout=600,
                    what="the resumed experiment to finish",
                    detail=stack.logs,
                )
            assert traffic.summaries, "loadgen ran"
        finally:
            celery.stop()
        assert second["phase"] == "succeeded", json.dumps(second, indent=1)
        arms = {a["name"]: a for a in second["arms"]}
        assert all(a["status"] == "succeeded" for a in arms.values()), arms
        for name, arm in arms.items():
            repeats = [r["repeat"] for r in arm["results"]]
            assert sorted(repeats) == [0, 1], (name, repeats)  # each repeat exactly once
        for name, arm in arms.items():  # what was stored before the kill stands: never rerun
            assert all(r in arm["results"] for r in before[name]["results"]), name
        # Arms interleave (repeat 0: baseline, chunk-64, chunk-128; repeat 1 rotated); the
        # one repeat under way when the worker died was started again, and only it.
        attempts = sorted(a["attempts"] for a in arms.values())
        assert attempts in ([1, 1, 1], [1, 1, 2]), attempts
        lab.refresh_from_db()
        assert (lab.desired_revision_id, lab.cordoned) == (None, False)
