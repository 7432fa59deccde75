"""A Celery worker whose Redis connection is lost while it holds unacked
messages (acks are late) must reconnect, not die: kombu's QoS then builds a
client from connection info that Celery has already cleared, and its
AttributeError ended the worker ("Unrecoverable error"), which stopped the
whole demo (tests/faults/test_store_outages.py). ``controlplane.celery``
turns it into the connection error the consumer handles."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kombu
import pytest
import redis
from django.conf import settings

import controlplane.celery  # noqa: F401  (applies the guard)


@pytest.fixture
def lost_channel() -> Iterator[Any]:
    """A real channel on the test Redis, left as Celery leaves it after the
    loss: its pool dropped and the transport's connection info cleared."""
    conn = kombu.Connection(settings.REDIS_URL, transport_options={"visibility_timeout": 60})
    channel = conn.channel()
    client = channel.connection.client
    channel._pool = None
    channel.connection.client = None
    yield channel
    channel.connection.client = client
    conn.release()


@pytest.mark.parametrize("call", ["ack", "reject", "restore_unacked"])
def test_an_ack_or_restore_after_the_broker_connection_is_lost_is_a_connection_error(
    lost_channel: Any, call: str
) -> None:
    qos = lost_channel.qos
    args = () if call == "restore_unacked" else ("a-delivery-tag",)
    with pytest.raises(redis.ConnectionError, match="broker connection is gone"):
        getattr(qos, call)(*args)
    # The consumer's own handler: kombu counts redis.ConnectionError among the
    # transport's connection errors, so Message.ack_log_error logs it.
    assert issubclass(redis.ConnectionError, lost_channel.connection.connection_errors)


def test_on_a_live_connection_the_calls_go_through(db: Any) -> None:
    conn = kombu.Connection(settings.REDIS_URL)
    try:
        qos = conn.channel().qos
        qos.restore_unacked()  # nothing delivered: nothing to restore, no error
    finally:
        conn.release()
