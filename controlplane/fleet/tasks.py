"""The health sweep: silent workers become unhealthy, then offline; drift
clocks are re-derived from stored state. Beat runs it every
HEALTH_SWEEP_INTERVAL_SECONDS; running it twice at once is harmless (each
transition is a conditional update)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.celery import app


@app.task(name="fleet.health_sweep")
def health_sweep() -> dict[str, int]:
    from controlplane.fleet.models import Worker

    now = timezone.now()
    transitions = Worker.sweep_liveness(now)
    drift_changes = Worker.refresh_drift(Worker.objects.with_stale_drift_clock(), now)
    return {"transitions": len(transitions), "drift_changes": drift_changes}


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    sender.add_periodic_task(
        settings.HEALTH_SWEEP_INTERVAL_SECONDS,
        health_sweep.s(),
        name="fleet health sweep",
        expires=settings.HEALTH_SWEEP_INTERVAL_SECONDS,
    )
