"""Alerting's Celery tasks: the evaluation cycle, the dispatcher and
delivery. Beat runs ``alerts.evaluate`` every ALERT_EVAL_INTERVAL and
``alerts.dispatch`` every few seconds (group_wait and group_interval are
honoured to within that), and ``alerts.purge`` hourly (retention). Each may run twice at once without harm (see
evaluation and notify); deliveries retry with capped exponential backoff,
scheduled as a countdown and re-found by the dispatcher if a task is lost."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.alerts import conf, evaluation, killswitch, notify, retention
from controlplane.celery import app

log = logging.getLogger(__name__)


@app.task(name="alerts.evaluate")
def evaluate() -> dict[str, Any]:
    result = evaluation.evaluate(timezone.now())
    pulled = killswitch.pull_all(timezone.now())
    if result.errors:
        log.warning("alert rules failed to evaluate: %s", result.errors)
    return {
        "tick": result.tick.isoformat(),
        "num_rules": result.num_rules,
        "num_transitions": len(result.transitions),
        "num_aborts": len(pulled),
        "seconds": round(result.seconds, 3),
    }


@app.task(name="alerts.dispatch")
def dispatch() -> dict[str, int]:
    result = notify.dispatch(timezone.now())
    for delivery_id in result.deliveries:
        deliver.delay(delivery_id)
    return {
        "num_groups": result.num_groups,
        "num_deliveries": len(result.deliveries),
        "num_silenced": result.num_silenced,
    }


@app.task(name="alerts.deliver")
def deliver(delivery_id: int) -> dict[str, Any] | None:
    attempt = notify.deliver(delivery_id, timezone.now())
    if attempt is None:
        return None
    if attempt.retry_in_seconds is not None:
        deliver.apply_async((delivery_id,), countdown=attempt.retry_in_seconds)
    return {"sent": attempt.sent, "error": attempt.error}


@app.task(name="alerts.purge")
def purge() -> dict[str, int]:
    return retention.purge(timezone.now())


def enqueue_dispatch() -> None:
    """Wake the dispatcher once the current transaction commits."""
    transaction.on_commit(lambda: dispatch.delay())


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    sender.add_periodic_task(
        conf.ALERT_EVAL_INTERVAL.get(),
        evaluate.s(),
        name="alert rule evaluation",
        expires=conf.ALERT_EVAL_INTERVAL.get(),
    )
    sender.add_periodic_task(
        conf.ALERT_DISPATCH_INTERVAL.get(),
        dispatch.s(),
        name="alert notification dispatch",
        expires=conf.ALERT_DISPATCH_INTERVAL.get(),
    )
    sender.add_periodic_task(3600.0, purge.s(), name="alert history retention", expires=3600.0)
