"""The load generator: seeded plans, client-side timing, vllm-bench-style summary."""

import asyncio
import json
import subprocess

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.support import PYTHON, ROOT
from tests.workers.server.support import ThreadedServer
from workers.loadgen import (
    SESSION_HEADER,
    RequestRecord,
    meets_slos,
    parse_slos,
    plan,
    summarize,
)

# A token every 50 ms after a 200 ms first token, with one 300 ms stall.
DELAYS = [0.2, 0.05, 0.05, 0.3, 0.05]


def timed_source(seen_headers: list[dict[str, str]], *, status: int = 200, unready_calls: int = 0) -> Starlette:
    """An OpenAI completions endpoint with known token timing (the edge the
    load generator measures), recording what headers reached it. Its first
    ``unready_calls`` model listings answer 503, as a gateway whose workers
    are still loading does."""
    listings = []

    async def models(request: Request):
        listings.append(1)
        if len(listings) <= unready_calls:
            return JSONResponse({"error": {"message": "no worker ready"}}, status_code=503)
        return JSONResponse({"object": "list", "data": [{"id": "timed", "object": "model", "max_model_len": 4096}]})

    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 600, "completion_tokens": 1}})
        seen_headers.append(dict(request.headers))
        if status != 200:
            return JSONResponse(
                {"error": {"message": "full", "type": "rate_limit_error"}},
                status_code=status,
                headers={"Retry-After": "1"},
            )

        async def events():
            for i, delay in enumerate(DELAYS):
                await asyncio.sleep(delay)
                last = i == len(DELAYS) - 1
                choice = {"index": 0, "text": f"t{i}", "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": len(DELAYS), "total_tokens": 10 + len(DELAYS)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def loadgen(url: str, *extra: str) -> dict:
    out = subprocess.run(
        [PYTHON, "-m", "workers", "loadgen", "--url", url, "--json", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def test_client_side_ttft_itl_tpot_and_stall_are_measured_per_request():
    seen: list[dict[str, str]] = []
    with ThreadedServer(timed_source(seen)) as server:
        result = loadgen(
            server.url,
            "--scenario",
            "burst",
            "--duration",
            "1",
            "--rate",
            "2",
            "--burst-period",
            "1",
            "--sticky-keys",
            "3",
            "--api-key",
            "sk-test",
        )
    records = result["requests"]
    assert len(records) == 2 and all(r["success"] for r in records)
    for r in records:
        assert abs(r["ttft_seconds"] - 0.2) < 0.1
        assert len(r["itl_seconds"]) == len(DELAYS) - 1
        assert abs(r["max_gap_seconds"] - 0.3) < 0.1
        assert abs(r["tpot_seconds"] - sum(DELAYS[1:]) / (len(DELAYS) - 1)) < 0.05
        assert (r["prompt_tokens"], r["output_tokens"]) == (10, len(DELAYS))
    assert {h[SESSION_HEADER] for h in seen} <= {"key-0", "key-1", "key-2"}
    assert all(h["authorization"] == "Bearer sk-test" for h in seen)
    summary = result["summary"]
    assert summary["successful_requests"] == 2
    assert abs(summary["max_gap_ms"]["p99"] - 300) < 100
    assert summary["tokens_per_word"] == 1.5  # 600 prompt tokens for the 400-word calibration


def test_rounds_replay_fresh_plans_once_the_server_serves():
    seen: list[dict[str, str]] = []
    with ThreadedServer(timed_source(seen, unready_calls=2)) as server:
        out = subprocess.run(
            [
                PYTHON,
                "-m",
                "workers",
                "loadgen",
                "--url",
                server.url,
                "--json",
                "--scenario",
                "long-tail",
                "--duration",
                "2",
                "--rate",
                "3",
                "--rounds",
                "2",
                "--wait",
                "10",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    decoder, text, rounds = json.JSONDecoder(), out.stdout.strip(), []
    while text:
        doc, end = decoder.raw_decode(text)
        rounds.append(doc)
        text = text[end:].strip()
    assert [r["summary"]["round"] for r in rounds] == [0, 1]
    assert all(r["summary"]["successful_requests"] == len(r["requests"]) > 0 for r in rounds)
    assert len(seen) == sum(len(r["requests"]) for r in rounds)
    # Round i replays the plan of seed + i, not the first one again.
    for i, r in enumerate(rounds):
        planned = plan("long-tail", duration_seconds=2, rate=3, seed=i, tokens_per_word=1.5, max_model_len=4096)
        assert [q["target_prompt_tokens"] for q in r["requests"]] == [p.target_prompt_tokens for p in planned]


def test_a_server_that_never_serves_is_an_error_after_the_wait():
    with ThreadedServer(timed_source([], unready_calls=10**6)) as server:
        out = subprocess.run(
            [PYTHON, "-m", "workers", "loadgen", "--url", server.url, "--duration", "1", "--wait", "2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2 and "is not serving" in out.stderr and "503" in out.stderr


def test_refusals_count_as_failures_before_the_first_byte():
    seen: list[dict[str, str]] = []
    with ThreadedServer(timed_source(seen, status=429)) as server:
        result = loadgen(server.url, "--scenario", "burst", "--duration", "1", "--rate", "2", "--burst-period", "1")
    summary = result["summary"]
    assert summary["failed_requests"] == 2 and summary["failed_before_first_byte"] == 2
    assert summary["failed_by_status"] == {"429": 2}
    [reason] = summary["failure_reasons"]  # the two refusals say the same
    assert json.loads(reason)["error"]["type"] == "rate_limit_error", reason
    assert not any(h.get(SESSION_HEADER) for h in seen)  # no --sticky-keys, no header


def test_plans_are_seeded_and_shaped_like_their_scenario():
    a = plan("long-tail", duration_seconds=200, rate=2, seed=7)
    assert a == plan("long-tail", duration_seconds=200, rate=2, seed=7)
    assert a != plan("long-tail", duration_seconds=200, rate=2, seed=8)
    assert 300 < len(a) < 500  # Poisson at 2/s for 200 s
    tokens = sorted(r.target_prompt_tokens for r in a)
    assert tokens[len(tokens) // 2] < 700 and tokens[-1] >= 2000  # a long tail
    assert all(16 <= r.max_tokens <= 256 for r in a)

    bursts = plan("burst", duration_seconds=10, rate=4, burst_period_seconds=5)
    assert sorted({r.start_seconds for r in bursts}) == [0.0, 5.0] and len(bursts) == 40

    chat = plan("chat", duration_seconds=20, rate=2, sticky_keys=3)
    assert {r.session_key for r in chat} <= {"key-0", "key-1", "key-2"} and all(r.endpoint == "chat" for r in chat)


def test_prompts_fit_the_model():
    for r in plan("long-tail", duration_seconds=100, rate=2, max_model_len=1024):
        assert r.target_prompt_tokens + r.max_tokens <= 1024


def test_goodput_counts_requests_within_every_slo():
    slos = parse_slos(["ttft:500", "tpot:50"])

    def rec(ttft, tpot, ok=True):
        return RequestRecord(
            0,
            "completions",
            None,
            200,
            ok,
            ttft_seconds=ttft,
            tpot_seconds=tpot,
            latency_seconds=1.0,
            output_tokens=10,
            prompt_tokens=5,
            itl_seconds=[tpot],
        )

    records = [rec(0.1, 0.01), rec(0.6, 0.01), rec(0.1, 0.2), rec(0.1, 0.01, ok=False)]
    assert [meets_slos(r, slos) for r in records] == [True, False, False, False]
    summary = summarize(records, 2.0, slos)
    assert summary["goodput"] == 0.5 and summary["successful_requests"] == 3
    assert summary["output_throughput"] == 15.0
