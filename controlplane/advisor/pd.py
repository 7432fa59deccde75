"""Prefill-decode disaggregation estimated from NVIDIA AIConfigurator's
performance database (``aiconfigurator-core``), for the pool's GPU and model,
the traffic's mean prompt and output lengths and the TTFT and TPOT
objectives. Not pure: it reads the database and the pool's workers;
``verdicts.pd_database`` judges what it returns (``verdicts.PdDatabase``).

Design note. Both sides are throughput per GPU under the objectives, each
the best configuration a sweep finds on the database:

* aggregated chunked serving: the package's own sweep,
  ``find_best_agg_result_under_constraints`` (batch size × chunk tokens,
  chunked prefill on), for each tensor-parallel size in ``TP_SIZES``;
* disaggregated serving: the package's per-phase models, ``run_static`` in
  ``static_ctx`` (a prefill worker) and ``static_gen`` (a decode worker) over
  batch sizes and ``TP_SIZES``, then rate-matched as AIConfigurator's
  ``DisaggInferenceSession`` does (that session lives in the full
  ``aiconfigurator`` package, not in the core we depend on, so the matching
  is ours, with its published factors): a prefill worker's TTFT is scaled by
  ``TTFT_QUEUEING_FACTOR`` for queueing, prefill and decode rates by
  ``PREFILL_DEGRADATION``/``DECODE_DEGRADATION``, and the worker counts (up
  to ``MAX_WORKERS`` a side) that give the most tokens/s per GPU win. We add
  the KV transfer AIConfigurator leaves out: a prompt's KV (the database's
  bytes per token × the prompt) over the prefill-to-decode link
  (``ADVISOR_LINK_BANDWIDTH_GBPS``), added to the prefill's TTFT.

A sweep takes seconds (see ``PdDatabase.sweep_seconds``), so it runs where
the kept reports are computed (beat's ``advisor.refresh``), cached per set
of inputs; a report computed in a request reuses the kept report's estimate
when the inputs match, and otherwise says it is pending. Lengths are rounded
to five significant bits so that rounds of similar traffic share a sweep.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.advisor.verdicts import PdDatabase, Requests, Thresholds
from controlplane.fleet.models import Pool, Worker
from controlplane.metrics import query

log = logging.getLogger(__name__)

TP_SIZES = (1, 2, 4, 8)
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32)
PREFILL_MAX_NUM_TOKENS = 16384  # a prefill batch's tokens, unless one prompt is longer
DECODE_BATCHES = (
    *range(1, 16),
    *range(16, 32, 2),
    *range(32, 128, 4),
    *range(128, 512, 16),
    512,
)
MAX_WORKERS = 16
# AIConfigurator's rate-matching factors (aiconfigurator.sdk.picking): prefill
# pipeline bubbles, unsaturated decode batch slots, and prefill queueing.
PREFILL_DEGRADATION = 0.9
DECODE_DEGRADATION = 0.92
TTFT_QUEUEING_FACTOR = 1.8
KV_MEMORY_FRACTION = 0.9

# torch's device name (``torch.cuda.get_device_name``) → the database's system,
# longest name first so "GB200" is not read as "B200", "L40S" not as "L4"; a
# PCIe part maps to its PCIe system (``PCIE_SYSTEMS``) or to none.
GPU_SYSTEMS: tuple[tuple[str, str], ...] = (
    ("GB300", "gb300"),
    ("GB200", "gb200"),
    ("B300", "b300_sxm"),
    ("B200", "b200_sxm"),
    ("H200", "h200_sxm"),
    ("H100", "h100_sxm"),
    ("A100", "a100_sxm"),
    ("L40S", "l40s"),
    ("L4", "l4"),
    ("A30", "a30"),
    ("RTX PRO 6000", "rtx_pro_6000_server"),
)
PCIE_SYSTEMS = {"h100_sxm": "h100_pcie", "a100_sxm": "a100_pcie"}
# A worker's engine → the database's backend; the reference engine has none.
ENGINE_BACKENDS = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}


@dataclass(frozen=True)
class Target:
    """One sweep's inputs: what the cache is keyed by."""

    system: str
    backend: str
    database_version: str
    model: str
    isl: int
    osl: int
    ttft_objective_seconds: float
    tpot_objective_seconds: float
    link_bandwidth_gbps: float

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "backend": self.backend,
            "database_version": self.database_version,
            "model": self.model,
            "isl": self.isl,
            "osl": self.osl,
            "ttft_objective_seconds": self.ttft_objective_seconds,
            "tpot_objective_seconds": self.tpot_objective_seconds,
            "link_bandwidth_gbps": self.link_bandwidth_gbps,
        }


