"""A wedged stream, end to end: a real reference worker told to stop feeding
one stream (its fault knob), a real gateway, a rollout under analysis driven
in-process. The silence gauge rises within two scrapes of the gateway, the
control plane's /metrics (which the shipped ChunkpilotCanaryStreamsSilent
rule watches; promtool's test of that rule is in deploy/) carries it, the
analysis fails on it and the rollout aborts naming the reason, and the idle
timeout ends the stream with an OpenAI-style error event, logged as 598."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.gateway.inflight import STATUS_STREAM_TIMED_OUT
from controlplane.gateway.models import ClientKey, RequestLog
from controlplane.metrics import exposition
from controlplane.rollouts import controller
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import AnalysisTemplate, Measurement, Rollout
from tests.controlplane.rollouts.factories import follow, make_fleet
from tests.support import PYTHON, child_env, free_port, running, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 64,
    "long_prefill_token_threshold": 32,
    "max_num_seqs": 4,
    "block_size": 16,
    "kv_cache_bytes": 16 << 20,
}
MARKER = "WEDGE"
SILENCE_SECONDS = 0.5
IDLE_TIMEOUT_SECONDS = 8.0
SCRAPE_SECONDS = 1.0


def _silent(text: str, name: str, cohort: str = "canary") -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("cohort") == cohort:
                total += sample.value
    return total


def _stream(url: str, key: str, events: list[Any], done: threading.Event) -> None:
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=60,
            headers={"authorization": f"Bearer {key}", "x-chunkpilot-cohort": "canary"},
            json={
                "model": "tiny",
                "prompt": f"{MARKER} def fibonacci(n):",
                "max_tokens": 64,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    finally:
        done.set()


def test_a_wedged_canary_stream_is_seen_alerted_aborted_and_ended(tiny_model, start_gateway, tmp_path) -> None:
    port = free_port()
    argv = [
        PYTHON,
        "-m",
        "workers",
        "serve",
        "--engine",
        "reference",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--profile",
        json.dumps(PROFILE),
        "--fault-stall-marker",
        MARKER,
    ]
    with running(argv, env=child_env(), log_path=tmp_path / "worker.log") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health", timeout=180)
        fleet = make_fleet(num_stable=1, num_canary=1, urls={"stable": [url], "canary": [url]})
        AnalysisTemplate.objects.create(
            name="hang",
            metrics=[{"name": "hanging", "figure": "timed_out_streams", "test": "hanging", "floor": 0}],
            interval_seconds=1.0,
            count=30,
            initial_delay_seconds=0.0,
            window_seconds=60.0,
        )
        key = ClientKey.issue("ops", is_admin=True)[1]
        env = {
            "GATEWAY_STREAM_SILENCE_SECONDS": str(SILENCE_SECONDS),
            "GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS": str(IDLE_TIMEOUT_SECONDS),
        }
        with start_gateway(**env) as gw:
            rollout = Rollout.start(
                routing_table=fleet.table,
                stable_pool=fleet.stable,
                canary_pool=fleet.canary,
                target_revision=fleet.target_revision,
                actor="tester",
                gate={"enabled": False},
                steps=[{"set_weight": 5000}, {"analysis": {"template": "hang"}}, {"set_weight": 10000}],
            )

            def in_analysis() -> bool:
                controller.drive(rollout.pk)
                follow(fleet)
                r = Rollout.objects.get(pk=rollout.pk)
                return r.step_index == 1 and r.current_analysis() is not None

            wait_until(in_analysis, timeout=30, interval=0.3)
            # A normal stream first: nothing silent, the analysis measures clean.
            quiet = httpx.get(f"{gw.url}/metrics", timeout=5).text
            assert _silent(quiet, "chunkpilot:gateway_streams_silent") == 0

            events: list[Any] = []
            done = threading.Event()
            thread = threading.Thread(target=_stream, args=(gw.url, key, events, done), daemon=True)
            thread.start()
            wait_until(lambda: events, timeout=30, interval=0.05)  # its first output arrived, then nothing

            scrapes = []
            for _ in range(2):
                time.sleep(SCRAPE_SECONDS)
                scrapes.append(
                    _silent(httpx.get(f"{gw.url}/metrics", timeout=5).text, "chunkpilot:gateway_streams_silent")
                )
            assert max(scrapes) == 1, scrapes
            assert not done.is_set()

            # The control plane sees it through the gateway's liveness record.
            shown = wait_until(
                lambda: _silent(exposition.render().decode(), "chunkpilot_gateway_streams_silent"),
                timeout=5,
                interval=0.2,
            )
            assert shown == 1

            def aborted() -> Rollout | None:
                controller.drive(rollout.pk)
                r = Rollout.objects.get(pk=rollout.pk)
                return r if r.phase in (Phase.ABORTING, Phase.ABORTED) else None

            r = wait_until(aborted, timeout=IDLE_TIMEOUT_SECONDS - 3, interval=0.5)
            assert not done.is_set(), "the analysis must abort before the stream times out"
            assert "hanging" in r.abort_reason, r.abort_reason
            verdict = next(
                v for m in Measurement.objects.filter(run__rollout=r) for v in m.verdicts if v["phase"] == "failed"
            )
            assert verdict["metric"] == "hanging" and "1 canary streams hung" in verdict["reason"]

            assert done.wait(IDLE_TIMEOUT_SECONDS + 10)
            error = events[-1]["error"]
            assert error["code"] == "stream_idle_timeout" and error["type"] == "timeout_error"
            row = wait_until(lambda: RequestLog.objects.filter(status=STATUS_STREAM_TIMED_OUT).first(), timeout=10)
            assert (
                row.cohort == "canary" and row.pool_id == fleet.canary.pk and "GATEWAY_STREAM_IDLE_TIMEOUT" in row.error
            )
            after = httpx.get(f"{gw.url}/metrics", timeout=5).text
            assert _silent(after, "chunkpilot:gateway_streams_silent") == 0
            assert _silent(after, "chunkpilot:gateway_streams_timed_out_total") == 1
