"""The ``chunkpilot`` extension key: the facts a worker hands the gateway
match the reference engine's own records, for a chunked and a whole
request, streamed and not, and the official ``openai`` client parses every
reply that carries them. The app is served as ``serve`` serves it, on the
real reference engine; an observer takes the engine's records as they happen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.workers.server.support import ThreadedServer, get, wait_until
from workers import engines
from workers.engines.api import RequestMetrics, StepMetrics
from workers.profile import EngineProfile
from workers.server.app import build_app
from workers.server.host import EngineHost, RunningProfile
from workers.server.metrics import MetricsExporter

CHUNK_CAP = 32
PROFILE = EngineProfile(
    prefill_mode="chunked",
    max_num_batched_tokens=64,
    long_prefill_token_threshold=CHUNK_CAP,
    max_num_seqs=4,
    block_size=16,
    kv_cache_bytes=8 << 20,
    enable_prefix_caching=False,
)
LONG_PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 6
SHORT_PROMPT = "hi"


class Recorder:
    """The engine's own records, by request id."""

    def __init__(self) -> None:
        self.finished: dict[str, RequestMetrics] = {}

    def on_step(self, step: StepMetrics) -> None:
        pass

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None:
        self.finished[request_id] = metrics


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[str, Recorder]]:
    spec = engines.EngineSpec(kind="reference", model=str(tiny_model), device="cpu", max_model_len=512)
    backend = engines.backend("reference")
    recorder = Recorder()
    running = RunningProfile(PROFILE, revision_id=None, name="facts", revision=3)
    host = EngineHost(
        lambda p: backend.build(spec, p), running, on_engine=lambda engine, _running: engine.add_observer(recorder)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        task = asyncio.ensure_future(host.start())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await host.shutdown()

    app = build_app(host, MetricsExporter(model_name="tiny", max_model_len=512), model_name="tiny", lifespan=lifespan)
    with ThreadedServer(app) as server:
        wait_until(lambda: get(f"{server.url}/health").status_code == 200, timeout=120)
        yield server.url, recorder


def _check(facts: dict[str, Any], record: RequestMetrics, usage: Any) -> None:
    assert record.prefill_chunks is not None
    assert facts["engine"] == "reference" and facts["prefill_mode"] == "chunked"
    assert (facts["profile"], facts["profile_revision"], facts["profile_revision_id"]) == ("facts", 3, None)
    assert facts["num_prefill_chunks"] == len(record.prefill_chunks)
    assert facts["prompt_split"] is (len(record.prefill_chunks) > 1)
    assert facts["num_prompt_tokens"] == record.num_prompt_tokens == usage.prompt_tokens
    assert facts["num_cached_tokens"] == record.num_cached_tokens
    assert facts["num_computed_tokens"] == sum(n for _, n in record.prefill_chunks)
    assert facts["num_preemptions"] == record.num_preemptions
    assert record.first_scheduled_time is not None and record.first_token_time is not None
    assert facts["queue_seconds"] == pytest.approx(record.first_scheduled_time - record.arrival_time)
    assert facts["prefill_seconds"] == pytest.approx(record.first_token_time - record.first_scheduled_time)
    assert facts["prefill_chunks"] == [
        [pytest.approx(t - record.arrival_time, abs=1e-6), n] for t, n in record.prefill_chunks
    ]


@pytest.mark.parametrize("prompt, split", [(LONG_PROMPT, True), (SHORT_PROMPT, False)], ids=["chunked", "whole"])
def test_streamed_facts_match_the_engines_records(served: tuple[str, Recorder], prompt: str, split: bool) -> None:
    url, recorder = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None and final.usage.completion_tokens == 4
    assert all("chunkpilot" not in (c.model_extra or {}) for c in chunks[:-1])
    facts = (final.model_extra or {})["chunkpilot"]
    record = recorder.finished[f"{final.id}-0"]
    _check(facts, record, final.usage)
    assert facts["prompt_split"] is split
    if split:
        assert all(n <= CHUNK_CAP for _, n in record.prefill_chunks or [])


@pytest.mark.parametrize("prompt, split", [(LONG_PROMPT, True), (SHORT_PROMPT, False)], ids=["chunked", "whole"])
def test_whole_reply_facts_match_the_engines_records(served: tuple[str, Recorder], prompt: str, split: bool) -> None:
    url, recorder = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    facts = (done.model_extra or {})["chunkpilot"]
    _check(facts, recorder.finished[f"{done.id}-0"], done.usage)
    assert facts["prompt_split"] is split


def test_the_openai_client_parses_chat_replies_that_carry_facts(served: tuple[str, Recorder]) -> None:
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert done.choices[0].message.role == "assistant" and (done.model_extra or {})["chunkpilot"]["num_prompts"] == 1
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=3,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and (chunks[-1].model_extra or {})["chunkpilot"]["engine"] == "reference"
