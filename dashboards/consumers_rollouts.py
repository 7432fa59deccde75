"""Live rollout pages: the list, and one rollout. Each transition the
reconciler records is pushed (``controlplane.rollouts.live``) as htmx
out-of-band swaps of the page's live partial."""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from controlplane.accounts.roles import Role, role_of
from controlplane.rollouts.live import LIST_GROUP, group_for
from dashboards import views_rollouts

FORBIDDEN = 4403


class _RoleConsumer(AsyncWebsocketConsumer):
    group = ""

    async def connect(self) -> None:
        role = await database_sync_to_async(role_of)(self.scope.get("user"))
        if role < Role.VIEWER:
            await self.close(code=FORBIDDEN)
            return
        self.user_context = {"can_operate": role >= Role.OPERATOR, "role": role.group_name}
        self.group = self.group_name()
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    def group_name(self) -> str:
        raise NotImplementedError


class RolloutListConsumer(_RoleConsumer):
    def group_name(self) -> str:
        return LIST_GROUP

    async def rollout_changed(self, event: dict[str, Any]) -> None:
        html = await database_sync_to_async(views_rollouts.render_list_push)()
        await self.send(text_data=html.strip())


class RolloutConsumer(_RoleConsumer):
    def group_name(self) -> str:
        return group_for(int(self.scope["url_route"]["kwargs"]["pk"]))

    async def rollout_changed(self, event: dict[str, Any]) -> None:
        html = await database_sync_to_async(views_rollouts.render_detail_push)(event["rollout_id"], self.user_context)
        if html:
            await self.send(text_data=html.strip())
