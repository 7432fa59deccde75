"""The client-facing latencies measured where the user sees them (issue 29):
fine buckets that resolve milliseconds, figures from the times the server
wrote each SSE event, the engine's own production times beside them, and a
worker whose event loop falls behind reporting the stall its client saw."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.metrics.promql import histogram_quantile
from tests.workers.server.support import ThreadedServer, get, metric_value, wait_until
from workers import engines, figures
from workers.engines import stream
from workers.engines.api import CompletionOutput, RequestMetrics, RequestOutput, StepMetrics
from workers.profile import EngineProfile
from workers.server.app import build_app, request_start
from workers.server.host import EngineHost, RunningProfile
from workers.server.metrics import MetricsExporter


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram in Prometheus text."""
    out = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return out


def written(start: float, gaps: list[float]) -> list[tuple[float, int]]:
    """One-token events ``gaps`` apart, the first at ``start``."""
    out, at = [(start, 1)], start
    for gap in gaps:
        at += gap
        out.append((at, 1))
    return out


def test_fine_buckets_resolve_latencies_under_ten_milliseconds() -> None:
    """Every value under 10 ms: the old lowest bucket (0–10 ms) read any P50
    as 5 ms; the fine buckets give the exact one within 10%."""
    rng = random.Random(29)
    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    all_gaps: list[float] = []
    tpots: list[float] = []
    max_gaps: list[float] = []
    for i in range(200):
        scale = rng.uniform(0.0012, 0.006)  # requests differ: 1.2–6 ms per token
        gaps = [min(0.0099, rng.lognormvariate(math.log(scale), 0.3)) for _ in range(24)]
        writes = written(100.0 + i, gaps)
        m = RequestMetrics(arrival_time=100.0 + i - 0.004, token_times=[at for at, _ in writes])
        exporter.observe_delivered(m, writes)
        all_gaps += gaps
        tpots.append(sum(gaps) / len(gaps))
        max_gaps.append(max(gaps))
    text = exporter.render().decode()
    for name, values in (
        ("chunkpilot:inter_token_latency_seconds", all_gaps),
        ("chunkpilot:request_time_per_output_token_seconds", tpots),
        ("chunkpilot:request_max_gap_seconds", max_gaps),
    ):
        assert max(values) < 0.010
        exact = figures.percentile(values, 50)
        estimate = histogram_quantile(0.5, buckets(text, name))
        assert exact is not None and estimate is not None
        assert estimate == pytest.approx(exact, rel=0.10), name


def test_fine_buckets_are_log_spaced_from_half_a_millisecond() -> None:
    edges = figures.fine_buckets(80.0)
    assert edges[0] == 0.0005 and edges[-1] >= 80.0
    assert max(b / a for a, b in zip(edges, edges[1:], strict=False)) < 1.2  # no bucket wider than ~19%
    assert figures.fine_buckets(2560.0)[-1] >= 2560.0


def test_long_prefill_threshold_is_relative_to_the_models_context() -> None:
    assert figures.long_prefill_tokens(4096) == 256
    assert figures.long_prefill_tokens(131_072) == 8192
    assert figures.long_prefill_tokens(512) == 64  # never below 64


def long_step(*, start: float, end: float) -> StepMetrics:
    return StepMetrics(
        start_time=start,
        duration_seconds=end - start,
        num_prefill_tokens=2000,
        num_decode_tokens=0,
        num_running=1,
        num_waiting=0,
        num_blocks_held=1,
        num_tokens_stored=16,
        block_size=16,
        num_blocks_total=100,
        memory_bytes=1000,
        peak_memory_bytes=1000,
        max_prefill_tokens=2000,
    )


