"""A task for the fault tests only (the worker imports it with ``--include``):
something in flight, with its ack still to come, when the broker goes."""

from __future__ import annotations

import time

from controlplane.celery import app


@app.task(name="faults.hold")
def hold(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
