"""The agent against a control plane over real HTTP.

The worker is the real ``serve`` process (reference engine); the control
plane is a stand-in that speaks ``workers.contract`` (fake_control_plane),
which the tests drive: a desired profile, a drain, an outage, a restart that
forgot every secret.
"""

import json

import httpx
import pytest

from tests.workers.agent.fake_control_plane import FakeControlPlane
from tests.workers.server.support import ThreadedServer, get, wait_until, worker

ENGINE = "reference"
MAX_MODEL_LEN = 1024
PROFILE = {"max_num_batched_tokens": 256, "max_num_seqs": 8, "block_size": 32, "kv_cache_bytes": 16 << 20}


def agent_args(cp_url, *more):
    return [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--control-plane",
        cp_url,
        "--enroll-token",
        "enroll-1",
        "--name",
        "w1",
        "--advertise-url",
        "http://w1.example:8000",
        "--label",
        "zone=a",
        *more,
    ]


def complete(url):
    return httpx.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 3}, timeout=30)


def ready_on(cp, revision_id):
    last = cp.last() or {}
    return last.get("state") == "ready" and last.get("running_revision_id") == revision_id


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    """One worker and its control plane for the tests that leave both up."""
    cp = FakeControlPlane()
    log = tmp_path_factory.mktemp("agent") / "worker.log"
    with (
        ThreadedServer(cp.app()) as server,
        worker(tiny_model, log, engine=ENGINE, profile=json.dumps(PROFILE), extra=agent_args(server.url)) as (
            url,
            proc,
        ),
    ):
        wait_until(lambda: ready_on(cp, None), timeout=60)
        yield cp, url


def test_it_registers_with_the_enrollment_token_and_heartbeats_what_it_runs(fleet):
    cp, url = fleet
    [registration] = cp.registrations
    assert registration["name"] == "w1" and registration["url"] == "http://w1.example:8000"
    assert registration["engine_kind"] == ENGINE and registration["max_model_len"] == MAX_MODEL_LEN
    assert registration["labels"] == {"zone": "a"}
    assert registration["hardware"]["device"] == "cpu" and registration["hardware"]["memory_bytes"] > 0
    assert cp.tokens == set()  # the token was spent; heartbeats use the worker's secret
    heartbeat = cp.last()
    assert heartbeat["running_profile"]["max_num_batched_tokens"] == 256
    assert set(heartbeat["load"]) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
    assert heartbeat["hardware"]["cpu_count"] >= 1 and heartbeat["apply_error"] is None


def test_it_applies_the_desired_profile_and_reports_ready_on_the_new_revision(fleet):
    cp, url = fleet
    mark = len(cp.heartbeats)
    cp.set_desired(
        7, {**PROFILE, "max_num_batched_tokens": 128, "long_prefill_token_threshold": 32}, name="small", revision=2
    )
    wait_until(lambda: ready_on(cp, 7), timeout=120)
    states = [s for s, _ in cp.states_since(mark)]
    assert {"draining", "applying"} & set(states)  # each state change is reported at once
    assert cp.last()["running_profile"]["long_prefill_token_threshold"] == 32
    health = get(f"{url}/health").json()
    assert health["profile"] == {
        "name": "small",
        "revision": 2,
        "revision_id": 7,
        "fields": cp.last()["running_profile"],
    }
    assert complete(url).status_code == 200


def test_a_profile_it_cannot_run_is_reported_and_the_last_one_keeps_serving(fleet):
    cp, url = fleet
    running = cp.last()["running_revision_id"]
    cp.set_desired(8, {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 128}, name="broken", revision=3)
    wait_until(lambda: (cp.last() or {}).get("apply_error"), timeout=30)
    last = cp.last()
    assert "revision 8" in last["apply_error"] and "long_prefill_token_threshold" in last["apply_error"]
    assert last["state"] == "ready" and last["running_revision_id"] == running
    assert complete(url).status_code == 200


def test_a_drain_request_stops_admission_until_lifted(fleet):
    cp, url = fleet
    cp.drain = True
    wait_until(lambda: (cp.last() or {}).get("state") == "draining", timeout=10)
    assert get(f"{url}/health").status_code == 503
    refused = complete(url)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "worker_draining"
    cp.drain = False
    wait_until(lambda: (cp.last() or {}).get("state") == "ready", timeout=10)
    assert complete(url).status_code == 200


def test_it_keeps_serving_while_the_control_plane_is_away_and_reconnects(tiny_model, tmp_path):
    cp = FakeControlPlane()
    server = ThreadedServer(cp.app()).start()
    with worker(
        tiny_model, tmp_path / "w.log", engine=ENGINE, profile=json.dumps(PROFILE), extra=agent_args(server.url)
    ) as (url, proc):
        wait_until(lambda: ready_on(cp, None), timeout=60)
        server.stop()
        count = len(cp.heartbeats)
        for _ in range(3):
            assert complete(url).status_code == 200
        assert get(f"{url}/health").status_code == 200
        ThreadedServer(cp.app(), port=server.port).start()
        wait_until(lambda: len(cp.heartbeats) > count, timeout=60)
        assert len(cp.registrations) == 1  # same secret, no new enrollment


def test_a_control_plane_that_forgot_the_worker_gets_a_fresh_registration(tiny_model, tmp_path):
    first = FakeControlPlane()
    server = ThreadedServer(first.app()).start()
    with worker(
        tiny_model, tmp_path / "w.log", engine=ENGINE, profile=json.dumps(PROFILE), extra=agent_args(server.url)
    ) as (url, proc):
        wait_until(lambda: ready_on(first, None), timeout=60)
        server.stop()
        second = FakeControlPlane()  # a fresh database: the secret means nothing, the token is new
        with ThreadedServer(second.app(), port=server.port):
            wait_until(lambda: ready_on(second, None), timeout=60)
            assert len(second.registrations) == 1


def test_the_secret_survives_a_restart_in_the_state_file(tiny_model, tmp_path):
    cp = FakeControlPlane()
    state_file = tmp_path / "agent.json"
    with ThreadedServer(cp.app()) as server:
        args = agent_args(server.url, "--state-file", str(state_file))
        with worker(tiny_model, tmp_path / "a.log", engine=ENGINE, profile=json.dumps(PROFILE), extra=args):
            wait_until(lambda: ready_on(cp, None), timeout=60)
        assert state_file.stat().st_mode & 0o077 == 0  # the secret is for the worker's user only
        count = len(cp.heartbeats)
        with worker(tiny_model, tmp_path / "b.log", engine=ENGINE, profile=json.dumps(PROFILE), extra=args):
            wait_until(lambda: len(cp.heartbeats) > count and ready_on(cp, None), timeout=60)
        assert len(cp.registrations) == 1  # the token was single-use; the restart needed none