def test_streamed_figures_come_from_the_written_events_and_the_engines_stay_beside() -> None:
    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    # the engine made four tokens 10 ms apart; the loop fell behind and wrote the last three as one event
    m = RequestMetrics(
        arrival_time=0.5,
        first_scheduled_time=0.6,
        first_token_time=1.0,
        token_times=[1.0, 1.01, 1.02, 1.03],
        num_prompt_tokens=100,
        num_output_tokens=4,
    )
    exporter.on_request_finished("r", m, "length")
    # a step with a long prefill (2,000 tokens on a 4,096-token model) ran between the two events
    exporter.on_step(long_step(start=1.03, end=1.4))
    exporter.observe_delivered(m, [(1.005, 1), (1.5, 3)])
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:time_to_first_token_seconds_sum") == pytest.approx(0.505)
    assert metric_value(text, "chunkpilot:request_max_gap_seconds_sum") == pytest.approx(0.495)
    assert metric_value(text, "chunkpilot:request_max_gap_by_prompt_seconds_sum", prompt_bucket="<=512") == (
        pytest.approx(0.495)
    )
    # merged tokens share their event's write time: one 495-ms gap, two of 0
    assert metric_value(text, "chunkpilot:inter_token_latency_seconds_count") == 3
    assert metric_value(text, "chunkpilot:inter_token_latency_seconds_sum") == pytest.approx(0.495)
    assert metric_value(text, "chunkpilot:request_time_per_output_token_seconds_sum") == pytest.approx(0.495 / 3)
    # write time minus the production time of the event's newest token
    assert metric_value(text, "chunkpilot:delivery_lag_seconds_count") == 2
    assert metric_value(text, "chunkpilot:delivery_lag_seconds_sum") == pytest.approx(0.005 + 0.47)
    # head-of-line gaps as delivered: the stall had a long prefill in it; the merged tokens' gaps did not
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_count") == 1
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_sum") == pytest.approx(0.495)
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_count") == 2
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_sum") == 0.0
    # the engine's own view: 10-ms gaps
    assert metric_value(text, "chunkpilot:engine_request_max_gap_seconds_sum") == pytest.approx(0.01)
    assert metric_value(text, "chunkpilot:request_prefill_time_by_prompt_seconds_sum", prompt_bucket="<=512") == (
        pytest.approx(0.4)
    )


def test_a_whole_reply_takes_the_engines_token_times() -> None:
    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    m = RequestMetrics(arrival_time=0.5, first_token_time=1.0, token_times=[1.0, 1.01, 1.5], num_output_tokens=3)
    exporter.observe_delivered(m, None)
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert metric_value(text, "chunkpilot:request_max_gap_seconds_sum") == pytest.approx(0.49)
    assert metric_value(text, "chunkpilot:delivery_lag_seconds_count") == 0


def test_ttft_counts_from_when_the_server_began_reading_the_request() -> None:
    """A busy worker reads and tokenizes before the engine's arrival time: the
    client's TTFT includes that wait, so the worker's does too (it read 0.7x
    the client's P99 under load)."""
    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    m = RequestMetrics(arrival_time=0.5, first_token_time=1.0, token_times=[1.0, 1.01], num_output_tokens=2)
    exporter.observe_delivered(m, [(1.002, 1), (1.012, 1)], received_at=0.2)
    exporter.observe_delivered(m, None, received_at=0.3)
    exporter.observe_delivered(m, None, received_at=0.9)  # a clock that says later than arrival changes nothing
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:time_to_first_token_seconds_sum") == pytest.approx(0.802 + 0.7 + 0.5)


def test_each_delta_merged_into_an_earlier_output_is_counted() -> None:
    def delta(token: int, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, f"t{token}", [token], None, "length" if finished else None)
        return RequestOutput("r", "p", [1], [completion], finished)

    async def main() -> list[RequestOutput]:
        queue: asyncio.Queue[stream.StreamItem] = asyncio.Queue()
        for item in (delta(1), delta(2), delta(3, finished=True)):  # all three waiting: the loop was behind
            queue.put_nowait(item)
        return [out async for out in stream.deltas(queue, on_abandoned=lambda: None)]

    before = stream.merged_deltas_total()
    outputs = asyncio.run(main())
    assert [out.outputs[0].token_ids for out in outputs] == [[1, 2, 3]]
    assert stream.merged_deltas_total() - before == 2
    text = MetricsExporter(model_name="tiny", max_model_len=4096).render().decode()
    assert metric_value(text, "chunkpilot:stream_merged_deltas_total") == stream.merged_deltas_total()


