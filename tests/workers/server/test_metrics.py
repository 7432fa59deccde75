"""The /metrics exporter: the metric vocabulary's names ("Metrics" in
docs/architecture.md), fed by engine records."""

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter

from tests.workers.server.support import metric_names, metric_value
from workers.engines.api import EngineLoad, MemoryFacts, RequestMetrics, StepMetrics
from workers.profile import EngineProfile
from workers.server.metrics import MetricsExporter, request_token_buckets

# The vocabulary ("Metrics" in docs/architecture.md), exactly as it names the exposed families.
VLLM_NAMES = {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:iteration_tokens_total",
}
CHUNKPILOT_NAMES = {
    "chunkpilot:time_to_first_token_seconds",
    "chunkpilot:inter_token_latency_seconds",
    "chunkpilot:request_time_per_output_token_seconds",
    "chunkpilot:request_max_gap_seconds",
    "chunkpilot:engine_request_max_gap_seconds",
    "chunkpilot:delivery_lag_seconds",
    "chunkpilot:stream_merged_deltas_total",
    "chunkpilot:decode_gap_long_prefill_seconds",
    "chunkpilot:decode_gap_other_seconds",
    "chunkpilot:long_prefill_tokens",
    "chunkpilot:max_model_len",
    "chunkpilot:prefill_chunk_wait_seconds",
    "chunkpilot:kv_fragmentation_ratio",
    "chunkpilot:kv_fragmentation_ratio_seconds_total",
    "chunkpilot:memory_bytes",
    "chunkpilot:memory_recent_peak_bytes",
    "chunkpilot:memory_byte_seconds_total",
    "chunkpilot:held_seconds_total",
    "chunkpilot:step_tokens_total",
    "chunkpilot:steps_total",
    "chunkpilot:profile_info",
}


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


@dataclass
class RecordingEngine:
    """An engine's observable surface: its load and its observers."""

    observers: list = field(default_factory=list)
    current: EngineLoad = field(default_factory=lambda: EngineLoad(2, 1, 0.25))

    def add_observer(self, observer):
        self.observers.append(observer)

    def load(self):
        return self.current


def step(start, *, held=4, stored=40, memory=1000, peak=1500, prefill=32, decode=3, waits=()):
    return StepMetrics(
        start_time=start,
        duration_seconds=0.5,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_running=3,
        num_waiting=1,
        num_blocks_held=held,
        num_tokens_stored=stored,
        block_size=16,
        num_blocks_total=100,
        memory_bytes=memory,
        peak_memory_bytes=peak,
        num_preemptions=1,
        prefill_chunk_waits=list(waits),
        prefix_cache_queries=32,
        prefix_cache_hits=16,
    )


def exporter_with_engine(clock):
    exporter = MetricsExporter(model_name="tiny", max_model_len=4096, clock=clock)
    engine = RecordingEngine()
    exporter.attach(engine)
    exporter.set_profile(
        EngineProfile(max_num_batched_tokens=256, long_prefill_token_threshold=64),
        engine_kind="reference",
        name="chunked-256",
        revision=3,
    )
    return exporter, engine


def test_every_design_metric_is_exposed_for_an_engine_without_its_own():
    exporter, _ = exporter_with_engine(Clock())
    names = metric_names(exporter.render().decode())
    assert VLLM_NAMES <= names
    assert CHUNKPILOT_NAMES <= names


def test_an_engine_with_its_own_vllm_metrics_keeps_them_and_gets_ours_beside():
    native = CollectorRegistry()
    Counter("vllm:prompt_tokens", "native", registry=native).inc(7)
    Counter("python_other", "not vllm", registry=native).inc()

    class NativeEngine(RecordingEngine):
        def prometheus_collector(self):
            return native

    exporter = MetricsExporter(model_name="tiny", max_model_len=4096)
    exporter.attach(NativeEngine())
    text = exporter.render().decode()
    assert metric_value(text, "vllm:prompt_tokens_total") == 7
    assert CHUNKPILOT_NAMES - {"chunkpilot:profile_info"} <= metric_names(text)
    assert "python_other" not in text
    assert "vllm:time_to_first_token_seconds" not in text  # vLLM's own would be there in a real engine


