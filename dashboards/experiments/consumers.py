"""Live experiment pages: the list, and one experiment. Each change the
runner records (``Experiment.changed()``: progress, an arm's result, a
phase) is pushed as an htmx out-of-band swap of the page's live partial."""

from __future__ import annotations

from controlplane import live
from dashboards.experiments import pages
from dashboards.live import LiveConsumer


class ExperimentListConsumer(LiveConsumer):
    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.EXPERIMENT_CHANGED)]

    async def experiments_changed(self, event: live.ExperimentChanged) -> None:
        await self.push(pages.render_list_push)


class ExperimentConsumer(LiveConsumer):
    async def live_groups(self) -> list[str]:
        return [live.group(live.Event.EXPERIMENT_CHANGED, int(self.url_kwargs["pk"]))]

    async def experiments_changed(self, event: live.ExperimentChanged) -> None:
        await self.push(pages.render_detail_push, event["experiment_id"], self.user_context)
