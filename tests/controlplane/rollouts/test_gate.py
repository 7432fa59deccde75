"""The consistency gate: greedy replays on a chunked and a monolithic
reference worker (the tiny model) agree token for token; a worker whose
output differs aborts the rollout, showing the first differing position."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controlplane.rollouts import controller, gate
from controlplane.rollouts.evaluator import GateStatus, Phase
from controlplane.rollouts.models import Rollout
from tests.controlplane.rollouts.factories import follow, make_fleet, table_weights
from tests.support import PYTHON, child_env, free_port, running

CHUNKED = {"prefill_mode": "chunked", "max_num_batched_tokens": 256, "long_prefill_token_threshold": 64}
MONOLITHIC = {"prefill_mode": "monolithic", "max_num_batched_tokens": 512}


@contextlib.contextmanager
def reference_worker(model: Path, profile: dict[str, Any], log: Path) -> Iterator[str]:
    port = free_port()
    argv = [PYTHON, "-m", "workers", "serve", "--model", str(model), "--port", str(port), "--max-model-len", "512",
            "--profile", json.dumps(profile), "--device", "cpu", "--log-level", "warning"]
    with running(argv, env=child_env(), log_path=log) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health", timeout=120)
        yield url


@pytest.mark.slow
def test_chunked_and_monolithic_workers_agree_token_for_token(tiny_model: Path, tmp_path: Path) -> None:
    with reference_worker(tiny_model, CHUNKED, tmp_path / "canary.log") as canary, \
            reference_worker(tiny_model, MONOLITHIC, tmp_path / "stable.log") as stable:
        prompts = gate.default_prompts(chunk_cap=64, max_model_len=512, max_tokens=8)
        outcome = gate.run(canary, stable, prompts, max_tokens=8, chunk_cap=64)
    assert outcome.passed, outcome.message
    assert outcome.details["prompt_lengths"] == [96, 160, 224]
    assert outcome.details["max_chunk_boundaries_crossed"] == 3
    assert outcome.details["mismatches"] == []


class _Stub(BaseHTTPRequestHandler):
    """A worker at the edge of the world: greedy output is the prompt's
    first tokens, except that ``flip_at`` (if set) is changed."""

    flip_at: int | None = None

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["prompt"]
        out = [(t * 7 + i) % 1000 for i, t in enumerate(prompt[: body["max_tokens"]])]
        if self.flip_at is not None:
            out[self.flip_at] += 1
        reply = json.dumps({"choices": [{"index": 0, "text": "x", "prompt_token_ids": prompt, "token_ids": out,
                                         "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def stub(flip_at: int | None) -> Iterator[str]:
    handler = type("Stub", (_Stub,), {"flip_at": flip_at})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.django_db
def test_a_mismatch_aborts_the_rollout_and_shows_the_first_differing_position() -> None:
    with stub(flip_at=3) as canary_url, stub(flip_at=None) as stable_url:
        fleet = make_fleet(urls={"stable": [stable_url], "canary": [canary_url]}, num_stable=1)
        r = Rollout.start(routing_table=fleet.table, stable_pool=fleet.stable, canary_pool=fleet.canary,
                          target_revision=fleet.target_revision, steps=[{"set_weight": 1000}], actor="tester",
                          gate={"max_tokens": 6})
        assert r.gate_status == GateStatus.PENDING  # the target is chunked
        controller.drive(r.pk)
        follow(fleet)
        controller.drive(r.pk)
        follow(fleet)
        controller.drive(r.pk)
    r = Rollout.objects.get(pk=r.pk)
    assert r.gate_status == GateStatus.FAILED
    assert r.phase in (Phase.ABORTING, Phase.ABORTED)
    assert "differs at output position 3" in r.abort_reason
    first = r.gate_result["mismatches"][0]
    assert first["position"] == 3 and first["canary_token"] == first["stable_token"] + 1
    assert r.gate_result["prompt_lengths"] == [96, 160, 224]  # 1.5, 2.5 and 3.5 chunks of 64
    # it never took traffic
    assert table_weights(fleet.table)["canary"] == 0
    assert not r.events.filter(kind="weights_set", data__weights__canary__gt=0).exists()
    assert r.events.filter(kind="gate_failed").exists()


@pytest.mark.django_db
def test_a_gate_that_cannot_reach_a_worker_retries_and_does_not_fail() -> None:
    fleet = make_fleet(urls={"stable": ["http://127.0.0.1:1"], "canary": ["http://127.0.0.1:1"]}, num_stable=1)
    r = Rollout.start(routing_table=fleet.table, stable_pool=fleet.stable, canary_pool=fleet.canary,
                      target_revision=fleet.target_revision, steps=[{"set_weight": 1000}], actor="tester")
    controller.drive(r.pk)
    follow(fleet)
    controller.drive(r.pk)
    r = Rollout.objects.get(pk=r.pk)
    assert r.gate_status == GateStatus.PENDING and r.phase == Phase.PROGRESSING
    assert "consistency gate" in r.last_error and "unreachable" in r.last_error
