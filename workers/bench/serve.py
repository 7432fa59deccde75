"""``python -m workers bench-serve``: what HTTP costs, and vLLM against ours.

A benchmark, not a test. For each engine one child process runs the worker
(the same engine, host and app as ``serve``) with one extra route that only
the benchmark mounts: ``POST /_bench/in-process`` replays the workload on the
engine directly, ``AsyncEngine.generate`` streams consumed in the server's
own event loop and timed where the tokens arrive. The parent alternates that
with the same workload over HTTP, through the load generator's streaming
client, on the same warmed engine:

    in-process, http, in-process, http, ...

Pairs taken seconds apart see the same machine, so their ratio holds even
on a shared 2-core host whose neighbours come and go; the report gives the
median of the paired ratios, and each path's best run.

The workload saturates the engine (every request at t=0), so output tokens/s
is the engine's capacity on that path. The engines are then compared on the
HTTP path: throughput, TTFT P99 and ITL P99. ``--scenario long-tail --rate R``
adds an open-loop Poisson run through HTTP for latency below saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from workers import engines
from workers.engines.api import EngineSpec, SamplingParams
from workers.loadgen import WORDS, Client, PlannedRequest, RequestRecord, plan, replay, summarize
from workers.profile import EngineProfile
from workers.server.app import build_app
from workers.server.host import EngineHost, RunningProfile
from workers.server.metrics import MetricsExporter

DEFAULT_PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 512,
    "max_num_seqs": 64,
    "block_size": 32,
    "kv_cache_bytes": 256 << 20,
}
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
SLOS = {"ttft": 1000.0, "tpot": 100.0}


def saturating_workload(
    num_requests: int, min_words: int, max_words: int, output_tokens: int, seed: int
) -> list[PlannedRequest]:
    rng = random.Random(seed)
    return [
        PlannedRequest(
            0.0,
            "completions",
            output_tokens,
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))),
        )
        for _ in range(num_requests)
    ]


def _workloads(args: argparse.Namespace) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up, measured): the warm-up has the same shapes and short outputs."""
    measured = saturating_workload(args.num_requests, args.min_words, args.max_words, args.output_tokens, args.seed)
    warm = saturating_workload(args.num_requests, args.min_words, args.max_words, 16, args.seed + 1)
    return warm, measured


# ---- the worker child ----------------------------------------------------------------


async def replay_in_process(engine: Any, workload: list[PlannedRequest], tag: str) -> dict[str, Any]:
    """Every request at once on the engine itself; timed as the loadgen times HTTP."""

    async def one(i: int, req: PlannedRequest, run_start: float) -> RequestRecord:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        record = RequestRecord(start_seconds=time.perf_counter() - run_start, endpoint="in-process", session_key=None)
        start = last = time.perf_counter()
        async for out in engine.generate(req.prompt, params, f"bench-{tag}-{i}"):
            now = time.perf_counter()
            completion = out.outputs[0]
            record.output_tokens += len(completion.token_ids)
            if completion.text:
                if record.ttft_seconds is None:
                    record.ttft_seconds = now - start
                else:
                    record.itl_seconds.append(now - last)
                last = now
            if out.finished:
                record.prompt_tokens = len(out.prompt_token_ids)
                record.finish_reason = completion.finish_reason
        record.latency_seconds = time.perf_counter() - start
        record.success = record.finish_reason == "length"
        record.got_first_byte = record.ttft_seconds is not None
        if record.itl_seconds:
            record.max_gap_seconds = max(record.itl_seconds)
        if record.ttft_seconds is not None and record.output_tokens > 1:
            record.tpot_seconds = (record.latency_seconds - record.ttft_seconds) / (record.output_tokens - 1)
        return record

    run_start = time.perf_counter()
    records = await asyncio.gather(*(one(i, r, run_start) for i, r in enumerate(workload)))
    return {"records": [asdict(r) for r in records], "wall_seconds": time.perf_counter() - run_start}


