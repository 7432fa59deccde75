"""``python manage.py bench_gateway``: the gateway's added TTFT beside nginx's,
and how fast a routing change is acked by every gateway.

It makes throwaway rows (a table, two pools, workers, a key; all named
``bench-<id>`` and deleted afterwards) in the configured database, starts a
worker (synthetic by default, see ``controlplane.bench.synthetic``; or
``--upstream URL`` for a real one), ``--gateways`` gateway processes and
nginx, drives ``--streams`` concurrent streams through each in turn, then
flips the canary weight ``--ack-trials`` times and times each change from
the ``set_weights`` call until every gateway has acked it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.bench import gateway as bench
from controlplane.bench.upstream import CLIENTS, HttpxGateway
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import ClientKey, PoolSpec, RequestLog, RoutingTable
from controlplane.launcher import child, free_port, gateway_argv, wait_http, wait_until


class Command(BaseCommand):
    help = "Benchmark the gateway's added TTFT against nginx, and routing-epoch ack latency."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
        parser.add_argument("--rounds", type=int, default=8, help="rounds over the three targets (default 8)")
        parser.add_argument("--phase-seconds", type=float, default=5.0, help="seconds per target per round")
        parser.add_argument("--ttft-ms", type=float, default=20.0, help="synthetic worker's TTFT")
        parser.add_argument("--itl-ms", type=float, default=20.0, help="synthetic worker's inter-token latency")
        parser.add_argument("--tokens", default="16-48", help="output tokens per stream, a range (default 16-48)")
        parser.add_argument("--upstream", help="a running worker's URL instead of the synthetic one")
        parser.add_argument("--model", default="", help="model name the --upstream worker serves")
        parser.add_argument(
            "--client", choices=sorted(CLIENTS), default="native", help="the gateways' upstream HTTP client"
        )
        parser.add_argument("--gateways", type=int, default=2, help="gateway processes (traffic goes to the first)")
        parser.add_argument("--ack-trials", type=int, default=20, help="weight changes timed until every gateway acks")
        parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
        parser.add_argument(
            "--untracked",
            action="store_true",
            help="one more target: a gateway with GATEWAY_STREAM_TRACKING off, to price the tracking",
        )
        # The child mode that serves one gateway over the httpx client (``--client httpx``).
        parser.add_argument("--serve-gateway", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
        parser.add_argument("--log-level", default="info", help=argparse.SUPPRESS)

    def _gateway_argv(self, port: int, client: str) -> list[str]:
        command = ("bench_gateway", "--serve-gateway") if client == "httpx" else ("rungateway",)
        return gateway_argv(port, log_level="warning", command=command)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["serve_gateway"]:
            call_command(HttpxGateway(), port=options["port"], log_level=options["log_level"])
            return
        lo, _, hi = options["tokens"].partition("-")
        tag = f"bench-{uuid.uuid4().hex[:6]}"
        model = options["model"] or tag
        load = bench.Load(
            num_streams=options["streams"],
            min_tokens=int(lo),
            max_tokens=int(hi or lo),
            phase_seconds=options["phase_seconds"],
            num_rounds=options["rounds"],
            model=model,
        )
        with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
            workdir = Path(tmp)
            with self._worker(options, workdir) as worker_url:
                rows = BenchRows.make(tag, model, worker_url)
                try:
                    self._run(options, load, rows, worker_url, workdir)
                finally:
                    rows.delete()

    @contextlib.contextmanager
    def _worker(self, options: dict[str, Any], workdir: Path) -> Iterator[str]:
        if options["upstream"]:
            yield options["upstream"].rstrip("/")
            return
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "controlplane.bench.synthetic",
            "--port",
            str(port),
            "--name",
            "w",
            "--ttft-ms",
            str(options["ttft_ms"]),
            "--itl-ms",
            str(options["itl_ms"]),
        ]
        with child(argv, workdir / "worker.log") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/health", proc)
            yield url

    def _run(self, options: dict[str, Any], load: bench.Load, rows: BenchRows, worker_url: str, workdir: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with contextlib.ExitStack() as stack:
            gateway_urls, gateway_pids = [], []
            for i in range(options["gateways"]):
                port = free_port()
                argv = self._gateway_argv(port, options["client"])
                proc = stack.enter_context(child(argv, workdir / f"gateway-{i}.log", env))
                url = f"http://127.0.0.1:{port}"
                wait_http(f"{url}/health", proc)
                gateway_urls.append(url)
                gateway_pids.append(proc.pid)
            untracked_url = None
            if options["untracked"]:
                port = free_port()
                argv = self._gateway_argv(port, options["client"])
                proc = stack.enter_context(
                    child(argv, workdir / "gateway-untracked.log", {**env, "GATEWAY_STREAM_TRACKING": "false"})
                )
                untracked_url, untracked_pid = f"http://127.0.0.1:{port}", proc.pid
                wait_http(f"{untracked_url}/health", proc)
            nginx_port = free_port()
            nginx_argv = bench.nginx_argv(workdir / "nginx", nginx_port, worker_url.removeprefix("http://"))
            nginx = stack.enter_context(child(nginx_argv, workdir / "nginx" / "output.log"))
            nginx_url = f"http://127.0.0.1:{nginx_port}"
            wait_http(f"{nginx_url}/health", nginx, timeout=20)

            def serves_the_model(url: str) -> bool:
                return load.model in httpx.get(f"{url}/health", timeout=2).json().get("models", {})

            for url in gateway_urls + ([untracked_url] if untracked_url else []):  # each has the bench table first
                wait_until(
                    functools.partial(serves_the_model, url),
                    30,
                    "the gateways to load the bench routing table",
                    interval=0.1,
                )

            def targets() -> list[bench.Target]:
                out = [
                    bench.Target("direct", worker_url),
                    bench.Target("gateway", gateway_urls[0], [gateway_pids[0]]),
                    bench.Target("nginx", nginx_url, [nginx.pid]),
                ]
                if untracked_url:
                    out.append(bench.Target("untracked", untracked_url, [untracked_pid]))
                return out

            headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {rows.key}".encode())]
            self.stdout.write(
                f"{load.num_streams} concurrent streams, {load.min_tokens}-{load.max_tokens} tokens each, "
                f"{load.num_rounds} rounds x {load.phase_seconds:g}s per target; worker: "
                + (
                    worker_url
                    if options["upstream"]
                    else f"synthetic (TTFT {options['ttft_ms']:g} ms, ITL {options['itl_ms']:g} ms)"
                )
                + f"; gateway client: {options['client']}; {os.cpu_count()} CPUs"
            )
            _use_uvloop()
            # One stream at a time first: the path's own cost, without queueing.
            single = bench.Load(
                num_streams=1,
                min_tokens=1,
                max_tokens=1,
                phase_seconds=1.0,
                warmup_seconds=0.3,
                num_rounds=3,
                model=load.model,
            )
            alone = targets()
            asyncio.run(bench.run_load(alone, single, headers))
            loaded = targets()
            asyncio.run(bench.run_load(loaded, load, headers, progress=lambda m: self.stderr.write(m)))
            acks = rows.time_acks(options["ack_trials"])
            self._report(bench.summary(alone), bench.summary(loaded), acks, options)

    def _report(
        self,
        alone: dict[str, dict[str, float]],
        figures: dict[str, dict[str, float]],
        acks: list[float],
        options: dict[str, Any],
    ) -> None:
        out = self.stdout.write
        a_gw, a_nx = alone["gateway"], alone["nginx"]
        if "untracked" in figures:
            tracked, untracked = figures["gateway"], figures["untracked"]
            added = bench.ratio(tracked["added_p50_ms"], untracked["added_p50_ms"])
            paired = bench.ratio(tracked["round_added_p50_ms"], untracked["round_added_p50_ms"])
            out(
                f"stream tracking: added TTFT P50 {tracked['added_p50_ms']:.3f} ms tracked, "
                f"{untracked['added_p50_ms']:.3f} ms untracked: ratio "
                f"{'n/a' if added is None else f'{added:.3f}x'} (goal <= 1.05x); paired by round "
                f"{tracked['round_added_p50_ms']:.3f} vs {untracked['round_added_p50_ms']:.3f} ms: "
                f"{'n/a' if paired is None else f'{paired:.3f}x'}; proxy CPU per stream "
                f"{tracked['cpu_ms_per_stream']:.3f} vs {untracked['cpu_ms_per_stream']:.3f} ms"
            )
        out(
            f"one stream at a time: added TTFT P50 gateway {a_gw['added_p50_ms']:.3f} ms, "
            f"nginx {a_nx['added_p50_ms']:.3f} ms (direct P50 {alone['direct']['p50_ms']:.2f} ms)"
        )
        out(f"{options['streams']} concurrent streams:")
        out(
            f"{'target':8} {'streams':>7} {'errors':>6} {'P50 ms':>8} {'P90 ms':>8} {'P99 ms':>8} "
            f"{'added P50':>10} {'added P99':>10} {'proxy CPU':>10} {'CPU/stream':>11}"
        )
        for name, row in figures.items():
            out(
                f"{name:8} {row['n']:7.0f} {row['errors']:6.0f} {row['p50_ms']:8.2f} {row['p90_ms']:8.2f} "
                f"{row['p99_ms']:8.2f} {row['added_p50_ms']:10.3f} {row['added_p99_ms']:10.3f} "
                f"{row['cpu_percent']:9.1f}% {row['cpu_ms_per_stream']:8.3f} ms"
            )
        gw, nx = figures["gateway"], figures["nginx"]
        r50 = bench.ratio(gw["added_p50_ms"], nx["added_p50_ms"])
        r99 = bench.ratio(gw["added_p99_ms"], nx["added_p99_ms"])
        out(
            f"gateway added TTFT: P50 {gw['added_p50_ms']:.3f} ms (goal <= 1), P99 {gw['added_p99_ms']:.3f} ms "
            f"(goal <= 5)"
        )
        out(f"nginx added TTFT:   P50 {nx['added_p50_ms']:.3f} ms, P99 {nx['added_p99_ms']:.3f} ms")
        out(
            f"gateway/nginx added-latency ratio: P50 {bench.times(r50)}, P99 {bench.times(r99)} (goal <= 3x); "
            f"CPU per stream {bench.times(bench.ratio(gw['cpu_ms_per_stream'], nx['cpu_ms_per_stream']))} nginx's"
        )
        rr50 = bench.ratio(gw["round_added_p50_ms"], nx["round_added_p50_ms"])
        rr99 = bench.ratio(gw["round_added_p99_ms"], nx["round_added_p99_ms"])
        out(
            f"paired within each round (median of {options['rounds']} rounds): gateway P50 "
            f"{gw['round_added_p50_ms']:.3f} ms, P99 {gw['round_added_p99_ms']:.3f} ms; nginx P50 "
            f"{nx['round_added_p50_ms']:.3f} ms, P99 {nx['round_added_p99_ms']:.3f} ms; ratio P50 {bench.times(rr50)}, "
            f"P99 {bench.times(rr99)} (goal <= 3x)"
        )
        ack_figures: dict[str, float] = {}
        if acks:
            ordered = sorted(acks)
            ack_figures = {
                "p50_ms": ordered[len(ordered) // 2] * 1000,
                "p99_ms": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1000,
                "max_ms": ordered[-1] * 1000,
            }
            out(
                f"routing change acked by all {options['gateways']} gateways ({len(acks)} changes): "
                f"P50 {ack_figures['p50_ms']:.1f} ms, P99 {ack_figures['p99_ms']:.1f} ms, "
                f"max {ack_figures['max_ms']:.1f} ms (rollout goal: P99 <= 1000 ms)"
            )
        if options["json"]:
            out(
                json.dumps(
                    {
                        "one_stream": alone,
                        "ttft": figures,
                        "ratio_p50": r50,
                        "ratio_p99": r99,
                        "round_ratio_p50": rr50,
                        "round_ratio_p99": rr99,
                        "acks": ack_figures,
                    }
                )
            )


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class BenchRows:
    """A benchmark's own rows, made and removed around the run: a stable and
    a canary pool (canary weight 0), their workers, the routing table, a
    client key. bench_fidelity uses them too."""

    def __init__(self, tag: str, table: Any, pools: list[Any], workers: list[Any], key_row: Any, key: str):
        self.tag, self.table, self.pools, self.workers, self.key_row, self.key = (
            tag,
            table,
            pools,
            workers,
            key_row,
            key,
        )

    @classmethod
    def make(cls, tag: str, model: str, worker_url: str, *, canary_worker: bool = True) -> BenchRows:
        """``canary_worker=False``: the worker only in the stable pool (a
        scraper would read one worker's page twice under two rows)."""
        actor = f"system:{tag}"
        if RoutingTable.objects.filter(model=model).exists():
            raise CommandError(f"a routing table for {model!r} exists already; benchmark another model name")
        pools = [Pool.objects.create(name=f"{tag}-{role}") for role in ("stable", "canary")]
        workers = [
            Worker.objects.create(
                name=f"{tag}-{pool.name}", url=worker_url, pool=pool, state=WorkerState.READY, model=model
            )
            for pool in (pools if canary_worker else pools[:1])
        ]
        table = RoutingTable.create_audited(model, actor=actor)
        table.configure([PoolSpec(pools[0], "stable", 10000), PoolSpec(pools[1], "canary", 0)], actor=actor)
        key_row, key = ClientKey.issue(tag, actor="system:bench")
        return cls(tag, table, pools, workers, key_row, key)

    def time_acks(self, num_trials: int) -> list[float]:
        """Seconds from each weight change's call until every gateway acked it."""
        times = []
        for i in range(num_trials):
            canary = 0 if i % 2 else 1000
            started = time.perf_counter()
            epoch = self.table.set_weights({"canary": canary, "stable": 10000 - canary}, actor=f"system:{self.tag}")
            status = self.table.wait_for_acks(epoch, timeout_seconds=10)
            elapsed = time.perf_counter() - started
            if not status.complete:
                raise CommandError(f"gateways {[g.id for g in status.pending]} did not ack epoch {epoch} in 10s")
            times.append(elapsed)
            time.sleep(0.05)
        return times

    def delete(self) -> None:
        RequestLog.objects.filter(api_key=self.key_row).delete()
        self.table.delete()
        self.key_row.delete()
        for worker in self.workers:
            worker.delete()
        for pool in self.pools:
            pool.delete()