class NoDatabase(Exception):
    """The pool's GPU, engine or model has no data in the package: the sentence says which."""


# ---- the package (imported on first use) ---------------------------------------------


def _sdk() -> Any:
    # Lazy: the package loads pandas, pyarrow and its Rust core (~2 s); only
    # the advisor's round pays for it, never a web process that shows a page.
    import aiconfigurator_core.sdk as sdk

    return sdk


@functools.cache
def supported_databases() -> dict[str, dict[str, list[str]]]:
    """system → backend → database versions, as the package ships them."""
    # Lazy: see _sdk.
    from aiconfigurator_core.sdk.perf_database import get_supported_databases

    return {s: {b: list(v) for b, v in backends.items()} for s, backends in get_supported_databases().items()}


@functools.cache
def packaged_models() -> tuple[str, ...]:
    """Model ids whose config the package ships (``org/name``)."""
    from pathlib import Path

    # Lazy: see _sdk.
    import aiconfigurator_core

    configs = Path(aiconfigurator_core.__file__).parent / "model_configs"
    stems = (p.name.removesuffix("_config.json") for p in configs.glob("*_config.json"))
    return tuple(sorted(s.replace("--", "/", 1) for s in stems if not s.endswith("_hf_quant")))


def latest_version(system: str, backend: str) -> str:
    # Lazy: see _sdk.
    from aiconfigurator_core.sdk.perf_database import get_latest_database_version

    return str(get_latest_database_version(system, backend))


# ---- what the pool runs ---------------------------------------------------------------


def system_for_gpu(name: str) -> str | None:
    """The database's system for a torch device name ("NVIDIA H200" → h200_sxm)."""
    upper = name.upper()
    for part, system in GPU_SYSTEMS:
        if part.upper() in upper:
            if "PCIE" in upper:
                return PCIE_SYSTEMS.get(system)
            return system
    return None


def _model_key(name: str) -> str:
    key = name.lower().rsplit("/", 1)[-1].removesuffix("-instruct")
    return key.removeprefix("meta-")


def packaged_model(served: str) -> str | None:
    """The packaged model id the served one is: the same id, or the same name
    once the org, "Meta-" and "-Instruct" are set aside
    ("meta-llama/Llama-3.1-8B-Instruct" → meta-llama/Meta-Llama-3.1-8B)."""
    models = packaged_models()
    if served in models:
        return served
    matches = [m for m in models if _model_key(m) == _model_key(served)]
    return matches[0] if len(matches) == 1 else None


def _worker_target(worker: Worker) -> tuple[str, str, str | None, str]:
    """(system, backend, version or None for the latest, model) of one worker, or NoDatabase."""
    hardware = worker.hardware or {}
    sim = hardware.get("sim") or {}
    if hardware.get("simulated") or worker.engine_kind == "sim":
        if sim.get("kind") == "fitted":
            raise NoDatabase(
                f"worker {worker.name} is simulated from a fitted step-time table, not AIConfigurator's database."
            )
        if sim.get("kind") != "aiconfigurator":
            raise NoDatabase(f"worker {worker.name} is simulated but did not report the database it rests on.")
        return str(sim["system"]), str(sim["backend"]), sim.get("database_version"), str(sim["model"])
    if hardware.get("device") != "cuda":
        device = hardware.get("device") or "an unknown device"
        raise NoDatabase(f"no database for this GPU: worker {worker.name} runs on {device}.")
    gpu = str(hardware.get("name") or "")
    system = system_for_gpu(gpu)
    if system is None:
        known = ", ".join(part for part, _ in GPU_SYSTEMS)
        raise NoDatabase(f"no database for this GPU ({gpu or 'unnamed'}); the database knows {known}.")
    backend = ENGINE_BACKENDS.get(worker.engine_kind)
    if backend is None:
        raise NoDatabase(f"no database for the {worker.engine_kind} engine; it has vllm, sglang and trtllm.")
    model = packaged_model(worker.model)
    if model is None:
        raise NoDatabase(f"no database for this model ({worker.model or 'unnamed'}).")
    return system, backend, None, model