def _serve_child(args: argparse.Namespace) -> int:
    """The worker with the benchmark's in-process route."""
    spec = EngineSpec(
        kind=args.serve_child, model=args.model, device=args.device, max_model_len=args.max_model_len, dtype=args.dtype
    )
    profile = EngineProfile.from_dict(json.loads(args.profile))
    backend = engines.backend(spec.kind)
    exporter = MetricsExporter(model_name=spec.model_name, max_model_len=args.max_model_len)
    host = EngineHost(
        lambda p: backend.build(spec, p),
        RunningProfile(profile),
        max_queue=10 * args.num_requests,
        on_engine=lambda engine, running: exporter.attach(engine),
    )
    counter = iter(range(1 << 30))

    async def in_process(request: Request) -> JSONResponse:
        body = await request.json()
        workload = [PlannedRequest(**r) for r in body["workload"]]
        cpu = time.process_time()
        run = await replay_in_process(host.engine, workload, str(next(counter)))
        run["server_cpu_seconds"] = time.process_time() - cpu
        return JSONResponse(run)

    async def cpu_seconds(request: Request) -> JSONResponse:
        return JSONResponse({"cpu_seconds": time.process_time()})  # every thread of this process

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        await host.start()
        yield
        await host.shutdown()

    app = build_app(host, exporter, model_name=spec.model_name, lifespan=lifespan)
    app.router.routes.append(Route("/_bench/in-process", in_process, methods=["POST"]))
    app.router.routes.append(Route("/_bench/cpu", cpu_seconds, methods=["GET"]))
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)).run()
    return 0


# ---- the parent ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the worker at {url} was not ready after {timeout}s")


async def _drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    warm, measured = _workloads(args)
    client = Client(url, model=None, api_key=None)
    async with httpx.AsyncClient(base_url=url, timeout=None) as control:

        async def in_process(workload: list[PlannedRequest]) -> dict[str, Any]:
            r = await control.post("/_bench/in-process", json={"workload": [asdict(w) for w in workload]})
            r.raise_for_status()
            return dict(r.json())

        try:
            client.model, max_model_len = await client.discover()
            await in_process(warm)
            await replay(client, warm)
            out: dict[str, Any] = {"in_process": {"runs": []}, "http_saturating": {"runs": []}}

            async def server_cpu() -> float:
                return float((await control.get("/_bench/cpu")).json()["cpu_seconds"])

            for _ in range(args.repeat):
                out["in_process"]["runs"].append(await in_process(measured))
                server_before, client_before = await server_cpu(), time.process_time()
                records, wall = await replay(client, measured)
                client_cpu = time.process_time() - client_before
                out["http_saturating"]["runs"].append(
                    {
                        "records": [asdict(r) for r in records],
                        "wall_seconds": wall,
                        "server_cpu_seconds": await server_cpu() - server_before,
                        "client_cpu_seconds": client_cpu,
                    }
                )
            if args.scenario:
                tokens_per_word = await client.calibrate()
                planned = plan(
                    args.scenario,
                    duration_seconds=args.duration,
                    rate=args.rate,
                    seed=args.seed,
                    tokens_per_word=tokens_per_word,
                    max_model_len=max_model_len,
                )
                records, wall = await replay(client, planned)
                out[f"http_{args.scenario}"] = {
                    "runs": [{"records": [asdict(r) for r in records], "wall_seconds": wall}]
                }
            return out
        finally:
            await client.close()


