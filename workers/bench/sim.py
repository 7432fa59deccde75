"""``python -m workers bench-sim``: is the simulated engine right?

Two checks, each printed as a table of ratios (simulated / reference):

1. ``--against aiconfigurator``: fixed prompt and output lengths at fixed
   concurrency (a closed loop: each finished request replaced at once), the
   simulated H200's mean TTFT and TPOT beside the package's own
   aggregated-serving estimate (``run_agg``) for the same database, model,
   batch and chunk. TPOT is the one like-for-like figure: the package's TTFT
   is a calibrated queueing heuristic for requests arriving together, the
   simulation queues them as they come (README says what that means).
2. ``--against reference``: a step-time table is fitted to the reference
   engine's own steps on this CPU (``workers.engines.sim.fit``), then the
   reference engine (wall time) and the simulated engine on that table
   (virtual time) run the same workloads, none of them used for the fit: the
   prefill bench's mixed workload, the long-tail scenario near capacity and
   a bursty one, each monolithic and chunked. Stall P99, TTFT P50/P99 and
   output throughput are compared. By default (``--clock cpu``) the
   reference engine runs on one torch thread and ``ThreadCpuClock``: it
   computes every step for real, and a step lasts the CPU time it took, so
   the fit and the check see the same machine whatever else runs on it
   (``--clock wall``: wall time, as a live worker sees it).

Figures go to stdout and, with ``--json``, to a file. The machine is shared
and noisy; the reference runs are one sample each: read the ratios as such.
A figure that rests on a handful of samples (the burst scenario's stall P99
is its largest gap over about 50 requests) moves with one slow step.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from workers import loadgen
from workers.bench.harness import mixed_workload
from workers.engines.reference.llm_engine import LLMEngine
from workers.engines.reference.tiny import SHIPPED_DIR
from workers.engines.sim import fit
from workers.engines.sim.engine import SimLLMEngine, VirtualClock
from workers.engines.sim.steptime import AicDevice, FittedDevice
from workers.engines.sim.virtual import ThreadCpuClock, closed_loop, figures, measure, one_torch_thread, predict
from workers.figures import mean, tpot_seconds, ttft_seconds
from workers.loadgen import PlannedRequest
from workers.profile import EngineProfile

# (concurrency, prompt tokens, output tokens, chunk tokens per step)
AGG_SHAPES = ((16, 1024, 256, 2048), (32, 2048, 128, 2048), (64, 512, 512, 1024), (8, 4096, 64, 8192))
COMPARED = ("stall_p99_seconds", "ttft_p50_seconds", "ttft_p99_seconds", "output_throughput_tps")
MAX_MODEL_LEN = 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", choices=("aiconfigurator", "reference", "both"), default="both")
    parser.add_argument("--system", default="h200_sxm")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--model", default="meta-llama/Meta-Llama-3.1-8B", help="the simulated model (aiconfigurator)")
    parser.add_argument("--table", type=Path, help="reference: use this fitted table instead of fitting one")
    parser.add_argument(
        "--save-table",
        type=Path,
        default=Path("var/bench/sim-fitted-tiny-model.json"),
        help="where the fitted table is written (not the data dir's var/sim/: that one predicts live workers)",
    )
    parser.add_argument("--duration", type=float, default=25.0, help="reference: seconds of arrivals per workload")
    parser.add_argument("--long-tail-rate", type=float, default=1.2, help="reference: the long-tail scenario's rate")
    parser.add_argument("--mixed-rate", type=float, default=2.0)
    parser.add_argument("--burst-rate", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="reference: steps last their thread CPU time (one torch thread) or wall time",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")


# ---- 1. against the package's aggregated-serving estimate ------------------------------
def against_aiconfigurator(system: str, backend: str, model: str) -> list[dict[str, Any]]:
    # The package's own aggregated estimate: its internal API, used here only.
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.config import RuntimeConfig
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database

    device = AicDevice(system, backend, model)
    built = get_model(
        model, build_model_config(tp_size=1, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1), backend
    )
    database = get_database(system, backend, device.version)
    estimator = get_backend(backend)
    rows = []
    for b, isl, osl, ctx in AGG_SHAPES:
        theirs = estimator.run_agg(built, database, RuntimeConfig(batch_size=b, isl=isl, osl=osl), ctx_tokens=ctx)
        d = theirs.get_result_dict()
        clock = VirtualClock()
        profile = EngineProfile(max_num_batched_tokens=ctx + b, long_prefill_token_threshold=ctx, max_num_seqs=b)
        engine = SimLLMEngine(
            device, SHIPPED_DIR, max_model_len=16384, profile=profile, clock=clock, sleep=None, seed=b
        )
        recorder = closed_loop(engine, concurrency=b, prompt_tokens=isl, output_tokens=osl, num_requests=20 * b)
        steady = recorder.requests[2 * b : -2 * b]  # not the start, where all arrive at once, nor the drain
        rows.append(
            {
                "concurrency": b,
                "prompt_tokens": isl,
                "output_tokens": osl,
                "chunk_tokens": ctx,
                "package_ttft_ms": float(d["ttft"]),
                "sim_ttft_ms": 1e3 * (mean(v for m in steady if (v := ttft_seconds(m)) is not None) or 0.0),
                "package_tpot_ms": float(d["tpot"]),
                "sim_tpot_ms": 1e3 * (mean(v for m in steady if (v := tpot_seconds(m)) is not None) or 0.0),
            }
        )
    return rows


def print_aiconfigurator(rows: list[dict[str, Any]], system: str, model: str) -> None:
    print(f"\nSimulated {system} / {model} against aiconfigurator's aggregated estimate (closed loop)")
    print(
        f"{'conc':>4} {'isl':>5} {'osl':>4} {'chunk':>5} | {'TPOT pkg':>9} {'sim':>7} {'ratio':>6} |"
        f" {'TTFT pkg':>9} {'sim':>7} {'ratio':>6}"
    )
    for r in rows:
        tpot, ttft = r["sim_tpot_ms"] / r["package_tpot_ms"], r["sim_ttft_ms"] / r["package_ttft_ms"]
        print(
            f"{r['concurrency']:>4} {r['prompt_tokens']:>5} {r['output_tokens']:>4} {r['chunk_tokens']:>5} |"
            f" {r['package_tpot_ms']:>7.2f}ms {r['sim_tpot_ms']:>5.2f}ms {tpot:>6.2f} |"
            f" {r['package_ttft_ms']:>7.1f}ms {r['sim_ttft_ms']:>5.1f}ms {ttft:>6.2f}"
        )


# ---- 2. against the reference engine on this CPU ------------------------------------------
def workloads(args: argparse.Namespace) -> dict[str, list[PlannedRequest]]:
    mixed = [
        PlannedRequest(r.offset_seconds, "completions", r.max_tokens, prompt_token_ids=r.prompt_token_ids)
        for r in mixed_workload(args.seed, args.duration, args.mixed_rate, 0.05, (2500, 4000), 2048, 0)
    ]
    long_tail = loadgen.plan(
        "long-tail", duration_seconds=args.duration, rate=args.long_tail_rate, seed=args.seed, max_model_len=4096
    )
    burst = loadgen.plan("burst", duration_seconds=args.duration, rate=args.burst_rate, seed=args.seed)
    return {"mixed": mixed, "long-tail": long_tail, "burst": burst}


PROFILES = {
    "monolithic": EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=MAX_MODEL_LEN),
    "chunked-256": EngineProfile(prefill_mode="chunked", max_num_batched_tokens=256),
}
FIT_PROFILES = [
    EngineProfile(prefill_mode="chunked", max_num_batched_tokens=256),
    EngineProfile(prefill_mode="monolithic", max_num_batched_tokens=MAX_MODEL_LEN),
]


def against_reference(args: argparse.Namespace) -> dict[str, Any]:
    cpu = args.clock == "cpu"
    if args.table:
        table_path = args.table
    else:
        started = time.monotonic()
        print("fitting the step-time table to the reference engine…", file=sys.stderr, flush=True)
        table = fit.fit_reference(
            SHIPPED_DIR, FIT_PROFILES, seed=args.seed + 1000, max_model_len=MAX_MODEL_LEN, cpu_clock=cpu
        )
        table_path = fit.write(table, args.save_table)
        print(
            f"  fitted on {table['steps']} steps in {time.monotonic() - started:.0f}s, R² {table['r2']:.3f}",
            file=sys.stderr,
        )
    device = FittedDevice(table_path)
    out: dict[str, Any] = {"table": str(table_path), "r2": device.table.get("r2"), "clock": args.clock, "runs": {}}
    for name, planned in workloads(args).items():
        for label, profile in PROFILES.items():
            print(f"  {name} / {label}: reference engine…", file=sys.stderr, flush=True)
            # What this process already holds (the fit's steps, earlier runs' records) is not
            # the engine's: frozen, the collector does not walk it in the engine's steps.
            gc.collect()
            gc.freeze()
            with one_torch_thread() if cpu else nullcontext():
                clock = ThreadCpuClock() if cpu else time.monotonic
                engine = LLMEngine(
                    SHIPPED_DIR, profile=profile, seed=args.seed, max_model_len=MAX_MODEL_LEN, clock=clock
                )
                real, real_duration = measure(engine, planned)
            sim, sim_duration = predict(
                device, planned, profile, tokenizer_dir=SHIPPED_DIR, seed=args.seed, max_model_len=MAX_MODEL_LEN
            )
            m, p = figures(real, real_duration), figures(sim, sim_duration)
            out["runs"][f"{name}/{label}"] = {k: {"reference": m[k], "sim": p[k]} for k in COMPARED}
    return out


def print_reference(report: dict[str, Any]) -> None:
    print(
        f"\nSimulated (fitted table, R² {report['r2']:.3f}) against the reference engine on this CPU"
        f" ({report['clock']} clock)"
    )
    print(
        f"{'workload / profile':<26}"
        + "".join(f" {k.replace('_seconds', '').replace('_tps', ''):>22}" for k in COMPARED)
    )
    for run, values in report["runs"].items():
        cells = []
        for k in COMPARED:
            ref, sim = values[k]["reference"], values[k]["sim"]
            scale = 1e3 if k.endswith("_seconds") else 1.0
            ratio = f"{sim / ref:.2f}" if ref and sim is not None else "—"
            cells.append(f"{(ref or 0) * scale:>8.1f}/{(sim or 0) * scale:<8.1f}{ratio:>5}")
        print(f"{run:<26}" + "".join(f" {c:>22}" for c in cells))
    print("(cells: reference / simulated, ms or tokens/s, then the ratio simulated/reference)")


def main(args: argparse.Namespace) -> int:
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    report: dict[str, Any] = {}
    if args.against in ("aiconfigurator", "both"):
        report["aiconfigurator"] = against_aiconfigurator(args.system, args.backend, args.model)
        print_aiconfigurator(report["aiconfigurator"], args.system, args.model)
    if args.against in ("reference", "both"):
        report["reference"] = against_reference(args)
        print_reference(report["reference"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


__all__ = ["add_arguments", "main"]
