"""``manage.py demo`` for real, on the embedded default: it comes up, the
admin can log in, its four workers (one a lab worker) register and reach their pools'
revisions, and Ctrl-C leaves no process and no Redis behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane import embedded
from tests.support import PYTHON, Process, free_port, wait_until

pytestmark = pytest.mark.slow


def processes_using(data_dir: Path) -> list[int]:
    """Live processes started for this data dir (by their environment)."""
    needle = f"CHUNKPILOT_DATA_DIR={data_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def log_in(base: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=base, follow_redirects=False)
    client.get("/login/")
    response = client.post(
        "/login/",
        data={"username": "admin", "password": password, "csrfmiddlewaretoken": client.cookies["csrftoken"]},
        headers={"Referer": f"{base}/login/"},
    )
    assert response.status_code == 302 and response.headers["location"] == "/", response.text[:500]
    return client


def gateway_requests(port: int) -> float:
    """Requests the gateway answered 200, from its Prometheus exposition."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("chunkpilot:gateway_requests_total{") and 'status="200"' in line
    )


def test_demo_runs_everything_and_ctrl_c_stops_it_cleanly(tmp_path: Path, tiny_model: Path) -> None:
    port, gateway_port = free_port(), free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "CHUNKPILOT_TEST_DB", "CELERY_QUEUE", "CHANNELS_PREFIX")
    }
    env.update(
        CHUNKPILOT_DATA_DIR=str(tmp_path),
        CHUNKPILOT_PORT=str(port),
        CHUNKPILOT_GATEWAY_PORT=str(gateway_port),
        CHUNKPILOT_ADMIN_PASSWORD="demo-secret",
        PYTHONUNBUFFERED="1",
    )
    demo = Process([PYTHON, "manage.py", "demo", "--model", str(tiny_model)], env=env, log_path=tmp_path / "demo.out")
    try:
        demo.wait_for_output("Chunkpilot is running.", timeout=240)
        assert "admin / demo-secret" in demo.output()
        base = f"http://127.0.0.1:{port}"
        browser = log_in(base, "demo-secret")
        try:
            assert "Fleet" in browser.get("/").text
            seen: list[str] = []

            def all_ready() -> str | None:
                seen[:] = [browser.get("/", headers={"HX-Request": "true"}).text]
                return seen[0] if seen[0].count('data-state="ready"') == 8 else None

            # Eight: five simulated H200s (three stable, a canary, a lab worker)
            # and three reference workers (two serving the tiny model, a lab worker).
            rows = wait_until(
                all_ready, 240, "eight workers ready on the fleet page", interval=1, detail=lambda: seen[0]
            )
            assert rows.count(">in step<") == 8, "each worker runs its pool's revision"
            assert rows.count(">simulated<") == 5, "every simulated worker is marked so"
        finally:
            browser.close()
        key = demo.output().split(" key ", 1)[1].split(")", 1)[0]
        completion = httpx.post(
            f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            json={"model": tiny_model.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["message"]["content"] is not None
        simulated = httpx.post(
            f"http://127.0.0.1:{gateway_port}/v1/completions",
            json={"model": "llama-3.1-8b-sim", "prompt": "hello", "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert simulated.status_code == 200, simulated.text
        assert simulated.json()["usage"]["completion_tokens"] == 4
        # The demo's own traffic flows through the gateway too (the figures
        # pages have data): more completed requests than the one sent above.
        wait_until(
            lambda: gateway_requests(gateway_port) >= 3, 120, "the demo's own traffic through the gateway", interval=1
        )
        assert "long-tail mix at 4 req/s to llama-3.1-8b-sim and 0.5 req/s to" in demo.output()
        assert embedded.socket_path(tmp_path).exists()
        assert len(processes_using(tmp_path)) >= 8  # demo, web, celery ×2+, beat, 4 workers, traffic, redis

        os.kill(demo.pid, signal.SIGINT)
        demo.popen.wait(60)
        assert demo.popen.returncode == 0, demo.output()[-3000:]
        assert "Stopped." in demo.output()
        assert processes_using(tmp_path) == []
        assert not embedded.socket_path(tmp_path).exists() or not embedded._answers_ping(embedded.socket_path(tmp_path))
    finally:
        demo.stop()
        embedded.stop(tmp_path)


@pytest.mark.django_db
def test_the_generated_admin_password_is_kept_across_restarts(tmp_path: Path, settings: Any) -> None:
    from django.contrib.auth import authenticate

    from controlplane import demo

    settings.DATA_DIR = tmp_path
    first = demo.ensure_admin(None)
    kept = tmp_path / demo.ADMIN_PASSWORD_FILE
    assert kept.read_text().strip() == first and kept.stat().st_mode & 0o077 == 0
    assert demo.ensure_admin(None) == first, "a restart keeps the password"
    assert authenticate(username="admin", password=first) is not None
    assert demo.ensure_admin("chosen") == "chosen"  # CHUNKPILOT_ADMIN_PASSWORD wins, and is not stored
    assert authenticate(username="admin", password="chosen") is not None
    assert kept.read_text().strip() == first


def test_a_restart_finds_the_tiny_model_already_copied(tmp_path: Path, tiny_model: Path) -> None:
    from controlplane import demo

    assert demo.tiny_model_ready(tiny_model)
    assert not demo.tiny_model_ready(tmp_path / "tiny-model"), "nothing there yet: the demo copies it"
