"""``catalogue.parse`` plans a page shape once and reuses the plan: every
page reduces exactly as ``parse_lines`` reduces it, line by line."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import numpy as np
import pytest

from controlplane.metrics import catalogue
from workers.engines.api import RequestMetrics, StepMetrics
from workers.profile import EngineProfile
from workers.server.metrics import MetricsExporter

LABELS = 'engine="0",model_name="m"'


@pytest.fixture(autouse=True)
def no_plans() -> Iterator[None]:
    catalogue._PLANS.clear()
    yield
    catalogue._PLANS.clear()


def assert_same(a: catalogue.Scrape, b: catalogue.Scrape) -> None:
    assert a.layout == b.layout
    assert a.profile == b.profile
    assert np.array_equal(a.values, b.values, equal_nan=True)
    assert (np.signbit(a.values) == np.signbit(b.values)).all()


def parsed_as_lines(text: str) -> catalogue.Scrape:
    """``parse`` of the page, checked against ``parse_lines``."""
    scrape = catalogue.parse(text)
    assert_same(scrape, catalogue.parse_lines(text))
    return scrape


def exporter(revision: int = 1) -> MetricsExporter:
    e = MetricsExporter(model_name="meta-llama/Meta-Llama-3.1-8B", max_model_len=131072, clock=lambda: 50.0)
    e.set_profile(
        EngineProfile(max_num_batched_tokens=512, long_prefill_token_threshold=64),
        engine_kind="sim",
        name='chunked "512"',
        revision=revision,
    )
    return e


def traffic(e: MetricsExporter, rng: random.Random, num_requests: int) -> None:
    for i in range(num_requests):
        at = 10.0 + i
        prompt_tokens = rng.choice((100, 1500, 6000, 30_000, 90_000))
        e.on_step(
            StepMetrics(
                start_time=at,
                duration_seconds=0.03,
                num_prefill_tokens=prompt_tokens,
                num_decode_tokens=3,
                num_running=3,
                num_waiting=0,
                num_blocks_held=8,
                num_tokens_stored=100,
                block_size=16,
                num_blocks_total=64,
                memory_bytes=2048,
                peak_memory_bytes=4096,
                max_prefill_tokens=prompt_tokens,
            )
        )
        times = [at + 0.04 + 0.01 * k + rng.uniform(0, 0.003) for k in range(5)]
        m = RequestMetrics(
            arrival_time=at,
            first_scheduled_time=at + 0.005,
            first_token_time=times[0],
            token_times=times,
            finished_time=times[-1],
            num_prompt_tokens=prompt_tokens,
            num_output_tokens=5,
        )
        e.on_request_finished(f"r{i}", m, ("stop", "length", "abort")[i % 3])
        e.observe_delivered(m, [(t, 1) for t in times])


def test_pages_of_a_real_exporter_reduce_as_line_by_line_through_traffic() -> None:
    rng = random.Random(5)
    e = exporter()
    first = parsed_as_lines(e.render().decode())
    for num_requests in (1, 3, 20):
        traffic(e, rng, num_requests)
        scrape = parsed_as_lines(e.render().decode())
        assert scrape.profile["revision"] == "1"
        assert np.nansum(scrape.values) > np.nansum(first.values)


def test_a_page_of_a_known_shape_reuses_its_plan() -> None:
    e = exporter()
    first = catalogue.parse(e.render().decode())
    traffic(e, random.Random(1), 3)  # the first step and finished reasons: a new shape
    second = parsed_as_lines(e.render().decode())
    traffic(e, random.Random(2), 4)  # no new label value: the same shape
    third = parsed_as_lines(e.render().decode())
    assert third.layout is second.layout  # the plan's own layout
    assert second.layout == first.layout  # the same keys: the bucket bounds did not change
    assert sum(len(plans) for plans in catalogue._PLANS.values()) == 2


def test_a_profile_switch_is_a_new_shape_with_its_own_profile() -> None:
    e = exporter(revision=1)
    assert parsed_as_lines(e.render().decode()).profile["revision"] == "1"
    e.set_profile(EngineProfile(max_num_batched_tokens=8192), engine_kind="sim", name="mono", revision=2)
    again = parsed_as_lines(e.render().decode())
    assert (again.profile["profile"], again.profile["revision"]) == ("mono", "2")


def page(values: dict[str, str], *, info: str = "1", extra: str = "") -> str:
    """A small page: a counter, a histogram, two gauges, two finished reasons
    (summed into one series), a family nothing keeps and the profile line."""
    return "\n".join(
        [
            "# HELP chunkpilot:steps Engine steps.",
            "# TYPE chunkpilot:steps counter",
            f"chunkpilot:steps_total{{{LABELS}}} {values['steps']}",
            "# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{{LABELS},finished_reason="stop"}} {values["stop"]}',
            f'vllm:request_success_total{{{LABELS},finished_reason="length"}} {values["length"]}',
            f'chunkpilot:decode_gap_other_seconds_bucket{{{LABELS},le="0.5"}} {values["b1"]}',
            f'chunkpilot:decode_gap_other_seconds_bucket{{{LABELS},le="+Inf"}} {values["b2"]}',
            f"chunkpilot:decode_gap_other_seconds_sum{{{LABELS}}} {values['sum']}",
            f"chunkpilot:decode_gap_other_seconds_count{{{LABELS}}} {values['b2']}",
            f"vllm:kv_cache_usage_perc{{{LABELS}}} {values['usage']}",
            f"chunkpilot:memory_bytes{{{LABELS}}} {values['memory']}",
            f'python_gc_objects_collected_total{{generation="0"}} {values["steps"]}',
            'chunkpilot:profile_info{engine="0",model_name="m",profile="a \\"b\\" \\\\c\\nd",revision="7"} ' + info,
            extra,
        ]
    )


BASE = {"steps": "3.0", "stop": "2.0", "length": "1.0", "b1": "1.0", "b2": "4.0", "sum": "2.5", "usage": "0.25"}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"usage": "NaN", "memory": "NaN"},
        {"sum": "+Inf", "b2": "+Inf", "usage": "-Inf"},
        {"steps": "1e+06", "stop": "0.1", "length": "0.2"},  # a sum of floats, in page order
        {"memory": "-0.0", "usage": "1.7976931348623157e+308"},
    ],
)
def test_edge_values_reduce_as_line_by_line_planned_or_not(changes: dict[str, str]) -> None:
    parsed_as_lines(page({**BASE, "memory": "1024.0"}))  # plans the shape
    scrape = parsed_as_lines(page({**BASE, "memory": "1024.0", **changes}))
    assert scrape.profile == {"profile": 'a "b" \\c\nd', "revision": "7"}


def test_a_profile_line_not_at_one_is_no_profile() -> None:
    parsed_as_lines(page({**BASE, "memory": "1.0"}))
    assert parsed_as_lines(page({**BASE, "memory": "1.0"}, info="0.0")).profile == {}


def test_a_gauge_the_page_lacks_is_nan_in_a_planned_page() -> None:
    text = page({**BASE, "memory": "1.0"})
    parsed_as_lines(text)
    scrape = parsed_as_lines(text)
    assert math.isnan(scrape.values[scrape.layout.index["chunkpilot:max_model_len"]])
    assert scrape.values[scrape.layout.index["vllm:request_success_total"]] == 3.0


def test_timestamps_are_read_line_by_line_and_never_planned() -> None:
    values = {**BASE, "memory": "2.0 1700000000000", "usage": "0.5 1700000000000"}
    scrape = parsed_as_lines(page(values))
    parsed_as_lines(page(values))
    assert scrape.values[scrape.layout.index["chunkpilot:memory_bytes"]] == 2.0
    assert catalogue._PLANS == {}


def test_carriage_returns_and_a_trailing_newline_change_nothing() -> None:
    text = page({**BASE, "memory": "5.0"}) + "\n"
    parsed_as_lines(text)
    parsed_as_lines(text.replace("\n", "\r\n"))
    parsed_as_lines(text.replace("\n", "\r\n"))


def test_a_value_that_is_not_a_number_fails_as_line_by_line_does() -> None:
    parsed_as_lines(page({**BASE, "memory": "1.0"}))  # plans the shape
    bad = page({**BASE, "memory": "lots"})
    with pytest.raises(ValueError):
        catalogue.parse_lines(bad)
    with pytest.raises(ValueError):
        catalogue.parse(bad)


def test_a_shape_with_a_family_nothing_keeps_ignores_its_values() -> None:
    parsed_as_lines(page({**BASE, "memory": "1.0"}, extra='other_family{x="1"} 12.5 1700000000000'))
    parsed_as_lines(page({**BASE, "memory": "1.0"}, extra='other_family{x="1"} 12.5 1700000000000'))
