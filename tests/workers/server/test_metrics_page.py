"""The /metrics page rendered once per change: the cached page is byte for
byte prometheus_client's generic exposition (``render_uncached``), and an
exporter nothing wrote to re-renders none of its own families."""

from __future__ import annotations

import argparse
import json
import math
import random
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from controlplane.bench import metrics_page
from workers.engines.api import EngineLoad, RequestMetrics, StepMetrics
from workers.profile import EngineProfile
from workers.server.metrics import BY_PROMPT_TTFT, MetricsExporter, _Cached


@dataclass
class Engine:
    observers: list = field(default_factory=list)

    def add_observer(self, observer):
        self.observers.append(observer)

    def load(self):
        return EngineLoad(2, 1, 0.25)


def exporter(model_name: str = "m") -> MetricsExporter:
    e = MetricsExporter(model_name=model_name, max_model_len=131072, clock=lambda: 50.0)  # a still clock
    e.attach(Engine())
    return e


def step(start: float, prefill: int = 512, decode: int = 4) -> StepMetrics:
    return StepMetrics(
        start_time=start,
        duration_seconds=0.02,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_running=4,
        num_waiting=1,
        num_blocks_held=10,
        num_tokens_stored=150,
        block_size=16,
        num_blocks_total=100,
        memory_bytes=1000,
        peak_memory_bytes=1800,
        prefill_chunk_waits=[0.003],
        prefix_cache_queries=32,
        prefix_cache_hits=16,
        max_prefill_tokens=prefill,
    )


def request(at: float, prompt_tokens: int, rng: random.Random) -> tuple[RequestMetrics, list[tuple[float, int]]]:
    times = [at + 0.05 + 0.01 * i + rng.uniform(0, 0.004) for i in range(6)]
    m = RequestMetrics(
        arrival_time=at,
        first_scheduled_time=at + 0.01,
        first_token_time=times[0],
        token_times=times,
        finished_time=times[-1],
        num_prompt_tokens=prompt_tokens,
        num_output_tokens=len(times),
    )
    return m, [(t + 0.001, 1) for t in times]


def profile(e: MetricsExporter, revision: int) -> None:
    e.set_profile(
        EngineProfile(max_num_batched_tokens=512, long_prefill_token_threshold=64),
        engine_kind="sim",
        name="chunked-512",
        revision=revision,
    )


def cached_families(e: MetricsExporter) -> list[_Cached]:
    return [c for r in (e.registry, e.vllm_registry) for c in r.collectors if isinstance(c, _Cached)]


def assert_same_page(e: MetricsExporter) -> None:
    assert e.render() == e.render_uncached()


def test_the_cached_page_is_the_generic_one_after_every_kind_of_update() -> None:
    rng = random.Random(7)
    e = exporter()
    assert_same_page(e)
    profile(e, 1)
    assert_same_page(e)
    for i, prompt_tokens in enumerate((100, 3000, 100, 40_000, 9000, 600)):
        at = 10.0 + i
        e.on_step(step(at, prefill=prompt_tokens))
        assert_same_page(e)
        m, writes = request(at, prompt_tokens, rng)
        # a new finished reason is a new child of vllm:request_success
        e.on_request_finished(f"r{i}", m, "stop" if i % 3 else "length")
        assert_same_page(e)
        e.observe_delivered(m, writes if i % 2 else None, received_at=at - 0.002)
        assert_same_page(e)
    profile(e, 2)  # profile_info cleared and relabelled
    assert_same_page(e)
    e.ttft.observe(math.inf)  # the +Inf bucket and an infinite sum
    e.prefill_seconds.inc(0.0)
    assert_same_page(e)
    e.max_gap.observe(math.nan)  # NaN: no bucket, the sum goes NaN
    assert_same_page(e)


def test_label_values_that_need_escaping_render_as_prometheus_client_escapes_them() -> None:
    e = exporter('a "quoted"\\back\nslash model')
    profile(e, 3)
    e.by_prompt[BY_PROMPT_TTFT].labels(*e._labels, "<=2K").observe(0.07)
    page = e.render()
    assert b'model_name="a \\"quoted\\"\\\\back\\nslash model"' in page
    assert page == e.render_uncached()


def test_an_unchanged_exporter_re_renders_none_of_its_families() -> None:
    e = exporter()
    profile(e, 1)
    first = e.render()
    families = cached_families(e)
    renders = [f.num_renders for f in families]
    texts = [f.exposition() for f in families]
    assert e.render() == first
    assert [f.num_renders for f in families] == renders
    # the very same bytes objects: served from the cache, not formatted again
    assert all(f.exposition() is text for f, text in zip(families, texts, strict=True))


def test_one_write_re_renders_only_the_child_it_wrote() -> None:
    e = exporter()
    e.render()
    family = e.by_prompt[BY_PROMPT_TTFT]
    children = {key: child.num_renders for key, child in family._metrics.items()}
    others = {id(f): f.num_renders for f in cached_families(e) if f is not family}

    family.labels(*e._labels, "<=8K").observe(0.3)
    page = e.render()

    assert page == e.render_uncached()
    assert {key: child.num_renders - children[key] for key, child in family._metrics.items()} == {
        (*e._labels, name): int(name == "<=8K") for name in ("<=512", "<=2K", "<=8K", "<=32K", ">32K")
    }
    assert {id(f): f.num_renders for f in cached_families(e) if f is not family} == others


def test_a_filtered_render_keeps_the_families_the_generic_filter_keeps() -> None:
    e = exporter()
    profile(e, 1)
    e.on_step(step(1.0))
    for names in (
        ["vllm:num_requests_waiting"],
        ["chunkpilot:steps_total", "vllm:kv_cache_usage_perc"],
        ["chunkpilot:steps"],  # a counter by its family name
        [f"{BY_PROMPT_TTFT}_bucket"],
        ["vllm:request_success_total"],  # no child yet: the generic filter keeps no family either
        ["chunkpilot:profile_info", "chunkpilot:held_seconds_total"],
        ["nothing:like_this"],
    ):
        assert e.render(names) == e.render_uncached(names), names


def test_an_engine_with_its_own_registry_is_rendered_as_it_stands() -> None:
    native = CollectorRegistry()
    prompt_tokens = Counter("vllm:prompt_tokens", "native", registry=native)

    class NativeEngine(Engine):
        def prometheus_collector(self):
            return native

    e = MetricsExporter(model_name="m", max_model_len=4096, clock=lambda: 50.0)
    e.attach(NativeEngine())
    assert_same_page(e)
    prompt_tokens.inc(7)  # a write the exporter does not see: its page still shows it
    assert b"vllm:prompt_tokens_total 7.0" in e.render()
    assert_same_page(e)


def test_writes_racing_renders_are_never_lost() -> None:
    e = exporter()
    rng = random.Random(3)
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            e.on_step(step(float(i), prefill=rng.choice((100, 3000, 20_000))))
            e.itl.observe(rng.uniform(0, 0.1))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(30):
            e.render()
    finally:
        stop.set()
        writer.join()
    assert_same_page(e)


def test_the_page_benchmark_finds_both_paths_identical(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    metrics_page.add_arguments(parser)
    args = parser.parse_args(["--repeat", "2", "--requests", "1", "--json", str(tmp_path / "out.json")])
    assert metrics_page.main(args) == 0
    out = capsys.readouterr().out
    assert "rendered pages identical: yes" in out
    assert [row["case"] for row in json.loads((tmp_path / "out.json").read_text())["rows"]] == [
        "render, idle",
        "render after 1 request",
        "parse (control plane)",
    ]