# ---- a real worker whose event loop is made slow --------------------------------------------
PROFILE = EngineProfile(
    prefill_mode="chunked",
    max_num_batched_tokens=256,
    long_prefill_token_threshold=64,
    max_num_seqs=4,
    block_size=16,
    kv_cache_bytes=16 << 20,
    enable_prefix_caching=False,
)
STALL_SECONDS = 0.8


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[str, dict[str, asyncio.AbstractEventLoop]]]:
    """The app as ``serve`` builds it, on the reference engine, with a handle on its event loop."""
    spec = engines.EngineSpec(kind="reference", model=str(tiny_model), device="cpu", max_model_len=1024)
    backend = engines.backend("reference")
    exporter = MetricsExporter(model_name="tiny", max_model_len=1024)
    host = EngineHost(
        lambda p: backend.build(spec, p),
        RunningProfile(PROFILE, revision_id=None, name="slow-loop", revision=1),
        on_engine=lambda engine, _running: exporter.attach(engine),
    )
    loops: dict[str, asyncio.AbstractEventLoop] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        loops["server"] = asyncio.get_running_loop()
        task = asyncio.ensure_future(host.start())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await host.shutdown()

    app = build_app(host, exporter, model_name="tiny", lifespan=lifespan)
    with ThreadedServer(app) as server:
        wait_until(lambda: get(f"{server.url}/health").status_code == 200, timeout=120)
        yield server.url, loops


def stream_events(url: str, body: dict[str, Any], on_event: Any = None) -> list[tuple[float, dict[str, Any]]]:
    """Each SSE data event as the client receives it, stamped on arrival."""
    out: list[tuple[float, dict[str, Any]]] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out.append((time.monotonic(), json.loads(line[6:])))
            if on_event is not None:
                on_event(len(out))
    return out


def test_a_worker_whose_event_loop_falls_behind_reports_the_stall_its_client_saw(
    served: tuple[str, dict[str, asyncio.AbstractEventLoop]],
) -> None:
    url, loops = served
    before_text = get(f"{url}/metrics").text
    merged_before = metric_value(before_text, "chunkpilot:stream_merged_deltas_total") or 0.0
    gap_sum_before = metric_value(before_text, "chunkpilot:request_max_gap_seconds_sum") or 0.0
    engine_sum_before = metric_value(before_text, "chunkpilot:engine_request_max_gap_seconds_sum") or 0.0

    def block_the_loop(events_seen: int) -> None:
        if events_seen == 5:  # mid-stream: the loop sleeps while the engine thread steps on
            loops["server"].call_soon_threadsafe(time.sleep, STALL_SECONDS)

    events = stream_events(
        url,
        {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True},
        block_the_loop,
    )
    times = [at for at, event in events if event["choices"] and event["choices"][0]["text"]]
    client_max_gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    assert client_max_gap > STALL_SECONDS * 0.9

    after_text = get(f"{url}/metrics").text
    reported = (metric_value(after_text, "chunkpilot:request_max_gap_seconds_sum") or 0.0) - gap_sum_before
    engine = (metric_value(after_text, "chunkpilot:engine_request_max_gap_seconds_sum") or 0.0) - engine_sum_before
    print(f"client's largest gap {client_max_gap * 1e3:.1f} ms; worker reports {reported * 1e3:.1f} ms")
    print(f"the engine produced tokens at most {engine * 1e3:.1f} ms apart")
    assert reported == pytest.approx(client_max_gap, rel=0.10)
    assert engine < STALL_SECONDS / 2  # the engine itself never stalled
    merged = (metric_value(after_text, "chunkpilot:stream_merged_deltas_total") or 0.0) - merged_before
    assert merged > 0
    assert merged == stream.merged_deltas_total() - merged_before  # the process's own count, exported
    # every token event written has its delivery lag
    lags_before = metric_value(before_text, "chunkpilot:delivery_lag_seconds_count") or 0.0
    assert (metric_value(after_text, "chunkpilot:delivery_lag_seconds_count") or 0.0) - lags_before == len(times)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 100.0),  # no proxy: when the server began reading
        ("t=999.75", 99.75),  # the gateway took it 250 ms before this worker read it
        ("999.75", 99.75),
        ("t=1000.5", 100.0),  # from the future: clocks apart, ignored
        ("t=100", 100.0),  # 900 s old: clocks apart, ignored
        ("t=soon", 100.0),
    ],
)
def test_a_proxys_request_start_moves_the_start_of_ttft_back(header: str | None, expected: float) -> None:
    assert request_start(header, now_monotonic=100.0, now_wall=1000.0) == pytest.approx(expected)
