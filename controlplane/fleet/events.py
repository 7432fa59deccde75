"""Fleet changes pushed to live pages through the channel layer.

Sent after the transaction commits (a page must never show a change that was
rolled back), and never fatal: a heartbeat is answered even when Redis is
briefly away; the page's periodic refresh catches up.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from django.db import transaction

log = logging.getLogger(__name__)

FLEET_GROUP = "fleet"
WORKER_CHANGED = "worker.changed"  # handled by the consumer's worker_changed()


def worker_changed(worker_id: int, *, created: bool = False, deleted: bool = False) -> None:
    message = {"type": WORKER_CHANGED, "worker_id": worker_id, "created": created, "deleted": deleted}
    transaction.on_commit(lambda: _send(FLEET_GROUP, message))


def _send(group: str, message: dict[str, object]) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    def send() -> None:
        try:
            layer = get_channel_layer()
            if layer is not None:
                async_to_sync(layer.group_send)(group, message)
        except Exception:  # noqa: BLE001 - a live page is a convenience, the heartbeat is not
            log.warning("could not push %s to group %s", message["type"], group, exc_info=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        send()
        return
    # Sync code called from a thread that runs an event loop (a script or a
    # test driving Playwright): async_to_sync refuses to run there.
    thread = threading.Thread(target=send, name="fleet-event")
    thread.start()
    thread.join(timeout=5)
