"""Debian's Alertmanager with the shipped config, in the loop both ways.

* In: Alertmanager routes an acting alert (``chunkpilot_action=
  "abort_rollout"``) to Chunkpilot's webhook, repeats it, then sends its
  resolution; the webhook acts once per fingerprint and records the end.
* End to end: the shipped ``ChunkpilotCanaryTTFTRegression`` rule, fired in
  a real Prometheus by a real regression (the canary runs a profile that
  prefills one sequence 16 tokens a step), travels Prometheus →
  Alertmanager → Chunkpilot and aborts the running rollout by the kill
  switch; the resolution follows once the aborted canary is idle.
* Out: Chunkpilot's own alerts, forwarded to an ``alertmanager`` receiver,
  are taken by a real Alertmanager's ``/api/v2/alerts``, and so is their end.

The test copies of the configs shorten intervals, ranges and ``for:``; the
shipped files keep theirs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from controlplane.alerts import notify
from controlplane.alerts.models import InboundAlert, Receiver
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.gateway.models import ClientKey, PoolSpec, RoutingTable
from controlplane.launcher import Enrollment, celery_worker_argv, gateway_argv, web_argv, worker_argv
from controlplane.metrics import deploy
from controlplane.profiles.models import Profile
from controlplane.rollouts.models import Rollout
from tests.conftest import control_plane_env
from tests.controlplane.rollouts.factories import make_fleet
from tests.monitoring import (
    alertmanager,
    alertmanager_config,
    prometheus,
    prometheus_config,
    short_rules,
)
from tests.support import Process, Traffic, child_env, free_port, running

logging.getLogger("httpx").setLevel(logging.WARNING)
REGRESSION = "ChunkpilotCanaryTTFTRegression"


def token(username: str, role: str) -> str:
    out = io.StringIO()
    call_command("createapitoken", username, role=role, create=True, stdout=out)
    return out.getvalue().strip()


def wait_for(predicate: Any, timeout: float, what: str, logs: Any = None, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met after {timeout}s\n{logs() if logs else ''}")
        time.sleep(interval)


def regression_rule() -> dict[str, Any]:
    return next(r for g in deploy.prometheus_rules()["groups"] for r in g["rules"] if r.get("alert") == REGRESSION)


def rfc3339(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.slow
def test_alertmanager_routes_an_acting_alert_to_the_webhook_which_acts_once_and_records_its_end(
    web: str, tmp_path: Path
) -> None:
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="tester",
        progress_deadline_seconds=120,
    )
    config = alertmanager_config(control_plane=web, group_interval="1s", repeat_interval="2s")
    with alertmanager(tmp_path / "am", config, {deploy.TOKEN_FILE: token("alertmanager", "operator")}) as am:
        # As Prometheus posts the shipped rule's alert.
        rule = regression_rule()
        labels = {
            "alertname": REGRESSION,
            **rule["labels"],
            "model_name": "tiny",
            "pool": fleet.canary.name,
            "cohort": "canary",
        }
        started = timezone.now()
        alert = {
            "labels": labels,
            "annotations": {"summary": "the canary is slow"},
            "startsAt": rfc3339(started),
            "endsAt": rfc3339(started + timedelta(minutes=5)),
            "generatorURL": "http://prometheus/graph",
        }
        assert am.http.post("/api/v2/alerts", json=[alert]).status_code == 200
        (held,) = am.alerts()

        wait_for(
            lambda: Rollout.objects.get(pk=rollout.pk).abort_requested,
            30,
            "the webhook to abort the rollout",
            am.proc.output,
        )
        # Alertmanager repeats it (repeat_interval 2 s): still one abort.
        wait_for(lambda: am.notifications() >= 3, 30, "two repeats of the notification", am.proc.output)
        assert Rollout.objects.get(pk=rollout.pk).events.filter(kind="abort_requested").count() == 1
        (record,) = InboundAlert.objects.all()
        assert record.fingerprint == held["fingerprint"]  # Alertmanager's, of the label set
        assert abs((record.starts_at - started).total_seconds()) < 0.001
        assert record.outcome == f"rollout {rollout.pk}: abort requested" and record.status == "firing"

        # Prometheus ends it; Alertmanager sends the resolved notification.
        ended = timezone.now()
        alert["endsAt"] = rfc3339(ended)
        assert am.http.post("/api/v2/alerts", json=[alert]).status_code == 200
        wait_for(
            lambda: InboundAlert.objects.get(pk=record.pk).status == "resolved",
            30,
            "the resolved notification recorded",
            am.proc.output,
        )
        record.refresh_from_db()
        assert abs((record.ends_at - ended).total_seconds()) < 1
        assert InboundAlert.objects.count() == 1


def test_chunkpilots_forwarded_alerts_and_their_end_are_taken_by_a_real_alertmanager(db: Any, tmp_path: Path) -> None:
    config = {"route": {"receiver": "nobody"}, "receivers": [{"name": "nobody"}]}
    with alertmanager(tmp_path / "am", config) as am:
        Receiver.objects.create(name="upstream-am", kind="alertmanager", url=am.url)
        fired = timezone.now() - timedelta(seconds=10)
        event = notify.notify_event(
            "RolloutAborted",
            labels={"rollout": "12", "pool": "gpu-a"},
            summary="Rollout 12 aborted: canary TTFT P99 1.4x baseline",
            severity="critical",
            ttl_seconds=5,
            now=fired,
        )

        def forward(at: datetime) -> None:
            deliveries = notify.dispatch(at).deliveries
            assert deliveries, "nothing forwarded"
            for delivery_id in deliveries:
                attempt = notify.deliver(delivery_id, at)
                assert attempt is not None and attempt.sent, attempt

        forward(fired)
        (held,) = am.alerts()
        assert held["labels"] == event.labels and held["status"]["state"] == "active"
        assert held["annotations"]["summary"] == "Rollout 12 aborted: canary TTFT P99 1.4x baseline"
        assert abs((datetime.fromisoformat(held["startsAt"]) - fired).total_seconds()) < 0.001

        # The event expires (5 s after it fired, 5 s ago): its end is forwarded and taken.
        forward(timezone.now())
        assert am.alerts() == []
        received = am.http.get("/metrics").text
        assert 'alertmanager_alerts_received_total{status="resolved",version="v2"} 1' in received, received


# ---- end to end ----------------------------------------------------------------------------

MODEL = "tiny-model"  # the served name: the checkpoint directory's
MAX_MODEL_LEN = 1024
PROFILES = {
    "stable": {"prefill_mode": "chunked", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
    # One sequence at a time, 16 tokens a step: requests queue behind each other.
    "regressed": {
        "prefill_mode": "chunked",
        "max_num_batched_tokens": 16,
        "long_prefill_token_threshold": 16,
        "max_num_seqs": 1,
    },
}
WEB_ENV = {"HEARTBEAT_INTERVAL_SECONDS": "0.5"}
GATEWAY_ENV = {
    "GATEWAY_POLL_SECONDS": "0.5",
    "GATEWAY_HEARTBEAT_SECONDS": "0.3",
    "GATEWAY_LIVENESS_TTL_SECONDS": "3",
    "GATEWAY_LOG_FLUSH_SECONDS": "0.2",
}


class Stack:
    def __init__(self) -> None:
        self.procs: dict[str, Process] = {}
        self.web = self.gateway = ""

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{p.output()[-2500:]}" for name, p in self.procs.items())


@contextlib.contextmanager
def stack_up(tmp: Path, tiny_model: Path, pools: dict[str, Pool]) -> Iterator[Stack]:
    """The control plane (web, Celery without beat, a gateway) and one
    reference worker per pool, each run by its agent."""
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
        celery = start(
            "celery",
            celery_worker_argv(f"am-e2e-{gw_port}@%h", queue=settings.CELERY_TASK_DEFAULT_QUEUE, pool="solo"),
            control_plane_env(ROLLOUT_ACK_WAIT_SECONDS="2"),
        )
        gateway = start(
            "gateway",
            gateway_argv(gw_port, log_level="warning"),
            control_plane_env(**GATEWAY_ENV),
        )
        for role, pool in pools.items():
            _, enroll = EnrollmentToken.issue(f"am-e2e {role}", pool=pool, max_uses=1)
            port = free_port()
            enrollment = Enrollment(
                s.web, enroll, f"am-e2e-{role}", tmp / f"{role}.state", advertise_url=f"http://127.0.0.1:{port}"
            )
            argv = worker_argv(
                tiny_model, port, max_model_len=MAX_MODEL_LEN, device="cpu", log_level="warning", enrollment=enrollment
            )
            start(role, argv, child_env())
        web.wait_http(f"{s.web}/login/", timeout=90)
        gateway.wait_http(f"{s.gateway}/health", timeout=90)
        celery.wait_for_output("ready.", timeout=90)
        yield s


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_canary_regression_fires_the_shipped_rule_and_alertmanager_has_chunkpilot_abort_the_rollout(
    tiny_model: Path, tmp_path: Path
) -> None:
    profile = Profile.objects.create(name="am-e2e", engine_kind="reference")
    revisions = {name: profile.add_revision(fields, comment=name) for name, fields in PROFILES.items()}
    pools = {role: Pool.objects.create(name=f"am-e2e-{role}") for role in ("stable", "canary")}
    for pool in pools.values():
        pool.set_desired_revision(revisions["stable"])
    key = ClientKey.issue("loadgen")[1]
    operator, viewer = token("alertmanager", "operator"), token("prometheus", "viewer")

    with stack_up(tmp_path, tiny_model, pools) as stack:
        wait_for(
            lambda: Worker.objects.filter(state=Worker.State.READY, running_revision=revisions["stable"]).count() == 2,
            240,
            "both workers ready on the stable revision",
            stack.logs,
        )
        table = RoutingTable.create_audited(MODEL, actor="test")
        table.configure(
            [PoolSpec(pools["stable"], "stable", 10000), PoolSpec(pools["canary"], "canary", 0)], actor="test"
        )
        am_config = alertmanager_config(control_plane=stack.web, group_interval="1s", repeat_interval="2s")
        with alertmanager(tmp_path / "am", am_config, {deploy.TOKEN_FILE: operator}) as am:
            # The shipped rules over 20-s ranges, firing after 5 s instead of 10 min.
            files = {"rules.yml": short_rules(window="20s", for_="5s"), deploy.TOKEN_FILE: viewer}
            config = prometheus_config(control_plane=stack.web, scrape_interval="1s", alertmanager=am.url)
            with (
                prometheus(tmp_path / "prometheus", config, files) as prom,
                Traffic(stack.gateway, key, rate=2, duration=10, sticky_keys=200) as traffic,
            ):
                stack.procs["prometheus"], stack.procs["alertmanager"] = prom.proc, am.proc
                api = httpx.Client(
                    base_url=f"{stack.web}/api/v1", headers={"Authorization": f"Token {operator}"}, timeout=30
                )
                wait_for(
                    lambda: prom.query('chunkpilot:ttft_p99:5m{cohort="stable"}'),
                    60,
                    "the stable pool's TTFT P99 recorded",
                    stack.logs,
                )
                reply = api.post(
                    "/rollouts/",
                    json={
                        "model": MODEL,
                        "stable_pool": pools["stable"].name,
                        "canary_pool": pools["canary"].name,
                        "target_revision": revisions["regressed"].pk,
                        "progress_deadline_seconds": 600,
                        "gate": {"enabled": False},
                        "steps": [{"set_weight": 5000}, {"pause": {}}],
                    },
                )
                assert reply.status_code == 201, reply.text
                rollout_id = reply.json()["id"]

                def rollout() -> dict[str, Any]:
                    return dict(api.get(f"/rollouts/{rollout_id}/").json())

                finished = wait_for(
                    lambda: (r := rollout())["finished"] and r, 300, "the rollout to finish", stack.logs, interval=1
                )
                canary = prom.by("cohort", "chunkpilot:ttft_p99:5m")
                assert finished["phase"] == "aborted", json.dumps(finished["timeline"], indent=1)
                assert REGRESSION in finished["abort_reason"] and "alertmanager webhook" in finished["abort_reason"]
                kinds = [e["kind"] for e in finished["timeline"]]
                assert kinds.count("abort_requested") == 1, kinds
                # It fired on the regression: after the canary ran the regressed
                # revision and took half the traffic.
                messages = [e["message"] for e in finished["timeline"]]
                regressed_at = next(i for i, m in enumerate(messages) if str(revisions["regressed"]) in m)
                half_at = next(i for i, m in enumerate(messages) if "canary 50%" in m)
                assert regressed_at < half_at < kinds.index("abort_requested"), messages
                (requested,) = [e for e in finished["timeline"] if e["kind"] == "abort_requested"]
                assert requested["actor"] == "alertmanager"
                print(f"\nthe abort: {finished['abort_reason']}\nTTFT P99 then: {canary}")

                # The aborted canary takes no traffic; its range empties and
                # the alert resolves, which Alertmanager tells the webhook.
                record = wait_for(
                    lambda: InboundAlert.objects.filter(labels__alertname=REGRESSION, status="resolved").first(),
                    120,
                    "the resolved notification recorded",
                    stack.logs,
                    interval=1,
                )
                assert record.ends_at is not None and record.outcome == f"rollout {rollout_id}: abort requested"
                # Repeated notifications of the same firing alert acted once.
                assert am.notifications() >= 3
                acted = InboundAlert.objects.filter(labels__alertname=REGRESSION, outcome__endswith="abort requested")
                assert acted.count() == 1
            assert not traffic.failures, traffic.failures
