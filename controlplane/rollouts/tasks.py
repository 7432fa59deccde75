"""Celery tasks: ``reconcile(rollout_id)`` drives one rollout from its stored
state (see ``controller``); beat's ``sweep`` restarts rollouts whose next
run is overdue (a task lost with its worker: acks_late redelivers it only
after the broker's visibility timeout).

Tasks take ids and re-read the row; a rollout that is gone is a quiet
return. Only a lost database or Redis connection is retried, with capped
exponential backoff; anything else is a bug and is logged, and the sweeper
tries again later.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from controlplane import outages
from controlplane.celery import app
from controlplane.rollouts import conf, controller
from controlplane.rollouts.models import Rollout

RETRIED = outages.STORE_ERRORS


@app.task(
    name="rollouts.reconcile",
    autoretry_for=RETRIED,
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=20,
)
def reconcile(rollout_id: int, token: str | None = None) -> None:
    controller.drive(rollout_id, token)


@app.task(name="rollouts.sweep", autoretry_for=RETRIED, retry_backoff=1, retry_backoff_max=30, max_retries=3)
def sweep() -> list[int]:
    """Kick every unfinished rollout whose next run should have happened."""
    grace = conf.ROLLOUT_SWEEP_GRACE_SECONDS.get()
    overdue = list(Rollout.objects.overdue(timezone.now(), grace).values_list("pk", flat=True))
    for rollout_id in overdue:
        reconcile.delay(rollout_id)
    return overdue


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    interval = conf.ROLLOUT_SWEEP_INTERVAL_SECONDS.get()
    sender.add_periodic_task(interval, sweep.s(), name="rollout sweeper", expires=interval)
