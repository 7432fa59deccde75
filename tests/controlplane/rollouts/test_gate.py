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
    argv = [
        PYTHON,
        "-m",
        "workers",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--profile",
        json.dumps(profile),
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    with running(argv, env=child_env(), log_path=log) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/health", timeout=120)
        yield url


@pytest.mark.slow
def test_chunked_and_monolithic_workers_agree_token_for_token(tiny_model: Path, tmp_path: Path) -> None:
    with (
        reference_worker(tiny_model, CHUNKED, tmp_path / "canary.log") as canary,
        reference_worker(tiny_model, MONOLITHIC, tmp_path / "stable.log") as stable,
    ):
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

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["prompt"]
        out = [(t * 7 + i) % 1000 for i, t in enumerate(prompt[: body["max_tokens"]])]
        if self.flip_at is not None:
            out[self.flip_at] += 1
        reply = json.dumps(
            {
                "choices": [
                    {"index": 0, "text": "x", "prompt_token_ids": prompt, "token_ids": out, "finish_reason": "length"}
                ]
            }
        ).encode()
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
        r = Rollout.start(
            routing_table=fleet.table,
            stable_pool=fleet.stable,
            canary_pool=fleet.canary,
            target_revision=fleet.target_revision,
            steps=[{"set_weight": 1000}],
            actor="tester",
            gate={"max_tokens": 6},
        )
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
    r = Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 1000}],
        actor="tester",
    )
    controller.drive(r.pk)
    follow(fleet)
    controller.drive(r.pk)
    r = Rollout.objects.get(pk=r.pk)
    assert r.gate_status == GateStatus.PENDING and r.phase == Phase.PROGRESSING
    assert "consistency gate" in r.last_error and "unreachable" in r.last_error


@pytest.mark.parametrize(
    ("profile", "max_model_len", "max_tokens", "expected"),
    [
        ({"chunk_cap": 64}, 0, 12, 2),  # context unknown: the full requirement
        ({"chunk_cap": 64}, 512, 12, 2),
        ({"chunk_cap": 64}, 150, 12, 2),  # 137 tokens fit: 2 boundaries
        ({"chunk_cap": 64}, 100, 12, 1),  # 87 tokens fit: only 1 boundary can be crossed
        ({"chunk_cap": 64}, 60, 12, 0),  # nothing the context holds is ever split
        ({"chunk_cap": 64, "short_prompt_threshold": 200}, 210, 12, 0),  # all that fits is prefilled whole
    ],
)
def test_the_boundaries_a_gate_must_cross_are_capped_by_the_context(
    profile, max_model_len, max_tokens, expected
) -> None:
    assert (
        gate.required_boundaries(profile["chunk_cap"], max_model_len, max_tokens, profile.get("short_prompt_threshold"))
        == expected
    )


def test_default_prompts_cross_enough_boundaries_even_past_a_short_prompt_threshold() -> None:
    prompts = gate.default_prompts(chunk_cap=64, max_model_len=0, max_tokens=8, short_prompt_threshold=200)
    assert [len(p) for p in prompts] == [96 + 128, 160 + 128, 224 + 128]  # whole chunks more, all past 200
    assert [gate.chunks_crossed(len(p), 64, 200) for p in prompts] == [3, 4, 5]
    assert gate.prompt_errors(prompts, 64, 0, 8, 200) == []
    # unshifted, the first two (96 and 160 tokens) would be prefilled whole: no boundary at all
    assert gate.chunks_crossed(160, 64, 200) == 0


def _start(fleet: Any, **gate_settings: Any) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        steps=[{"set_weight": 1000}],
        actor="tester",
        gate=gate_settings,
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("prompts", "why"),
    [
        ([list(range(16, 16 + 100))], "at least 2 chunk boundaries"),  # 100 tokens: 1 boundary of 64
        (["a short question"], "at least 2 chunk boundaries"),  # at most 17 tokens, whatever the tokenizer
        ([list(range(16, 16 + 600))], "prompt #1 has 600 tokens"),  # past the 512-token context
    ],
)
def test_a_gate_whose_prompts_cannot_cross_two_chunk_boundaries_is_refused_naming_the_gate(prompts, why) -> None:
    from django.core.exceptions import ValidationError

    fleet = make_fleet(num_stable=1)  # target chunk cap 64, workers' context 512
    with pytest.raises(ValidationError) as exc:
        _start(fleet, prompts=prompts)
    assert list(exc.value.message_dict) == ["gate"]
    assert why in " ".join(exc.value.message_dict["gate"])
    assert not Rollout.objects.exists()


