"""What the gateway adds to time-to-first-token, beside nginx. No Django.

Three targets serve the same streams from one worker: the worker called
directly, the gateway, and nginx (Debian's, as a reverse proxy with upstream
keep-alive and buffering off, one worker process like the gateway's one
event loop). A closed loop keeps ``num_streams`` streams in flight against one
target at a time; phases alternate between targets in rotating order, so
drift in the machine's load falls on all three alike. Each stream's TTFT is
the time from writing the request to receiving its first body bytes (the
worker sends its head with the first token). Added latency is a target's
percentile minus the direct percentile at the same rank, over all rounds
pooled, and also round by round: each round's three phases run back to back,
so their difference is taken within the round and the median over rounds
reported. On a shared machine a burst of someone else's work lands on one
phase and moves a pooled P99 by milliseconds (seen: the direct target's own
P99 moving 21.7 to 24.4 ms between runs); the median of the rounds' paired
differences is what a burst of a few seconds cannot move.

Starts are staggered and token counts drawn from a seeded range, so requests
arrive spread out rather than in waves of ``num_streams``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.gateway.upstream import Upstream, UpstreamTimeouts

NGINX = "/usr/sbin/nginx"


@dataclass
class Target:
    name: str
    url: str  # base URL
    pids: list[int] = field(default_factory=list)  # the proxy's processes, for its CPU time
    ttfts: list[float] = field(default_factory=list)
    round_ends: list[int] = field(default_factory=list)  # len(ttfts) at the end of each measured round
    errors: int = 0
    cpu_seconds: float = 0.0  # the proxy's, over the measured phases
    wall_seconds: float = 0.0
    # One client per target, kept across phases: connections stay warm.
    client: Upstream = field(default_factory=lambda: Upstream(UpstreamTimeouts(connect_seconds=10)))

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile, seconds."""
        return _percentile(self.ttfts, q)

    def rounds(self) -> list[list[float]]:
        starts = [0, *self.round_ends[:-1]]
        return [self.ttfts[a:b] for a, b in zip(starts, self.round_ends, strict=True)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Load:
    num_streams: int = 64
    min_tokens: int = 16
    max_tokens: int = 48
    phase_seconds: float = 5.0
    warmup_seconds: float = 1.0
    num_rounds: int = 4
    model: str = "bench"
    seed: int = 0


async def _one_stream(
    client: Upstream, target: Target, body: bytes, headers: list[tuple[bytes, bytes]], record: bool
) -> None:
    started = time.perf_counter()
    try:
        response = await client.send(target.url + "/v1/completions", headers, body)
        first = True
        async for _chunk in response.chunks():
            if first:
                first = False
                if record:
                    target.ttfts.append(time.perf_counter() - started)
        if response.status != 200 and record:
            target.errors += 1
    except Exception:  # noqa: BLE001 - counted; a benchmark reports, it does not stop
        if record:
            target.errors += 1


async def _phase(
    target: Target, load: Load, headers: list[tuple[bytes, bytes]], rng: random.Random, seconds: float, record: bool
) -> None:
    client = target.client
    deadline = time.perf_counter() + seconds
    bodies = [
        json.dumps(
            {
                "model": load.model,
                "prompt": "Say something.",
                "stream": True,
                "max_tokens": rng.randint(load.min_tokens, load.max_tokens),
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        for _ in range(4096)
    ]

    async def loop(i: int, offset: float) -> None:
        await asyncio.sleep(offset)
        n = i
        while time.perf_counter() < deadline:
            await _one_stream(client, target, bodies[n % len(bodies)], headers, record)
            n += load.num_streams

    stagger = 0.5  # seconds over which the first requests spread
    await asyncio.gather(*(loop(i, stagger * i / load.num_streams) for i in range(load.num_streams)))


async def run_load(
    targets: list[Target], load: Load, headers: list[tuple[bytes, bytes]], progress: Callable[[str], None] | None = None
) -> None:
    rng = random.Random(load.seed)
    for target in targets:
        await _phase(target, load, headers, rng, load.warmup_seconds, record=False)
    try:
        await _rounds(targets, load, headers, rng, progress)
    finally:
        for target in targets:
            await target.client.close()


async def _rounds(
    targets: list[Target],
    load: Load,
    headers: list[tuple[bytes, bytes]],
    rng: random.Random,
    progress: Callable[[str], None] | None,
) -> None:
    for round_index in range(load.num_rounds):
        order = targets[round_index % len(targets) :] + targets[: round_index % len(targets)]
        for target in order:
            cpu_before, started = cpu_seconds(target.pids), time.perf_counter()
            await _phase(target, load, headers, rng, load.phase_seconds, record=True)
            target.wall_seconds += time.perf_counter() - started
            target.cpu_seconds += cpu_seconds(target.pids) - cpu_before
            target.round_ends.append(len(target.ttfts))
            if progress is not None:
                progress(f"round {round_index + 1}/{load.num_rounds}: {target.name} ({len(target.ttfts)} streams)")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes and their children (nginx's worker)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    seen: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


# ---- nginx ------------------------------------------------------------------------------
def nginx_config(workdir: Path, listen_port: int, upstream: str) -> str:
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    upstream worker {{
        server {upstream};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://worker;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def nginx_argv(workdir: Path, listen_port: int, upstream: str) -> list[str]:
    """Writes the config into ``workdir``; the command line that runs it."""
    if not shutil.which(NGINX) and not Path(NGINX).exists():
        raise RuntimeError(f"{NGINX} is missing: apt-get install nginx-light")
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_config(workdir, listen_port, upstream))
    return [NGINX, "-p", str(workdir), "-c", str(conf)]


# ---- the report --------------------------------------------------------------------------
def summary(targets: list[Target]) -> dict[str, dict[str, float]]:
    direct = next(t for t in targets if t.name == "direct")
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        row: dict[str, float] = {"n": len(t.ttfts), "errors": t.errors}
        for q in (50, 90, 99):
            row[f"p{q}_ms"] = t.percentile(q) * 1000 if t.ttfts else float("nan")
            row[f"added_p{q}_ms"] = (t.percentile(q) - direct.percentile(q)) * 1000 if t.ttfts else float("nan")
        for q in (50, 99):  # round by round against direct's same round, then the median
            paired = [
                (_percentile(mine, q) - _percentile(theirs, q)) * 1000
                for mine, theirs in zip(t.rounds(), direct.rounds(), strict=True)
                if mine and theirs
            ]
            row[f"round_added_p{q}_ms"] = statistics.median(paired) if paired else float("nan")
        row["mean_ms"] = statistics.fmean(t.ttfts) * 1000 if t.ttfts else float("nan")
        # The proxy's CPU per stream served (direct: no proxy, 0).
        row["cpu_ms_per_stream"] = 1000 * t.cpu_seconds / len(t.ttfts) if t.ttfts and t.pids else 0.0
        row["cpu_percent"] = 100 * t.cpu_seconds / t.wall_seconds if t.wall_seconds and t.pids else 0.0
        out[t.name] = row
    return out


def ratio(ours: float, theirs: float) -> float | None:
    """Our added latency over nginx's; None when nginx's is under 50 µs (or
    negative: within the noise), where a ratio says nothing."""
    return ours / theirs if theirs >= 0.05 else None


def times(value: float | None) -> str:
    return "n/a (nginx's is within noise)" if value is None else f"{value:.1f}x"
