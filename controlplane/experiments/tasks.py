"""Celery tasks: ``drive(experiment_id)`` does an experiment's next step
and enqueues its successor (``runner``, or ``prediction`` for one in
predict mode); beat's ``sweep`` restarts the
experiments whose runner was lost (their lease ran out).

Tasks take ids and re-read the row; only a lost database or Redis
connection is retried, with capped backoff.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from controlplane import outages
from controlplane.celery import app
from controlplane.experiments import conf, prediction, runner
from controlplane.experiments.models import Experiment, Mode

RETRIED = outages.STORE_ERRORS


@app.task(
    name="experiments.drive",
    autoretry_for=RETRIED,
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=20,
)
def drive(experiment_id: int) -> None:
    mode = Experiment.objects.filter(pk=experiment_id).values_list("mode", flat=True).first()
    if (prediction.drive if mode == Mode.PREDICT else runner.drive)(experiment_id):
        drive.delay(experiment_id)


@app.task(name="experiments.sweep", autoretry_for=RETRIED, retry_backoff=1, retry_backoff_max=30, max_retries=3)
def sweep() -> list[int]:
    """Kick every unfinished experiment that no runner holds."""
    overdue = list(Experiment.objects.overdue(timezone.now()).values_list("pk", flat=True))
    for experiment_id in overdue:
        drive.delay(experiment_id)
    return overdue


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    interval = conf.EXPERIMENT_SWEEP_INTERVAL_SECONDS.get()
    sender.add_periodic_task(interval, sweep.s(), name="experiment sweeper", expires=interval)
