"""The health sweep: silent workers become unhealthy, then offline; drift
clocks are re-derived from stored state. Beat runs it every
HEALTH_SWEEP_INTERVAL_SECONDS; running it twice at once is harmless (each
transition is a conditional update)."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from controlplane import outages
from controlplane.celery import app
from controlplane.fleet import conf
from controlplane.fleet.models import Worker


@app.task(name="fleet.health_sweep")
def health_sweep() -> dict[str, int | str]:
    now = timezone.now()
    try:
        transitions = Worker.sweep_liveness(now)
        drift_changes = Worker.refresh_drift(Worker.objects.with_stale_drift_clock(), now)
    except Exception as exc:
        # A database outage is the control plane's own deafness: noted, so the
        # next sweep after it does not blame the workers (fleet/health.py).
        if store := outages.store_down(exc):
            outages.note(store, exc, "the health sweep")
            return {"skipped": store}
        raise
    return {"transitions": len(transitions), "drift_changes": drift_changes}


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    sender.add_periodic_task(
        conf.HEALTH_SWEEP_INTERVAL_SECONDS.get(),
        health_sweep.s(),
        name="fleet health sweep",
        expires=conf.HEALTH_SWEEP_INTERVAL_SECONDS.get(),
    )
