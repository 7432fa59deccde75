"""The agent keeps to the heartbeat interval the control plane hands out
(a large fleet is told a longer one), within bounds, and to its own when the
reply names none. The agent runs in this process on the tiny model; the
control plane is the contract's stand-in, reached over ASGI."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.agent.fake_control_plane import FakeControlPlane
from workers.agent import Agent, ControlPlaneClient
from workers.agent.agent import MAX_HEARTBEAT_INTERVAL_SECONDS, MIN_HEARTBEAT_INTERVAL_SECONDS
from workers.engines.reference import AsyncLLM
from workers.profile import EngineProfile
from workers.server.host import EngineHost, RunningProfile

PROFILE = EngineProfile(max_num_batched_tokens=64, max_num_seqs=4, block_size=16, kv_cache_bytes=8 << 20)
OWN_INTERVAL_SECONDS = 3.0


def with_agent(tiny_model: Path, cp: FakeControlPlane, body: Callable[[Agent], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        host = EngineHost(lambda p: AsyncLLM(tiny_model, max_model_len=256, profile=p), RunningProfile(PROFILE))
        await host.start()
        client = ControlPlaneClient("http://control-plane", transport=httpx.ASGITransport(app=cp.app()))
        agent = Agent(
            host,
            client,
            enroll_token="enroll-1",
            name="w",
            url="http://127.0.0.1:8123",
            engine_kind="reference",
            model="tiny",
            max_model_len=256,
            hardware={},
            heartbeat_interval_seconds=OWN_INTERVAL_SECONDS,
        )
        try:
            return await body(agent)
        finally:
            await client.close()
            await host.shutdown()

    return asyncio.run(main())


def test_the_agent_uses_the_interval_each_reply_hands_out(tiny_model: Path) -> None:
    cp = FakeControlPlane(heartbeat_interval_seconds=7.0)

    async def body(agent: Agent) -> list[float]:
        seen = []
        await agent.register()
        seen.append(agent.interval)
        await agent.heartbeat()
        seen.append(agent.interval)
        cp.heartbeat_interval_seconds = 12.0  # the fleet grew
        await agent.heartbeat()
        seen.append(agent.interval)
        return seen

    assert with_agent(tiny_model, cp, body) == [7.0, 7.0, 12.0]


def test_the_agent_loop_waits_the_handed_out_interval_between_heartbeats(tiny_model: Path) -> None:
    cp = FakeControlPlane(heartbeat_interval_seconds=9.0)

    async def body(agent: Agent) -> list[float]:
        waits: list[float] = []

        async def record(seconds: float, changed: asyncio.Event) -> None:
            waits.append(seconds)  # instead of sleeping: the loop's next wait is what it was told
            if len(waits) == 2:
                agent.stop()

        agent._sleep = record  # type: ignore[method-assign]
        await asyncio.wait_for(agent.run(), 30)
        return waits

    assert with_agent(tiny_model, cp, body) == [9.0, 9.0]
    assert len(cp.heartbeats) == 2


@pytest.mark.parametrize(
    ("told", "expected"),
    [
        (None, OWN_INTERVAL_SECONDS),  # an older control plane says nothing: the agent's own
        (0.0, OWN_INTERVAL_SECONDS),  # nor does a nonsense value
        (-5.0, OWN_INTERVAL_SECONDS),
        (0.001, MIN_HEARTBEAT_INTERVAL_SECONDS),  # bounded: no flood
        (1e6, MAX_HEARTBEAT_INTERVAL_SECONDS),  # nor silence long enough to look dead
    ],
)
def test_a_missing_or_out_of_bounds_interval_is_not_obeyed_as_is(
    tiny_model: Path, told: float | None, expected: float
) -> None:
    cp = FakeControlPlane(heartbeat_interval_seconds=told)

    async def body(agent: Agent) -> tuple[float, float]:
        await agent.register()
        after_register = agent.interval
        await agent.heartbeat()
        return after_register, agent.interval

    assert with_agent(tiny_model, cp, body) == (expected, expected)