def _run_engine(engine: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = {**os.environ, **QUIET_ENV, "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / f"worker-{engine}.log"
    argv = [
        sys.executable,
        "-m",
        "workers",
        "bench-serve",
        "--serve-child",
        engine,
        "--port",
        str(port),
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--profile",
        args.profile,
        "--max-model-len",
        str(args.max_model_len),
        "--num-requests",
        str(args.num_requests),
    ]
    print(f"[{engine}] starting the worker ...", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, proc, log_path)
            print(f"[{engine}] {args.repeat} × (in-process, http) ...", file=sys.stderr, flush=True)
            return asyncio.run(_drive(url, args))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- the report ---------------------------------------------------------------------------


def _summaries(path: dict[str, Any]) -> list[dict[str, Any]]:
    return [summarize([RequestRecord(**r) for r in run["records"]], run["wall_seconds"], SLOS) for run in path["runs"]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    paired: dict[str, list[float]] = {}
    # CPU-seconds per 1K output tokens, server and client together: what the
    # HTTP path costs whatever the neighbours take.
    cpu_cost: dict[str, dict[str, float]] = {}
    for engine, paths in results.items():
        for path, data in paths.items():
            summaries = _summaries(data)
            best = max(summaries, key=lambda s: s["output_throughput"])
            rows.append(
                {
                    "engine": engine,
                    "path": "saturating" if path in ("in_process", "http_saturating") else path.removeprefix("http_"),
                    "transport": "in-process" if path == "in_process" else "http",
                    "requests": best["successful_requests"],
                    "failed": best["failed_requests"],
                    "output_tokens": best["total_output_tokens"],
                    "seconds": best["duration_seconds"],
                    "output_tok_s": best["output_throughput"],
                    "ttft_p99_ms": best["ttft_ms"]["p99"],
                    "itl_p99_ms": best["itl_ms"]["p99"],
                    "max_gap_p99_ms": best["max_gap_ms"]["p99"],
                    "ttft_p50_ms": best["ttft_ms"]["p50"],
                    "itl_p50_ms": best["itl_ms"]["p50"],
                    "all_output_tok_s": [s["output_throughput"] for s in summaries],
                }
            )
        local = [s["output_throughput"] for s in _summaries(paths["in_process"])]
        http = [s["output_throughput"] for s in _summaries(paths["http_saturating"])]
        paired[engine] = [h / i for h, i in zip(http, local, strict=False) if i]
        cpu_cost[engine] = {
            path: statistics.mean(
                1000
                * (run.get("server_cpu_seconds", 0.0) + run.get("client_cpu_seconds", 0.0))
                / max(1, sum(r["output_tokens"] for r in run["records"]))
                for run in paths[path]["runs"]
            )
            for path in ("in_process", "http_saturating")
        }
    ratios: dict[str, Any] = {}
    by = {(r["engine"], r["path"], r["transport"]): r for r in rows}
    for engine, values in paired.items():
        if values:
            ratios[f"{engine}: http / in-process tok/s (median of pairs)"] = statistics.median(values)
        cost = cpu_cost[engine]
        ratios[f"{engine}: CPU-s per 1K tokens, in-process / http"] = _ratio(
            cost["in_process"], cost["http_saturating"]
        )
        http_row, local_row = by.get((engine, "saturating", "http")), by.get((engine, "saturating", "in-process"))
        if http_row and local_row:
            ratios[f"{engine}: http / in-process tok/s (best runs)"] = _ratio(
                http_row["output_tok_s"], local_row["output_tok_s"]
            )
    if "vllm" in results and "reference" in results:
        for path in sorted({r["path"] for r in rows if r["transport"] == "http"}):
            v, ref = by.get(("vllm", path, "http")), by.get(("reference", path, "http"))
            if v and ref:
                ratios[f"{path} over http: reference / vllm tok/s"] = _ratio(ref["output_tok_s"], v["output_tok_s"])
                ratios[f"{path} over http: reference / vllm TTFT P99"] = _ratio(ref["ttft_p99_ms"], v["ttft_p99_ms"])
                ratios[f"{path} over http: reference / vllm ITL P99"] = _ratio(ref["itl_p99_ms"], v["itl_p99_ms"])
    return {
        "rows": rows,
        "ratios": ratios,
        "paired_http_over_in_process": paired,
        "cpu_seconds_per_1k_tokens": cpu_cost,
    }


def format_report(rep: dict[str, Any]) -> str:
    def f(value: Any, spec: str = ".1f") -> str:
        return "n/a" if value is None else format(value, spec)

    header = (
        f"{'engine':<10}{'run':<12}{'via':<11}{'ok':>4}{'fail':>5}{'out tok':>9}{'s':>7}{'tok/s':>9}"
        f"{'TTFT p99':>10}{'ITL p99':>9}{'gap p99':>9}   all runs tok/s"
    )
    lines = [header, "-" * len(header)]
    for r in rep["rows"]:
        lines.append(
            f"{r['engine']:<10}{r['path']:<12}{r['transport']:<11}{r['requests']:>4}{r['failed']:>5}"
            f"{r['output_tokens']:>9}{f(r['seconds'], '.2f'):>7}{f(r['output_tok_s']):>9}"
            f"{f(r['ttft_p99_ms']):>10}{f(r['itl_p99_ms']):>9}{f(r['max_gap_p99_ms']):>9}   "
            + " ".join(f"{x:.0f}" for x in r["all_output_tok_s"])
        )
    lines.append("")
    for name, value in rep["ratios"].items():
        lines.append(f"{name:<58}{f(value, '.2f')}")
    lines.append("(ms; saturating: every request at t=0; rows are each path's best run by tok/s;")
    lines.append(" in-process and http runs alternate on one warmed engine; above 1: the left side is higher)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--engines", default="reference,vllm", help="comma-separated engines to run")
    parser.add_argument("--profile", default=json.dumps(DEFAULT_PROFILE), help="engine profile JSON for every run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-words", type=int, default=80)
    parser.add_argument("--max-words", type=int, default=240)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=4, help="(in-process, http) pairs per engine after one warm-up")
    parser.add_argument("--scenario", choices=["long-tail", "chat", "burst"], help="add an open-loop HTTP run")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve-child", help=argparse.SUPPRESS)  # child mode: the worker with the bench route
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.serve_child:
        return _serve_child(args)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
            results[engine] = _run_engine(engine, args, Path(tmp))
    rep = report(results)
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"bench-serve: {args.model}, profile {args.profile}")
        print(format_report(rep))
    return 0
