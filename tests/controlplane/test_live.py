"""``controlplane.live`` over the real Redis channel layer: an event reaches
its group and each scoped group, only once the transaction commits, from
sync code inside a running event loop too, and a broken layer is logged,
never raised."""

from __future__ import annotations

import asyncio
import inspect
import logging
import typing
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import transaction

from controlplane import live

pytestmark = pytest.mark.django_db(transaction=True)
T = TypeVar("T")
QUIET_SECONDS = 0.5


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """On a fresh loop in a fresh thread: a browser test's Playwright loop
    may be running in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, scenario()).result(timeout=30)


async def listen(*groups: str) -> list[str]:
    layer = get_channel_layer()
    channels = []
    for name in groups:
        channel = await layer.new_channel("test.")
        await layer.group_add(name, channel)
        channels.append(channel)
    return channels


async def heard(channel: str, timeout: float = 5.0) -> dict[str, Any] | None:
    try:
        return await asyncio.wait_for(get_channel_layer().receive(channel), timeout)
    except TimeoutError:
        return None


def test_group_names_and_handlers() -> None:
    assert live.group(live.Event.WORKER_CHANGED) == "fleet.worker_changed"
    assert live.group(live.Event.ROLLOUT_CHANGED, 12) == "rollouts.changed.12"
    assert live.Event.METRICS_SCRAPED.handler == "metrics_scraped"
    assert live.Event.ALERTS_CHANGED.handler == "alerts_changed"


def test_each_event_is_published_with_exactly_its_message_fields() -> None:
    """``publish``'s overload for an event takes the fields of that event's
    message type, required where the message requires them, so a type
    checker holds every publish to its event's message."""
    seen = {}
    for overload in typing.get_overloads(live.publish):
        signature = inspect.signature(overload, eval_str=True)
        (event,) = typing.get_args(signature.parameters["event"].annotation)
        fields = {n: p for n, p in signature.parameters.items() if n not in ("event", "scopes")}
        seen[event] = (
            {n for n, p in fields.items() if p.default is inspect.Parameter.empty},
            {n for n, p in fields.items() if p.default is not inspect.Parameter.empty},
        )
    expected = {}
    for event, message in live.MESSAGES.items():
        # Read from the hints: under postponed annotations __optional_keys__ misses NotRequired.
        hints = typing.get_type_hints(message, include_extras=True)
        optional = {n for n, hint in hints.items() if typing.get_origin(hint) is typing.NotRequired}
        expected[event] = (set(hints) - optional - {"type"}, optional)
    assert seen == expected and set(seen) == set(live.Event)


def test_an_event_reaches_its_group_and_each_scoped_group() -> None:
    async def scenario() -> list[dict[str, Any] | None]:
        event = live.Event.ROLLOUT_CHANGED
        channels = await listen(live.group(event), live.group(event, 7), live.group(event, 8))
        # From a sync thread of this loop, as consumers call model methods.
        await sync_to_async(live.publish)(event, scopes=[7], rollout_id=7)
        return [await heard(channels[0]), await heard(channels[1]), await heard(channels[2], QUIET_SECONDS)]

    everyone, scoped, other = run(scenario)
    assert everyone == scoped == {"type": "rollouts.changed", "rollout_id": 7}
    assert other is None, "another rollout's page hears nothing"


def test_an_event_is_sent_after_commit_and_never_for_a_rollback() -> None:
    group = live.group(live.Event.WORKER_CHANGED)

    async def scenario() -> tuple[Any, Any, Any]:
        (channel,) = await listen(group)
        loop = asyncio.get_running_loop()

        def rolled_back() -> None:
            with pytest.raises(RuntimeError), transaction.atomic():
                live.publish(live.Event.WORKER_CHANGED, worker_id=1)
                raise RuntimeError("rolled back")

        def committed() -> Any:
            with transaction.atomic():
                live.publish(live.Event.WORKER_CHANGED, worker_id=2)
                # Not yet: the transaction is open.
                return asyncio.run_coroutine_threadsafe(heard(channel, QUIET_SECONDS), loop).result()

        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, rolled_back)
            after_rollback = await heard(channel, QUIET_SECONDS)
            before_commit = await loop.run_in_executor(pool, committed)
        return after_rollback, before_commit, await heard(channel)

    after_rollback, before_commit, after_commit = run(scenario)
    assert after_rollback is None and before_commit is None
    assert after_commit == {"type": "fleet.worker_changed", "worker_id": 2}


def test_publishing_from_sync_code_inside_a_running_loop_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script or a Playwright test calls model methods from the thread its
    loop runs in, where async_to_sync refuses to run."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # as such scripts must, for the ORM

    async def scenario() -> Any:
        (channel,) = await listen(live.group(live.Event.ALERTS_CHANGED))
        live.publish(live.Event.ALERTS_CHANGED, alert_ids=[3])  # sync, on this loop's own thread
        return await heard(channel)

    assert run(scenario) == {"type": "alerts.changed", "alert_ids": [3]}


def test_a_broken_channel_layer_is_logged_not_raised(settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"], "prefix": "nobody"},
        }
    }
    with caplog.at_level(logging.WARNING, logger="controlplane.live"):
        live.publish(live.Event.WORKER_CHANGED, worker_id=1)
    assert "could not publish fleet.worker_changed to fleet.worker_changed" in caplog.text
