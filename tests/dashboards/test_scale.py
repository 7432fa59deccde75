"""The operator's pages at fleet scale: the fleet, rollout and figures pages
cost the same number of queries with 200 workers as with 20 (none per
worker), and the fleet page shows one page of rows at a time."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from controlplane.fleet.models import Worker
from controlplane.rollouts.models import Rollout
from dashboards.fleet import pages as fleet_pages
from tests.controlplane.rollouts.factories import Fleet, make_fleet

pytestmark = pytest.mark.django_db


def num_queries(client: Client, url: str, **headers: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url, headers=headers)
    assert response.status_code == 200, url
    return len(ctx.captured_queries)


def rollout_of(fleet: Fleet) -> Rollout:
    return Rollout.start(
        routing_table=fleet.table,
        stable_pool=fleet.stable,
        canary_pool=fleet.canary,
        target_revision=fleet.target_revision,
        actor="tester",
    )


def grow(fleet: Fleet, num_each: int) -> None:
    """More ready workers in both pools, the way make_fleet makes them."""
    more = make_fleet("more", num_stable=num_each, num_canary=num_each)
    for pool_name, pool in (("stable", fleet.stable), ("canary", fleet.canary)):
        for worker in more.workers[pool_name]:
            worker.pool = pool
            worker.save(update_fields=["pool"])


PAGES: dict[str, Callable[[Fleet, Rollout], str]] = {
    "fleet": lambda fleet, rollout: "/",
    "rollout": lambda fleet, rollout: f"/rollouts/{rollout.pk}/",
    "rollouts": lambda fleet, rollout: "/rollouts/",
    "figures": lambda fleet, rollout: "/figures/",
    "panel": lambda fleet, rollout: "/figures/panel/",
}


def test_no_page_costs_a_query_per_worker(viewer_client: Client, db: Any) -> None:
    fleet = make_fleet(num_stable=10, num_canary=10)
    rollout = rollout_of(fleet)
    urls = {page: url(fleet, rollout) for page, url in PAGES.items()}
    for url in urls.values():
        viewer_client.get(url)  # the first request fills per-process caches
    at_20 = {page: num_queries(viewer_client, url) for page, url in urls.items()}
    grow(fleet, 90)
    at_200 = {page: num_queries(viewer_client, url) for page, url in urls.items()}
    assert at_200 == at_20, f"queries with 20 workers {at_20}, with 200 {at_200}"


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fleet_pages, "PAGE_SIZE", 5)
    return 5


def shown(html: str) -> list[str]:
    return re.findall(r'<tr id="worker-\d+" data-worker="([^"]+)"', html)


def test_the_fleet_page_shows_one_page_of_rows_with_links_to_the_others(
    small_pages: int, viewer_client: Client
) -> None:
    make_fleet(num_stable=7, num_canary=5)
    first = viewer_client.get("/").content.decode()
    assert len(shown(first)) == small_pages
    assert 'href="?page=2"' in first and "page 1 of 3 · 12 workers" in first
    last = viewer_client.get("/?page=3").content.decode()
    assert len(shown(last)) == 2 and 'href="?page=2" rel="prev"' in last
    assert 'ws-connect="/ws/fleet/?page=3"' in last, "the page's pushes render the page it shows"
    everyone = set(shown(first)) | set(shown(viewer_client.get("/?page=2").content.decode())) | set(shown(last))
    assert len(everyone) == 12


def test_the_fleet_page_shows_one_pool_when_asked(small_pages: int, viewer_client: Client) -> None:
    fleet = make_fleet(num_stable=7, num_canary=3)
    html = viewer_client.get(f"/?pool={fleet.canary.name}").content.decode()
    assert sorted(shown(html)) == sorted(w.name for w in fleet.workers["canary"])
    assert f'hx-get="/?pool={fleet.canary.name}"' in html, "the 30-s refresh keeps the pool"
    assert "<strong>10</strong> workers" in html, "the summary stays the fleet's"


def test_a_worker_that_comes_pushes_the_pages_rows_not_the_fleets(small_pages: int) -> None:
    fleet = make_fleet(num_stable=7, num_canary=5)
    newcomer = fleet.workers["canary"][-1]
    messages = fleet_pages.render_push(
        newcomer.pk, created=True, deleted=False, user_context={}, view=fleet_pages.View(page="2")
    )
    rows = shown(messages[0])
    assert messages[0].startswith('<tbody id="fleet-rows" hx-swap-oob="true" hx-get="/?page=2"')
    assert len(rows) == small_pages
    ordered = [w.name for w in Worker.objects.order_by("pool__name", "name")]
    assert rows == ordered[5:10]
