"""Predict a replay on a worker's simulated device: the one door the
control plane has to the simulated engine (``workers.engines.sim``).

An experiment in *predict* mode runs each arm's replay in virtual time on
the device its lab worker runs on, or stands for:

- a simulated worker (engine kind ``sim``) reports the device it rests on
  (its hardware's ``sim``, ``Device.describe()``): the same GPU, backend and
  model are rebuilt from it;
- a reference worker is priced by a step-time table fitted to the reference
  engine's own steps on this machine (``fit_reference_table``, about 100 s,
  kept in a file and reused), so what it predicts can be checked against
  what the reference worker then does;
- any other engine (vLLM) has no simulated device: ``CannotSimulate``.

Pure: no Django. The engine modules (torch, the kernel database) are
imported when a prediction is made, so a process that only asks whether a
worker can be simulated never loads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile

if TYPE_CHECKING:
    from workers.engines.sim.steptime import Device

# The profiles a reference table is fitted under: a monolithic one (whole
# prompts in one step; its budget is the model's length, see fit_profiles)
# and a chunked one (chunks over a cached context), so the fit sees the step
# shapes of either kind of arm.
FIT_PROFILES: tuple[dict[str, Any], ...] = (
    {"prefill_mode": "monolithic"},
    {"prefill_mode": "chunked", "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256},
)


def fit_profiles(model_dir: Path) -> list[EngineProfile]:
    """FIT_PROFILES for ``model_dir``: the fit runs at the model's own
    length, and a monolithic budget must hold a whole prompt of it."""
    max_len = int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    return [
        EngineProfile(**{"max_num_batched_tokens": max_len, **p} if p["prefill_mode"] == "monolithic" else p)
        for p in FIT_PROFILES
    ]


class CannotSimulate(ValueError):
    """A worker whose device no prediction can stand for; says why."""


@dataclass(frozen=True)
class Target:
    """What a prediction for one worker runs on: the device, and the
    tokenizer whose vocabulary the simulated engine emits from."""

    device: Device
    tokenizer_dir: Path

    @property
    def label(self) -> str:
        """The device for people: "H200 SXM", "x86_64 CPU, fitted table"."""
        name = self.device.name.replace(" (simulated, fitted)", ", fitted table")
        return name.replace(" (simulated)", "")


def shipped_model_dir() -> Path:
    """The project's tiny model, which reference workers serve by default."""
    # Imported here: reading the path must not load the engine (torch).
    from workers.engines.reference.tiny import SHIPPED_DIR

    return Path(SHIPPED_DIR)


def why_not(engine_kind: str, hardware: dict[str, Any] | None) -> str:
    """Why a worker cannot be simulated, or "" when it can."""
    if engine_kind == "reference":
        return ""
    if engine_kind == "sim":
        if not isinstance((hardware or {}).get("sim"), dict):
            return "it reports no simulated device (hardware.sim): a worker older than predictions"
        return ""
    return (
        f"its engine ({engine_kind}) has no simulated device: predictions run for simulated workers "
        "(their GPU's kernel database) and reference workers (a step-time table fitted on this machine)"
    )


def fitted_table_path(data_dir: Path, model_dir: Path) -> Path:
    return Path(data_dir) / "sim" / f"fitted-{Path(model_dir).name}.json"


def fit_reference_table(model_dir: Path, path: Path) -> Path:
    """Fit the reference engine's step times on ``model_dir`` (about 100 s on
    two cores) and write the table to ``path``, atomically: a second fit
    racing this one leaves one whole table."""
    # Imported here: fitting runs the reference engine (torch).
    from workers.engines.sim import fit

    table = fit.fit_reference(model_dir, fit_profiles(model_dir))
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    fit.write(table, partial)
    os.replace(partial, path)
    return path


def target(engine_kind: str, hardware: dict[str, Any] | None, *, table: Path | None = None) -> Target:
    """The device a prediction for this worker runs on. ``table``: the
    fitted table for a reference worker (it must exist). Raises
    CannotSimulate, saying why, also when the device cannot be rebuilt (a
    database this install lacks, a table fitted on a checkpoint not here)."""
    if why := why_not(engine_kind, hardware):
        raise CannotSimulate(why)
    # Imported here: building a device loads the engine and its database.
    from workers.engines.sim.steptime import FittedDevice, SimSetupError, from_description

    try:
        if engine_kind == "sim":
            return Target(from_description(dict((hardware or {})["sim"])), shipped_model_dir())
        if table is None or not table.exists():
            raise CannotSimulate("no step-time table has been fitted for it yet")
        device = FittedDevice(table)
    except SimSetupError as exc:
        raise CannotSimulate(f"its simulated device cannot be rebuilt here: {exc}") from exc
    return Target(device, Path(device.table.get("model_dir") or shipped_model_dir()))


@dataclass(frozen=True)
class Prediction:
    """One predicted replay: ``workers.figures.summarize``'s figures over
    the simulated engines' own records, the virtual seconds it spanned
    (first arrival to last finish) and the requests it held."""

    figures: dict[str, float | None]
    duration_seconds: float
    num_requests: int
    num_finished: int
    prefix_cache_queries: int
    prompt_tokens: int
    output_tokens: int


def predict(
    target: Target,
    shares: Sequence[Sequence[PlannedRequest]],
    profile: EngineProfile,
    *,
    max_model_len: int | None,
    ttft_seconds: float,
    tpot_seconds: float,
    seed: int = 0,
) -> Prediction:
    """Each share of the requests on its own simulated worker (one engine,
    one prefix cache, cold), in virtual time; the figures over all of them."""
    # Imported here: the simulated engine loads torch and the kernel database.
    from workers.engines.sim import virtual
    from workers.figures import SLO

    recorder = virtual.Recorder()
    duration = 0.0
    for share in shares:
        if not share:
            continue
        rec, seconds = virtual.predict(
            target.device,
            share,
            profile,
            tokenizer_dir=target.tokenizer_dir,
            max_model_len=max_model_len,
            seed=seed,
        )
        recorder.steps += rec.steps
        recorder.requests += rec.requests
        duration = max(duration, seconds)
    figures = virtual.figures(recorder, duration, SLO(ttft_seconds, tpot_seconds))
    return Prediction(
        figures=figures,
        duration_seconds=duration,
        num_requests=sum(len(s) for s in shares),
        num_finished=len(recorder.requests),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in recorder.steps),
        prompt_tokens=sum(m.num_prompt_tokens for m in recorder.requests),
        output_tokens=sum(m.num_output_tokens for m in recorder.requests),
    )


__all__ = [
    "FIT_PROFILES",
    "CannotSimulate",
    "Prediction",
    "Target",
    "fit_profiles",
    "fit_reference_table",
    "fitted_table_path",
    "predict",
    "shipped_model_dir",
    "target",
    "why_not",
]
