"""The gateway as it runs: ``manage.py rungateway`` processes in front of
real worker processes, on the test PostgreSQL and Redis.

The workers here are synthetic (``controlplane.bench.synthetic``): real
HTTP servers that stream OpenAI chunks on a fixed clock, so that tests about
routing and failover do not wait on an engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Worker
from controlplane.gateway.inflight import STATUS_STREAM_BROKEN
from controlplane.gateway.models import ClientKey, RequestLog, RoutingTable
from tests.controlplane.factories import api_client, heartbeat_request, make_profile, make_user
from tests.controlplane.gateway.factories import routed_model
from tests.support import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def user_key(transactional_db: Any) -> str:
    return ClientKey.issue("app")[1]


@pytest.fixture
def admin_key(transactional_db: Any) -> str:
    return ClientKey.issue("ops", is_admin=True)[1]


def complete(
    base: str,
    key: str | None,
    *,
    session: str | None = None,
    user: str | None = None,
    headers: dict[str, str] | None = None,
    stream: bool = False,
    max_tokens: int = 2,
    model: str = "tiny",
) -> httpx.Response:
    h = dict(headers or {})
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    if session is not None:
        h["x-chunkpilot-session"] = session
    body: dict[str, Any] = {"model": model, "prompt": "hello there", "max_tokens": max_tokens, "stream": stream}
    if user is not None:
        body["user"] = user
    return httpx.post(f"{base}/v1/completions", json=body, headers=h, timeout=30)


def cohorts_of(base: str, key: str, sessions: list[str], *, concurrency: int = 16) -> dict[str, str]:
    """The cohort the gateway gives each session (its x-chunkpilot-cohort
    reply header). Threads with http.client: a light client, so that the
    gateway, not the test, sets the pace."""
    port = int(base.rsplit(":", 1)[1])
    local = threading.local()

    def one(session: str) -> tuple[str, str]:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}),
            headers={
                "authorization": f"Bearer {key}",
                "x-chunkpilot-session": session,
                "content-type": "application/json",
            },
        )
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200, body
        return session, response.getheader("x-chunkpilot-cohort") or ""

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, sessions))


def operator_client() -> APIClient:
    return api_client(make_user(Role.OPERATOR))


# ---- keys ------------------------------------------------------------------------
def test_requests_without_a_valid_key_are_refused_with_401(start_gateway, start_worker, user_key) -> None:
    with start_worker("w") as (url, _):
        routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            for headers in ({}, {"authorization": "Bearer cpk_not-a-key"}, {"authorization": f"Basic {user_key}"}):
                r = complete(gw.url, None, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert httpx.get(f"{gw.url}/v1/models", timeout=5).status_code == 401
            assert complete(gw.url, user_key).status_code == 200
            models = httpx.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {user_key}"}, timeout=5)
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]
            # The context length clients size prompts by: what the workers reported.
            reported = Worker.objects.get(url=url).max_model_len
            assert reported > 0 and models.json()["data"][0]["max_model_len"] == reported
            # A revoked key stops working as soon as the gateway hears of it.
            ClientKey.objects.update(active=False)
            ClientKey.objects.get().announce()  # outside a transaction: published at once
            wait_until(lambda: complete(gw.url, user_key).status_code == 401, timeout=5)
        assert not RequestLog.objects.filter(status=401).exists()  # no key, no row


# ---- streams ---------------------------------------------------------------------------
def test_streams_arrive_intact_through_the_openai_client(start_gateway, start_worker, user_key) -> None:
    with start_worker("w", itl_ms=2) as (url, _):
        routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            direct = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            via = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=user_key, max_retries=0)
            for client_kind in ("completions", "chat"):
                results = []
                for client in (direct, via):
                    if client_kind == "chat":
                        stream = client.chat.completions.create(
                            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
                        )
                        chunks = list(stream)
                        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    else:
                        stream = client.completions.create(model="tiny", prompt="hi", max_tokens=12, stream=True)
                        chunks = list(stream)
                        text = "".join(c.choices[0].text for c in chunks if c.choices)
                    results.append((text, len(chunks), [c.usage for c in chunks]))
                assert results[0] == results[1]
                assert results[1][2] == [None] * results[1][1]  # usage asked by the gateway never reaches the client
            # Usage the client asks for arrives, once, last.
            chunks = list(
                via.completions.create(
                    model="tiny", prompt="hi", max_tokens=5, stream=True, stream_options={"include_usage": True}
                )
            )
            assert chunks[-1].usage.completion_tokens == 5 and all(c.usage is None for c in chunks[:-1])
            done = via.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert done.choices[0].message.content == " w-0 w-1 w-2 w-3"
            # Each request is one log row, with what the client saw.
            rows = wait_until(
                lambda: list(RequestLog.objects.order_by("created_at")) if RequestLog.objects.count() == 4 else None
            )
        stream_row, plain_row = rows[0], rows[3]
        worker = Worker.objects.get()
        assert (stream_row.cohort, stream_row.pool_id, stream_row.worker_id) == ("stable", worker.pool_id, worker.pk)
        assert stream_row.stream and stream_row.status == 200 and stream_row.error == ""
        assert (stream_row.prompt_tokens, stream_row.cached_tokens, stream_row.output_tokens) == (1, 0, 12)
        assert 0.004 < stream_row.ttft_seconds < stream_row.e2e_seconds
        assert 0 < stream_row.tpot_seconds <= stream_row.max_gap_seconds < 1
        assert stream_row.api_key_id == ClientKey.objects.get().pk
        assert not plain_row.stream and plain_row.output_tokens == 4 and plain_row.ttft_seconds is None


def test_a_stream_is_passed_through_event_by_event_not_buffered(start_gateway, start_worker, user_key) -> None:
    """Tokens 0.4 s apart: the client has the first event while the worker
    is still streaming the rest."""
    with start_worker("slow", ttft_ms=5, itl_ms=400) as (url, _):
        routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            assert complete(gw.url, user_key).status_code == 200  # connections warm
            started = time.monotonic()
            with httpx.stream(
                "POST",
                f"{gw.url}/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": "hi", "max_tokens": 6, "stream": True},
                headers={"authorization": f"Bearer {user_key}"},
            ) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                first = next(chunks)
                first_at = time.monotonic() - started
                in_flight = httpx.get(f"{url}/stats", timeout=5).json()["in_flight"]
                rest = b"".join(chunks)
            finished_at = time.monotonic() - started
    assert first.startswith(b"data: ") and b" slow-0" in first and b" slow-1" not in first
    assert in_flight == 1  # the worker had not finished the stream
    assert first_at < 1.0 and finished_at > 1.9  # five gaps of 0.4 s came after the first event
    assert b" slow-5" in rest and rest.endswith(b"data: [DONE]\n\n")


def test_a_client_that_leaves_mid_stream_is_logged_as_gone_and_the_gateway_serves_on(
    start_gateway, start_worker, user_key
) -> None:
    with start_worker("slow", ttft_ms=5, itl_ms=200) as (url, _):
        routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            with httpx.stream(
                "POST",
                f"{gw.url}/v1/completions",
                timeout=30,
                json={"model": "tiny", "prompt": "hi", "max_tokens": 50, "stream": True},
                headers={"authorization": f"Bearer {user_key}"},
            ) as r:
                assert r.status_code == 200
                assert next(r.iter_raw()).startswith(b"data: ")
            # The block closed the connection ten seconds before the stream's end.
            row = wait_until(lambda: RequestLog.objects.filter(status=499).first())
            assert row.error == "the client went away mid-stream" and row.ttft_seconds is not None
            assert row.e2e_seconds < 5
            assert complete(gw.url, user_key, stream=True).status_code == 200


# ---- cohorts ---------------------------------------------------------------------------
def test_the_same_key_gets_the_same_cohort_across_two_gateways_and_a_restart(
    start_gateway, start_worker, user_key
) -> None:
    sessions = [f"conversation-{i}" for i in range(300)]
    with start_worker("stable") as (stable_url, _), start_worker("canary") as (canary_url, _):
        routed_model(canary_bp=3000, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as a, start_gateway() as b:
            seen_a = cohorts_of(a.url, user_key, sessions)
            seen_b = cohorts_of(b.url, user_key, sessions)
            port = a.port
        assert seen_a == seen_b
        assert 0.2 < list(seen_a.values()).count("canary") / len(sessions) < 0.4
        with start_gateway(port=port) as restarted:
            assert cohorts_of(restarted.url, user_key, sessions) == seen_a
        # The body's `user` is the sticky key when no session is given.
        with start_gateway() as c:
            by_user = {u: complete(c.url, user_key, user=u).headers["x-chunkpilot-cohort"] for u in sessions[:40]}
            assert by_user == {s: seen_a[s] for s in sessions[:40]}


def test_split_accuracy_twenty_percent_of_5000_keys_through_the_gateway(start_gateway, start_worker, user_key) -> None:
    with start_worker("stable", ttft_ms=0) as (stable_url, _), start_worker("canary", ttft_ms=0) as (canary_url, _):
        routed_model(canary_bp=2000, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as gw:
            seen = cohorts_of(gw.url, user_key, [f"user-{i}" for i in range(5000)])
    share = list(seen.values()).count("canary") / 5000
    assert 0.18 <= share <= 0.22, share


def test_raising_the_canary_weight_never_moves_a_canary_key_back(start_gateway, start_worker, user_key) -> None:
    sessions = [f"s{i}" for i in range(400)]
    api = operator_client()
    with start_worker("stable") as (stable_url, _), start_worker("canary") as (canary_url, _):
        table, _, _ = routed_model(canary_bp=1000, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as gw:
            before = cohorts_of(gw.url, user_key, sessions)
            for canary_bp in (2500, 5000):
                r = api.patch(
                    "/api/v1/routing/tiny/",
                    {"weights": {"canary": canary_bp, "stable": 10000 - canary_bp}},
                    format="json",
                )
                assert r.status_code == 200, r.content
                assert table.wait_for_acks(r.json()["epoch"], timeout_seconds=5).complete
                after = cohorts_of(gw.url, user_key, sessions)
                assert [s for s in sessions if before[s] == "canary" and after[s] != "canary"] == []
                assert list(after.values()).count("canary") > list(before.values()).count("canary")
                before = after


def test_an_admin_key_may_force_a_cohort_and_a_client_key_may_not(
    start_gateway, start_worker, user_key, admin_key
) -> None:
    with start_worker("stable") as (stable_url, _), start_worker("canary") as (canary_url, _):
        routed_model(canary_bp=0, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as gw:
            forced = complete(gw.url, admin_key, headers={"x-chunkpilot-cohort": "canary"})
            assert forced.status_code == 200
            assert (forced.headers["x-chunkpilot-cohort"], forced.headers["x-chunkpilot-worker"]) == (
                "canary",
                "tiny-canary-0",
            )
            assert " canary-0" in forced.json()["choices"][0]["text"]
            refused = complete(gw.url, user_key, headers={"x-chunkpilot-cohort": "canary"})
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "cohort_override_forbidden"
            bad = complete(gw.url, admin_key, headers={"x-chunkpilot-cohort": "blue"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cohort"
            assert "x-chunkpilot-worker" not in complete(gw.url, user_key).headers


# ---- epochs and acks ----------------------------------------------------------------------------
def test_every_gateways_ack_is_visible_after_a_weight_change(start_gateway, start_worker, user_key) -> None:
    api = operator_client()
    with start_worker("stable") as (stable_url, _), start_worker("canary") as (canary_url, _):
        table, _, _ = routed_model(canary_bp=0, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as a, start_gateway() as b:
            listed = wait_until(
                lambda: len(api.get("/api/v1/gateways/").json()) == 2 and api.get("/api/v1/gateways/").json()
            )
            assert {g["address"] for g in listed} == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
            started = time.monotonic()
            r = api.patch("/api/v1/routing/tiny/", {"weights": {"canary": 1000, "stable": 9000}}, format="json")
            epoch = r.json()["epoch"]
            acks = api.get(f"/api/v1/routing/tiny/acks/?epoch={epoch}&wait=5").json()
            elapsed = time.monotonic() - started
            assert acks["complete"] is True and acks["epoch"] == epoch
            assert [(g["acked_epoch"], g["current"]) for g in acks["gateways"]] == [(epoch, True), (epoch, True)]
            assert elapsed < 2.0
            assert {g["address"]: g["epochs"] for g in api.get("/api/v1/gateways/").json()} == {
                f"127.0.0.1:{a.port}": {"tiny": epoch},
                f"127.0.0.1:{b.port}": {"tiny": epoch},
            }
            assert api.get("/api/v1/routing/tiny/").json()["acks"]["complete"] is True
            assert a.health()["models"] == {"tiny": epoch}
            # A later epoch nobody has applied yet is pending on both.
            pending = api.get(f"/api/v1/routing/tiny/acks/?epoch={epoch + 1}").json()
            assert pending["complete"] is False and len(pending["gateways"]) == 2
        # Stopped gateways withdraw: nothing is left to wait for.
        assert table.wait_for_acks(epoch + 1, timeout_seconds=3).complete
        assert api.get("/api/v1/gateways/").json() == []


# ---- the request log ------------------------------------------------------------------------------
def test_the_request_log_names_the_revision_the_worker_was_running(start_gateway, start_worker, user_key) -> None:
    """Not the pool's desired revision: what the worker last reported running."""
    first = make_profile("served")
    second = first.profile.add_revision({"max_num_batched_tokens": 256}, comment="next")
    with start_worker("w") as (url, _):
        _, pools, workers = routed_model(urls={"stable": [url]})
        worker = workers["stable"][0]
        pools["stable"].set_desired_revision(second)
        worker.record_heartbeat(heartbeat_request("ready", first.pk))
        with start_gateway() as gw:
            assert complete(gw.url, user_key, stream=True).status_code == 200
            row = wait_until(lambda: RequestLog.objects.first())
            assert (row.worker_id, row.profile_revision_id) == (worker.pk, first.pk)
            # The worker switches: later requests are logged with what it runs now.
            worker.record_heartbeat(heartbeat_request("ready", second.pk))
            wait_until(
                lambda: (
                    complete(gw.url, user_key).status_code == 200
                    and RequestLog.objects.filter(profile_revision=second).exists()
                ),
                timeout=10,
            )
    assert set(RequestLog.objects.values_list("profile_revision_id", flat=True)) == {first.pk, second.pk}


