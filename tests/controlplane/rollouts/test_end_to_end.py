"""End to end on a real stack: the control plane's web server (ASGI), a
Celery worker, a gateway, three reference workers on the tiny model (two
stable, one canary) run by their agents, and ``python -m workers loadgen``
traffic through the gateway the whole time.

One stack, three rollouts in a row (two cores do not have room for three
stacks):

1. monolithic → chunked, through the consistency gate, an analysis and
   promotion (the stable pool moves one worker at a time): it succeeds;
2. a regressed profile (one sequence at a time, tiny chunks): the analysis
   fails and the rollout aborts by itself;
3. a fine profile, paused at 25%: an operator aborts it through the API.

Across all three, no client request fails: loadgen's own counts and the
gateway's request log agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token

from controlplane.accounts.roles import Role
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway.models import ClientKey, PoolSpec, RequestLog, RoutingTable
from controlplane.launcher import Enrollment, celery_worker_argv, gateway_argv, web_argv, worker_argv
from controlplane.metrics.query import is_failed
from controlplane.profiles.models import Profile
from controlplane.rollouts.models import AnalysisTemplate, Rollout
from tests.conftest import control_plane_env
from tests.controlplane.factories import make_user
from tests.support import Process, Traffic, child_env, free_port, running, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
logging.getLogger("httpx").setLevel(logging.WARNING)

MAX_MODEL_LEN = 1024
MODEL = "tiny-model"  # the served name: the checkpoint directory's
WEB_ENV = {"HEARTBEAT_INTERVAL_SECONDS": "0.5"}
GATEWAY_ENV = {
    "GATEWAY_POLL_SECONDS": "0.5",
    "GATEWAY_HEARTBEAT_SECONDS": "0.3",
    "GATEWAY_LIVENESS_TTL_SECONDS": "3",
    "GATEWAY_LOG_FLUSH_SECONDS": "0.2",
}
PROFILES = {
    "stable": {"prefill_mode": "monolithic", "max_num_batched_tokens": MAX_MODEL_LEN},
    "chunked": {"prefill_mode": "chunked", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
    # one sequence at a time, 16 tokens a step: prompts take dozens of steps, requests queue behind each other
    "regressed": {
        "prefill_mode": "chunked",
        "max_num_batched_tokens": 16,
        "long_prefill_token_threshold": 16,
        "max_num_seqs": 1,
    },
    "chunked-128": {"prefill_mode": "chunked", "max_num_batched_tokens": 512, "long_prefill_token_threshold": 128},
}


class Stack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, Process] = {}
        self.web = self.gateway = ""
        self.api = httpx.Client(timeout=30)
        self.last: dict[str, Any] | None = None  # the last rollout read, for the failure report

    def logs(self) -> str:
        procs = "\n".join(f"--- {name} ---\n{p.output()[-3000:]}" for name, p in self.procs.items())
        return f"{describe(self.last) if self.last else ''}\n{procs}"


@contextlib.contextmanager
def stack_up(tmp: Path, tiny_model: Path) -> Iterator[Stack]:
    from django.conf import settings

    s = Stack(tmp)
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
        celery = start(
            "celery",
            celery_worker_argv(f"e2e-{gw_port}@%h", queue=settings.CELERY_TASK_DEFAULT_QUEUE, pool="solo"),
            control_plane_env(ROLLOUT_ACK_WAIT_SECONDS="2"),
        )
        gateway = start(
            "gateway",
            gateway_argv(gw_port, log_level="warning"),
            control_plane_env(**GATEWAY_ENV),
        )
        for role, pool in (("stable", "e2e-stable"), ("stable", "e2e-stable"), ("canary", "e2e-canary")):
            _, token = EnrollmentToken.issue(f"e2e {role}", pool=Pool.objects.get(name=pool), max_uses=1)
            port = free_port()
            name = f"{pool}-{port}"
            enrollment = Enrollment(s.web, token, name, tmp / f"{name}.state", advertise_url=f"http://127.0.0.1:{port}")
            argv = worker_argv(
                tiny_model, port, max_model_len=MAX_MODEL_LEN, device="cpu", log_level="warning", enrollment=enrollment
            )
            start(name, argv, child_env())
        web.wait_http(f"{s.web}/login/", timeout=90)
        gateway.wait_http(f"{s.gateway}/health", timeout=90)
        celery.wait_for_output("ready.", timeout=90)
        yield s


def api(stack: Stack, token: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return stack.api.request(
        method, f"{stack.web}/api/v1{path}", json=body, headers={"Authorization": f"Token {token}"}
    )


def rollout_state(stack: Stack, token: str, rollout_id: int) -> dict[str, Any]:
    stack.last = api(stack, token, "GET", f"/rollouts/{rollout_id}/").json()
    return stack.last


def finished(stack: Stack, token: str, rollout_id: int) -> dict[str, Any] | None:
    data = rollout_state(stack, token, rollout_id)
    stack.last = data
    return data if data["finished"] else None


def describe(data: dict[str, Any]) -> str:
    lines = [f"{e['time']} {e['kind']}: {e['message']}" for e in data["timeline"]]
    lines += [json.dumps(m["verdicts"]) for run in data["analysis_runs"] for m in run["measurements"]]
    return "\n".join(lines)


def test_rollouts_promote_abort_on_regression_and_abort_by_hand_with_no_failed_request(
    tiny_model: Path, tmp_path: Path
) -> None:
    profile = Profile.objects.create(name="e2e", engine_kind="reference")
    revisions = {name: profile.add_revision(fields, comment=name) for name, fields in PROFILES.items()}
    pools = {}
    for role in ("stable", "canary"):
        pools[role] = Pool.objects.create(name=f"e2e-{role}")
        pools[role].set_desired_revision(revisions["stable"])
    # Passes unless the canary is absurdly worse; rounds with too few finished
    # requests (a loaded machine finishes few) count, rather than pause.
    AnalysisTemplate.objects.create(
        name="lenient",
        interval_seconds=4,
        count=2,
        initial_delay_seconds=4,
        window_seconds=10,
        inconclusive_limit=2,
        metrics=[
            {"name": "ttft", "figure": "client_ttft_p99", "max_ratio": 20, "floor": 5, "min_samples": 2},
            {"name": "errors", "figure": "error_rate", "test": "error_rate", "floor": 0.01, "min_samples": 2},
        ],
    )
    # Fails at the first failed measurement; tolerates a few rounds with too
    # few finished canary requests (a slow canary finishes few).
    AnalysisTemplate.objects.create(
        name="strict",
        interval_seconds=4,
        count=6,
        initial_delay_seconds=5,
        window_seconds=12,
        inconclusive_limit=4,
        metrics=[{"name": "ttft", "figure": "client_ttft_p99", "max_ratio": 1.5, "floor": 0.1, "min_samples": 2}],
    )
    key = ClientKey.issue("loadgen")[1]
    token = Token.objects.create(user=make_user(Role.OPERATOR)).key

    with stack_up(tmp_path, tiny_model) as stack:
        wait_until(
            lambda: Worker.objects.filter(state=Worker.State.READY, running_revision=revisions["stable"]).count() == 3,
            timeout=240,
            what="three workers ready on the stable revision",
            detail=stack.logs,
        )
        table = RoutingTable.create_audited(MODEL, actor="test")
        table.configure(
            [PoolSpec(pools["stable"], "stable", 10000), PoolSpec(pools["canary"], "canary", 0)], actor="test"
        )
        started, traffic_start = time.time(), timezone.now()
        with Traffic(stack.gateway, key, rate=1.5, duration=16, loops=2, stagger=8, sticky_keys=200) as traffic:
            # 1. monolithic → chunked: gate, analysis, promotion one worker at a time
            reply = api(
                stack,
                token,
                "POST",
                "/rollouts/",
                {
                    "model": MODEL,
                    "stable_pool": "e2e-stable",
                    "canary_pool": "e2e-canary",
                    "target_revision": revisions["chunked"].pk,
                    "progress_deadline_seconds": 300,
                    "steps": [{"set_weight": 5000}, {"analysis": {"template": "lenient"}}, {"set_weight": 10000}],
                },
            )
            assert reply.status_code == 201, reply.text
            first = wait_until(
                lambda: finished(stack, token, reply.json()["id"]),
                timeout=400,
                what="the chunked rollout to finish",
                detail=stack.logs,
            )
            assert first["phase"] == "succeeded", describe(first)
            assert first["gate_status"] == "passed", first["gate_result"]
            assert first["analysis_runs"][0]["phase"] == "successful"
            kinds = [e["kind"] for e in first["timeline"]]
            assert kinds.count("worker_moved") == 2 and "pool_finalized" in kinds
            assert set(Worker.objects.filter(pool=pools["stable"]).values_list("running_revision", flat=True)) == {
                revisions["chunked"].pk
            }

            # 2. a regressed profile: the analysis fails, the rollout aborts by itself
            reply = api(
                stack,
                token,
                "POST",
                "/rollouts/",
                {
                    "model": MODEL,
                    "stable_pool": "e2e-stable",
                    "canary_pool": "e2e-canary",
                    "target_revision": revisions["regressed"].pk,
                    "progress_deadline_seconds": 300,
                    "steps": [{"set_weight": 5000}, {"analysis": {"template": "strict"}}, {"set_weight": 10000}],
                },
            )
            assert reply.status_code == 201, reply.text
            second = wait_until(
                lambda: finished(stack, token, reply.json()["id"]),
                timeout=400,
                what="the regressed rollout to finish",
                detail=stack.logs,
            )
            assert second["phase"] == "aborted", describe(second)
            assert "failed" in second["abort_reason"] and "ttft" in second["abort_reason"], second["abort_reason"]
            failed = [
                v for m in second["analysis_runs"][0]["measurements"] for v in m["verdicts"] if v["phase"] == "failed"
            ]
            assert failed and failed[0]["canary"] > failed[0]["baseline"]
            print(
                f"e2e: the regression's failed verdict: {failed[0]['reason']} "
                f"(canary {failed[0]['canary']:.3f} s, baseline {failed[0]['baseline']:.3f} s)"
            )
            assert second["weights"]["canary"] == 0

            # 3. a fine profile, paused at 25%: aborted by an operator
            reply = api(
                stack,
                token,
                "POST",
                "/rollouts/",
                {
                    "model": MODEL,
                    "stable_pool": "e2e-stable",
                    "canary_pool": "e2e-canary",
                    "target_revision": revisions["chunked-128"].pk,
                    "progress_deadline_seconds": 300,
                    "steps": [{"set_weight": 2500}, {"pause": {}}],
                },
            )
            assert reply.status_code == 201, reply.text
            third_id = reply.json()["id"]
            wait_until(
                lambda: rollout_state(stack, token, third_id)["phase"] == "paused",
                timeout=300,
                what="the third rollout to pause at 25%",
                detail=stack.logs,
            )
            paused_at = Rollout.objects.get(pk=third_id).created
            wait_until(  # the canary serves traffic before the abort takes it away
                lambda: RequestLog.objects.filter(cohort="canary", created_at__gte=paused_at).count() >= 3,
                timeout=60,
                what="requests logged from the canary at 25%",
                detail=stack.logs,
            )
            assert api(stack, token, "POST", f"/rollouts/{third_id}/abort/", {"reason": "by hand"}).status_code == 200
            third = wait_until(
                lambda: finished(stack, token, third_id),
                timeout=300,
                what="the manual abort to finish",
                detail=stack.logs,
            )
            assert third["phase"] == "aborted" and "by hand" in third["abort_reason"], describe(third)
            served = traffic.num_requests
            wait_until(  # traffic goes on after the abort, and counts below
                lambda: traffic.num_requests > served,
                timeout=60,
                what="a traffic run to end after the abort",
                interval=0.5,
            )
        # every worker is back where it belongs, and no client request failed
        assert not traffic.failures, traffic.failures
        assert traffic.num_requests >= 50, traffic.summaries
        assert sum(s["failed_requests"] for s in traffic.summaries) == 0, [
            (s["failed_requests"], s["failed_by_status"]) for s in traffic.summaries
        ]
        # The gateway writes its log in batches: wait for every request the traffic sent.
        wait_until(
            lambda: RequestLog.objects.filter(created_at__gte=traffic_start).count() >= traffic.num_requests,
            timeout=30,
            what="the request log to hold every request the traffic sent",
            detail=stack.logs,
        )
        logged = RequestLog.objects.filter(created_at__gte=Rollout.objects.order_by("created").first().created)
        bad = [(r.status, r.error, r.cohort) for r in logged if is_failed(r.status, r.error) or r.status >= 400]
        assert not bad, bad
        assert logged.filter(cohort="canary").count() > 10
        print(f"e2e: {traffic.num_requests} client requests in {time.time() - started:.0f}s, none failed")
    assert Rollout.objects.get(pk=third_id).canary_pool.desired_revision_id == revisions["chunked"].pk
