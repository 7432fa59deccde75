"""Live metric pages: one consumer per page, pushed after every scrape.

The scraper sends one ``metrics.scraped`` message per group after each
round (``controlplane.metrics.live``). Each consumer checks the viewer role
before joining, then, on each message, renders its page's live partial for
the parameters it was opened with (``?group_by=&range=&window=``) and sends
it as an htmx out-of-band swap; charts read the JSON inside it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from controlplane.accounts.roles import Role, role_of
from controlplane.metrics import live
from dashboards import metrics_pages as pages

FORBIDDEN = 4403
NOT_FOUND = 4404


class _MetricsPageConsumer(AsyncWebsocketConsumer):
    page = ""

    async def connect(self) -> None:
        role = await database_sync_to_async(role_of)(self.scope.get("user"))
        if role < Role.VIEWER:
            await self.close(code=FORBIDDEN)
            return
        params = dict(parse_qsl(self.scope.get("query_string", b"").decode()))
        self.view = pages.View.from_params(params)
        self.worker: Any = None
        self.group = await self.group_name()
        if self.group is None:
            await self.close(code=NOT_FOUND)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def group_name(self) -> str | None:
        return live.FLEET_GROUP

    async def disconnect(self, code: int) -> None:
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def metrics_scraped(self, event: dict[str, Any]) -> None:
        html = await database_sync_to_async(pages.render_push)(self.page, self.view, event["at"], self.worker)
        await self.send(text_data=html.strip())


class OverviewConsumer(_MetricsPageConsumer):
    page = "overview"


class PanelConsumer(_MetricsPageConsumer):
    page = "panel"


class CohortsConsumer(_MetricsPageConsumer):
    page = "cohorts"


class LengthsConsumer(_MetricsPageConsumer):
    page = "lengths"


class WorkerConsumer(_MetricsPageConsumer):
    page = "worker"

    async def group_name(self) -> str | None:
        from controlplane.fleet.models import Worker

        pk = int(self.scope["url_route"]["kwargs"]["pk"])
        self.worker = await database_sync_to_async(
            lambda: Worker.objects.select_related("pool").filter(pk=pk).first()
        )()
        return None if self.worker is None else live.worker_group(pk)
