"""Beat keeps the last advisor report per pool and for the fleet, so the
page opens at once; a round still queued when the next is due expires. A
round that cannot read the metrics backend keeps the last reports."""

from __future__ import annotations

import logging
from typing import Any

from controlplane.advisor import conf
from controlplane.advisor.models import AdvisorReport
from controlplane.celery import app
from controlplane.metrics.query import BackendUnavailable

log = logging.getLogger(__name__)


@app.task(name="advisor.refresh")
def refresh() -> dict[str, Any]:
    try:
        # The round, not a request, sweeps the PD database: seconds per new set of inputs.
        return {"reports": AdvisorReport.refresh_all(database_estimate=True)}
    except BackendUnavailable as exc:
        # Prometheus down or slow: the kept reports stay as they are until a round can read it.
        log.warning("advisor round skipped: %s", exc)
        return {"reports": 0, "unavailable": exc.reason}


@app.on_after_finalize.connect
def schedule(sender: Any, **kwargs: Any) -> None:
    interval = conf.ADVISOR_INTERVAL_SECONDS.get()
    sender.add_periodic_task(interval, refresh.s(), name="advisor refresh", expires=interval)
