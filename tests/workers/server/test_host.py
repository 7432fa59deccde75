"""The engine host: bounded admission and profile switches, on the real
reference engine in this process."""

import asyncio

import pytest

from tests.support import wait_until_async
from workers import engines
from workers.engines.api import SamplingParams
from workers.profile import EngineProfile, ProfileError
from workers.server.host import (
    DRAINING,
    READY,
    ApplyError,
    EngineHost,
    QueueFull,
    RunningProfile,
    Unavailable,
)

BASE = EngineProfile(max_num_batched_tokens=128, max_num_seqs=2, block_size=32, kv_cache_bytes=8 << 20)


@pytest.fixture
def make_host(tiny_model):
    spec = engines.EngineSpec(kind="reference", model=str(tiny_model), device="cpu", max_model_len=512)
    backend = engines.backend("reference")

    def make(profile=BASE, **kwargs):
        return EngineHost(
            lambda p: backend.build(spec, p),
            RunningProfile(profile),
            validate=lambda p, mll: engines.validate(spec, p, mll),
            **kwargs,
        )

    return make


async def drain_stream(engine, request_id, max_tokens=40, streaming=None):
    """Every token of one request; ``streaming`` (an asyncio.Event) is set at its first."""
    tokens = []
    async for out in engine.generate("word " * 20, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id):
        tokens += out.outputs[0].token_ids
        if streaming is not None:
            streaming.set()
    return tokens


def test_admission_is_bounded_by_max_num_seqs_plus_the_queue(make_host):
    async def scenario():
        host = make_host(max_queue=1)
        with pytest.raises(Unavailable):
            host.admit(["early"])  # still loading
        await host.start()
        tickets = [host.admit([f"r{i}"]) for i in range(3)]  # 2 running + 1 queued
        with pytest.raises(QueueFull):
            host.admit(["r3"])
        tickets[0].release()
        host.admit(["r3"]).release()
        for t in tickets[1:]:
            t.release()
        assert host.num_in_flight == 0
        await host.shutdown()

    asyncio.run(scenario())


def test_a_scheduler_knob_change_applies_between_steps_without_refusing_anyone(make_host):
    async def scenario():
        host = make_host()
        await host.start()
        ticket = host.admit(["a"])
        streaming = asyncio.Event()
        running = asyncio.ensure_future(drain_stream(ticket.engine, "a", 200, streaming))
        await asyncio.wait_for(streaming.wait(), 30)  # the change lands mid-request
        engine = host.engine
        await host.apply(
            RunningProfile(EngineProfile(**{**BASE.to_dict(), "long_prefill_token_threshold": 16}), 5, "cap", 2)
        )
        assert host.engine is engine and host.state == READY  # same engine, no rebuild
        assert host.engine.profile.long_prefill_token_threshold == 16
        assert len(await running) == 200
        ticket.release()
        await host.shutdown()

    asyncio.run(scenario())


def test_a_layout_change_drains_in_flight_requests_then_rebuilds(make_host):
    async def scenario():
        host = make_host()
        await host.start()
        ticket = host.admit(["a"])
        engine = ticket.engine

        streaming = asyncio.Event()

        async def serve():
            try:
                return await drain_stream(engine, "a", 120, streaming)
            finally:
                ticket.release()

        running = asyncio.ensure_future(serve())
        await asyncio.wait_for(streaming.wait(), 30)  # in flight when the change comes
        apply = asyncio.ensure_future(
            host.apply(RunningProfile(EngineProfile(**{**BASE.to_dict(), "block_size": 64}), 6, "big", 3))
        )
        await wait_until_async(lambda: host.state == DRAINING, 10, "the host to drain for the layout change")
        with pytest.raises(Unavailable):
            host.admit(["b"])  # draining: refused before any byte
        await apply
        assert len(await running) == 120  # the in-flight request finished on the old engine
        assert host.engine is not engine and host.engine.profile.block_size == 64
        assert host.running.revision_id == 6 and host.state == READY
        await host.shutdown()

    asyncio.run(scenario())


def test_the_drain_deadline_aborts_stragglers(make_host):
    async def scenario():
        host = make_host(drain_timeout_seconds=0.2)
        await host.start()
        ticket = host.admit(["slow"])
        engine = ticket.engine

        streaming = asyncio.Event()

        async def serve():
            try:
                finish_reason = None
                params = SamplingParams(max_tokens=5000, ignore_eos=True)
                async for out in engine.generate("x " * 10, params, "slow"):
                    streaming.set()
                    finish_reason = out.outputs[0].finish_reason
                return finish_reason
            finally:
                ticket.release()

        running = asyncio.ensure_future(serve())
        await asyncio.wait_for(streaming.wait(), 30)  # a straggler in flight when the drain starts
        await host.apply(RunningProfile(EngineProfile(**{**BASE.to_dict(), "block_size": 64}), 7, "big", 4))
        assert await running == "abort"

    asyncio.run(scenario())


def test_a_profile_the_backend_refuses_changes_nothing(make_host):
    async def scenario():
        host = make_host()
        await host.start()
        engine = host.engine
        with pytest.raises(ProfileError):
            await host.apply(RunningProfile(EngineProfile(max_num_batched_tokens=16, max_num_seqs=64), 8, "bad", 1))
        assert host.engine is engine and host.state == READY and host.running.revision_id is None
        await host.shutdown()

    asyncio.run(scenario())


def test_an_engine_that_fails_to_build_leaves_the_last_profile_serving(make_host):
    async def scenario():
        host = make_host()
        await host.start()
        # Valid as a profile, but too little KV cache for one max-length sequence.
        tiny_kv = EngineProfile(**{**BASE.to_dict(), "block_size": 64, "kv_cache_bytes": 4096})
        with pytest.raises(ApplyError):
            await host.apply(RunningProfile(tiny_kv, 9, "starved", 1))
        assert host.state == READY and host.running.revision_id is None
        assert host.engine.profile == BASE and host.last_apply_error
        ticket = host.admit(["after"])
        assert len(await drain_stream(ticket.engine, "after", 5)) == 5
        ticket.release()
        await host.shutdown()

    asyncio.run(scenario())


def test_the_same_knobs_under_a_new_revision_are_adopted_without_a_rebuild(make_host):
    async def scenario():
        host = make_host()
        await host.start()
        engine = host.engine
        ticket = host.admit(["a"])
        await host.apply(RunningProfile(BASE, 11, "same", 5))
        assert host.engine is engine and host.running.revision_id == 11 and host.state == READY
        ticket.release()
        await host.shutdown()

    asyncio.run(scenario())
