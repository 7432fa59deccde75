"""Live pages over websockets: one consumer per live view."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from controlplane.accounts.roles import Role, role_of
from controlplane.fleet.events import FLEET_GROUP
from dashboards import fleet_view

FORBIDDEN = 4403


class FleetConsumer(AsyncWebsocketConsumer):
    """Pushes the fleet page's changed row (and summary) as htmx
    out-of-band swaps whenever ``controlplane.fleet.events`` reports one."""

    async def connect(self) -> None:
        self.user = self.scope.get("user")
        role = await database_sync_to_async(role_of)(self.user)
        if role < Role.VIEWER:
            await self.close(code=FORBIDDEN)
            return
        self.user_context = {"can_operate": role >= Role.OPERATOR, "role": role.group_name}
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def worker_changed(self, event: dict[str, Any]) -> None:
        messages = await database_sync_to_async(fleet_view.render_push)(
            event["worker_id"], created=event.get("created", False), deleted=event.get("deleted", False),
            user_context=self.user_context,
        )
        for html in messages:
            await self.send(text_data=html.strip())
