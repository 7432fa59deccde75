"""One request cannot take the engine down: a request whose sampling breaks
fails alone with a clear error and the others go on; an engine that stopped
stepping says so (/health 503, the agent reports ``unhealthy`` and why)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import httpx
import pytest

from workers.agent import Agent, ControlPlaneClient
from workers.engines.api import RequestError, RequestFailed, SamplingParams
from workers.engines.reference import LLM, AsyncLLM, LLMEngine
from workers.profile import EngineProfile
from workers.server.app import build_app
from workers.server.host import UNHEALTHY, EngineHost, RunningProfile, Unavailable
from workers.server.metrics import MetricsExporter

PROMPT = "The for statement"
PROFILE = EngineProfile(max_num_batched_tokens=64, max_num_seqs=4, block_size=16, kv_cache_bytes=8 << 20)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(top_p=math.nan), "top_p"),
        (SamplingParams(seed=2**70), "seed"),
        (SamplingParams(seed=-(2**63) - 1), "seed"),
    ],
)
def test_the_engine_refuses_non_finite_numbers_and_a_seed_beyond_64_bits(
    tiny_model: Path, params: SamplingParams, field: str
) -> None:
    engine = LLMEngine(tiny_model, max_model_len=256, max_num_batched_tokens=64)
    with pytest.raises(RequestError) as info:
        engine.check_request(PROMPT, params)
    assert info.value.field == field


def test_a_tiny_positive_temperature_samples_like_vllm_instead_of_dividing_into_nan(tiny_model: Path) -> None:
    llm = LLM(tiny_model, max_model_len=256, max_num_batched_tokens=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=1e-40, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def poison(engine: LLMEngine, request_id: str) -> None:
    """Break one admitted request's sampling from inside, as a bug or a
    parameter that slipped past validation would: its logits turn to NaN."""
    seq = engine.requests[request_id]
    seq.params = dataclasses.replace(seq.params, temperature=math.nan)


def test_a_request_whose_sampling_fails_fails_alone_and_frees_its_blocks(tiny_model: Path) -> None:
    engine = LLMEngine(tiny_model, max_model_len=256, profile=PROFILE)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    engine.add_request("bad", PROMPT, sampled)
    engine.add_request("good", PROMPT, dataclasses.replace(sampled, seed=8))
    poison(engine, "bad")
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    failed = engine.take_failed_requests()
    assert list(failed) == ["bad"] and "sampling failed" in failed["bad"]
    assert "bad" not in finished
    assert len(finished["good"].outputs[0].token_ids) == 10
    assert engine.blocks.pool.num_used == 0, "the failed request's blocks are freed"
    assert engine.requests == {}


def test_the_async_engine_fails_that_request_and_serves_the_next_ones(tiny_model: Path) -> None:
    async def main() -> None:
        engine = AsyncLLM(tiny_model, max_model_len=256, profile=PROFILE)
        await engine.start()
        try:
            sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
            bad = engine.generate(PROMPT, sampled, "bad")
            good = engine.generate(PROMPT, sampled, "good")
            first_bad = asyncio.ensure_future(anext(bad))
            await asyncio.sleep(0)  # the add command is queued
            inner = engine.engine
            assert inner is not None
            await engine._call(lambda: poison(inner, "bad"))

            async def tokens(stream) -> int:  # type: ignore[no-untyped-def]
                return sum([len(o.outputs[0].token_ids) async for o in stream])

            num_good = asyncio.ensure_future(tokens(good))
            with pytest.raises(RequestFailed, match="sampling failed"):
                await first_bad
                await tokens(bad)
            assert await num_good == 8
            assert engine.health_error() is None
            after = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "after")
            assert await tokens(after) == 5
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_engine_that_stopped_stepping_answers_health_503_and_the_agent_reports_why(tiny_model: Path) -> None:
    async def main() -> None:
        host = EngineHost(lambda p: AsyncLLM(tiny_model, max_model_len=256, profile=p), RunningProfile(PROFILE))
        await host.start()
        app = build_app(host, MetricsExporter(model_name="tiny", max_model_len=256), model_name="tiny")
        agent = Agent(
            host,
            ControlPlaneClient("http://127.0.0.1:9"),
            enroll_token=None,
            name="w",
            url="http://127.0.0.1:8123",
            engine_kind="reference",
            model="tiny",
            max_model_len=256,
            hardware={},
        )
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as http:
                assert (await http.get("/health")).status_code == 200
                engine = host.engine
                assert isinstance(engine, AsyncLLM) and engine._thread is not None
                with engine._wake:  # the step thread ends as if it had died
                    engine._stopping = True
                    engine._wake.notify()
                await asyncio.to_thread(engine._thread.join)

                beat = agent.heartbeat_request()
                assert beat["state"] == "unhealthy" and beat["url"] == "http://127.0.0.1:8123"
                assert beat["health_error"] == "the engine's step thread is not running."
                health = await http.get("/health")
                assert health.status_code == 503
                assert health.json()["status"] == UNHEALTHY
                assert health.json()["health_error"] == beat["health_error"]
                with pytest.raises(Unavailable):
                    host.admit(["r"])
                refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_unhealthy"
        finally:
            await agent.client.close()
            await host.shutdown()

    asyncio.run(main())