def round_tokens(value: float) -> int:
    """Rounded to five significant bits (within 3%; 4096 and 256 stay as they
    are), so that rounds of similar traffic share one cached sweep."""
    if value < 16:
        return max(1, round(value))
    step = 2 ** (math.floor(math.log2(value)) - 4)
    return int(round(value / step) * step)


def _mean_tokens(values: Sequence[int | None], ok: Sequence[bool]) -> float | None:
    known = [v for v, good in zip(values, ok, strict=False) if good and v is not None and v > 0]
    return sum(known) / len(known) if known else None


def target_for(
    pool: Pool | None,
    requests: Requests,
    t: Thresholds,
    tbt_objective_seconds: float | None,
    *,
    check: bool = True,
) -> Target:
    """The sweep's inputs for the pool, or NoDatabase saying why there are
    none. Without ``check`` the package is not asked (it takes seconds to
    load): the system and backend go unchecked, and a version not named by
    the workers is left empty (the latest, when swept)."""
    if pool is None:
        raise NoDatabase("estimated per pool (one GPU and model each), not for the fleet as a whole.")
    workers = list(Worker.objects.filter(pool=pool).order_by("name"))
    if not workers:
        raise NoDatabase("the pool has no workers.")
    targets = {_worker_target(w) for w in workers}
    if len(targets) > 1:
        raise NoDatabase(
            "the pool's workers differ in GPU, engine or model: "
            + "; ".join(sorted(f"{s}/{b} {m}" for s, b, _, m in targets))
        )
    system, backend, version, model = targets.pop()
    if check:
        databases = supported_databases()
        if system not in databases:
            raise NoDatabase(f"no database for this GPU ({system}); the database knows {', '.join(sorted(databases))}.")
        if backend not in databases[system]:
            raise NoDatabase(f"no database for {backend} on {system}; it has {', '.join(sorted(databases[system]))}.")
        version = version or latest_version(system, backend)
    isl = _mean_tokens(requests.prompt_tokens, requests.ok)
    osl = _mean_tokens(requests.output_tokens, requests.ok)
    if isl is None or osl is None:
        raise NoDatabase("no successful request with prompt and output lengths in the window.")
    objectives = query.objectives_now()
    tpot = tbt_objective_seconds if tbt_objective_seconds is not None else objectives.tpot_seconds
    return Target(
        system,
        backend,
        version or "",
        model,
        round_tokens(isl),
        max(2, round_tokens(osl)),
        objectives.ttft_seconds,
        tpot,
        t.link_bandwidth_gbps,
    )


# ---- the sweep ---------------------------------------------------------------------------


def _runtime(target: Target, batch_size: int) -> Any:
    # Lazy: see _sdk.
    from aiconfigurator_core.sdk.config import RuntimeConfig

    return RuntimeConfig(
        batch_size=batch_size,
        isl=target.isl,
        osl=target.osl,
        ttft=target.ttft_objective_seconds * 1000,
        tpot=target.tpot_objective_seconds * 1000,
    )


def _model(target: Target, tp: int) -> Any:
    # Lazy: see _sdk.
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    config = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1)
    return get_model(target.model, config, target.backend)


def _database(target: Target) -> Any:
    # Lazy: see _sdk.
    from aiconfigurator_core.sdk.perf_database import get_database

    return get_database(target.system, target.backend, target.database_version)


