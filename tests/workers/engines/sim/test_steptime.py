"""The step-time adapter against the package it reads (aiconfigurator-core),
and the simulated device's memory against the package's own estimate."""

from __future__ import annotations

import pytest
from aiconfigurator_core.sdk import EngineHandle, estimate_kv_cache

from tests.workers.engines.sim.conftest import BACKEND, MODEL, SYSTEM
from workers.engines.sim.steptime import (
    AicDevice,
    SimSetupError,
    StepBatch,
    from_description,
    load_device,
    supported_databases,
)


@pytest.fixture(scope="module")
def package() -> EngineHandle:
    return EngineHandle.compile(MODEL, SYSTEM, BACKEND)


@pytest.mark.parametrize(("tokens", "decodes"), [(512, 0), (512, 32), (2048, 32), (4096, 8)])
def test_one_whole_prompt_beside_decodes_costs_what_the_package_says_for_that_mixed_step(
    h200: AicDevice, package: EngineHandle, tokens: int, decodes: int
) -> None:
    # Decodes at the prompt's own length: the one shape where the package's
    # single-isl mixed step and the adapter's per-part sum price the same work.
    batch = StepBatch(prefills=((0, tokens),), decode_kv_lens=(tokens,) * decodes)
    assert h200.step_seconds(batch) * 1e3 == pytest.approx(package.mixed_step_latency(tokens, decodes, tokens, 2))


@pytest.mark.parametrize(("decodes", "kv"), [(1, 512), (32, 1024), (128, 4096)])
def test_a_decode_only_step_costs_the_packages_decode_step(
    h200: AicDevice, package: EngineHandle, decodes: int, kv: int
) -> None:
    batch = StepBatch(decode_kv_lens=(kv,) * decodes)
    assert h200.step_seconds(batch) * 1e3 == pytest.approx(package.decode_step_latency(decodes, kv, 2))


def test_a_later_chunk_pays_attention_over_the_tokens_before_it(h200: AicDevice) -> None:
    first = h200.step_seconds(StepBatch(prefills=((0, 2048),)))
    last = h200.step_seconds(StepBatch(prefills=((6144, 2048),)))
    assert last > first


def test_gpu_economics_flat_for_small_steps_then_linear(h200: AicDevice) -> None:
    def step(tokens: int) -> float:
        return h200.step_seconds(StepBatch(prefills=((0, tokens),), decode_kv_lens=(2048,) * 32))

    # Weights are read once a step whatever it holds: 64 and 256 tokens cost
    # about the same; past the knee, cost grows with the tokens.
    assert step(256) / step(64) < 1.5
    assert 3.0 < step(8192) / step(2048) < 5.5


def test_kv_capacity_is_the_packages_estimate_at_the_same_memory_fraction(h200: AicDevice) -> None:
    ours = h200.kv_cache_bytes(max_num_batched_tokens=2048, max_num_seqs=256)
    theirs = estimate_kv_cache(
        MODEL,
        SYSTEM,
        BACKEND,
        h200.version,
        max_num_tokens=2048,
        max_batch_size=256,
        memory_fraction_kind="of_total",
        memory_fraction_value=0.9,
    )["total_kv_size_bytes"]
    assert ours == pytest.approx(theirs, rel=0.02)
    assert h200.name == "H200 SXM (simulated)"


@pytest.mark.parametrize(
    ("options", "field", "lists"),
    [
        ({"system": "h900_sxm", "model": MODEL}, "sim_system", "h200_sxm"),
        ({"system": SYSTEM, "backend": "tgi", "model": MODEL}, "sim_backend", "vllm"),
        ({"system": SYSTEM, "model": "acme/NoSuchModel-9B"}, "sim_model", MODEL),
        ({"system": SYSTEM, "model": MODEL, "version": "0.0.1"}, "sim_version", "0.24.0"),
        ({"model": MODEL}, "sim_system", "h200_sxm"),
    ],
)
def test_an_unknown_name_fails_naming_the_field_and_listing_what_is_available(
    options: dict[str, str], field: str, lists: str
) -> None:
    with pytest.raises(SimSetupError) as err:
        load_device(**options)
    assert err.value.field == field
    assert lists in str(err.value)


def test_the_database_lists_the_issue_s_gpus() -> None:
    assert {"h100_sxm", "h200_sxm", "b200_sxm"} <= set(supported_databases())


def test_a_device_rebuilds_from_what_its_worker_reported(h200: AicDevice) -> None:
    again = from_description(h200.describe())
    batch = StepBatch(prefills=((0, 1000),), decode_kv_lens=(3000,) * 20)
    assert again.step_seconds(batch) == h200.step_seconds(batch)
    assert again.name == h200.name
