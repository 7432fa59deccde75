"""The web UI on the embedded default, as ``make demo`` runs it: no
DATABASE_URL and no REDIS_URL, so SQLite and the embedded Redis in a fresh
data directory. The rest of the suite runs on PostgreSQL, where a lookup
SQLite lacks (``contains`` on JSON) went unnoticed until the alert page
was a bare 500 in the demo.

A headless browser signs in and walks every page the navigation and each
page's links reach (every detail page a list links to, the admin's lists),
submits every filter form with its defaults and opens every other form,
and fails on any 4xx/5xx response or console error. The database is seeded
first (``tests/dashboards/sqlite_seed.py``) so that each list has a row."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import pytest

from controlplane import embedded
from tests.support import PYTHON, ROOT, free_port, running

pytestmark = [pytest.mark.browser, pytest.mark.slow]

USERNAME, PASSWORD = "walker", "pw-sqlite-walk"
MAX_NUM_PAGES = 200
# Whose answer is a file, not a page: fetched, not opened.
DOWNLOADS = re.compile(r"/api/|[?&](format|export)=|\.(csv|jsonl|json|txt)$|/metrics/?$")


@dataclass
class Embedded:
    base: str
    ids: dict[str, int]
    data_dir: Path


def embedded_env(data_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "CHUNKPILOT_TEST_DB", "CELERY_QUEUE", "CHANNELS_PREFIX")
    }
    env.update(CHUNKPILOT_DATA_DIR=str(data_dir), DJANGO_SETTINGS_MODULE="controlplane.settings", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def sqlite_web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Embedded]:
    """The ASGI server on a seeded embedded-default data directory."""
    data_dir = tmp_path_factory.mktemp("embedded")
    env = embedded_env(data_dir)

    def child(*argv: str) -> str:
        done = subprocess.run([PYTHON, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        child("manage.py", "migrate", "--noinput", "-v", "0")
        assert (data_dir / "chunkpilot.sqlite3").exists(), "the embedded default is SQLite"
        ids = json.loads(child("-m", "tests.dashboards.sqlite_seed", USERNAME, PASSWORD).strip().splitlines()[-1])
        port = free_port()
        argv = [PYTHON, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port)]
        with running(argv, env=env, log_path=data_dir / "web.log") as proc:
            base = f"http://127.0.0.1:{port}"
            proc.wait_http(f"{base}/login/", timeout=60)
            yield Embedded(base, ids, data_dir)
    finally:
        embedded.stop(data_dir)


class Problems:
    """Every 4xx/5xx answer and console error the page meets, with where."""

    def __init__(self, page: Any):
        self.page, self.found = page, []
        page.on("response", self._response)
        page.on("console", lambda m: m.type == "error" and self.found.append(f"console: {m.text} ({page.url})"))
        page.on("pageerror", lambda e: self.found.append(f"page error: {e} ({page.url})"))

    def _response(self, response: Any) -> None:
        if response.status >= 400:
            self.found.append(f"{response.status} {response.request.method} {response.url} (on {self.page.url})")


def sign_in(page: Any, base: str) -> None:
    page.goto(f"{base}/login/?next=/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")


def settle(page: Any) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_load_state("networkidle", timeout=5000)
    except PlaywrightTimeout:  # a page that polls is never idle; its requests are still checked
        pass


def links(page: Any, base: str) -> list[str]:
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map((e) => e.href)")
    return [h.split("#")[0] for h in hrefs if h.startswith(base)]


def filter_forms(page: Any) -> list[str]:
    """Each GET form's URL with its default values, as a submit would send it."""
    return page.eval_on_selector_all(
        "form",
        """forms => forms
             .filter((f) => (f.getAttribute('method') || 'get').toLowerCase() === 'get')
             .map((f) => new URL(f.getAttribute('action') || location.href, location.href).href.split('?')[0]
                         + '?' + new URLSearchParams(new FormData(f)).toString())""",
    )


def is_walked(url: str) -> bool:
    path = urlsplit(url).path
    if path.startswith("/admin/"):
        # the admin's index and its lists; its thousand change forms are Django's own
        return path.count("/") <= 4 and not path.startswith("/admin/logout")
    return not path.startswith(("/logout", "/static/", "/ws/"))