def _backend(target: Target) -> Any:
    # A fresh one per model: a backend caches run_agg results by lengths and
    # batch, not by the model's parallelism. Lazy: see _sdk.
    from aiconfigurator_core.sdk.backends.factory import get_backend

    return get_backend(target.backend)


def kv_bytes_per_token(target: Target) -> int:
    """A token's KV across the whole model, as the database sizes it."""
    sdk = _sdk()
    memory = sdk.estimate_kv_cache(
        target.model,
        target.system,
        target.backend,
        target.database_version,
        max_num_tokens=PREFILL_MAX_NUM_TOKENS,
        max_batch_size=256,
        memory_fraction_kind="of_total",
        memory_fraction_value=KV_MEMORY_FRACTION,
    )
    return int(memory["kv_size_per_token_bytes"])


def best_agg(target: Target, database: Any) -> dict[str, Any] | None:
    """The package's aggregated (chunked) sweep: its best row over ``TP_SIZES``."""
    best: dict[str, Any] | None = None
    for tp in TP_SIZES:
        summary = _backend(target).find_best_agg_result_under_constraints(
            _model(target, tp),
            database,
            _runtime(target, 1),
            top_k=1,
            max_batch_size=512,
            ctx_stride=512,
            enable_chunked_prefill=True,
        )
        frame = summary.get_summary_df()
        if frame is None or frame.empty:
            continue
        row = frame.iloc[0].to_dict()
        if best is None or row["tokens/s/gpu"] > best["tokens/s/gpu"]:
            best = row
    if best is None:
        return None
    return {
        "tokens_per_second_per_gpu": float(best["tokens/s/gpu"]),
        "tp": int(best["tp"]),
        "batch_size": int(best["bs"]),
        "chunk_tokens": int(best["ctx_tokens"]),
        "ttft_seconds": float(best["ttft"]) / 1000,
        "tpot_seconds": float(best["tpot"]) / 1000,
        "num_gpus": int(best["num_total_gpus"]),
    }


@dataclass(frozen=True)
class PhaseWorker:
    """One prefill or decode worker configuration, as ``run_static`` estimates it."""

    tp: int
    batch_size: int
    seq_per_second: float  # one worker's requests per second
    ttft_seconds: float  # prefill: one batch's (uncorrected); decode: 0
    tpot_seconds: float  # decode: per output token; prefill: 0


def phase_workers(target: Target, database: Any, mode: str) -> list[PhaseWorker]:
    """Every worker of the phase (``static_ctx`` or ``static_gen``) that fits in memory."""
    batches = PREFILL_BATCHES if mode == "static_ctx" else DECODE_BATCHES
    found = []
    for tp in TP_SIZES:
        model = _model(target, tp)
        backend = _backend(target)
        for b in batches:
            if mode == "static_ctx" and b > 1 and b * target.isl > PREFILL_MAX_NUM_TOKENS:
                break
            summary = backend.run_static(model, database, _runtime(target, b), mode)
            if summary.check_oom() or summary.check_kv_cache_oom():
                break  # a larger batch does not fit either
            row = summary.get_summary_df().iloc[0]
            found.append(PhaseWorker(tp, b, float(row["seq/s"]), float(row["ttft"]) / 1000, float(row["tpot"]) / 1000))
    return found


def match(prefill: PhaseWorker, decode: PhaseWorker, osl: int) -> tuple[float, int, int]:
    """(tokens/s per GPU, prefill workers, decode workers): the worker counts
    up to ``MAX_WORKERS`` a side whose matched rate per GPU is highest."""
    best = (0.0, 0, 0)
    for num_prefill in range(1, MAX_WORKERS + 1):
        for num_decode in range(1, MAX_WORKERS + 1):
            rate = min(
                prefill.seq_per_second * num_prefill * PREFILL_DEGRADATION,
                decode.seq_per_second * num_decode * DECODE_DEGRADATION,
            )
            per_gpu = rate * osl / (prefill.tp * num_prefill + decode.tp * num_decode)
            if per_gpu > best[0]:
                best = (per_gpu, num_prefill, num_decode)
    return best