def test_request_figures_come_from_the_records():
    exporter, _ = exporter_with_engine(Clock())
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        token_times=[11.0, 11.1, 13.1, 13.2],
        finished_time=13.2,
        num_prompt_tokens=100,
        num_output_tokens=4,
    )
    exporter.on_request_finished("r", metrics, "length")
    text = exporter.render().decode()
    # the engine's own gap; the client's figures wait for the server (observe_delivered)
    assert metric_value(text, "chunkpilot:engine_request_max_gap_seconds_sum") == 2.0
    assert metric_value(text, "chunkpilot:request_max_gap_seconds_count") == 0
    assert metric_value(text, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert metric_value(text, "vllm:request_queue_time_seconds_sum") == 0.5
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") == 3
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 1
    assert metric_value(text, "vllm:prompt_tokens_total") == 100
    assert metric_value(text, "vllm:generation_tokens_total") == 4


def test_step_figures_and_time_weighted_integrals():
    clock = Clock(100.0)
    exporter, _ = exporter_with_engine(clock)
    exporter.on_step(step(99.5, held=4, stored=48, memory=1000, peak=1500, waits=(0.25, 0.5)))  # ends at 100
    clock.now = 102.0
    exporter.on_step(step(101.5, held=2, stored=32, memory=3000, peak=3000))  # ends at 102
    clock.now = 104.0
    text = exporter.render().decode()
    # 1 − 48 / (4 × 16) = 0.25 for 2 s, then 1 − 32/32 = 0 for 2 s
    assert metric_value(text, "chunkpilot:kv_fragmentation_ratio") == 0.0
    assert metric_value(text, "chunkpilot:kv_fragmentation_ratio_seconds_total") == 0.5
    assert metric_value(text, "chunkpilot:memory_bytes") == 3000
    assert metric_value(text, "chunkpilot:memory_byte_seconds_total") == 1000 * 2 + 3000 * 2
    assert metric_value(text, "chunkpilot:held_seconds_total") == 4  # the time both integrals cover
    assert metric_value(text, "chunkpilot:memory_recent_peak_bytes") == 3000
    assert metric_value(text, "chunkpilot:prefill_chunk_wait_seconds_count") == 2
    assert metric_value(text, "chunkpilot:step_tokens_total", kind="prefill") == 64
    assert metric_value(text, "chunkpilot:step_tokens_total", kind="decode") == 6
    assert metric_value(text, "chunkpilot:steps_total") == 2
    assert metric_value(text, "vllm:num_preemptions_total") == 2
    assert metric_value(text, "vllm:prefix_cache_hits_total") == 32


def test_recent_peak_forgets_peaks_older_than_fifteen_seconds():
    clock = Clock(100.0)
    exporter, _ = exporter_with_engine(clock)
    exporter.on_step(step(99.5, memory=1000, peak=9000))
    exporter.on_step(step(105.0, memory=1000, peak=1200))
    clock.now = 110.0
    assert metric_value(exporter.render().decode(), "chunkpilot:memory_recent_peak_bytes") == 9000
    clock.now = 116.0
    assert metric_value(exporter.render().decode(), "chunkpilot:memory_recent_peak_bytes") == 1200


def test_load_gauges_are_read_from_the_engine_at_scrape_time():
    exporter, engine = exporter_with_engine(Clock())
    engine.current = EngineLoad(0, 0, 0.0)
    text = exporter.render().decode()
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.0


def test_profile_info_names_the_running_profile():
    exporter, _ = exporter_with_engine(Clock())
    text = exporter.render().decode()
    assert (
        metric_value(
            text,
            "chunkpilot:profile_info",
            profile="chunked-256",
            revision="3",
            prefill_mode="chunked",
            budget="256",
            chunk_cap="64",
            engine_kind="reference",
        )
        == 1
    )
    exporter.set_profile(
        EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=4096),
        engine_kind="reference",
        name="mono",
        revision=4,
    )
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:profile_info", profile="chunked-256") is None
    assert metric_value(text, "chunkpilot:profile_info", profile="mono", revision="4") == 1


def test_token_buckets_follow_vllms_one_two_five_series():
    assert request_token_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def gap_step(end, *, prefill=0, decode=2, longest=0, memory=1000, peak=1000):
    """A 0.5-s step ending at ``end`` whose largest running prefill has ``longest`` tokens left to compute."""
    return StepMetrics(
        start_time=end - 0.5,
        duration_seconds=0.5,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_running=2,
        num_waiting=0,
        num_blocks_held=1,
        num_tokens_stored=16,
        block_size=16,
        num_blocks_total=100,
        memory_bytes=memory,
        peak_memory_bytes=peak,
        max_prefill_tokens=longest,
    )


