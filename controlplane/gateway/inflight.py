"""Streams in flight and how long each has been silent.

A stream that never finishes never reaches the request log, so no figure
from finished requests can see a worker that stopped feeding one. The
gateway therefore keeps every stream it is relaying here, with its meter
(whose ``last_token_at`` the relay already sets on each token event: the
tracking costs one dict insert and one delete per stream, nothing per
token). From it, read when asked:

* the streams silent longer than ``GATEWAY_STREAM_SILENCE_SECONDS``, by
  model, cohort, pool and worker, and the longest current silence (the
  gateway's ``/metrics``, and its liveness record, which the control
  plane's ``/metrics`` and the rollout analysis read);
* the streams silent longer than ``GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS``,
  which ``watch`` ends: the relay sends the client an OpenAI-style error
  event and logs the row with status 598.

Silence counts from the last token event, or from arrival before the first
(a prefill that takes longer than the threshold is silence too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.gateway.meter import StreamMeter

log = logging.getLogger(__name__)

STATUS_STREAM_TIMED_OUT = 598  # the gateway ended a stream its worker stopped feeding
STATUS_STREAM_BROKEN = 597  # the worker's stream broke off mid-way (it died, or its connection did)
LABELS = ["model", "cohort", "pool", "worker"]


class StreamLabels(NamedTuple):
    model: str
    cohort: str
    pool: str
    worker: str


@dataclass(slots=True)
class Stream:
    labels: StreamLabels
    meter: StreamMeter
    on_timeout: Callable[[], None]
    timed_out: bool = False

    def silent_seconds(self, now: float) -> float:
        last = self.meter.last_token_at
        return now - (self.meter.arrival if last is None else last)


class InFlight:
    def __init__(self, clock: Callable[[], float], *, silence_seconds: float, idle_timeout_seconds: float):
        self.clock = clock
        self.silence_seconds = silence_seconds
        self.idle_timeout_seconds = idle_timeout_seconds  # 0: never time out
        self.streams: dict[int, Stream] = {}
        self.timed_out: dict[StreamLabels, int] = {}

    def add(self, key: int, stream: Stream) -> None:
        self.streams[key] = stream

    def remove(self, key: int) -> None:
        self.streams.pop(key, None)

    # ---- what is silent ----------------------------------------------------------------
    def silent(self, now: float | None = None) -> tuple[dict[StreamLabels, int], float]:
        """Streams silent past the threshold by labels, and the longest silence of all."""
        now = self.clock() if now is None else now
        by_labels: dict[StreamLabels, int] = {}
        longest = 0.0
        for stream in list(self.streams.values()):
            silence = stream.silent_seconds(now)
            longest = max(longest, silence)
            if silence > self.silence_seconds:
                by_labels[stream.labels] = by_labels.get(stream.labels, 0) + 1
        return by_labels, longest

    def summary(self) -> dict[str, Any]:
        """For the liveness record: what the control plane reads."""
        by_labels, longest = self.silent()
        return {
            "silence_seconds": self.silence_seconds,
            "in_flight": len(self.streams),
            "longest_silence_seconds": round(longest, 3),
            "silent": [{**labels._asdict(), "streams": n} for labels, n in sorted(by_labels.items())],
        }

    # ---- the idle timeout ------------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        """End every stream silent past the idle timeout; returns how many."""
        if self.idle_timeout_seconds <= 0:
            return 0
        now = self.clock() if now is None else now
        ended = 0
        for stream in list(self.streams.values()):
            if not stream.timed_out and stream.silent_seconds(now) > self.idle_timeout_seconds:
                stream.timed_out = True
                self.timed_out[stream.labels] = self.timed_out.get(stream.labels, 0) + 1
                ended += 1
                try:
                    stream.on_timeout()
                except Exception:
                    log.exception("could not end a stream past its idle timeout")
        return ended

    async def watch(self) -> None:
        """Check for idle streams a few times per timeout, until cancelled."""
        if self.idle_timeout_seconds <= 0:
            return
        period = min(1.0, max(0.05, self.idle_timeout_seconds / 4))
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):
                self.expire()


class InFlightCollector(Collector):
    """The gateway's gauges of silent streams, read at scrape time."""

    def __init__(self, inflight: InFlight):
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        by_labels, longest = self.inflight.silent()
        silent = GaugeMetricFamily(
            "chunkpilot:gateway_streams_silent",
            f"Streams in flight with no token for more than GATEWAY_STREAM_SILENCE_SECONDS "
            f"({self.inflight.silence_seconds:g} s).",
            labels=LABELS,
        )
        for labels, n in sorted(by_labels.items()):
            silent.add_metric(list(labels), n)
        yield silent
        longest_gauge = GaugeMetricFamily(
            "chunkpilot:gateway_stream_longest_silence_seconds",
            "The longest time any stream in flight has gone without a token.",
        )
        longest_gauge.add_metric([], longest)
        yield longest_gauge
        in_flight = GaugeMetricFamily("chunkpilot:gateway_streams_in_flight", "Streams this gateway is relaying.")
        in_flight.add_metric([], len(self.inflight.streams))
        yield in_flight
        timed_out = CounterMetricFamily(
            "chunkpilot:gateway_streams_timed_out",
            "Streams ended by GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS (their worker stopped feeding them).",
            labels=LABELS,
        )
        for labels, n in sorted(self.inflight.timed_out.items()):
            timed_out.add_metric(list(labels), n)
        yield timed_out
