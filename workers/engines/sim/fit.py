"""Fit a step-time table to the reference engine's own steps on this machine.

The reference engine runs a fitting workload in process; each step's batch
(prefill chunks and decode KV lengths, ``StepBatch``) is paired with the
step's measured duration (``StepMetrics.duration_seconds``: schedule, forward
pass, sampling). A non-negative least-squares fit over ``FIT_FEATURES``
gives seconds per unit of each, which ``FittedDevice`` reads. The table is
fitted on workloads apart from those the validation then predicts.
"""

from __future__ import annotations

import json
import platform
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from workers.engines.reference.llm_engine import LLMEngine
from workers.engines.reference.scheduler import ScheduledChunk
from workers.engines.reference.sequence import Sequence
from workers.engines.sim.steptime import FIT_FEATURES, StepBatch, features
from workers.engines.sim.virtual import measure
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile


class RecordingEngine(LLMEngine):
    """The reference engine, keeping each step's batch beside its duration."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.batches: list[StepBatch] = []

    def _execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Sequence], Any, Any, dict[int, Any], Any]:
        self.batches.append(StepBatch.of(chunks))
        return super()._execute(chunks)


def fit(batches: list[StepBatch], seconds: list[float]) -> tuple[dict[str, dict[str, float]], float]:
    """Non-negative coefficients per feature, one set for decode-only steps
    and one for steps with a prefill (on a CPU the two run different kernels
    and thread counts: one line through both fitted neither), and R² of the
    whole fit."""
    from scipy.optimize import nnls  # a dependency of aiconfigurator-core; only fitting needs it

    x = np.array([features(b) for b in batches], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    decode_only = np.array([not b.prefills for b in batches])
    predicted = np.zeros_like(y)
    out: dict[str, dict[str, float]] = {}
    for kind, rows in (("decode", decode_only), ("prefill", ~decode_only)):
        coef = np.zeros(x.shape[1])
        if rows.any():
            scale = np.maximum(x[rows].max(axis=0), 1e-12)  # columns of very different sizes: fit on [0, 1]
            coef, _ = nnls(x[rows] / scale, y[rows])
            coef = coef / scale
        predicted[rows] = x[rows] @ coef
        out[kind] = dict(zip(FIT_FEATURES, (float(c) for c in coef), strict=True))
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 0.0
    return out, r2


def fitting_workload(seed: int = 0) -> list[PlannedRequest]:
    """Steps of every shape the scheduler makes: decode batches of 1..N over
    short and long contexts, chunks from the first to the last of long
    prompts, and mixed steps. Lengths are spread, arrivals dense enough to
    batch, so the fit sees the ranges the validation workloads reach."""
    rng = random.Random(seed)
    planned = []
    t = 0.0
    for k in range(160):
        t += rng.expovariate(4.0)
        prompt = rng.choice((rng.randint(16, 400), rng.randint(400, 1500), rng.randint(1500, 4000)))
        ids = [rng.randrange(100, 2000) for _ in range(prompt)]
        planned.append(PlannedRequest(t, "completions", rng.randint(8, 160), prompt_token_ids=ids))
        if k % 40 == 39:
            t += 3.0  # a pause: decode-only tails of every batch size
    return planned


def fit_reference(
    model_dir: str | Path, profiles: list[EngineProfile], seed: int = 0, max_model_len: int | None = None
) -> dict[str, Any]:
    """Run the fitting workload under each profile on the reference engine and fit one table."""
    batches: list[StepBatch] = []
    seconds: list[float] = []
    weight_bytes = 0
    kv_cache_bytes = 0
    for profile in profiles:
        engine = RecordingEngine(model_dir, profile=profile, seed=seed, max_model_len=max_model_len)
        recorder, _ = measure(engine, fitting_workload(seed))
        if len(engine.batches) != len(recorder.steps):
            raise RuntimeError("the step records and the batches do not pair up")
        batches += engine.batches
        seconds += [s.duration_seconds for s in recorder.steps]
        weight_bytes = engine.memory_facts().weight_bytes
        kv_cache_bytes = engine.num_blocks_total * engine.block_bytes
    coefficients, r2 = fit(batches, seconds)
    return {
        "coefficients": coefficients,
        "r2": r2,
        "steps": len(seconds),
        "model_dir": str(Path(model_dir).resolve()),
        "max_model_len": max_model_len,
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": kv_cache_bytes,
        "hardware": f"{platform.machine()} CPU",
        "fitted_on": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write(table: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    return out


__all__ = ["RecordingEngine", "fit", "fit_reference", "fitting_workload", "write"]
