"""Live alert views: the alerts page's active table, and the critical-alert
banner every page shows. Each state change an alert goes through
(``AlertTransition.record``) is pushed as htmx out-of-band swaps."""

from __future__ import annotations

from controlplane import live
from dashboards.alerts import pages
from dashboards.live import LiveConsumer


class AlertsConsumer(LiveConsumer):
    """The alerts page, with the filters it was opened with
    (``?severity=&silenced=``)."""

    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.ALERTS_CHANGED)]

    async def alerts_changed(self, event: live.AlertsChanged) -> None:
        await self.push(pages.render_active_push, self.params, self.user_context)


class BannerConsumer(LiveConsumer):
    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.ALERTS_CHANGED)]

    async def alerts_changed(self, event: live.AlertsChanged) -> None:
        await self.push(pages.render_banner_push)
