"""Fixtures every suite shares: the real services, a real Celery worker, the
tiny model, a headless Chromium.

Tests run on PostgreSQL and Redis (``make test`` sets DATABASE_URL and
REDIS_URL). A missing service fails the run at the start: these tests never
skip for want of a service, in CI or out of it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.support import PYTHON, ROOT, Process, child_env, free_port, running

TINY_MODEL_DIR = Path(os.environ.get("CHUNKPILOT_TINY_MODEL", ROOT / "var" / "tiny-model"))
# One id per pytest process: its Celery queue and channel-layer prefix, so that
# two test runs against one Redis never take each other's messages.
RUN_ID = uuid.uuid4().hex[:8]


def _check_services() -> list[str]:
    problems = []
    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        problems.append(f"DATABASE_URL must name PostgreSQL for the test suite (got {db_url!r}); run `make test`.")
    else:
        import psycopg

        try:
            psycopg.connect(db_url.replace("postgres://", "postgresql://", 1), connect_timeout=3).close()
        except psycopg.Error as exc:
            problems.append(f"PostgreSQL at {db_url} is not reachable: {exc}")
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        problems.append("REDIS_URL must be set for the test suite; run `make test`.")
    else:
        import redis

        try:
            redis.Redis.from_url(redis_url, socket_connect_timeout=3).ping()
        except redis.RedisError as exc:
            problems.append(f"Redis at {redis_url} is not reachable: {exc}")
    return problems


def pytest_configure(config: pytest.Config) -> None:
    problems = _check_services()
    if problems:
        raise pytest.UsageError("services missing:\n  " + "\n  ".join(problems))
    from django.conf import settings

    from controlplane.celery import app

    queue = f"chunkpilot-test-{RUN_ID}"
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    app.conf.task_default_queue = queue
    settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = f"chunkpilot-test-{RUN_ID}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Browser tests run last. Playwright's sync API keeps an event loop running
    in the main thread while the session's browser is open; ``async_to_sync``
    and ``asyncio.run`` refuse to run beside it, so a plain test scheduled
    after a browser test would fail for a reason that is not its own."""
    uses_browser = [item for item in items if {"browser", "page"} & set(getattr(item, "fixturenames", ()))]
    if uses_browser:
        ids = {id(item) for item in uses_browser}
        items[:] = [item for item in items if id(item) not in ids] + uses_browser


def test_database_url() -> str:
    """The URL of the database the tests run on (pytest-django's test_* copy)."""
    from django.db import connection

    s = connection.settings_dict
    user = quote(s.get("USER") or "")
    password = f":{quote(s['PASSWORD'])}" if s.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    return f"postgres://{auth}{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


def control_plane_env(**overrides: str) -> dict[str, str]:
    """Environment for a control-plane child process (Celery, web, gateway)
    that must see the test database and this run's queue and prefix."""
    from django.conf import settings

    return child_env(
        DATABASE_URL=test_database_url(),
        REDIS_URL=os.environ["REDIS_URL"],
        CELERY_QUEUE=settings.CELERY_TASK_DEFAULT_QUEUE,
        CHANNELS_PREFIX=settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"],
        CHUNKPILOT_DATA_DIR=str(ROOT / "var"),
        **overrides,
    )


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """pytest-django's test database, with one more step before it is dropped:
    threads that touched it (sync_to_async workers, scenario threads) keep their
    connections until the process exits, and PostgreSQL refuses to drop a
    database in use. End those sessions first."""
    yield
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture
def web(tmp_path: Path, transactional_db: Any) -> Iterator[str]:
    """The control plane's ASGI app served by uvicorn in its own process, on
    the test database (committed data only); yields its base URL."""
    port = free_port()
    argv = [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port)]
    with running(argv, env=control_plane_env(), log_path=tmp_path / "web.log") as proc:
        base = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{base}/login/", timeout=60)
        yield base


@pytest.fixture
def celery_worker(transactional_db: Any, tmp_path: Path) -> Iterator[Process]:
    """A real Celery worker process on this run's queue and the test database.

    Tests that use it see committed data only (transactional_db).
    """
    from django.conf import settings

    argv = [
        PYTHON,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "worker",
        "--pool",
        "solo",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "-Q",
        settings.CELERY_TASK_DEFAULT_QUEUE,
        "-n",
        f"test-{RUN_ID}-{uuid.uuid4().hex[:4]}@%h",
    ]
    with running(argv, env=control_plane_env(), log_path=tmp_path / "celery.log") as proc:
        proc.wait_for_output("ready.", timeout=60)
        yield proc


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The project's own tiny checkpoint, built once (instant when present)."""
    subprocess.run([PYTHON, "-m", "workers", "make-tiny-model", str(TINY_MODEL_DIR)], check=True, cwd=ROOT)
    return TINY_MODEL_DIR


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Debian's Chromium, driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the ORM calls
    # that tests make beside it are still plain synchronous code.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: apt-get install chromium chromium-driver (make test does)")
    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    yield pg
    context.close()


def _signed_in(role_name: str) -> Any:
    # Imported here: the models load once pytest-django has set Django up.
    from django.test import Client

    from controlplane.accounts.roles import Role
    from tests.controlplane.factories import make_user

    client = Client()
    client.force_login(make_user(Role[role_name]))
    return client


@pytest.fixture
def viewer_client(db: Any) -> Any:
    """Django's test client, signed in as a viewer (the web UI's tests)."""
    return _signed_in("VIEWER")


@pytest.fixture
def operator_client(db: Any) -> Any:
    """Django's test client, signed in as an operator."""
    return _signed_in("OPERATOR")
