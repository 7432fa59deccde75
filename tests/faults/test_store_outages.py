"""Fault injection: the whole system under steady traffic while its
PostgreSQL, then its Redis, is stopped and started again.

``manage.py demo`` runs every process (web, Celery worker and beat, a
gateway, the reference workers) on a PostgreSQL and a redis-server this test
owns (``stores.py``). A client sends completions through the gateway the
whole time, and a prober calls the admin API. It holds that:
- no client request is lost while either store is down;
- the API answers 503 with a JSON body and Retry-After, never a 500, and the
  web server logs no traceback;
- no worker is marked unhealthy after the database returns (the silence was
  the control plane's);
- a routing change made while Redis was down reaches the gateway after it
  returns;
- a websocket is closed with a reason when Redis goes, a handshake is
  refused meanwhile, and a new one connects when it is back; a page in a
  browser shows "live updates paused" meanwhile, and reconnects by itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from controlplane.demo import DEMO_SIM_WORKERS, DEMO_WORKERS, SIM_MODEL
from tests.controlplane.test_demo import log_in
from tests.dashboards.support import RECORD_SOCKETS, wait_for_socket
from tests.faults.stores import OwnPostgres, OwnRedis
from tests.support import PYTHON, ROOT, Process, free_port, wait_until

pytestmark = pytest.mark.slow

DB_OUTAGE_SECONDS = 8.0
REDIS_OUTAGE_SECONDS = 6.0
READY = 1  # controlplane.fleet.health.WorkerState.READY


@dataclass
class Recorder:
    """Calls made in a loop on a thread of its own, each (phase, status, detail)."""

    results: list[tuple[str, int, str]] = field(default_factory=list)
    phase: str = "before"
    stop: threading.Event = field(default_factory=threading.Event)

    def record(self, status: int, detail: str = "") -> None:
        self.results.append((self.phase, status, detail))

    def statuses(self, phase: str | None = None) -> list[int]:
        return [s for p, s, _ in self.results if phase is None or p == phase]


@dataclass
class System:
    demo: Process
    data_dir: Path
    base: str
    gateway: str
    key: str
    model: str
    token: str
    pg: OwnPostgres
    redis: OwnRedis

    def log(self, name: str) -> str:
        return (self.data_dir / "demo" / "logs" / f"{name}.log").read_text(errors="replace")

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Token {self.token}"}, timeout=30)


def _env(data_dir: Path, pg: OwnPostgres, redis_server: OwnRedis, port: int, gateway_port: int) -> dict[str, str]:
    drop = ("CHUNKPILOT_TEST_DB", "CELERY_QUEUE", "CHANNELS_PREFIX", "DJANGO_SETTINGS_MODULE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        DATABASE_URL=pg.url,
        REDIS_URL=redis_server.url,
        CHUNKPILOT_DATA_DIR=str(data_dir),
        CHUNKPILOT_PORT=str(port),
        CHUNKPILOT_GATEWAY_PORT=str(gateway_port),
        CHUNKPILOT_ADMIN_PASSWORD="faults-secret",
        CHUNKPILOT_DEMO_RATE="0",
        CHUNKPILOT_DEMO_GPU_RATE="0",
        PYTHONUNBUFFERED="1",
        # Sweep every second, so that a false "unhealthy" would show at once.
        HEALTH_SWEEP_INTERVAL_SECONDS="1",
        GATEWAY_POLL_SECONDS="2",
    )
    return env


DEMO_WORKER_COUNT = sum(count for _, _, count in DEMO_SIM_WORKERS) + len(DEMO_WORKERS)


@pytest.fixture
def system(tmp_path: Path, tiny_model: Path) -> Iterator[System]:
    pg, redis_server = OwnPostgres(), OwnRedis(tmp_path)
    demo: Process | None = None
    try:
        pg.start()
        pg.create_database()
        redis_server.start()
        port, gateway_port = free_port(), free_port()
        env = _env(tmp_path, pg, redis_server, port, gateway_port)
        demo = Process(
            [PYTHON, "manage.py", "demo", "--model", str(tiny_model)], env=env, log_path=tmp_path / "demo.out"
        )
        demo.wait_for_output("Chunkpilot is running.", timeout=300)
        key = demo.output().split(" key ", 1)[1].split(")", 1)[0]
        token = subprocess.run(
            [PYTHON, "manage.py", "createapitoken", "admin"],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        wait_until(
            lambda: pg.query("SELECT count(*) FROM fleet_worker WHERE state = %s", READY)[0][0] == DEMO_WORKER_COUNT,
            240,
            "every worker ready",
        )
        yield System(
            demo,
            tmp_path,
            f"http://127.0.0.1:{port}",
            f"http://127.0.0.1:{gateway_port}",
            key,
            # The model whose routing table has a stable and a canary pool (the
            # simulated H200s'); the tiny model's has its one pool only.
            SIM_MODEL,
            token,
            pg,
            redis_server,
        )
    finally:
        if demo is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(demo.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                demo.popen.wait(60)
            demo.stop()
        redis_server.stop()
        pg.remove()


def _traffic(sys_: System, rec: Recorder) -> None:
    """Completions through the gateway, one after another, without pause."""
    with httpx.Client(base_url=sys_.gateway, headers={"Authorization": f"Bearer {sys_.key}"}, timeout=60) as client:
        while not rec.stop.is_set():
            try:
                r = client.post("/v1/completions", json={"model": sys_.model, "prompt": "hello", "max_tokens": 2})
                rec.record(r.status_code, r.text[:200] if r.status_code != 200 else "")
            except httpx.HTTPError as exc:
                rec.record(0, repr(exc))
            time.sleep(0.1)


def _probe(sys_: System, rec: Recorder) -> None:
    """The admin API (a list, and a table with its acks), twice a second."""
    with sys_.api() as client:
        while not rec.stop.is_set():
            for path in ("/api/v1/pools/", f"/api/v1/routing/{sys_.model}/"):
                try:
                    r = client.get(path)
                except httpx.HTTPError as exc:
                    rec.record(0, repr(exc))
                    continue
                json_body = r.headers.get("content-type", "").startswith("application/json")
                detail = "json" if json_body else r.text[:200]
                if r.status_code == 503:
                    detail += f" retry-after={r.headers.get('retry-after')}"
                rec.record(r.status_code, detail)
            time.sleep(0.5)


def _unhealthy_marks(sys_: System) -> list[tuple[Any, ...]]:
    return sys_.pg.query(
        "SELECT object_repr, after FROM audit_auditevent WHERE action = 'worker.state_change'"
        " AND after->>'state' IN ('unhealthy', 'offline')"
    )


def _socket(sys_: System, cookies: httpx.Cookies) -> Any:
    cookie = "; ".join(f"{name}={value}" for name, value in cookies.items())
    url = sys_.base.replace("http://", "ws://") + "/ws/fleet/"
    return ws_connect(url, additional_headers={"Cookie": cookie}, origin=sys_.base, open_timeout=10)


def _sign_in(page: Any, base: str) -> None:
    """The admin in a headless browser, on the fleet page with its sockets open."""
    page.add_init_script(RECORD_SOCKETS)
    page.goto(f"{base}/login/?next=/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "faults-secret")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    wait_for_socket(page, "/ws/fleet/", "/ws/alerts/banner/")
    assert page.is_hidden("#live-paused")


def test_no_request_is_lost_and_nothing_is_500_while_each_store_is_down(system: System, page: Any) -> None:
    sys_ = system
    traffic, probes = Recorder(), Recorder()
    threads = [
        threading.Thread(target=_traffic, args=(sys_, traffic)),
        threading.Thread(target=_probe, args=(sys_, probes)),
    ]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: traffic.statuses().count(200) >= 3, 60, "traffic flowing")
        assert _unhealthy_marks(sys_) == []

        browser = log_in(sys_.base, "faults-secret")

        # ---- PostgreSQL down --------------------------------------------------------
        sys_.pg.stop()
        traffic.phase = probes.phase = "db-down"
        started = time.monotonic()
        with pytest.raises(InvalidStatus) as refused:
            _socket(sys_, browser.cookies)  # its session is in the database
        assert refused.value.response.status_code == 403, "refused cleanly, never a 500"
        fleet_page = httpx.get(f"{sys_.base}/", cookies=browser.cookies)
        assert fleet_page.status_code == 503 and "Service unavailable" in fleet_page.text
        time.sleep(max(0.0, DB_OUTAGE_SECONDS - (time.monotonic() - started)))
        sys_.pg.start()
        traffic.phase = probes.phase = "db-back"
        # Through the agents' backoff and well past the unhealthy limit (10 s),
        # with the sweep running every second.
        wait_until(lambda: probes.statuses("db-back").count(200) >= 2, 60, "the API answers again")
        time.sleep(15)
        assert _unhealthy_marks(sys_) == [], "the sweep blamed workers for the control plane's outage"
        states = sys_.pg.query("SELECT name, state FROM fleet_worker ORDER BY name")
        assert all(state == READY for _, state in states), states

        # ---- Redis down ---------------------------------------------------------------
        _sign_in(page, sys_.base)
        with _socket(sys_, browser.cookies) as socket:
            sys_.redis.stop()
            traffic.phase = probes.phase = "redis-down"
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013, closed.value
        assert "live updates paused" in closed.value.rcvd.reason
        with pytest.raises(InvalidStatus) as refused:
            _socket(sys_, browser.cookies)
        assert refused.value.response.status_code == 403, "refused cleanly (the browser backs off), never a 500"
        page.wait_for_selector("#live-paused", state="visible", timeout=30000)
        assert "Live updates paused" in page.inner_text("#live-paused")
        with sys_.api() as api:
            table = api.get(f"/api/v1/routing/{sys_.model}/").json()
            assert table["acks"]["state"] == "unknown"
            # A change of weights while Redis is away: committed, its notice lost.
            changed = api.patch(
                f"/api/v1/routing/{sys_.model}/",
                json={"weights": {"canary": 1000, "stable": 9000}, "reason": "during the Redis outage"},
            )
            assert changed.status_code == 200, changed.text
            epoch = changed.json()["epoch"]
        time.sleep(REDIS_OUTAGE_SECONDS)
        sys_.redis.start()
        traffic.phase = probes.phase = "redis-back"

        def acked() -> bool:
            with sys_.api() as api:
                acks = api.get(f"/api/v1/routing/{sys_.model}/acks/", params={"epoch": epoch}).json()
            return acks.get("state") == "complete" and len(acks["gateways"]) == 1

        wait_until(acked, 60, "the gateway applied the change made while Redis was down")

        def reconnects() -> bool:
            try:
                with _socket(sys_, browser.cookies):
                    return True
            except (InvalidStatus, OSError):
                return False

        wait_until(reconnects, 60, "a websocket connects again")
        # The page's own sockets reconnected by themselves (htmx's ws extension).
        page.wait_for_selector("#live-paused", state="hidden", timeout=90000)
        browser.close()
        wait_until(lambda: traffic.statuses("redis-back").count(200) >= 3, 60, "traffic after Redis")
    finally:
        traffic.stop.set()
        probes.stop.set()
        for t in threads:
            t.join(90)

    # ---- what clients saw ---------------------------------------------------------------
    phases = ("before", "db-down", "db-back", "redis-down", "redis-back")
    print(
        "client requests by phase:",
        {p: len(traffic.statuses(p)) for p in phases},
        "API statuses:",
        {s: probes.statuses().count(s) for s in sorted(set(probes.statuses()))},
    )
    for phase in ("db-down", "redis-down"):
        assert traffic.statuses(phase), f"no traffic while {phase}"
    lost = [r for r in traffic.results if r[1] != 200]
    assert lost == [], f"{len(lost)} of {len(traffic.results)} client requests failed: {lost[:5]}"
    assert 503 in probes.statuses("db-down"), "the API never noticed the database was down"
    bad = [
        r
        for r in probes.results
        if r[1] not in (200, 503) or (r[1] == 503 and not r[2].startswith("json retry-after="))
    ]
    assert bad == [], bad[:5]
    assert all(r[2] == "json retry-after=2" for r in probes.results if r[1] == 503)
    web_log = sys_.log("web")
    assert "Traceback" not in web_log and "Exception in ASGI application" not in web_log, web_log[-5000:]
    errors = [line for line in web_log.splitlines() if " ERROR " in line or line.startswith("ERROR:")]
    assert errors == [], "an outage is a warning per failure, not an error: " + "\n".join(errors[:5])
