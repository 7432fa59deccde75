"""A workload through one engine, in process: arrivals, steps, figures.

``drive`` feeds planned requests to an ``LLMEngine`` at their arrival times
and steps it until all have finished. With a ``VirtualClock`` and a
simulated engine, no time is waited: a 10-minute replay takes seconds
(``predict``). With the wall clock and the reference engine, it is the
engine's own behaviour over the same arrivals (``workers.bench.sim``
compares the two). Figures are ``workers.figures.summarize``'s, over the
engine's own per-request and per-step records: the same definitions the
worker's /metrics use.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.engines.api import RequestMetrics, SamplingParams, StepMetrics
from workers.engines.reference.llm_engine import LLMEngine
from workers.engines.reference.sequence import OutputKind
from workers.engines.sim.engine import SimLLMEngine, VirtualClock
from workers.engines.sim.steptime import Device
from workers.figures import SLO, summarize
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile

FINAL_ONLY = OutputKind.FINAL_ONLY


@dataclass
class Recorder:
    """An engine observer keeping every step and finished request."""

    steps: list[StepMetrics] = field(default_factory=list)
    requests: list[RequestMetrics] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def on_step(self, step: StepMetrics) -> None:
        self.steps.append(step)

    def on_request_finished(self, request_id: str, metrics: RequestMetrics, finish_reason: str) -> None:
        self.requests.append(metrics)
        self.finish_reasons[finish_reason] = self.finish_reasons.get(finish_reason, 0) + 1


def prompt_ids(engine: LLMEngine, req: PlannedRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    return engine.tokenizer.encode(req.prompt or req.user_turn or " ")


def drive(
    engine: LLMEngine,
    planned: Sequence[PlannedRequest],
    *,
    clock: Callable[[], float],
    wait_until: Callable[[float], None],
) -> tuple[Recorder, float]:
    """Run ``planned`` (arrival offsets in seconds) through ``engine``; the
    records and the run's duration (first arrival to last finish)."""
    recorder = Recorder()
    engine.add_observer(recorder)
    order = sorted(range(len(planned)), key=lambda k: planned[k].start_seconds)
    ids = {k: prompt_ids(engine, planned[k]) for k in order}
    t0 = clock()
    i = 0
    while i < len(order) or engine.has_unfinished_requests():
        now = clock() - t0
        while i < len(order) and planned[order[i]].start_seconds <= now:
            req = planned[order[i]]
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            # FINAL_ONLY: no incremental detokenizing and no output per step,
            # which a replay never reads (its figures are the engine's records).
            engine.add_request(
                f"r{order[i]}", ids[order[i]], params, arrival_time=t0 + req.start_seconds, output_kind=FINAL_ONLY
            )
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif i < len(order):
            wait_until(t0 + planned[order[i]].start_seconds)
    return recorder, clock() - t0


def predict(
    device: Device,
    planned: Sequence[PlannedRequest],
    profile: EngineProfile,
    *,
    tokenizer_dir: str | Path,
    max_model_len: int | None = None,
    seed: int = 0,
) -> tuple[Recorder, float]:
    """``planned`` on a simulated engine of ``device`` in virtual time."""
    clock = VirtualClock()
    engine = SimLLMEngine(
        device, tokenizer_dir, profile=profile, max_model_len=max_model_len, seed=seed, clock=clock, sleep=None
    )
    return drive(engine, planned, clock=clock, wait_until=clock.advance_to)


class ThreadCpuClock:
    """Time that moves with this thread's CPU time and jumps over idle waits.

    A real engine on this clock computes every step for real, but a step
    lasts the CPU time its thread spent on it, not the wall time: on a shared
    machine, another process taking the core stretches wall time and not
    this. Its intra-op work must then run on this thread (one torch thread),
    or the clock misses it. Used to fit a step-time table and to check the
    simulation against the real engine under the same conditions, whatever
    else runs beside them."""

    def __init__(self) -> None:
        self._offset = -time.thread_time()

    def __call__(self) -> float:
        return time.thread_time() + self._offset

    def advance_to(self, when: float) -> None:
        now = self()
        if when > now:
            self._offset += when - now


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch (and so an engine built inside) on one intra-op thread, as
    ``ThreadCpuClock`` needs; the count before is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))


def measure(engine: LLMEngine, planned: Sequence[PlannedRequest]) -> tuple[Recorder, float]:
    """``planned`` on a real engine, in the engine's own time: wall time
    (``time.monotonic``, the default) sleeps until each arrival; a clock that
    can jump (``ThreadCpuClock``) jumps there."""
    clock = engine.clock
    wait_until = getattr(clock, "advance_to", None) or _sleep_until
    return drive(engine, planned, clock=clock, wait_until=wait_until)


def figures(recorder: Recorder, duration_seconds: float, slo: SLO | None = None) -> dict[str, Any]:
    """The figures of one run (``workers.figures.summarize``)."""
    return summarize(recorder.requests, recorder.steps, duration_seconds, slo or SLO(2.0, 0.2))


__all__ = ["Recorder", "ThreadCpuClock", "one_torch_thread", "drive", "figures", "measure", "predict"]


def closed_loop(
    engine: LLMEngine,
    *,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    num_requests: int,
    seed: int = 0,
) -> Recorder:
    """Keep ``concurrency`` requests of fixed lengths in the engine, each one
    that finishes replaced at once (a steady state, as AIConfigurator's
    aggregated-serving estimate assumes), until ``num_requests`` have run.
    Prompts share no prefix."""
    rng = random.Random(seed)
    vocab = list(range(100, engine.config.vocab_size))
    recorder = Recorder()
    engine.add_observer(recorder)
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        ids = [rng.choice(vocab) for _ in range(prompt_tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        engine.add_request(f"c{submitted}", ids, params, output_kind=FINAL_ONLY)
        submitted += 1

    for _ in range(min(concurrency, num_requests)):
        submit()
    while engine.has_unfinished_requests():
        engine.step()
        while submitted < num_requests and engine.get_num_unfinished_requests() < concurrency:
            submit()
    return recorder
