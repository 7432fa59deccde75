"""The Celery app. Each domain app registers its periodic tasks in its own
``tasks.py`` (``@app.on_after_finalize.connect``), so beat's schedule is the
union of the apps that are installed."""

import functools
import os
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, signals
from kombu.transport import redis as kombu_redis

from controlplane import embedded

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("chunkpilot")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.beat_init.connect
@signals.before_task_publish.connect
def _lease_embedded_redis(**kwargs: Any) -> None:
    """The broker is Redis: a worker, beat, or any process sending a task
    holds the embedded server up (controlplane/embedded.py)."""
    embedded.lease_if_embedded()


# A worker that loses Redis while a task is in flight (acks are late here)
# must reconnect, not die. Celery 5.7 closes the lost connection after
# collect() has cleared the transport's connection info; kombu's channel
# close drops its pools, then restores the unacked message through a new
# client built from that missing info: AttributeError ('NoneType' ...
# 'hostname'), which the consumer does not expect, so the worker exits
# ("Unrecoverable error"; seen in tests/faults/test_store_outages.py, which
# the demo's supervisor then stops whole). A task that finishes just after
# the loss acks (or rejects) through the same missing info, the same way.
# Say what it is, a lost broker connection, which the consumer handles (an
# ack it cannot send is logged): the message stays in Redis' unacked index,
# and kombu restores it once the visibility timeout passes.
def _lost_connection_is_a_connection_error(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except AttributeError as exc:
            if self.channel.connection.client is not None:
                raise
            raise redis.ConnectionError(
                "the broker connection is gone; unacked messages wait for the visibility timeout"
            ) from exc

    return guarded


for _name in ("restore_unacked", "ack", "reject"):
    setattr(kombu_redis.QoS, _name, _lost_connection_is_a_connection_error(getattr(kombu_redis.QoS, _name)))