def best_disagg(target: Target, database: Any, transfer_seconds: float) -> dict[str, Any] | None:
    """The best rate-matched pair of a prefill and a decode worker under the objectives."""
    prefills = [
        p
        for p in phase_workers(target, database, "static_ctx")
        if p.ttft_seconds * TTFT_QUEUEING_FACTOR + transfer_seconds < target.ttft_objective_seconds
    ]
    decodes = [
        d for d in phase_workers(target, database, "static_gen") if d.tpot_seconds < target.tpot_objective_seconds
    ]
    best: tuple[float, int, int, PhaseWorker, PhaseWorker] | None = None
    for p in prefills:
        for d in decodes:
            per_gpu, num_p, num_d = match(p, d, target.osl)
            if num_p and (best is None or per_gpu > best[0]):
                best = (per_gpu, num_p, num_d, p, d)
    if best is None:
        return None
    per_gpu, num_p, num_d, p, d = best
    return {
        "tokens_per_second_per_gpu": per_gpu,
        "prefill_tp": p.tp,
        "prefill_batch_size": p.batch_size,
        "prefill_workers": num_p,
        "prefill_seq_per_second": p.seq_per_second,
        "decode_tp": d.tp,
        "decode_batch_size": d.batch_size,
        "decode_workers": num_d,
        "decode_seq_per_second": d.seq_per_second,
        "ttft_seconds": p.ttft_seconds * TTFT_QUEUEING_FACTOR + transfer_seconds,
        "prefill_seconds": p.ttft_seconds,
        "transfer_seconds": transfer_seconds,
        "tpot_seconds": d.tpot_seconds,
        "num_gpus": p.tp * num_p + d.tp * num_d,
    }


@functools.lru_cache(maxsize=32)
def estimate(target: Target) -> PdDatabase:
    """Both sides' best tokens/s per GPU for ``target``; seconds, so cached."""
    started = time.perf_counter()
    inputs = target.to_json()
    try:
        database = _database(target)
        if database is None:
            raise NoDatabase(f"no database for {target.system}/{target.backend} {target.database_version}.")
        kv_bytes = kv_bytes_per_token(target)
        transfer = target.isl * kv_bytes / (target.link_bandwidth_gbps * 1e9)
        inputs = {**inputs, "kv_bytes_per_token": kv_bytes}
        agg = best_agg(target, database)
        disagg = best_disagg(target, database, transfer)
    except NoDatabase as exc:
        return PdDatabase(inputs, unavailable=str(exc))
    except (ValueError, KeyError, RuntimeError) as exc:
        # The package refuses a combination it lacks data for: say so, the report goes on.
        log.warning("PD database estimate failed for %s: %s", target, exc)
        return PdDatabase(inputs, unavailable=f"the database cannot model {target.model} on {target.system}: {exc}")
    return PdDatabase(
        inputs,
        agg_tokens_per_second_per_gpu=agg["tokens_per_second_per_gpu"] if agg else None,
        disagg_tokens_per_second_per_gpu=disagg["tokens_per_second_per_gpu"] if disagg else None,
        agg_best=agg or {},
        disagg_best=disagg or {},
        sweep_seconds=time.perf_counter() - started,
    )


def for_pool(
    pool: Pool | None,
    requests: Requests,
    t: Thresholds,
    tbt_objective_seconds: float | None,
    *,
    run: bool,
    kept: dict[str, Any] | None = None,
) -> PdDatabase:
    """The estimate for the pool: swept (or from the cache) when ``run``; else
    the kept report's when its inputs are these, else pending."""
    try:
        target = target_for(pool, requests, t, tbt_objective_seconds, check=run)
    except NoDatabase as exc:
        return PdDatabase({}, unavailable=str(exc))
    if run:
        return estimate(target)
    wanted = {k: v for k, v in target.to_json().items() if v != ""}
    if kept and {k: (kept.get("inputs") or {}).get(k) for k in wanted} == wanted:
        return PdDatabase.from_json(kept)
    return PdDatabase(
        target.to_json(),
        unavailable="pending: the database sweep takes seconds, so the advisor's periodic round "
        "(advisor.refresh) runs it, not a request; the kept report will carry it.",
    )