@pytest.mark.django_db
def test_long_enough_prompts_and_the_default_set_are_accepted() -> None:
    fleet = make_fleet(num_stable=1)
    assert _start(fleet, prompts=[list(range(16, 16 + 100)), list(range(16, 16 + 129))]).gate_status == "pending"
    Rollout.objects.all().delete()
    assert _start(fleet).gate_status == "pending"  # 96, 160, 224 tokens
    Rollout.objects.all().delete()
    assert _start(fleet, prompts=["x" * 200]).gate_status == "pending"  # may be long enough: checked at the run


@pytest.mark.django_db
def test_a_short_context_lowers_the_bar_to_what_fits() -> None:
    fleet = make_fleet(num_stable=1, max_model_len=100)  # 87 prompt tokens fit with 12 out: one boundary
    assert _start(fleet, prompts=[list(range(16, 16 + 80))]).gate_status == "pending"


def test_a_custom_prompt_gate_run_passes_when_its_prompts_cross_enough_boundaries() -> None:
    prompts: list[gate.Prompt] = [list(range(16, 16 + 70)), list(range(100, 100 + 200))]
    with stub(flip_at=None) as canary_url, stub(flip_at=None) as stable_url:
        outcome = gate.run(canary_url, stable_url, prompts, max_tokens=6, chunk_cap=64)
    assert outcome.passed and not outcome.error, outcome.message
    assert outcome.details["prompt_lengths"] == [70, 200]
    assert outcome.details["max_chunk_boundaries_crossed"] == 3 and outcome.details["min_chunk_boundaries"] == 2
    assert "2 prompts (70, 200 tokens, up to 3 chunk boundaries) identical" in outcome.message


def test_a_gate_run_crossing_too_few_boundaries_is_an_error_not_a_pass() -> None:
    prompts: list[gate.Prompt] = [list(range(16, 16 + 100))]  # 1 boundary of 64
    with stub(flip_at=None) as canary_url, stub(flip_at=None) as stable_url:
        outcome = gate.run(canary_url, stable_url, prompts, max_tokens=6, chunk_cap=64)
        assert gate.run(canary_url, stable_url, prompts, max_tokens=6, chunk_cap=64, min_boundaries=1).passed
    assert not outcome.passed and outcome.error
    assert outcome.details["mismatches"] == [] and outcome.details["max_chunk_boundaries_crossed"] == 1
    assert "crossed at most 1 chunk boundaries" in outcome.message and "fewer than the 2 needed" in outcome.message


@pytest.mark.django_db
def test_a_rollout_whose_replayed_prompts_cross_too_few_boundaries_aborts_before_traffic() -> None:
    with stub(flip_at=None) as canary_url, stub(flip_at=None) as stable_url:
        fleet = make_fleet(urls={"stable": [stable_url], "canary": [canary_url]}, num_stable=1)
        # A string: long enough by its byte count, so creation lets it through;
        # the workers tokenize it into fewer tokens (this stub: one a character).
        r = _start(fleet, prompts=["x" * 200], max_tokens=6)
        Rollout.objects.filter(pk=r.pk).update(gate={"prompts": [list(range(16, 16 + 100))], "max_tokens": 6})
        for _ in range(3):
            controller.drive(r.pk)
            follow(fleet)
    r = Rollout.objects.get(pk=r.pk)
    assert r.gate_status == GateStatus.FAILED and r.gate_result["error"] is True
    assert r.phase in (Phase.ABORTING, Phase.ABORTED)
    assert "fewer than the 2 needed" in r.abort_reason
    assert table_weights(fleet.table)["canary"] == 0
    assert "could not show anything" in r.events.get(kind="gate_failed").message
