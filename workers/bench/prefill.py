"""``python -m workers bench``: what chunked prefill does, measured.

A benchmark, not a test: it prints figures and ratios, it asserts nothing.
Three scenarios, all in this one process, on the same checkpoint:

1. mixed — a seeded long-tailed workload replayed in real time: Poisson
   arrivals, most prompts a few hundred tokens, about one in ten of many
   thousands, outputs of tens to hundreds of tokens (greedy, EOS ignored so
   every run does the same work). Run monolithic and chunked at several
   budgets. Head-of-line blocking is judged by stalls: each short request's
   largest gap between two tokens, at P99 over requests, and the gaps that
   overlap a long prompt's prefill.
2. long-alone — one long prompt and nothing else, to show what chunking
   costs: time to first token, chunked over monolithic.
3. offline — a batch of requests all at once: engine throughput, the figure
   to compare with vLLM.

``--workload FILE`` replaces the mixed workload by a captured one (the JSON
that ``python -m workers replay`` takes: an experiment's workload), sampled
exactly as replay and an experiment's arm sample it (same seed, tokenizer,
block size and context cap), after ``--warmup`` seconds of it; ``--profile
JSON`` runs that one profile instead of the monolithic and budget grid. So
an experiment's figures for an arm can be held against this bench on the
same workload and profile (``manage.py bench_experiment``).

When vLLM is importable, the same workloads then run through vLLM's V1
engine in a child process of the bench (engine core in-process:
multiprocessing off, eager, explicit KV size), and the ratios are printed. Timestamps come from this harness for both
engines
(a token's time is when its step returned); block-level figures (memory,
fragmentation, prefill wait) come from our engine's own records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from workers import figures
from workers.bench.harness import (
    Adapter,
    ReferenceAdapter,
    Request,
    VLLMAdapter,
    mixed_workload,
    prepare_vllm_environment,
    replay,
    vllm_available,
)
from workers.engines.api import RequestMetrics, StepMetrics
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.tiny import ensure_tiny_model
from workers.profile import EngineProfile

DEFAULT_MODEL = Path("var/tiny-model")
WARMUP_SEED = 1000  # as an experiment's warm-up (controlplane.experiments.runner)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="checkpoint dir (default: the tiny model, built if missing)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--duration", type=float, default=25.0, help="seconds of arrivals in the mixed workload (default 25)"
    )
    parser.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second (default 3)")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="share of long prompts (default 0.1)")
    parser.add_argument(
        "--long-tokens", type=str, default="10000-16000", help="long prompt length range (default 10000-16000)"
    )
    parser.add_argument(
        "--budgets", type=str, default="256,512,1024", help="chunked budgets to run (default 256,512,1024)"
    )
    parser.add_argument("--long-prompt", type=int, default=8192, help="length of the long-alone prompt (default 8192)")
    parser.add_argument("--repeats", type=int, default=2, help="long-alone repeats; the best counts (default 2)")
    parser.add_argument("--offline-requests", type=int, default=96, help="requests in the offline batch (default 96)")
    parser.add_argument(
        "--block-size", type=int, default=32, help="KV block size for both engines (vLLM's CPU needs ×32)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput TTFT objective, seconds (default 2)")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput TPOT objective, seconds (default 0.1)")
    parser.add_argument(
        "--vllm", choices=("auto", "on", "off"), default="auto", help="also run vLLM (auto: when importable)"
    )
    parser.add_argument(
        "--vllm-budgets", type=str, default="512", help="chunked budgets for vLLM's mixed run (default 512)"
    )
    parser.add_argument("--scenarios", type=str, default="mixed,long-alone,offline")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 8 s of arrivals, smaller prompts")
    parser.add_argument(
        "--json", type=str, default=None, metavar="PATH", help="also write every figure as JSON ('-': stdout)"
    )
    parser.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes beside the bench for the whole run, the same load for every configuration (default 0)",
    )
    parser.add_argument(
        "--workload",
        type=Path,
        default=None,
        metavar="FILE",
        help="mixed: replay this captured workload (replay's JSON) instead of the seeded one",
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="--workload: multiply its recorded rate")
    parser.add_argument(
        "--warmup", type=float, default=0.0, help="--workload: seconds of it replayed first, unmeasured"
    )
    parser.add_argument(
        "--profile",
        type=str,
        default=None,
        metavar="JSON",
        help="run only this engine profile (its other knobs at their defaults), labelled 'profile'",
    )
    parser.add_argument("--only-vllm", action="store_true", help=argparse.SUPPRESS)  # the child process


# ---- workload --------------------------------------------------------------------
def captured_workload(
    path: Path, model: Path, seed: int, duration: float, rate_scale: float, block_size: int, max_model_len: int
) -> list[Request]:
    """A captured workload's requests, drawn as ``python -m workers replay``
    and an experiment's arm draw them (``replay.sample``: the same seed
    gives the same requests)."""
    from workers import replay as captured  # imported here: the seeded workload needs none of it

    data = json.loads(path.read_text())
    spec = captured.WorkloadSpec.from_dict(data.get("spec", data))
    planned = captured.sample(
        spec,
        vocabulary=captured.vocabulary(model),
        seed=seed,
        duration_seconds=duration,
        rate_scale=rate_scale,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    return [
        Request(f"w{i}", p.start_seconds, list(p.prompt_token_ids or []), p.max_tokens) for i, p in enumerate(planned)
    ]


# ---- figures --------------------------------------------------------------------
def mixed_figures(
    requests: list[RequestMetrics], steps: list[StepMetrics], duration: float, slo: figures.SLO
) -> dict[str, Any]:
    out: dict[str, Any] = figures.summarize(requests, steps, duration, slo)
    short = [m for m in requests if m.num_prompt_tokens <= 2048]
    out["stall_p99_short_seconds"] = figures.stalls_seconds(short, 99)
    during = figures.gaps_overlapping(short, figures.prefill_intervals(requests, 2049))
    out["gap_during_long_prefill_p50_seconds"] = figures.percentile(during, 50)
    out["gap_during_long_prefill_p99_seconds"] = figures.percentile(during, 99)
    out["gap_during_long_prefill_max_seconds"] = figures.percentile(during, 100)
    out["gaps_during_long_prefill"] = float(len(during))
    out["by_prompt_bucket"] = figures.by_prompt_bucket(requests)
    if not steps:  # vLLM: no block-level records here
        for key in (
            "memory_peak_bytes",
            "memory_mean_bytes",
            "memory_peak_over_mean",
            "kv_fragmentation_mean",
            "kv_fragmentation_max",
        ):
            out[key] = None
    return out


def long_alone(make: Callable[[], Adapter], length: int, repeats: int, vocab: int, bos: int, seed: int) -> float:
    """Best time from arrival to first token of one prompt of ``length`` alone."""
    adapter = make()
    rng = random.Random(seed)
    warm = Request("warm", 0.0, [bos] + [rng.randrange(3, vocab) for _ in range(63)], 2)
    replay(adapter, [warm])
    best = math.inf
    for i in range(repeats):
        ids = [bos] + [rng.randrange(3, vocab) for _ in range(length - 1)]  # fresh tokens: no prefix hits
        records, _ = replay(adapter, [Request(f"long{i}", 0.0, ids, 1)])
        best = min(best, records[0].first_token_time - records[0].arrival_time)  # type: ignore[operator]
    adapter.close()
    return best


def offline(make: Callable[[], Adapter], num_requests: int, vocab: int, bos: int, seed: int) -> dict[str, float]:
    adapter = make()
    rng = random.Random(seed)
    replay(adapter, [Request("warm", 0.0, [bos, 5, 6, 7], 4)])
    work = [
        Request(
            f"o{i}", 0.0, [bos] + [rng.randrange(3, vocab) for _ in range(rng.randint(128, 384))], rng.randint(64, 192)
        )
        for i in range(num_requests)
    ]
    records, duration = replay(adapter, work)
    adapter.close()
    tokens = sum(m.num_output_tokens for m in records)
    return {"output_tokens": float(tokens), "seconds": duration, "output_throughput_tps": tokens / duration}


# ---- output --------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def print_mixed(results: dict[str, dict[str, Any]], slo: figures.SLO) -> None:
    head = (
        f"{'config':<22}{'TTFT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}{'stall p99':>10}{'gap@long p99':>13}"
        f"{'TPOT p50':>9}{'tok/s':>7}{'goodput':>8}{'mem pk/mean':>12}{'frag':>6}{'pf-wait mean/p99':>17}{'preempt':>8}"
    )
    print(head)
    print("-" * len(head))
    for label, f in results.items():
        print(
            f"{label:<22}"
            f"{_ms(f['ttft_p50_seconds']) + '/' + _ms(f['ttft_p99_seconds']):>17}"
            f"{_ms(f['itl_p50_seconds']) + '/' + _ms(f['itl_p99_seconds']):>16}"
            f"{_ms(f['stall_p99_short_seconds']):>10}"
            f"{_ms(f['gap_during_long_prefill_p99_seconds']):>13}"
            f"{_ms(f['tpot_p50_seconds']):>9}"
            f"{_num(f['output_throughput_tps'], '{:.0f}'):>7}"
            f"{_num(f['goodput_rps']):>8}"
            f"{_num(f['memory_peak_over_mean']):>12}"
            f"{_num(f['kv_fragmentation_mean']):>6}"
            f"{_ms(f['prefill_wait_mean_seconds']) + '/' + _ms(f['prefill_wait_p99_seconds']):>17}"
            f"{_num(f['preemptions'], '{:.0f}'):>8}"
        )
    print(
        f"(ms unless noted; stall = P99 over short requests of each one's largest gap; goodput = req/s with "
        f"TTFT <= {slo.ttft_seconds}s and TPOT <= {slo.tpot_seconds}s; mem = peak / time-weighted mean)"
    )


def _child_argv(args: argparse.Namespace, json_path: str) -> list[str]:
    """The same benchmark, vLLM only, in a fresh process."""
    argv = [sys.executable, "-m", "workers", "bench", "--only-vllm", "--json", json_path]
    for name in (
        "model",
        "seed",
        "duration",
        "rate",
        "long_fraction",
        "long_tokens",
        "budgets",
        "long_prompt",
        "repeats",
        "offline_requests",
        "block_size",
        "max_num_seqs",
        "max_model_len",
        "slo_ttft",
        "slo_tpot",
        "vllm_budgets",
        "scenarios",
    ):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


@contextlib.contextmanager
def cpu_hogs(num: int) -> Iterator[None]:
    """``num`` processes that spin for as long as the block runs: contention
    like a loaded machine's, held steady across every configuration (the
    vLLM child included), so the configurations are compared under one load."""
    # Each spins until its parent is gone, so a bench killed outright leaves none behind.
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.DEVNULL) for _ in range(num)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def main(args: argparse.Namespace) -> int:
    if args.only_vllm or not args.cpu_hog:
        return _run(args)
    print(f"{args.cpu_hog} CPU hog process(es) running beside the bench", flush=True)
    with cpu_hogs(args.cpu_hog):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.long_tokens, args.long_prompt = 8.0, "2500-4000", 4096
        args.offline_requests, args.repeats = 16, 1
        args.quick = False  # the child gets the expanded values
    scenarios = set(args.scenarios.split(","))
    if args.model == DEFAULT_MODEL:
        ensure_tiny_model(args.model)
    config = ModelConfig.from_pretrained(args.model)
    vocab, bos = config.vocab_size, config.bos_token_id or 0
    max_len = min(args.max_model_len, config.max_position_embeddings)
    lo, hi = (int(x) for x in args.long_tokens.split("-"))
    hi = min(hi, max_len - 450)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    slo = figures.SLO(args.slo_ttft, args.slo_tpot)
    only_vllm = args.only_vllm
    use_vllm = only_vllm or args.vllm == "on" or (args.vllm == "auto" and vllm_available())
    if use_vllm and not only_vllm and (args.workload or args.profile):
        print("--workload/--profile run our engine only; vLLM is skipped", flush=True)
        use_vllm = False
    kv_bytes = 1 << 30
    base = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs, kv_cache_bytes=kv_bytes)
    configs: dict[str, dict[str, Any]] = {
        "monolithic": dict(base, prefill_mode="monolithic", max_num_batched_tokens=max_len)
    }
    for b in budgets:
        configs[f"chunked-{b}"] = dict(base, prefill_mode="chunked", max_num_batched_tokens=b)
    if args.profile:
        configs = {"profile": json.loads(args.profile)}  # as `workers serve --profile` takes it
    vllm_configs: dict[str, dict[str, Any]] = {}
    if use_vllm:
        vllm_configs["vllm monolithic"] = configs["monolithic"]
        for b in (int(x) for x in args.vllm_budgets.split(",") if x):
            vllm_configs[f"vllm chunked-{b}"] = dict(base, prefill_mode="chunked", max_num_batched_tokens=b)

    def make(label: str, profile: dict[str, Any]) -> Callable[[], Adapter]:
        if label.startswith("vllm"):
            return lambda: VLLMAdapter(label, args.model, profile, max_len, kv_bytes)
        return lambda: ReferenceAdapter.build(label, args.model, profile, max_len)

    # vLLM runs in a child process of its own: its start-up scans every loaded
    # module to patch kernels and trips over numba's objects, and its thread
    # binding would otherwise stay on for our runs.
    runs = vllm_configs if only_vllm else configs
    report: dict[str, Any] = {"mixed": {}, "long_alone_seconds": {}, "offline": {}}
    if not only_vllm:
        print(
            f"model {args.model} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), seed {args.seed}, "
            f"torch threads {torch.get_num_threads()}, block size {args.block_size}",
            flush=True,
        )
    else:
        prepare_vllm_environment()

    warmup: list[Request] = []
    if args.workload is not None:

        def draw(seed: int, seconds: float, profile: dict[str, Any]) -> list[Request]:
            return captured_workload(
                args.workload,
                args.model,
                seed,
                seconds,
                args.rate_scale,
                int(profile.get("block_size") or EngineProfile().block_size),
                max_len,
            )

        workload = draw(args.seed, args.duration, next(iter(runs.values()), {}))
        if args.warmup > 0:
            warmup = draw(WARMUP_SEED, args.warmup, next(iter(runs.values()), {}))
    else:
        workload = mixed_workload(args.seed, args.duration, args.rate, args.long_fraction, (lo, hi), vocab, bos)
    if "mixed" in scenarios:
        if not only_vllm:
            source = f"workload {args.workload}" if args.workload else "mixed"
            print(
                f"\n== {source}: {len(workload)} requests over {args.duration:.0f}s "
                f"({sum(r.is_long for r in workload)} long, "
                f"{sum(len(r.prompt_token_ids) for r in workload)} prompt tokens), replayed in real time ==",
                flush=True,
            )
        for label, profile in runs.items():
            adapter = make(label, profile)()
            replay(adapter, warmup or [Request("warm", 0.0, [bos, 5, 6, 7], 4)])
            adapter.steps.clear()
            requests, duration = replay(adapter, workload)
            adapter.close()
            report["mixed"][label] = mixed_figures(requests, adapter.steps, duration, slo)
            print(f"  mixed {label}: done in {duration:.1f}s", file=sys.stderr, flush=True)
    if "long-alone" in scenarios:
        n = min(args.long_prompt, max_len - 2)
        for label, profile in runs.items():
            report["long_alone_seconds"][label] = long_alone(
                make(label, profile), n, args.repeats, vocab, bos, args.seed
            )
            print(f"  long-alone {label}: {report['long_alone_seconds'][label]:.2f}s", file=sys.stderr, flush=True)
    if "offline" in scenarios:
        for label, profile in runs.items():
            if label.startswith("chunked") and label != "chunked-512":
                continue
            report["offline"][label] = offline(make(label, profile), args.offline_requests, vocab, bos, args.seed)
            print(
                f"  offline {label}: {report['offline'][label]['output_throughput_tps']:.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )

    if only_vllm:
        Path(args.json).write_text(json.dumps(report, default=str))
        return 0
    if use_vllm:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "vllm.json")
            done = subprocess.run(_child_argv(args, path), check=False)
            if done.returncode == 0 and Path(path).exists():
                theirs = json.loads(Path(path).read_text())
                for key in ("mixed", "long_alone_seconds", "offline"):
                    report[key].update(theirs.get(key, {}))
            else:
                print(f"vLLM run failed (exit {done.returncode}); its figures are missing", flush=True)

    report["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    report["slo"] = {"ttft_seconds": slo.ttft_seconds, "tpot_seconds": slo.tpot_seconds}
    report["ratios"] = compute_ratios(report)
    print_report(report, slo, args)
    if args.json:
        text = json.dumps(report, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            print(f"\nfigures written to {args.json}")
    return 0


def compute_ratios(report: dict[str, Any]) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {}
    mixed = report["mixed"]
    for prefix in ("", "vllm "):
        mono = mixed.get(f"{prefix}monolithic")
        if not mono:
            continue
        for label, f in mixed.items():
            if label.startswith(f"{prefix}chunked"):
                ratios[f"stall_reduction {label}"] = _ratio(
                    mono["stall_p99_short_seconds"], f["stall_p99_short_seconds"]
                )
                ratios[f"gap_during_long_reduction {label}"] = _ratio(
                    mono["gap_during_long_prefill_p99_seconds"], f["gap_during_long_prefill_p99_seconds"]
                )
                ratios[f"throughput_vs_monolithic {label}"] = _ratio(
                    f["output_throughput_tps"], mono["output_throughput_tps"]
                )
    for label, f in mixed.items():
        if not label.startswith("vllm") and f"vllm {label}" in mixed:
            ratios[f"mixed_throughput_ours_over_vllm {label}"] = _ratio(
                f["output_throughput_tps"], mixed[f"vllm {label}"]["output_throughput_tps"]
            )
    alone = report["long_alone_seconds"]
    for label, seconds in alone.items():
        base = "vllm monolithic" if label.startswith("vllm") else "monolithic"
        if "chunked" in label and base in alone:
            ratios[f"long_alone_vs_monolithic {label}"] = _ratio(seconds, alone[base])
    off = report["offline"]
    for label, f in off.items():
        if not label.startswith("vllm") and f"vllm {label}" in off:
            ratios[f"offline_throughput_ours_over_vllm {label}"] = _ratio(
                f["output_throughput_tps"], off[f"vllm {label}"]["output_throughput_tps"]
            )
    return ratios


def print_report(report: dict[str, Any], slo: figures.SLO, args: argparse.Namespace) -> None:
    if report["mixed"]:
        print()
        print_mixed(report["mixed"], slo)
    if report["long_alone_seconds"]:
        print(f"\n== long-alone: one {args.long_prompt}-token prompt, time to first token (best of {args.repeats}) ==")
        for label, seconds in report["long_alone_seconds"].items():
            print(f"  {label:<22} {seconds:7.3f}s")
    if report["offline"]:
        print(f"\n== offline: {args.offline_requests} requests at once (128-384 prompt, 64-192 output tokens) ==")
        for label, f in report["offline"].items():
            print(f"  {label:<22} {f['output_throughput_tps']:7.0f} output tok/s  ({f['seconds']:.1f}s)")
    print("\n== ratios ==")
    for key, value in report["ratios"].items():
        print(f"  {key:<52} {_num(value)}")
