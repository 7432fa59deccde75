"""Live rollout pages: the list, and one rollout. Each transition the
reconciler records (``Rollout.changed()``) is pushed as an htmx out-of-band
swap of the page's live partial."""

from __future__ import annotations

from controlplane import live
from dashboards.live import LiveConsumer
from dashboards.rollouts import pages


class RolloutListConsumer(LiveConsumer):
    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.ROLLOUT_CHANGED)]

    async def rollouts_changed(self, event: live.RolloutChanged) -> None:
        await self.push(pages.render_list_push)


class RolloutConsumer(LiveConsumer):
    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.ROLLOUT_CHANGED, int(self.url_kwargs["pk"]))]

    async def rollouts_changed(self, event: live.RolloutChanged) -> None:
        await self.push(pages.render_detail_push, event["rollout_id"], self.user_context)
