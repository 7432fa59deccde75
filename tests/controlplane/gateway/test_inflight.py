"""The in-flight tracker on a fixed clock: which streams count as silent, the
longest silence, and which the idle timeout ends (once each)."""

from __future__ import annotations

from controlplane.gateway.inflight import InFlight, InFlightCollector, Stream, StreamLabels
from controlplane.gateway.meter import StreamMeter

CANARY = StreamLabels("m", "canary", "gpu-c", "c1")
STABLE = StreamLabels("m", "stable", "gpu-s", "s1")


def _stream(labels: StreamLabels, arrival: float, last_token: float | None, ended: list[str]) -> Stream:
    meter = StreamMeter(arrival)
    if last_token is not None:
        meter.feed(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n', last_token)
    return Stream(labels, meter, lambda: ended.append(labels.cohort))


def test_silence_counts_from_the_last_token_or_from_arrival() -> None:
    now = [100.0]
    tracker = InFlight(lambda: now[0], silence_seconds=10.0, idle_timeout_seconds=30.0)
    ended: list[str] = []
    tracker.add(1, _stream(CANARY, arrival=50.0, last_token=95.0, ended=ended))  # 5 s: talking
    tracker.add(2, _stream(CANARY, arrival=80.0, last_token=None, ended=ended))  # 20 s: no first token yet
    tracker.add(3, _stream(STABLE, arrival=60.0, last_token=85.0, ended=ended))  # 15 s
    by_labels, longest = tracker.silent()
    assert by_labels == {CANARY: 1, STABLE: 1} and longest == 20.0
    assert tracker.summary()["silent"] == [{**CANARY._asdict(), "streams": 1}, {**STABLE._asdict(), "streams": 1}]
    tracker.remove(2)
    assert tracker.silent() == ({STABLE: 1}, 15.0)


def test_the_idle_timeout_ends_each_silent_stream_once() -> None:
    now = [100.0]
    tracker = InFlight(lambda: now[0], silence_seconds=10.0, idle_timeout_seconds=30.0)
    ended: list[str] = []
    tracker.add(1, _stream(CANARY, arrival=0.0, last_token=60.0, ended=ended))
    tracker.add(2, _stream(STABLE, arrival=0.0, last_token=90.0, ended=ended))
    assert tracker.expire() == 1 and ended == ["canary"]
    assert tracker.expire() == 0  # already ended: not again while the relay winds it down
    now[0] = 125.0
    assert tracker.expire() == 1 and ended == ["canary", "stable"]
    assert tracker.timed_out == {CANARY: 1, STABLE: 1}
    off = InFlight(lambda: 1e9, silence_seconds=10.0, idle_timeout_seconds=0.0)
    off.add(1, _stream(CANARY, arrival=0.0, last_token=None, ended=ended))
    assert off.expire() == 0


def test_the_gauges_carry_the_silent_streams_by_labels() -> None:
    tracker = InFlight(lambda: 100.0, silence_seconds=10.0, idle_timeout_seconds=0.0)
    tracker.add(1, _stream(CANARY, arrival=0.0, last_token=50.0, ended=[]))
    tracker.add(2, _stream(CANARY, arrival=0.0, last_token=70.0, ended=[]))
    families = {f.name: f for f in InFlightCollector(tracker).collect()}
    silent = families["chunkpilot:gateway_streams_silent"].samples
    assert [(s.labels, s.value) for s in silent] == [(CANARY._asdict(), 2)]
    assert families["chunkpilot:gateway_stream_longest_silence_seconds"].samples[0].value == 50.0
    assert families["chunkpilot:gateway_streams_in_flight"].samples[0].value == 2
