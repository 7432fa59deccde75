"""The engine contract's records: sampling parameters that name their bad
field, and the step record's fragmentation."""

from __future__ import annotations

import pytest

from workers.engines.api import RequestError, SamplingParams, StepMetrics


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_parameters_are_refused_naming_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestError, match=field) as info:
        params.validate()
    assert info.value.field == field


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(max_tokens=None, temperature=0, top_k=-1)])
def test_vllms_defaults_and_off_values_are_accepted(params: SamplingParams) -> None:
    params.validate()


def step(num_blocks_held: int, num_tokens_stored: int) -> StepMetrics:
    return StepMetrics(
        start_time=0.0,
        duration_seconds=0.01,
        num_prefill_tokens=0,
        num_decode_tokens=1,
        num_running=1,
        num_waiting=0,
        num_blocks_held=num_blocks_held,
        num_tokens_stored=num_tokens_stored,
        block_size=16,
        num_blocks_total=64,
        memory_bytes=0,
        peak_memory_bytes=0,
    )


def test_fragmentation_is_the_unfilled_share_of_the_blocks_held() -> None:
    assert step(num_blocks_held=4, num_tokens_stored=48).kv_fragmentation == pytest.approx(0.25)
    assert step(num_blocks_held=2, num_tokens_stored=32).kv_fragmentation == 0.0
    assert step(num_blocks_held=0, num_tokens_stored=0).kv_fragmentation is None
