"""The project as a whole: its OpenAPI document, and the embedded default
(no environment at all) booting for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from controlplane import embedded
from tests.support import PYTHON, ROOT, free_port, running


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
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CHUNKPILOT_TEST_DB", "CELERY_QUEUE", "CHANNELS_PREFIX")}
    env.update(CHUNKPILOT_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")

    def manage(*args: str) -> str:
        done = subprocess.run([PYTHON, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        manage("migrate", "--noinput", "-v", "0")
        token = manage("createapitoken", "admin", "--create", "--role", "admin").strip()
        assert (tmp_path / "chunkpilot.sqlite3").exists()
        assert embedded.socket_path(tmp_path).exists()
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
    finally:
        embedded.stop(tmp_path)
