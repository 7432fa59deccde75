"""The project as a whole: its OpenAPI document, and the embedded default
(no environment at all) booting for real."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from controlplane import embedded
from tests.support import PYTHON, ROOT, free_port, running, wait_until


@pytest.mark.django_db
def test_the_openapi_document_validates() -> None:
    response = APIClient().get("/api/schema/")
    assert response.status_code == 200
    document = yaml.safe_load(response.content)
    validate(document)
    assert "/api/v1/agent/heartbeat/" in document["paths"]
    assert {"tokenAuth", "workerSecret"} <= set(document["components"]["securitySchemes"])


@pytest.mark.django_db
def test_the_api_docs_page_is_served(client) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.slow
def test_the_embedded_default_boots_and_answers(tmp_path: Path) -> None:
    """SQLite and the embedded Redis, nothing configured: migrate, make a
    token, start the ASGI server, and read and write through the API."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "CHUNKPILOT_TEST_DB", "CELERY_QUEUE", "CHANNELS_PREFIX")
    }
    env.update(CHUNKPILOT_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")

    def manage(*args: str) -> str:
        done = subprocess.run(
            [PYTHON, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        manage("migrate", "--noinput", "-v", "0")
        token = manage("createapitoken", "admin", "--create", "--role", "admin").strip()
        assert (tmp_path / "chunkpilot.sqlite3").exists()
        assert not embedded._answers_ping(embedded.socket_path(tmp_path)), "commands that need no Redis start none"
        port = free_port()
        argv = [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port)]
        with running(argv, env=env, log_path=tmp_path / "web.log") as web:
            base = f"http://127.0.0.1:{port}"
            web.wait_http(f"{base}/login/", timeout=60)
            headers = {"Authorization": f"Token {token}"}
            created = httpx.post(f"{base}/api/v1/pools/", json={"name": "embedded"}, headers=headers)
            assert created.status_code == 201, created.text
            listed = httpx.get(f"{base}/api/v1/pools/", headers=headers).json()
            assert [p["name"] for p in listed["results"]] == ["embedded"]
            assert httpx.get(f"{base}/api/v1/pools/").status_code == 401
            assert embedded._answers_ping(embedded.socket_path(tmp_path))
            assert embedded.holders(tmp_path) == [web.popen.pid]
        # uvicorn dies by the SIGTERM it re-raises, running no exit hook: the reaper stops the server.
        wait_until(lambda: not embedded._answers_ping(embedded.socket_path(tmp_path)), timeout=30)
    finally:
        embedded.stop(tmp_path)


def embedded_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CHUNKPILOT_TEST_DB")}
    env.update(CHUNKPILOT_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    return env


def test_a_command_that_needs_no_redis_leaves_no_embedded_redis_server(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "manage.py", "createapitoken", "--help"],
        cwd=ROOT,
        env=embedded_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert not embedded.socket_path(tmp_path).exists() and embedded.pid(tmp_path) is None
    assert not (tmp_path / "redis.log").exists()


LEASE = (
    "import sys, time; from pathlib import Path; from controlplane import embedded; "
    "embedded.lease(Path(sys.argv[1])); print('leased', flush=True); sys.stdin.read()"
)


def test_the_embedded_server_stops_when_the_last_process_holding_it_exits(tmp_path: Path) -> None:
    """Each process that uses it leases it; one exiting leaves it to the
    other, the last exiting stops it; a lease of a killed process is pruned."""

    def holder() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [PYTHON, "-c", LEASE, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "leased"
        return proc

    path = embedded.socket_path(tmp_path)
    first, second, killed = holder(), holder(), holder()
    try:
        assert embedded.holders(tmp_path) == sorted([first.pid, second.pid, killed.pid])
        killed.kill()
        killed.wait()
        first.communicate("", timeout=60)  # EOF: it exits and gives its lease back
        assert embedded._answers_ping(path), "the second still holds it"
        second.communicate("", timeout=60)
        assert not embedded._answers_ping(path), "the last holder stopped it"
        assert embedded.holders(tmp_path) == []
    finally:
        for proc in (first, second, killed):
            if proc.poll() is None:
                proc.kill()
        embedded.stop(tmp_path)


def test_a_server_that_lives_but_does_not_answer_is_waited_for_never_doubled_and_stop_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under heavy load the ping timed out, the socket was unlinked and a second
    redis-server started on it while the first ran on. A live server (here
    frozen with SIGSTOP) is now waited for, and ``stop`` ends it by its pid."""
    monkeypatch.setattr(embedded, "START_TIMEOUT_SECONDS", 1.0)
    embedded.ensure_running(tmp_path)
    first = embedded.pid(tmp_path)
    assert first is not None
    try:
        os.kill(first, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match="not starting a second"):
            embedded.ensure_running(tmp_path)
        assert embedded.pid(tmp_path) == first and embedded.socket_path(tmp_path).exists()
        os.kill(first, signal.SIGCONT)
        embedded.ensure_running(tmp_path)
        assert embedded.pid(tmp_path) == first, "the same server, found again"
        os.kill(first, signal.SIGSTOP)
        assert embedded.stop(tmp_path), "stopped although it did not answer"
        wait_until(lambda: not os.path.exists(f"/proc/{first}") or _zombie(first), timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGCONT)
        embedded.stop(tmp_path)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
