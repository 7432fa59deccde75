"""The kill switch: alerts that stop a rollout by themselves.

* A firing alert of an ``abort_rollout`` rule (its selector is the canary
  cohort) asks every running rollout whose canary pool it concerns to
  abort: the pool its ``pool`` label names, else its ``worker``'s pool,
  else (a rule over the whole canary cohort) every running rollout. The
  rollout's timeline and audit row name the alert (actor
  ``alert:<alertname>``, reason with its value and fingerprint).
* An Alertmanager webhook (``POST /api/v1/alerts/webhook/``) whose firing
  alert carries ``chunkpilot_action="abort_rollout"`` and ``rollout="<id>"``
  does the same for that rollout. Each (fingerprint, startsAt) acts once,
  however often Alertmanager redelivers or repeats it.

Both only set the rollout's abort flag (``Rollout.request_abort``); the
rollout's reconciler acts on it. ``pull_all`` runs after every evaluation
cycle and asks only rollouts not already aborting, so it is idempotent and
also catches a rollout that starts (or is retried) while the alert fires.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from controlplane.alerts.engine import State
from controlplane.alerts.labels import fingerprint as fingerprint_of
from controlplane.alerts.models import (
    ACTION_ABORT,
    ACTION_LABEL,
    ROLLOUT_LABEL,
    Alert,
    InboundAlert,
)

log = logging.getLogger(__name__)


def _running_rollouts() -> Any:
    from controlplane.rollouts.models import Phase, Rollout

    return Rollout.objects.filter(phase__lt=Phase.ABORTING, abort_requested=False)


def rollouts_for(alert: Alert) -> list[Any]:
    """The running rollouts whose canary this alert is about."""
    from controlplane.fleet.models import Worker

    rollouts = _running_rollouts()
    pool = alert.labels.get("pool")
    if not pool and alert.labels.get("worker"):
        pool = Worker.objects.filter(name=alert.labels["worker"]).values_list("pool__name", flat=True).first()
    if pool:
        rollouts = rollouts.filter(canary_pool__name=pool)
    return list(rollouts)


def pull_all(now: datetime | None = None) -> list[tuple[int, int]]:
    """Ask for the abort of every running rollout a firing ``abort_rollout``
    alert concerns. Returns (alert id, rollout id) for each abort asked."""
    now = now or timezone.now()
    pulled = []
    for alert in Alert.objects.filter(state=State.FIRING, rule__action=ACTION_ABORT).select_related("rule"):
        for rollout in rollouts_for(alert):
            value = alert.value_detail or ("no data" if alert.value is None else f"{alert.value:.4g}")
            reason = f"alert {alert.name} firing ({alert.rule.describe_condition() if alert.rule else ''}; " \
                     f"value {value}; fingerprint {alert.fingerprint})"
            with transaction.atomic():
                if rollout.request_abort(f"alert:{alert.name}", reason=reason, source="alerts kill switch"):
                    Alert.objects.filter(pk=alert.pk).update(abort_requested_at=now, abort_rollout_id=rollout.pk)
                    pulled.append((alert.pk, rollout.pk))
                    log.warning("alert %s asked rollout %s to abort", alert.name, rollout.pk)
    return pulled


# ---- inbound Alertmanager webhooks --------------------------------------------------------


@dataclass
class InboundResult:
    num_alerts: int = 0
    num_acted: int = 0
    num_duplicates: int = 0
    num_ignored: int = 0
    outcomes: list[dict[str, Any]] = field(default_factory=list)


class PayloadError(ValueError):
    def __init__(self, errors: dict[str, list[str]]):
        super().__init__(str(errors))
        self.errors = errors


def parse_webhook(body: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """Check the v4 shape enough to act on it; raises PayloadError by field."""
    if not isinstance(body, Mapping):
        raise PayloadError({"non_field_errors": ["an Alertmanager webhook message (JSON object)."]})
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError({"alerts": ["a list of alerts."]})
    problems = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, Mapping) or not isinstance(alert.get("labels"), Mapping):
            problems.append(f"alerts[{i}]: an object with labels.")
        elif alert.get("status") not in ("firing", "resolved"):
            problems.append(f"alerts[{i}].status: firing or resolved.")
        elif parse_datetime(str(alert.get("startsAt", ""))) is None:
            problems.append(f"alerts[{i}].startsAt: an RFC 3339 time.")
    if problems:
        raise PayloadError({"alerts": problems})
    return str(body.get("receiver", "")), str(body.get("groupKey", "")), list(alerts)


def receive_webhook(body: Any, actor: Any, now: datetime | None = None) -> InboundResult:
    """Act on an Alertmanager webhook message: see the module's docstring."""
    from controlplane.rollouts.models import Rollout

    now = now or timezone.now()
    receiver, group_key, alerts = parse_webhook(body)
    result = InboundResult(num_alerts=len(alerts))
    for alert in alerts:
        labels = {str(k): str(v) for k, v in alert["labels"].items()}
        wants_abort = labels.get(ACTION_LABEL) == ACTION_ABORT and alert["status"] == "firing"
        rollout_id = labels.get(ROLLOUT_LABEL, "")
        if not wants_abort or not rollout_id.isdigit():
            result.num_ignored += 1
            continue
        fp = str(alert.get("fingerprint") or fingerprint_of(labels))
        starts_at = parse_datetime(str(alert["startsAt"]))
        assert starts_at is not None
        name = labels.get("alertname", "")
        try:
            with transaction.atomic():
                record = InboundAlert.objects.create(
                    fingerprint=fp, starts_at=starts_at, status=alert["status"], labels=labels,
                    annotations=dict(alert.get("annotations") or {}), receiver=receiver[:200],
                    group_key=group_key[:500], received_at=now,
                )
                rollout = Rollout.objects.filter(pk=int(rollout_id)).first()
                if rollout is None:
                    outcome = f"no rollout {rollout_id}"
                else:
                    summary = (alert.get("annotations") or {}).get("summary", "")
                    reason = f"Alertmanager alert {name} firing since {alert['startsAt']} (fingerprint {fp})" + (
                        f": {summary}" if summary else "")
                    asked = rollout.request_abort(actor, reason=reason,
                                                  source=f"alertmanager webhook {receiver}".strip())
                    outcome = f"rollout {rollout.pk}: abort requested" if asked else f"rollout {rollout.pk} already finished"
                    result.num_acted += int(asked)
                record.outcome = outcome
                record.save(update_fields=["outcome"])
        except IntegrityError:
            result.num_duplicates += 1
            outcome = "duplicate: already acted on this fingerprint and startsAt"
        result.outcomes.append({"fingerprint": fp, "alertname": name, "rollout": rollout_id, "outcome": outcome})
    return result



