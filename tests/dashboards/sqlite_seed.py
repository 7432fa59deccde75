"""Seeds a fresh embedded-default (SQLite) database so that every list in
the web UI has a row and every detail page exists: a fleet (pools,
profiles and their revisions, workers), a rollout with a measurement, a
finished experiment and its workload, a request, a firing alert with a
transition and a delivery, a silence, and the audit rows these leave.

Run by ``tests/dashboards/test_sqlite_walk.py`` in a child process on the
server's data directory (``python -m tests.dashboards.sqlite_seed USER
PASSWORD``); prints the seeded ids as JSON."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import django


def main(username: str, password: str) -> dict[str, int]:
    django.setup()
    from django.utils import timezone

    from controlplane.accounts.roles import Role
    from controlplane.alerts.lifecycle import AlertState
    from controlplane.alerts.models import AlertTransition, Delivery, Receiver, Silence
    from controlplane.gateway.models import RequestLog
    from controlplane.rollouts.models import AnalysisRun, Measurement, Rollout
    from tests.controlplane.alerts.support import firing_alert
    from tests.controlplane.factories import make_user
    from tests.controlplane.rollouts.factories import make_fleet
    from tests.dashboards.experiments.test_pages import finished_experiment

    now = timezone.now()
    # staff and superuser as the demo's admin is, so that the walk reaches the admin's lists too
    user = make_user(Role.ADMIN, username=username, password=password)
    user.is_staff = user.is_superuser = True
    user.save(update_fields=["is_staff", "is_superuser"])
    fleet = make_fleet(num_stable=1, num_canary=1)
    rollout = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 2500}, {"pause": {}}],
        gate={"enabled": False},
        actor="walk",
    )
    run = AnalysisRun.objects.create(
        rollout=rollout,
        attempt=1,
        step_index=0,
        template_name="default",
        canary_pool_name=fleet.canary.name,
        baseline_pool_name=fleet.stable.name,
        started_at=now,
        phase=5,
        message="ttft: 1 failed > 0",
        spec={"metrics": [{"name": "ttft", "figure": "client_ttft_p99"}], "count": 3, "interval_seconds": 30},
    )
    Measurement.objects.create(
        run=run,
        taken_at=now,
        window_seconds=30,
        phase=5,
        verdicts=[
            {
                "metric": "ttft",
                "figure": "client_ttft_p99",
                "phase": "failed",
                "canary": 0.91,
                "baseline": 0.2,
                "canary_samples": 40,
                "baseline_samples": 300,
                "ratio": 4.55,
                "reason": "canary 4.55× the baseline > 1.5×",
            }
        ],
    )
    experiment = finished_experiment()
    request = RequestLog.objects.create(
        request_id="walk-1",
        created_at=now,
        model=fleet.table.model,
        cohort="stable",
        pool=fleet.stable,
        worker=fleet.workers["stable"][0],
        status=200,
        prefill_mode="chunked",
        prompt_split=True,
        num_prefill_chunks=2,
        ttft_seconds=0.1,
    )
    alert = firing_alert({"alertname": "WalkAlert", "pool": fleet.stable.name}, now)
    AlertTransition.objects.create(
        alert=alert,
        fingerprint=alert.fingerprint,
        from_state=AlertState.PENDING,
        to_state=AlertState.FIRING,
        value=2.0,
        reason="held",
        at=now,
    )
    receiver = Receiver.objects.create(name="ops", kind="webhook", url="http://127.0.0.1:9/hook")
    Delivery.objects.create(
        receiver=receiver,
        reason="first notification",
        payload={},
        fingerprints=[alert.fingerprint],
        status=Delivery.SENT,
        next_attempt_at=now,
        created_at=now,
        sent_at=now,
    )
    Silence.objects.create(
        matchers=[{"name": "alertname", "value": "Other", "isRegex": False, "isEqual": True}],
        starts_at=now,
        ends_at=now + timedelta(hours=1),
        comment="walk",
        created_by=username,
    )
    return {
        "alert": alert.pk,
        "rollout": rollout.pk,
        "experiment": experiment.pk,
        "workload": experiment.workload_id,
        "request": request.pk,
        "worker": fleet.workers["stable"][0].pk,
        "profile": fleet.target_revision.profile_id,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
