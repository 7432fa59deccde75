"""A profile switch under load loses no request.

A worker with its agent runs against a stand-in control plane (real HTTP).
While the load generator streams requests at it, the control plane asks for
a new profile revision. The worker drains, rebuilds its engine, and reports
``ready`` on the new revision; every request either completes or is refused
with a retryable status before its first byte.
"""

import json
import time

import httpx
import pytest

from tests.support import PYTHON, Process
from tests.workers.agent.fake_control_plane import FakeControlPlane
from tests.workers.server.support import ThreadedServer, get, metric_value, wait_until, worker

MAX_MODEL_LEN = 1024
BEFORE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 256,
    "long_prefill_token_threshold": 64,
    "max_num_seqs": 8,
    "block_size": 32,
    "kv_cache_bytes": 32 << 20,
}
AFTER = {
    **BEFORE,
    "prefill_mode": "monolithic",
    "max_num_batched_tokens": MAX_MODEL_LEN,
    "long_prefill_token_threshold": None,
}


@pytest.fixture(params=["reference", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request):
    return request.param


def test_a_profile_switch_under_load_loses_no_request(engine, tiny_model, tmp_path):
    control_plane = FakeControlPlane(heartbeat_interval_seconds=0.2)
    with (
        ThreadedServer(control_plane.app()) as cp,
        worker(
            tiny_model,
            tmp_path / "worker.log",
            engine=engine,
            profile=json.dumps(BEFORE),
            extra=[
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--control-plane",
                cp.url,
                "--enroll-token",
                "enroll-1",
                "--name",
                "w1",
                "--drain-timeout",
                "60",
            ],
        ) as (url, proc),
    ):
        wait_until(lambda: (control_plane.last() or {}).get("state") == "ready", timeout=30)
        assert control_plane.registrations[0]["engine_kind"] == engine

        load = Process(
            [
                PYTHON,
                "-m",
                "workers",
                "loadgen",
                "--url",
                url,
                "--scenario",
                "burst",
                "--duration",
                "8",
                "--rate",
                "3",
                "--burst-period",
                "1",
                "--json",
            ],
            env=None,
            log_path=tmp_path / "loadgen.log",
        )
        time.sleep(2.5)  # a few bursts in flight on the old profile
        mark = len(control_plane.heartbeats)
        control_plane.set_desired(revision_id=42, fields=AFTER, name="mono", revision=2)
        wait_until(lambda: control_plane.states_since(mark)[-1:] == [("ready", 42)], timeout=120)
        assert load.popen.wait(180) in (0, 1)
        result = json.loads(load.output()[load.output().index("{") :])

        if engine == "vllm":  # vLLM rebuilds (the reference engine may apply between two steps)
            states = [s for s, _ in control_plane.states_since(mark)]
            assert "draining" in states or "applying" in states
        records = result["requests"]
        assert len(records) == 24
        lost = [r for r in records if not r["success"] and not (r["status"] in (429, 503) and not r["got_first_byte"])]
        assert lost == [], lost
        assert sum(r["success"] for r in records) >= 3  # the bursts before the switch were served

        health = get(f"{url}/health").json()
        assert health["status"] == "ready" and health["profile"]["revision_id"] == 42
        assert health["profile"]["fields"]["prefill_mode"] == "monolithic"
        text = get(f"{url}/metrics").text
        assert (
            metric_value(text, "chunkpilot:profile_info", profile="mono", revision="2", prefill_mode="monolithic") == 1
        )
        # The new engine serves.
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 40, "max_tokens": 4}, timeout=30)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        load.stop()