def test_every_page_detail_page_and_form_answers_on_the_embedded_default(page: Any, sqlite_web: Embedded) -> None:
    base, ids = sqlite_web.base, sqlite_web.ids
    problems = Problems(page)
    sign_in(page, base)

    queue, seen, fetched, forms = [f"{base}/"], set(), set(), set()
    while queue and len(seen) < MAX_NUM_PAGES:
        url = queue.pop(0)
        key = urlsplit(url).path
        if DOWNLOADS.search(url):
            if url not in fetched:
                fetched.add(url)
                answer = page.request.get(url)
                if answer.status >= 400:
                    problems.found.append(f"{answer.status} GET {url}")
            continue
        if key in seen or not is_walked(url):
            continue
        seen.add(key)
        page.goto(url)
        settle(page)
        if page.locator("form").count():
            forms.add(key)
        for submitted in filter_forms(page):
            if submitted not in fetched and is_walked(submitted):
                fetched.add(submitted)
                page.goto(submitted)
                settle(page)
                page.goto(url)
        queue.extend(link for link in links(page, base) if urlsplit(link).path not in seen)

    assert not problems.found, "\n".join(problems.found)
    for path in (
        f"/alerts/{ids['alert']}/",
        f"/rollouts/{ids['rollout']}/",
        f"/experiments/{ids['experiment']}/",
        f"/experiments/workloads/{ids['workload']}/",
        f"/requests/{ids['request']}/",
        f"/profiles/{ids['profile']}/",
        f"/workers/{ids['worker']}/",
        "/rollouts/new/",
        "/experiments/new/",
        "/profiles/new/",
        "/alerts/rules/new/",
        "/alerts/silences/",
        "/admin/",
        "/admin/alerts/delivery/",
        "/admin/rollouts/rollout/",
    ):
        assert path in seen, f"{path} was not reached from the navigation; walked: {sorted(seen)}"
    for path in ("/rollouts/new/", "/experiments/new/", "/profiles/new/", "/alerts/rules/new/", "/alerts/silences/"):
        assert path in forms, f"{path} shows no form"


def test_the_alert_page_and_the_alerts_api_list_its_deliveries_on_sqlite(page: Any, sqlite_web: Embedded) -> None:
    """The lookup that was a 500 on SQLite: which deliveries carried an alert."""
    base, alert_id = sqlite_web.base, sqlite_web.ids["alert"]
    problems = Problems(page)
    sign_in(page, base)
    page.goto(f"{base}/alerts/{alert_id}/")
    assert "ops" in page.locator("#deliveries").inner_text()
    body = page.request.get(f"{base}/api/v1/alerts/{alert_id}/").json()
    assert [d["receiver"] for d in body["deliveries"]] == ["ops"]
    assert not problems.found, "\n".join(problems.found)


def readme_pages() -> list[str]:
    """Every path README's "The web UI" table names."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The web UI", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"`(/[^`\s]*)`", section)))


def test_every_page_readme_lists_answers_a_get_with_a_page(page: Any, sqlite_web: Embedded) -> None:
    base, ids = sqlite_web.base, sqlite_web.ids
    sign_in(page, base)
    paths = readme_pages()
    assert "/figures/" in paths and "/alerts/" in paths
    for path in paths:
        url = base + path.replace("<id>", str(ids["workload"] if "workloads" in path else ids["worker"]))
        answer = page.request.get(url)
        assert answer.status == 200, f"README lists {path}, which answers {answer.status}"
        assert "text/html" in answer.headers["content-type"], path


def test_the_api_docs_load_swagger_ui_from_this_server(page: Any, sqlite_web: Embedded) -> None:
    """/api/docs/ works offline: every script and stylesheet is served here
    (drf-spectacular-sidecar), none from a CDN, and Swagger UI draws."""
    base = sqlite_web.base
    problems = Problems(page)
    sign_in(page, base)
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(base) else outside.append(r.url))
    page.goto(f"{base}/api/docs/")
    sources = page.eval_on_selector_all(
        "script[src], link[href]", "els => els.map((e) => e.src || e.href).filter(Boolean)"
    )
    assert sources and all(urljoin(base, s).startswith(base) for s in sources), sources
    assert page.evaluate("typeof SwaggerUIBundle") == "function"
    page.wait_for_selector(".swagger-ui .information-container", timeout=15000)
    assert not outside, outside
    assert not problems.found, "\n".join(problems.found)
