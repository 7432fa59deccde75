"""The step-time table fitted to the reference engine's own steps, and the
clock that lets the fit and its check ignore other work on the machine."""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from workers.engines.reference.llm_engine import LLMEngine
from workers.engines.reference.tiny import SHIPPED_DIR
from workers.engines.sim import fit
from workers.engines.sim.steptime import FIT_FEATURES, StepBatch, features
from workers.engines.sim.virtual import ThreadCpuClock, measure, one_torch_thread
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile

# seconds per unit: a decode step, and a prefill step's own part on top of its decodes
DECODE = {"steps": 8e-4, "decodes": 2e-4, "decode_kv_tokens": 4e-7}
PREFILL_PART = {"steps": 5e-4, "prefill_tokens": 4e-5, "prefill_attention": 3e-8}


def synthetic_steps(slow_share: float, seed: int = 3) -> tuple[list[StepBatch], list[float]]:
    """Steps of known cost; ``slow_share`` of them take 5x (what a collection
    or a preempted core does to a CPU step now and then)."""
    rng = random.Random(seed)
    truth = dict.fromkeys(FIT_FEATURES, 0.0)
    batches, seconds = [], []
    for _ in range(3000):
        decodes = tuple(rng.randint(16, 4000) for _ in range(rng.randint(0, 12)))
        prefills = ((rng.randint(0, 2000), rng.randint(16, 1024)),) if rng.random() < 0.3 else ()
        if not decodes and not prefills:
            continue
        batch = StepBatch(prefills, decodes)
        coef = {**truth, **DECODE, **(PREFILL_PART if prefills else {})}
        cost = sum(coef[name] * x for name, x in zip(FIT_FEATURES, features(batch), strict=True))
        batches.append(batch)
        seconds.append(cost * (5.0 if rng.random() < slow_share else rng.uniform(0.97, 1.03)))
    return batches, seconds


def test_the_fit_finds_the_typical_step_cost_despite_rare_slow_steps() -> None:
    coefficients, _ = fit.fit(*synthetic_steps(slow_share=0.05))
    for name, value in DECODE.items():
        assert abs(coefficients["decode"][name] / value - 1) < 0.05, (name, coefficients["decode"])
    for name, value in PREFILL_PART.items():
        assert abs(coefficients["prefill"][name] / value - 1) < 0.05, (name, coefficients["prefill"])
    # least squares on the same steps is pulled up by the slow ones: what the
    # absolute-error fit exists to avoid
    batches, seconds = synthetic_steps(slow_share=0.05)
    decode_rows = [i for i, b in enumerate(batches) if not b.prefills]
    x = np.array([features(batches[i]) for i in decode_rows])
    squares, *_ = np.linalg.lstsq(x[:, [0, 2, 4]], np.array([seconds[i] for i in decode_rows]), rcond=None)
    assert squares[0] > 1.1 * DECODE["steps"] or squares[2] > 1.1 * DECODE["decode_kv_tokens"]


def test_a_prefill_step_prices_its_decodes_as_a_decode_step_does() -> None:
    coefficients, r2 = fit.fit(*synthetic_steps(slow_share=0.0))
    for name in ("decodes", "decode_kv_tokens"):
        assert coefficients["prefill"][name] == coefficients["decode"][name]
    assert coefficients["decode"]["prefill_tokens"] == 0.0
    assert r2 > 0.99


def test_the_thread_cpu_clock_skips_idle_waits_and_counts_work() -> None:
    clock = ThreadCpuClock()
    start = clock()
    time.sleep(0.2)
    assert clock() - start < 0.05  # sleeping costs this thread no CPU
    clock.advance_to(start + 30.0)
    assert clock() >= start + 30.0
    clock.advance_to(start + 1.0)  # never backwards
    assert clock() >= start + 30.0
    before, spun = clock(), time.thread_time() + 0.05
    while time.thread_time() < spun:
        pass
    assert clock() - before >= 0.05


def test_the_reference_engine_on_the_cpu_clock_jumps_to_each_arrival() -> None:
    planned = [
        PlannedRequest(0.0, "completions", 4, prompt_token_ids=list(range(100, 164))),
        PlannedRequest(30.0, "completions", 4, prompt_token_ids=list(range(200, 264))),
    ]
    before = torch.get_num_threads()
    started = time.monotonic()
    with one_torch_thread():
        assert torch.get_num_threads() == 1
        engine = LLMEngine(SHIPPED_DIR, profile=EngineProfile(), max_model_len=1024, clock=ThreadCpuClock())
        recorder, duration = measure(engine, planned)
    assert torch.get_num_threads() == before
    assert time.monotonic() - started < 25.0  # it did not wait the 30 s between arrivals
    assert duration >= 30.0  # yet the run spans them in the engine's time
    first, second = sorted(recorder.requests, key=lambda m: m.arrival_time)
    assert second.arrival_time - first.arrival_time == 30.0
    assert all(m.first_token_time is not None and m.first_token_time > m.arrival_time for m in (first, second))
    assert sum(s.duration_seconds for s in recorder.steps) > 0.0
