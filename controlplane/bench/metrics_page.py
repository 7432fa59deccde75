"""``python manage.py bench_metrics_page``: what one worker's ``/metrics``
page costs to render and to parse, the old path against the new, in one run.

One exporter as a simulated worker has it (Llama 3.1 8B's 131,072-token
context, so every prompt-length bucket of the by-prompt histograms; a sim
engine's load; a profile), warmed with traffic so every series exists. Then,
``--repeat`` times each, alternating the two paths so that both see the same
machine:

* **render, idle**: nothing written since the last scrape. Old:
  prometheus_client's generic exposition of every family
  (``MetricsExporter.render_uncached``); new: ``render``, which re-formats
  only what changed.
* **render after traffic**: ``--requests`` requests (each a prefill step,
  decode steps, its records) written, then one page. The new path renders
  after the writes; the old one renders the same state.
* **parse**: the control plane's reduction of that page. Old:
  ``catalogue.parse_lines`` (line by line, its per-process series cache
  warm); new: ``catalogue.parse`` (the page shape's plan).

Each figure is the median CPU time of the thread per page (wall time is
mostly waiting for a core on a shared machine); both paths' pages are
checked equal (bytes for the render, the reduction for the parse).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.metrics import catalogue
from workers.engines.api import EngineLoad, RequestMetrics, StepMetrics
from workers.profile import EngineProfile
from workers.server.metrics import MetricsExporter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-name", default="meta-llama/Meta-Llama-3.1-8B")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--repeat", type=int, default=200, help="pages timed per path and case")
    parser.add_argument(
        "--requests",
        default="1,20",
        help="requests written before each page after traffic, comma-separated "
        "(bench_fleet's 0.04 req/s is 0.2 a 5-s scrape)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")


class _SimEngine:
    """What the exporter reads of an engine: its load, and its observers."""

    def add_observer(self, observer: Any) -> None:
        pass

    def load(self) -> EngineLoad:
        return EngineLoad(3, 1, 0.42)


def write_requests(exporter: MetricsExporter, rng: random.Random, num_requests: int, at: float) -> float:
    """``num_requests`` requests' steps and records, as a sim worker writes them; returns the clock after."""
    for _ in range(num_requests):
        prompt_tokens = int(rng.lognormvariate(7.0, 1.3)) + 1
        output_tokens = rng.randint(8, 64)
        step_seconds = rng.uniform(0.008, 0.02)
        exporter.on_step(_step(at, prompt_tokens, 0, step_seconds * (1 + prompt_tokens / 2048)))
        times = [at + 0.01 + step_seconds * (1 + prompt_tokens / 2048)]
        for _ in range(output_tokens - 1):
            exporter.on_step(_step(times[-1], 0, 4, step_seconds))
            times.append(times[-1] + step_seconds)
        m = RequestMetrics(
            arrival_time=at,
            first_scheduled_time=at + rng.uniform(0.0, 0.005),
            first_token_time=times[0],
            token_times=times,
            finished_time=times[-1],
            num_prompt_tokens=prompt_tokens,
            num_output_tokens=output_tokens,
        )
        exporter.on_request_finished("r", m, rng.choice(("stop", "length")))
        exporter.observe_delivered(m, [(t + 0.0005, 1) for t in times], received_at=at - 0.001)
        at = times[-1] + rng.uniform(0.0, 0.5)
    return at


def _step(start: float, prefill: int, decode: int, seconds: float) -> StepMetrics:
    return StepMetrics(
        start_time=start,
        duration_seconds=seconds,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_running=4,
        num_waiting=1,
        num_blocks_held=64,
        num_tokens_stored=1000,
        block_size=16,
        num_blocks_total=4096,
        memory_bytes=17_000_000_000,
        peak_memory_bytes=17_500_000_000,
        prefill_chunk_waits=[0.002] if prefill else [],
        prefix_cache_queries=prefill,
        prefix_cache_hits=prefill // 4,
        max_prefill_tokens=prefill,
    )


