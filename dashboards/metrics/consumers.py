"""Live metric pages: one consumer per page, pushed after every scrape.

The scraper publishes ``metrics.scraped`` after each round, to the
fleet-wide group and each scraped worker's; with the Prometheus backend,
where there is no round, beat's scrape tick publishes the same event for
every worker a round would scrape, and the pages re-read Prometheus. Each consumer renders its page's
live partial for the parameters it was opened with
(``?group_by=&range=&window=``) and sends it as an htmx out-of-band swap;
charts read the JSON inside it.
"""

from __future__ import annotations

from channels.db import database_sync_to_async

from controlplane import live
from controlplane.fleet.models import Worker
from dashboards.live import LiveConsumer
from dashboards.metrics import pages


class _MetricsPageConsumer(LiveConsumer):
    page = ""

    async def live_groups(self) -> list[str] | None:
        self.view = pages.View.from_params(self.params)
        self.worker: Worker | None = None
        return [live.group(live.Event.METRICS_SCRAPED)]

    async def metrics_scraped(self, event: live.MetricsScraped) -> None:
        await self.push(pages.render_push, self.page, self.view, event["at"], self.worker)


class OverviewConsumer(_MetricsPageConsumer):
    page = "overview"


class PanelConsumer(_MetricsPageConsumer):
    page = "panel"


class CohortsConsumer(_MetricsPageConsumer):
    page = "cohorts"


class LengthsConsumer(_MetricsPageConsumer):
    page = "lengths"


class WorkerConsumer(_MetricsPageConsumer):
    """One worker's page: hears only the rounds that scraped it."""

    page = "worker"

    async def live_groups(self) -> list[str] | None:
        await super().live_groups()
        pk = int(self.url_kwargs["pk"])
        self.worker = await database_sync_to_async(
            lambda: Worker.objects.select_related("pool").filter(pk=pk).first()
        )()
        return None if self.worker is None else [live.group(live.Event.METRICS_SCRAPED, pk)]