# ---- failures ------------------------------------------------------------------------------------
def test_no_routable_worker_means_503_with_openai_error_json(start_gateway, start_worker, user_key) -> None:
    with start_worker("w") as (url, _):
        _, _, workers = routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            assert complete(gw.url, user_key).status_code == 200
            worker = workers["stable"][0]
            worker.set_flags(cordoned=True)  # the fleet's event reaches the gateway, or its poll does
            r = wait_until(lambda: (resp := complete(gw.url, user_key)).status_code == 503 and resp, timeout=5)
            error = r.json()["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "no_worker_available"
            assert "tiny-stable" in error["message"] and r.headers["retry-after"] == "1"
    # Now the worker is back in the pool but its process is gone: 503 too.
    Worker.objects.update(cordoned=False)
    with start_gateway() as gw:
        r = complete(gw.url, user_key, stream=True)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"
        rows = wait_until(
            lambda: (
                list(RequestLog.objects.filter(status=503))
                if RequestLog.objects.filter(status=503).count() >= 2
                else None
            )
        )
        assert all(row.cohort == "stable" and row.worker_id is None for row in rows)


def test_a_worker_that_answers_busy_is_passed_over_before_the_first_byte(start_gateway, start_worker, user_key) -> None:
    with start_worker("busy", status=503) as (busy_url, _), start_worker("ok") as (ok_url, _):
        routed_model(urls={"stable": [busy_url, ok_url]})
        with start_gateway() as gw:
            for _ in range(10):
                r = complete(gw.url, user_key, stream=True)
                assert r.status_code == 200 and " ok-0" in r.text
            metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
            assert (
                'chunkpilot:gateway_upstream_errors_total{kind="status",pool="tiny-stable",worker="tiny-stable-0"}'
                in metrics
            )


def test_a_worker_killed_mid_run_gets_no_new_requests(start_gateway, start_worker, user_key) -> None:
    """Streams run at a steady rate over two workers; one is SIGKILLed. Its
    streams in flight break (the client had their first bytes), and every
    request that arrives after the kill is served by the other worker."""
    with start_worker("a", itl_ms=10) as (a_url, a_proc), start_worker("b", itl_ms=10) as (b_url, _):
        _, _, workers = routed_model(urls={"stable": [a_url, b_url]})
        killed_id = workers["stable"][0].pk
        with start_gateway() as gw:
            kill_at: list[float] = []
            outcomes: list[tuple[float, int, str]] = []  # (start, status, error)

            async def drive() -> None:
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:

                    async def one(i: int) -> None:
                        started = time.time()
                        try:
                            async with client.stream(
                                "POST",
                                "/v1/completions",
                                json={"model": "tiny", "prompt": "x", "max_tokens": 20, "stream": True},
                                headers={"authorization": f"Bearer {user_key}", "x-chunkpilot-session": str(i)},
                            ) as r:
                                body = b"".join([chunk async for chunk in r.aiter_raw()])
                                ok = r.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
                                outcomes.append((started, r.status_code, "" if ok else body[-200:].decode()))
                        except httpx.HTTPError as exc:
                            outcomes.append((started, 0, repr(exc)))

                    tasks = []
                    for i in range(160):
                        if i == 60:
                            a_proc.kill(signal.SIGKILL)
                            kill_at.append(time.time())
                        tasks.append(asyncio.ensure_future(one(i)))
                        await asyncio.sleep(0.02)
                    await asyncio.gather(*tasks)

            asyncio.run(drive())
            after_kill = [o for o in outcomes if o[0] > kill_at[0]]
            assert len(after_kill) >= 90
            assert [o for o in after_kill if o[1] != 200 or o[2]] == []
            wait_until(lambda: RequestLog.objects.count() == 160, timeout=10)
        late_rows = RequestLog.objects.filter(created_at__gt=_aware(kill_at[0]))
        assert late_rows.count() == len(after_kill)
        assert set(late_rows.values_list("worker_id", "status", "error")) == {(workers["stable"][1].pk, 200, "")}
        early = RequestLog.objects.filter(created_at__lt=_aware(kill_at[0]), worker_id=killed_id)
        assert early.exists()  # it did serve before the kill
        # Its streams in flight at the kill broke: logged as failed, the client told so in-stream.
        broken = [o for o in outcomes if o[0] < kill_at[0] and o[2]]
        assert all("upstream_broken" in o[2] for o in broken)
        assert early.exclude(error="").count() == len(broken)
        assert all("broke off" in e for e in early.exclude(error="").values_list("error", flat=True))
        assert set(early.exclude(error="").values_list("status", flat=True)) <= {STATUS_STREAM_BROKEN}
        assert early.filter(status=STATUS_STREAM_BROKEN).count() == len(broken)


def _aware(unix: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(unix, tz=UTC)


def test_gateway_metrics_count_requests_and_time_them_per_cohort(
    start_gateway, start_worker, user_key, admin_key
) -> None:
    with start_worker("stable") as (stable_url, _), start_worker("canary") as (canary_url, _):
        routed_model(canary_bp=0, urls={"stable": [stable_url], "canary": [canary_url]})
        with start_gateway() as gw:
            for _ in range(3):
                assert complete(gw.url, user_key, stream=True).status_code == 200
            assert (
                complete(gw.url, admin_key, stream=True, headers={"x-chunkpilot-cohort": "canary"}).status_code == 200
            )
            text = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'chunkpilot:gateway_requests_total{cohort="stable",model="tiny",status="200"} 3.0' in text
    assert 'chunkpilot:gateway_time_to_first_token_seconds_count{cohort="canary",model="tiny"} 1.0' in text
    assert 'chunkpilot:gateway_request_max_gap_seconds_bucket{cohort="stable",le="+Inf",model="tiny"} 3.0' in text
    assert 'chunkpilot:gateway_routing_epoch{model="tiny"}' in text


def test_routing_table_changes_reach_a_running_gateway(start_gateway, start_worker, user_key) -> None:
    """A table made while the gateway runs, then deleted."""
    with start_worker("w") as (url, _):
        with start_gateway() as gw:
            assert complete(gw.url, user_key).status_code == 404  # no table: model_not_found
            table, _, _ = routed_model(urls={"stable": [url]})
            assert table.wait_for_acks(timeout_seconds=5).complete
            assert complete(gw.url, user_key).status_code == 200
            table.delete_audited(actor="test")
            wait_until(lambda: complete(gw.url, user_key).status_code == 404, timeout=5)
            assert json.loads(complete(gw.url, user_key).text)["error"]["code"] == "model_not_found"
    assert RoutingTable.objects.count() == 0


# ---- hardening: caps and timeouts -------------------------------------------------------------------
def test_output_caps_set_in_the_control_plane_reach_a_running_gateway(start_gateway, start_worker, user_key) -> None:
    """A chat request with no max_tokens generated 4,083 tokens: now a route
    (and a key) can cap it. Over the cap is a 400; no limit asked gets the cap."""
    with start_worker("w") as (url, _):
        table, _, _ = routed_model(urls={"stable": [url]})
        with start_gateway() as gw:
            headers = {"authorization": f"Bearer {user_key}"}

            def chat(**extra: Any) -> httpx.Response:
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
                return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30)

            assert complete(gw.url, user_key, max_tokens=40).status_code == 200  # no cap: as before
            assert chat().json()["usage"]["completion_tokens"] == 16  # the worker's own default
            epoch = table.set_output_cap(5, actor="test")
            assert table.wait_for_acks(epoch, timeout_seconds=5).complete
            over = complete(gw.url, user_key, max_tokens=40)
            assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
            assert chat().json()["usage"]["completion_tokens"] == 5
            card = httpx.get(f"{gw.url}/v1/models/tiny", headers=headers, timeout=5).json()
            assert card["id"] == "tiny" and card["max_output_tokens"] == 5
            # The key's own cap, when tighter, holds.
            key = ClientKey.objects.get()
            ClientKey.objects.filter(pk=key.pk).update(max_output_tokens=3)
            key.announce()
            wait_until(lambda: complete(gw.url, user_key, max_tokens=4).status_code == 400, timeout=5)
            assert chat().json()["usage"]["completion_tokens"] == 3
    rows = RequestLog.objects.filter(status=400)
    assert rows.count() >= 2 and all("limit" in row.error for row in rows)


def test_the_gateways_read_and_client_body_timeouts_are_its_tunables(start_gateway, start_worker, user_key) -> None:
    """A worker that takes a request and says nothing (a hung engine) gets a
    504 after GATEWAY_READ_TIMEOUT_SECONDS; a client that declares a body and
    sends none a 408 after GATEWAY_CLIENT_BODY_TIMEOUT_SECONDS."""
    with start_worker("hung", ttft_ms=20_000) as (url, _):
        routed_model(urls={"stable": [url]})
        with start_gateway(GATEWAY_READ_TIMEOUT_SECONDS="1", GATEWAY_CLIENT_BODY_TIMEOUT_SECONDS="0.5") as gw:
            for stream in (False, True):
                r = complete(gw.url, user_key, stream=stream)
                assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
            conn.putrequest("POST", "/v1/completions")
            conn.putheader("authorization", f"Bearer {user_key}")
            conn.putheader("content-length", "100")
            conn.endheaders(b'{"model": "tiny"')  # 16 of the 100 bytes it declared
            response = conn.getresponse()
            assert response.status == 408 and b"did not arrive in full" in response.read()
    rows = wait_until(lambda: list(RequestLog.objects.filter(status=504)) if RequestLog.objects.count() >= 2 else None)
    assert all(row.worker_id is not None and "did not answer in time" in row.error for row in rows)
