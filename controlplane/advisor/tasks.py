"""Beat keeps the last advisor report per pool and for the fleet, so the
page opens at once; a round still queued when the next is due expires."""

from __future__ import annotations

from typing import Any

from controlplane.advisor import conf
from controlplane.advisor.models import AdvisorReport
from controlplane.celery import app


@app.task(name="advisor.refresh")
def refresh() -> dict[str, int]:
    return {"reports": AdvisorReport.refresh_all()}


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    interval = conf.ADVISOR_INTERVAL_SECONDS.get()
    sender.add_periodic_task(interval, refresh.s(), name="advisor refresh", expires=interval)