def _cpu_ms(op: Callable[[], Any]) -> float:
    start = time.thread_time()
    op()
    return (time.thread_time() - start) * 1e3


def _row(case: str, old_ms: list[float], new_ms: list[float]) -> dict[str, Any]:
    old, new = statistics.median(old_ms), statistics.median(new_ms)
    return {"case": case, "old_ms": old, "new_ms": new, "ratio": old / new if new > 0 else float("inf")}


def _same_reduction(a: Any, b: Any) -> bool:
    return bool(a.layout == b.layout and a.profile == b.profile and np.array_equal(a.values, b.values, equal_nan=True))


def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    clock = [0.0]
    exporter = MetricsExporter(model_name=args.model_name, max_model_len=args.max_model_len, clock=lambda: clock[0])
    exporter.attach(_SimEngine())
    exporter.set_profile(EngineProfile(max_num_batched_tokens=512), engine_kind="sim", name="chunked-512", revision=1)
    at = write_requests(exporter, rng, 50, 1.0)
    clock[0] = at
    page = exporter.render()
    assert page == exporter.render_uncached(), "the cached page differs from the generic one"
    num_lines = page.count(b"\n")
    print(f"one worker's page: {len(page):,} bytes, {num_lines:,} lines ({args.model_name}, {args.max_model_len})")

    rows: list[dict[str, Any]] = []
    old_ms: list[float] = []
    new_ms: list[float] = []
    for _ in range(args.repeat):
        old_ms.append(_cpu_ms(exporter.render_uncached))
        new_ms.append(_cpu_ms(exporter.render))
    rows.append(_row("render, idle", old_ms, new_ms))

    identical = True
    for num_requests in (int(n) for n in args.requests.split(",") if n):
        old_ms, new_ms = [], []
        for i in range(args.repeat):
            at = write_requests(exporter, rng, num_requests, at)
            clock[0] = at
            # the state is the same for both; alternate which goes first
            first, second = (
                (exporter.render, exporter.render_uncached) if i % 2 else (exporter.render_uncached, exporter.render)
            )
            timed = {first: _cpu_ms(first), second: _cpu_ms(second)}
            old_ms.append(timed[exporter.render_uncached])
            new_ms.append(timed[exporter.render])
            identical = identical and exporter.render() == exporter.render_uncached()
        rows.append(_row(f"render after {num_requests} request{'s' if num_requests != 1 else ''}", old_ms, new_ms))

    parse_identical = True
    parse_lines, parse = catalogue.parse_lines, catalogue.parse
    text = exporter.render().decode()
    parse_lines(text)  # its series cache warm, as in a running control plane
    parse(text)  # the page shape planned
    old_ms, new_ms = [], []
    for i in range(args.repeat):
        at = write_requests(exporter, rng, 1, at)
        clock[0] = at
        text = exporter.render().decode()
        old_ms.append(_cpu_ms(lambda: parse_lines(text)))  # noqa: B023 (called at once)
        new_ms.append(_cpu_ms(lambda: parse(text)))  # noqa: B023
        if i % 10 == 0:
            parse_identical = parse_identical and _same_reduction(parse_lines(text), parse(text))
    rows.append(_row("parse (control plane)", old_ms, new_ms))

    print(f"\nmedian CPU ms per page over {args.repeat} pages each, old path against new (old ÷ new):")
    print(f"{'case':<28} {'old ms':>9} {'new ms':>9} {'ratio':>8}")
    for row in rows:
        print(f"{row['case']:<28} {row['old_ms']:>9.3f} {row['new_ms']:>9.3f} {row['ratio']:>7.1f}x")
    print(f"\nrendered pages identical: {'yes' if identical else 'NO'}")
    print(f"parsed pages identical: {'yes' if parse_identical else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"page_bytes": len(page), "rows": rows}, indent=2))
    return 0 if identical and parse_identical else 1