def test_decode_gaps_are_each_requests_own_split_by_whether_a_long_prefill_ran_during_them():
    exporter, _ = exporter_with_engine(Clock(200.0))  # max_model_len 4096: long is more than 256 tokens
    exporter.on_step(gap_step(100.0))
    exporter.on_step(gap_step(100.5))
    # a monolithic 2000-token prefill: decodes wait through it, then decode at 103.5
    exporter.on_step(gap_step(103.0, prefill=2000, decode=0, longest=2000))
    exporter.on_step(gap_step(103.5))
    # a chunk of a long prompt beside the decodes (chunked): its step's gap is a long-prefill one too
    exporter.on_step(gap_step(104.0, prefill=256, longest=5000))
    # a short prefill (the threshold itself is not long)
    exporter.on_step(gap_step(104.5, prefill=256, longest=256))
    decoding = RequestMetrics(arrival_time=99.0, token_times=[100.0, 100.5, 103.5, 104.0, 104.5], num_output_tokens=5)
    # the long prompt itself: its first token came out of the 103.0 step; before it there is no gap
    long_one = RequestMetrics(arrival_time=100.2, token_times=[103.0, 103.5], num_output_tokens=2)
    exporter.observe_delivered(decoding, None)
    exporter.observe_delivered(long_one, None)
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_count") == 2  # 100.5→103.5, 103.5→104.0
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_sum") == 3.0 + 0.5
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_count") == 3  # 100→100.5, 104→104.5, b's one
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_sum") == 3 * 0.5
    assert metric_value(text, "chunkpilot:long_prefill_steps_total") == 2
    assert metric_value(text, "chunkpilot:long_prefill_tokens") == 256
    assert metric_value(text, "chunkpilot:max_model_len") == 4096
    # prefill share of step time: 0.5 s whole, 0.5 × 256/258 twice
    assert metric_value(text, "chunkpilot:prefill_seconds_total") == pytest.approx(0.5 + 2 * 0.5 * 256 / 258)


def test_idle_time_and_the_wait_for_a_first_token_are_never_gaps():
    exporter, _ = exporter_with_engine(Clock(200.0))
    exporter.on_step(gap_step(100.0, prefill=20, decode=0, longest=20))
    exporter.on_step(gap_step(100.5, decode=1))
    exporter.observe_delivered(RequestMetrics(arrival_time=99.4, token_times=[100.0, 100.5]), None)
    # 30 s of nothing, then a long prompt prefilled whole and decoded
    exporter.on_step(gap_step(132.0, prefill=2000, decode=0, longest=2000))
    exporter.on_step(gap_step(132.5, decode=1))
    exporter.observe_delivered(RequestMetrics(arrival_time=131.0, token_times=[132.0, 132.5]), None)
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_count") == 0
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_count") == 2
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_sum") == 1.0


def test_an_engine_that_does_not_say_what_prefill_ran_gets_no_gap_figures():
    exporter, _ = exporter_with_engine(Clock(200.0))
    for end in (100.0, 100.5, 101.0):
        exporter.on_step(step(end - 0.5))  # max_prefill_tokens unknown
    exporter.observe_delivered(RequestMetrics(arrival_time=99.0, token_times=[100.0, 100.5, 101.0]), None)
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:decode_gap_other_seconds_count") == 0
    assert metric_value(text, "chunkpilot:decode_gap_long_prefill_seconds_count") == 0


def test_memory_facts_and_activation_per_token_of_the_largest_prefill_step():
    class FactsEngine(RecordingEngine):
        def memory_facts(self):
            return MemoryFacts(weight_bytes=12_000_000, kv_bytes_per_token=2048)

    exporter = MetricsExporter(model_name="tiny", max_model_len=4096, clock=Clock(200.0))
    text = exporter.render().decode()
    assert "chunkpilot:weight_bytes" not in text  # nothing known: nothing exported
    exporter.attach(FactsEngine())
    exporter.on_step(gap_step(100.0, prefill=10, longest=10, memory=1000, peak=9000))  # small step: overheads
    exporter.on_step(gap_step(101.0, prefill=1000, longest=1000, memory=1000, peak=501_000))
    exporter.on_step(gap_step(102.0, prefill=0, memory=1000, peak=90_000))  # decode only: not a prefill step
    text = exporter.render().decode()
    assert metric_value(text, "chunkpilot:weight_bytes") == 12_000_000
    assert metric_value(text, "chunkpilot:kv_bytes_per_token") == 2048
    assert metric_value(text, "chunkpilot:activation_bytes_per_token") == 500.0
