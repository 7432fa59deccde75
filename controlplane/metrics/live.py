"""Scrapes pushed to live metric pages through the channel layer.

After each round the scraper sends one message per group: the fleet-wide
pages' group and each scraped worker's. A consumer that hears it recomputes
what its page shows and sends it down the websocket. Never fatal: the
scraper's data is stored whether or not Redis answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

log = logging.getLogger(__name__)

FLEET_GROUP = "metrics.fleet"
SCRAPED = "metrics.scraped"  # handled by the consumers' metrics_scraped()


def worker_group(worker_id: int) -> str:
    return f"metrics.worker.{worker_id}"


def notify_scraped(at: datetime, worker_ids: Sequence[int]) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    message = {"type": SCRAPED, "at": at.timestamp()}
    try:
        layer = get_channel_layer()
        if layer is None:
            return

        async def send_all() -> None:
            await layer.group_send(FLEET_GROUP, message)
            for worker_id in worker_ids:
                await layer.group_send(worker_group(worker_id), message)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            async_to_sync(send_all)()
        else:  # called from inside a running loop: async_to_sync would refuse
            with ThreadPoolExecutor(1) as pool:
                pool.submit(async_to_sync(send_all)).result()
    except Exception:  # noqa: BLE001 - a live page is a convenience, the scrape is not
        log.warning("could not push a scrape to the metric pages", exc_info=True)
