"""Fit a step-time table to the reference engine's own steps on this machine.

The reference engine runs a fitting workload in process; each step's batch
(prefill chunks and decode KV lengths, ``StepBatch``) is paired with the
step's measured duration (``StepMetrics.duration_seconds``: schedule, forward
pass, sampling). A non-negative fit over ``FIT_FEATURES`` (least absolute
deviation, decode part first, ``fit``) gives seconds per unit of each, which
``FittedDevice`` reads. The table is fitted on workloads apart from those the
validation then predicts.

On a shared machine, run the engine on ``virtual.ThreadCpuClock`` with one
torch thread (``fit_reference(..., cpu_clock=True)``): its steps then last
their own CPU time, so the fit and the check it serves see the same machine
whatever else runs beside them. A table meant to predict a live worker in
wall time is fitted in wall time (the default).
"""

from __future__ import annotations

import json
import platform
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from workers.engines.reference.llm_engine import LLMEngine
from workers.engines.reference.scheduler import ScheduledChunk
from workers.engines.reference.sequence import Sequence
from workers.engines.sim.steptime import FIT_FEATURES, StepBatch, features
from workers.engines.sim.virtual import ThreadCpuClock, measure, one_torch_thread
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


# Rounds of reweighting in the least-absolute-deviation fit; it settles in a few.
L1_ROUNDS = 30
# A residual below this many seconds counts as this many when reweighting (no division by ~0).
L1_FLOOR_SECONDS = 1e-5
DECODE_COLUMNS = (FIT_FEATURES.index("decodes"), FIT_FEATURES.index("decode_kv_tokens"))
PREFILL_COLUMNS = tuple(FIT_FEATURES.index(n) for n in ("steps", "prefill_tokens", "prefill_attention"))


def _nonnegative_l1(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the absolute error (iteratively
    reweighted non-negative least squares). A CPU step now and then takes
    several times its usual cost (a collection, a page fault, another process
    on the core): least squares follows those outliers, the absolute error
    follows the typical step."""
    from scipy.optimize import nnls  # a dependency of aiconfigurator-core; only fitting needs it

    if not len(y):
        return np.zeros(x.shape[1])
    scale = np.maximum(x.max(axis=0), 1e-12)  # columns of very different sizes: fit on [0, 1]
    xs = x / scale
    coef, _ = nnls(xs, y)
    for _ in range(L1_ROUNDS):
        weight = 1.0 / np.sqrt(np.maximum(np.abs(y - xs @ coef), L1_FLOOR_SECONDS))
        coef, _ = nnls(xs * weight[:, None], y * weight)
    return coef / scale


def fit(batches: list[StepBatch], seconds: list[float]) -> tuple[dict[str, dict[str, float]], float]:
    """Non-negative coefficients per feature, one set for decode-only steps
    and one for steps with a prefill, and R² of the whole fit.

    Two stages. The decode set is fitted on decode-only steps. A step with a
    prefill is then priced as the same decodes plus its prefill part: its
    decode coefficients are the decode set's, and only its own intercept,
    prefill tokens and prefill attention are fitted, on what the decodes
    leave. Fitting all five at once let the decode coefficients of prefill
    steps absorb prefill cost (they came out 4x the decode set's, so a
    chunk beside decodes was priced too high)."""
    x = np.array([features(b) for b in batches], dtype=np.float64).reshape(len(batches), len(FIT_FEATURES))
    y = np.array(seconds, dtype=np.float64)
    decode_only = np.array([not b.prefills for b in batches], dtype=bool)
    decode = _nonnegative_l1(x[decode_only], y[decode_only])
    prefill = np.zeros(len(FIT_FEATURES))
    for c in DECODE_COLUMNS:
        prefill[c] = decode[c]
    rows = ~decode_only
    left = y[rows] - x[rows] @ prefill
    prefill[list(PREFILL_COLUMNS)] = _nonnegative_l1(x[rows][:, list(PREFILL_COLUMNS)], left)
    predicted = np.where(decode_only, x @ decode, x @ prefill)
    total = float(((y - y.mean()) ** 2).sum()) if len(y) else 0.0
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 0.0
    out = {
        kind: dict(zip(FIT_FEATURES, (float(c) for c in coef), strict=True))
        for kind, coef in (("decode", decode), ("prefill", prefill))
    }
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
    model_dir: str | Path,
    profiles: list[EngineProfile],
    seed: int = 0,
    max_model_len: int | None = None,
    *,
    cpu_clock: bool = False,
) -> dict[str, Any]:
    """Run the fitting workload under each profile on the reference engine
    and fit one table; ``cpu_clock``: in the engine thread's CPU time."""
    batches: list[StepBatch] = []
    seconds: list[float] = []
    weight_bytes = 0
    kv_cache_bytes = 0
    for profile in profiles:
        with one_torch_thread() if cpu_clock else nullcontext():
            clock = ThreadCpuClock() if cpu_clock else time.monotonic
            engine = RecordingEngine(model_dir, profile=profile, seed=seed, max_model_len=max_model_len, clock=clock)
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
        "clock": "thread CPU time" if cpu_clock else "wall",
        "fitted_on": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write(table: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    return out


__all__ = ["RecordingEngine", "fit", "fit_reference", "fitting_workload", "write"]
