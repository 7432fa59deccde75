"""A store that is down answers 503, never 500: the API with a JSON body and
Retry-After, pages with the plain 503 page, heartbeats so the agent backs off.

The outage is real: a web process whose PostgreSQL is a port nobody listens
on, so every query fails to connect exactly as it does when the server is
stopped (tests/faults/ stops and restarts a real one under load)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from django.test import Client

from controlplane import outages
from controlplane.fleet.api import PoolViewSet
from tests.conftest import control_plane_env
from tests.support import PYTHON, free_port, running
from workers.contract import HEARTBEAT_PATH


@pytest.fixture
def web_without_database(tmp_path: Path) -> Any:
    port = free_port()
    env = control_plane_env()
    env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:{free_port()}/gone"
    argv = [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port)]
    with running(argv, env=env, log_path=tmp_path / "web.log") as proc:
        base = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{base}/login/", timeout=60, ok=(200, 503))
        yield base, proc
    outages.forget()  # the sweep tests that follow start from no outage


def test_api_pages_and_heartbeats_answer_503_while_the_database_is_down(web_without_database: Any) -> None:
    base, proc = web_without_database
    outages.forget()
    started = time.time()
    api = httpx.get(f"{base}/api/v1/pools/", headers={"Authorization": "Token some-token"})
    assert api.status_code == 503
    assert api.headers["Content-Type"] == "application/json"
    assert api.json()["unavailable"] == "database"
    assert int(api.headers["Retry-After"]) > 0

    # A signed-in browser: its session lives in the database.
    page = httpx.get(f"{base}/", cookies={"sessionid": "a" * 32}, follow_redirects=True)
    assert page.status_code == 503
    assert page.headers["Content-Type"].startswith("text/html")
    assert "Service unavailable" in page.text and "database" in page.text
    assert "Retry-After" in page.headers

    beat = httpx.post(f"{base}{HEARTBEAT_PATH}", json={}, headers={"Authorization": "Bearer cpw_x"})
    assert beat.status_code == 503
    assert beat.json()["unavailable"] == "database"

    log = proc.output()
    assert "Traceback" not in log and "_session_cache" not in log, log[-3000:]
    # The control plane recorded when it last failed to reach its database.
    failed_at = outages.last_database_failure()
    assert failed_at is not None and failed_at >= started


def test_an_outage_outside_any_view_is_a_503_too(rf: Any) -> None:
    """``handler500`` is called inside Django's ``except``: the backstop for
    a middleware's own query (the session saved on the way out)."""
    from django.db import OperationalError

    request = rf.get("/api/v1/pools/")
    try:
        raise OperationalError("connection refused")
    except OperationalError:
        response = outages.server_error(request)
    assert (response.status_code, response["Retry-After"]) == (503, str(outages.RETRY_AFTER_SECONDS))
    try:
        raise ZeroDivisionError
    except ZeroDivisionError:
        assert outages.server_error(rf.get("/")).status_code == 500


@pytest.mark.parametrize(
    ("error", "store"),
    [
        ("django.db.OperationalError", "database"),
        ("django.db.InterfaceError", "database"),
        ("django.db.IntegrityError", None),
        ("redis.ConnectionError", "redis"),
        ("redis.TimeoutError", "redis"),
        ("redis.ResponseError", None),
        ("kombu.exceptions.OperationalError", "redis"),
        ("builtins.ValueError", None),
    ],
)
def test_which_errors_are_outages(error: str, store: str | None) -> None:
    import importlib

    module, _, name = error.rpartition(".")
    assert outages.store_down(getattr(importlib.import_module(module), name)("x")) == store


@pytest.mark.parametrize(
    ("cause", "store"),
    [
        ("OperationalError", "database"),  # connection refused: no SQLSTATE
        ("AdminShutdown", "database"),  # 57P01: the server is stopping
        ("CannotConnectNow", "database"),  # 57P03: still starting up
        ("ConnectionFailure", "database"),  # 08006
        ("DeadlockDetected", None),  # an answer, not an outage
        ("QueryCanceled", None),  # a statement timeout
    ],
)
def test_a_database_error_is_an_outage_only_when_the_server_did_not_answer(cause: str, store: str | None) -> None:
    import psycopg
    from django.db import OperationalError

    # As Django raises it: its own class, psycopg's error as the cause.
    wrapped = OperationalError("x")
    wrapped.__cause__ = (getattr(psycopg.errors, cause, None) or getattr(psycopg, cause))("x")
    assert outages.store_down(wrapped) == store


@pytest.mark.django_db
def test_an_unexpected_error_under_api_is_a_json_500_and_a_page_keeps_the_html_one(operator: Any) -> None:
    """The backstop for a bug: an API client still gets JSON it can parse.
    The fault is injected by patching one view (nothing real fails on demand)."""
    client = Client(raise_request_exception=False)
    client.force_login(operator)
    with mock.patch.object(PoolViewSet, "list", autospec=True, side_effect=RuntimeError("a bug")):
        api = client.get("/api/v1/pools/")
    assert api.status_code == 500
    assert api["Content-Type"].startswith("application/json")
    assert "internal server error" in api.json()["detail"]
    with mock.patch("dashboards.fleet.views.render", autospec=True, side_effect=RuntimeError("a bug")):
        page = client.get("/")
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")
