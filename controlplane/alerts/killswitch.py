"""The kill switch: alerts that stop a rollout by themselves.

* A firing alert of an ``abort_rollout`` rule (its selector is the canary
  cohort) asks every running rollout whose canary pool it concerns to
  abort: the pool its ``pool`` label names, else its ``worker``'s pool,
  else (a rule over the whole canary cohort) every running rollout. The
  rollout's timeline and audit row name the alert (actor
  ``alert:<alertname>``, reason with its value and fingerprint).
* An Alertmanager webhook (``POST /api/v1/alerts/webhook/``) whose firing
  alert carries ``chunkpilot_action="abort_rollout"`` does the same: for the
  rollout its ``rollout="<id>"`` label names, else (an alert from
  Prometheus, which knows pools but not rollouts, such as the shipped
  ``ChunkpilotCanaryTTFTRegression``) for the running rollouts that own its
  ``pool`` (or its ``worker``'s pool) as canary; an alert naming none of
  them is ignored. Each (fingerprint, startsAt) acts once,
  however often Alertmanager redelivers or repeats it; its resolved
  notification is recorded on the same row.

Both only set the rollout's abort flag (``Rollout.request_abort``); the
rollout's reconciler acts on it. Alerts sit below rollouts in the layer order,
so they reach rollouts only through ``Target``, which the rollouts app
registers when it loads (as it registers its gauges with ``metrics.exposition``). ``pull_all`` runs after every
evaluation
cycle and asks only rollouts not already aborting, so it is idempotent and
also catches a rollout that starts (or is retried) while the alert fires.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from controlplane.alerts.choices import ACTION_ABORT, ACTION_LABEL, ROLLOUT_LABEL
from controlplane.alerts.labels import fingerprint as fingerprint_of
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert, InboundAlert
from controlplane.fleet.models import Worker

log = logging.getLogger(__name__)


class Abortable(Protocol):
    """A rollout, as far as the kill switch is concerned."""

    pk: Any

    def request_abort(self, actor: Any, reason: str = "", source: str = "api") -> bool: ...


@dataclass(frozen=True)
class Target:
    """How the kill switch finds rollouts: ``running(pool)`` the running ones
    not already aborting (those whose canary is ``pool``; every one for None),
    ``get(id)`` one by id or None."""

    running: Callable[[str | None], list[Abortable]]
    get: Callable[[int], Abortable | None]


_NO_ROLLOUTS = Target(running=lambda pool: [], get=lambda rollout_id: None)
_target = _NO_ROLLOUTS


def register(target: Target) -> None:
    """Called by the rollouts app when it loads; without it nothing is aborted."""
    global _target
    _target = target


def rollouts_for(alert: Alert) -> list[Abortable]:
    """The running rollouts whose canary this alert is about."""
    return rollouts_for_labels(alert.labels)


def rollouts_for_labels(labels: Mapping[str, str]) -> list[Abortable]:
    """The running rollouts whose canary pool the labels name (by ``pool``,
    else by ``worker``); every running one when they name neither."""
    pool = labels.get("pool")
    if not pool and labels.get("worker"):
        pool = Worker.objects.filter(name=labels["worker"]).values_list("pool__name", flat=True).first()
    return _target.running(pool or None)


def pull_all(now: datetime | None = None) -> list[tuple[int, int]]:
    """Ask for the abort of every running rollout a firing ``abort_rollout``
    alert concerns. Returns (alert id, rollout id) for each abort asked."""
    now = now or timezone.now()
    pulled = []
    for alert in Alert.objects.filter(state=AlertState.FIRING, rule__action=ACTION_ABORT).select_related("rule"):
        for rollout in rollouts_for(alert):
            value = alert.value_detail or ("no data" if alert.value is None else f"{alert.value:.4g}")
            reason = (
                f"alert {alert.name} firing ({alert.rule.describe_condition() if alert.rule else ''}; "
                f"value {value}; fingerprint {alert.fingerprint})"
            )
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
    num_resolved: int = 0
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
    now = now or timezone.now()
    receiver, group_key, alerts = parse_webhook(body)
    result = InboundResult(num_alerts=len(alerts))
    for alert in alerts:
        labels = {str(k): str(v) for k, v in alert["labels"].items()}
        rollout_id = labels.get(ROLLOUT_LABEL, "")
        # One that names neither a rollout nor a pool or worker is ignored:
        # from outside, it would ask every running rollout to abort.
        names_one = rollout_id.isdigit() if rollout_id else bool(labels.get("pool") or labels.get("worker"))
        if labels.get(ACTION_LABEL) != ACTION_ABORT or not names_one:
            result.num_ignored += 1
            continue
        fp = str(alert.get("fingerprint") or fingerprint_of(labels))
        starts_at = parse_datetime(str(alert["startsAt"]))
        assert starts_at is not None
        name = labels.get("alertname", "")
        if alert["status"] == "resolved":
            outcome = _record_resolved(alert, labels, fp, starts_at, receiver, group_key, now)
            result.num_resolved += 1
        else:
            try:
                with transaction.atomic():
                    record = InboundAlert.objects.create(
                        fingerprint=fp,
                        starts_at=starts_at,
                        status=alert["status"],
                        labels=labels,
                        annotations=dict(alert.get("annotations") or {}),
                        receiver=receiver[:200],
                        group_key=group_key[:500],
                        received_at=now,
                    )
                    outcome, num_acted = _abort(alert, labels, fp, rollout_id, receiver, actor)
                    result.num_acted += num_acted
                    record.outcome = outcome[:300]
                    record.save(update_fields=["outcome"])
            except IntegrityError:
                result.num_duplicates += 1
                outcome = "duplicate: already acted on this fingerprint and startsAt"
        result.outcomes.append({"fingerprint": fp, "alertname": name, "rollout": rollout_id, "outcome": outcome})
    return result


def _abort(
    alert: Mapping[str, Any], labels: Mapping[str, str], fp: str, rollout_id: str, receiver: str, actor: Any
) -> tuple[str, int]:
    name = labels.get("alertname", "")
    summary = (alert.get("annotations") or {}).get("summary", "")
    reason = f"Alertmanager alert {name} firing since {alert['startsAt']} (fingerprint {fp})" + (
        f": {summary}" if summary else ""
    )
    if rollout_id:
        rollout = _target.get(int(rollout_id))
        if rollout is None:
            return f"no rollout {rollout_id}", 0
        rollouts = [rollout]
    else:
        rollouts = rollouts_for_labels(labels)
        if not rollouts:
            return f"no running rollout owns canary pool {labels.get('pool') or labels.get('worker')}", 0
    outcomes, num_acted = [], 0
    for rollout in rollouts:
        asked = rollout.request_abort(actor, reason=reason, source=f"alertmanager webhook {receiver}".strip())
        outcomes.append(f"rollout {rollout.pk}: abort requested" if asked else f"rollout {rollout.pk} already finished")
        num_acted += int(asked)
    return "; ".join(outcomes), num_acted


def _record_resolved(
    alert: Mapping[str, Any],
    labels: Mapping[str, str],
    fp: str,
    starts_at: datetime,
    receiver: str,
    group_key: str,
    now: datetime,
) -> str:
    """The resolved notification, on the row of the firing one it ends (a
    new row when that never arrived). Repeats change nothing but the time."""
    ends_at = parse_datetime(str(alert.get("endsAt", ""))) or now
    updated = InboundAlert.objects.filter(fingerprint=fp, starts_at=starts_at).update(
        status="resolved", ends_at=ends_at, resolved_received_at=now
    )
    if updated:
        return f"resolved at {ends_at.isoformat()}"
    _, created = InboundAlert.objects.get_or_create(
        fingerprint=fp,
        starts_at=starts_at,
        defaults={
            "status": "resolved",
            "labels": dict(labels),
            "annotations": dict(alert.get("annotations") or {}),
            "receiver": receiver[:200],
            "group_key": group_key[:500],
            "received_at": now,
            "ends_at": ends_at,
            "resolved_received_at": now,
            "outcome": "resolved; its firing notification never arrived, nothing was done",
        },
    )
    return f"resolved at {ends_at.isoformat()}" + ("" if not created else " (never seen firing)")
