"""The fleet pages rendered by Django: the table (and its htmx partial),
one worker's page, and the drain and cordon buttons."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Worker
from tests.controlplane.factories import enroll_worker, heartbeat_request, make_pool, make_profile
from workers.contract import parse_heartbeat

pytestmark = pytest.mark.django_db


def test_fleet_page_shows_state_pool_revisions_drift_and_heartbeat(viewer_client: Client) -> None:
    running = make_profile("stable-prof")
    desired = running.profile.add_revision({"max_num_batched_tokens": 1024})
    pool = make_pool("stable", desired)
    worker, _ = enroll_worker("gpu-1", pool=pool)
    worker.record_heartbeat(parse_heartbeat(heartbeat_request(running_revision_id=running.pk)))
    with time_machine.travel(timezone.now() + timedelta(minutes=10)):
        html = viewer_client.get("/").content.decode()
    assert 'data-worker="gpu-1" data-state="ready"' in html
    assert "stable-prof@1" in html and "stable-prof@2" in html
    assert "drift 10" in html  # "drift 10 minutes"
    assert "ago" in html
    assert "<strong>1</strong> workers" in html
    assert "drain" not in html, "viewers get no buttons"


def test_fleet_partial_is_the_table_body_alone_for_htmx(viewer_client: Client) -> None:
    enroll_worker("gpu-2")
    html = viewer_client.get("/", headers={"HX-Request": "true"}).content.decode()
    assert html.lstrip().startswith('<tbody id="fleet-rows"') and "gpu-2" in html and "<html" not in html


def test_operators_drain_from_the_page_and_the_row_comes_back(operator_client: Client) -> None:
    worker, _ = enroll_worker("gpu-3")
    response = operator_client.post(f"/workers/{worker.pk}/drain/", headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert response.content.decode().lstrip().startswith(f'<tr id="worker-{worker.pk}"')
    assert "drain requested" in response.content.decode()
    assert Worker.objects.get(pk=worker.pk).drain_requested
    assert AuditEvent.objects.filter(action="worker.drain").count() == 1


def test_drain_without_javascript_redirects_back(operator_client: Client) -> None:
    worker, _ = enroll_worker("gpu-4")
    response = operator_client.post(f"/workers/{worker.pk}/cordon/", {"next": "/"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert Worker.objects.get(pk=worker.pk).cordoned


def test_viewers_cannot_drain(viewer_client: Client) -> None:
    worker, _ = enroll_worker("gpu-5")
    assert viewer_client.post(f"/workers/{worker.pk}/drain/").status_code == 403
    assert not Worker.objects.get(pk=worker.pk).drain_requested


def test_worker_page_shows_its_history(viewer_client: Client) -> None:
    worker, _ = enroll_worker("gpu-6")
    html = viewer_client.get(f"/workers/{worker.pk}/").content.decode()
    assert "worker.register" in html and "worker:gpu-6" in html


def test_a_worker_whose_engine_failed_shows_why_on_the_fleet_and_worker_pages(viewer_client: Client) -> None:
    worker, _ = enroll_worker("gpu-7")
    reason = "the engine's step thread is not running."
    worker.record_heartbeat(parse_heartbeat(heartbeat_request(state="unhealthy", health_error=reason)))
    fleet = viewer_client.get("/").content.decode()
    assert 'data-worker="gpu-7" data-state="unhealthy"' in fleet
    assert "engine failed" in fleet and "the engine&#x27;s step thread is not running." in fleet
    page = viewer_client.get(f"/workers/{worker.pk}/").content.decode()
    assert "Unhealthy because" in page and "the engine&#x27;s step thread is not running." in page
