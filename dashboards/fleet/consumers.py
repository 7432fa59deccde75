"""The fleet page's websocket."""

from __future__ import annotations

from controlplane import live
from dashboards.fleet import pages
from dashboards.live import LiveConsumer


class FleetConsumer(LiveConsumer):
    """Pushes the changed row (and the summary) as htmx out-of-band swaps
    whenever a worker changes; the page's ``pool`` and ``page`` come in the
    socket's query string, so a worker that comes or goes re-renders that
    page's rows only."""

    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.WORKER_CHANGED)]

    async def fleet_worker_changed(self, event: live.WorkerChanged) -> None:
        await self.push(
            pages.render_push,
            event["worker_id"],
            created=event.get("created", False),
            deleted=event.get("deleted", False),
            user_context=self.user_context,
            view=pages.View.from_params(self.params),
        )
