from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import Worker
from controlplane.profiles.models import Profile
from tests.controlplane.factories import (
    enroll_worker,
    heartbeat_request,
    make_pool,
    make_profile,
    make_user,
)
from workers.contract import parse_heartbeat

pytestmark = pytest.mark.django_db

PAGES = ["/", "/profiles/", "/audit/"]


@pytest.mark.parametrize("path", PAGES + ["/profiles/new/"])
def test_pages_send_anonymous_visitors_to_login(client: Client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_login_with_a_password_lands_on_the_fleet_page(client: Client) -> None:
    make_user(Role.VIEWER, username="ada", password="correct horse")
    assert client.post("/login/", {"username": "ada", "password": "wrong"}).status_code == 200
    response = client.post("/login/", {"username": "ada", "password": "correct horse"}, follow=True)
    assert response.redirect_chain[-1][0] == "/"
    assert b"Fleet" in response.content and b"ada" in response.content


def test_a_user_without_a_role_is_refused(client: Client) -> None:
    client.force_login(make_user(Role.NONE))
    assert client.get("/").status_code == 403


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


def test_profile_page_diffs_the_latest_two_revisions_by_default(viewer_client: Client) -> None:
    first = make_profile("diffy", max_num_batched_tokens=512)
    first.profile.add_revision({"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 256}, comment="bigger")
    html = viewer_client.get(f"/profiles/{first.profile_id}/").content.decode()
    assert 'data-changed="max_num_batched_tokens"' in html
    assert 'data-changed="long_prefill_token_threshold"' in html
    assert 'data-changed="max_num_seqs"' not in html
    assert "bigger" in html


def test_profile_diff_partial_for_any_two_revisions(viewer_client: Client) -> None:
    first = make_profile("tri", max_num_seqs=32)
    first.profile.add_revision({"max_num_seqs": 16})
    first.profile.add_revision({"max_num_seqs": 16, "block_size": 32})
    html = viewer_client.get(
        f"/profiles/{first.profile_id}/?from=1&to=3", headers={"HX-Request": "true", "HX-Target": "diff"}
    ).content.decode()
    assert html.lstrip().startswith('<div id="diff">')
    assert 'data-changed="max_num_seqs"' in html and 'data-changed="block_size"' in html


def test_profile_diff_with_a_missing_revision_says_so(viewer_client: Client) -> None:
    first = make_profile("short")
    html = viewer_client.get(f"/profiles/{first.profile_id}/?from=1&to=7").content.decode()
    assert "no revision 7" in html


def test_editing_a_profile_on_the_page_adds_a_revision_and_audits_it(operator_client: Client) -> None:
    first = make_profile("edited", max_num_batched_tokens=512)
    form = {**{k: ("" if v is None else v) for k, v in first.fields.items()}, "max_num_batched_tokens": 1024, "comment": "more budget"}
    form["enable_prefix_caching"] = "on"
    response = operator_client.post(f"/profiles/{first.profile_id}/edit/", form)
    assert response.status_code == 302
    latest = first.profile.latest_revision()
    assert (latest.revision, latest.fields["max_num_batched_tokens"], latest.comment) == (2, 1024, "more budget")
    event = AuditEvent.objects.get(action="profile.update")
    assert (event.before["revision"], event.after["revision"]) == (1, 2)


def test_a_bad_edit_shows_the_contracts_error_beside_the_knob(operator_client: Client) -> None:
    first = make_profile("guarded", max_num_batched_tokens=512)
    form = {**{k: ("" if v is None else v) for k, v in first.fields.items()}, "long_prefill_token_threshold": 4096}
    response = operator_client.post(f"/profiles/{first.profile_id}/edit/", form)
    assert response.status_code == 200
    assert 'data-field-error="long_prefill_token_threshold"' in response.content.decode()
    assert first.profile.revisions.count() == 1


def test_new_profile_from_the_page(operator_client: Client) -> None:
    response = operator_client.post(
        "/profiles/new/",
        {"name": "fresh", "engine_kind": "vllm", "prefill_mode": "chunked", "max_num_batched_tokens": 2048,
         "max_num_seqs": 64, "block_size": 16, "enable_prefix_caching": "on"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    profile = Profile.objects.get(name="fresh")
    assert profile.engine_kind == "vllm" and profile.latest_revision().fields["max_num_batched_tokens"] == 2048
    assert AuditEvent.objects.filter(action="profile.create", object_repr="fresh").exists()


def test_new_vllm_profile_with_a_reference_only_knob_is_refused(operator_client: Client) -> None:
    response = operator_client.post(
        "/profiles/new/",
        {"name": "wrong", "engine_kind": "vllm", "prefill_mode": "chunked", "max_num_batched_tokens": 2048,
         "max_num_seqs": 64, "block_size": 16, "short_prompt_threshold": 64},
    )
    assert response.status_code == 200
    assert 'data-field-error="short_prompt_threshold"' in response.content.decode()
    assert not Profile.objects.filter(name="wrong").exists()


def test_audit_page_filters_by_action_prefix(viewer_client: Client) -> None:
    enroll_worker("gpu-7")
    make_pool("audited")
    html = viewer_client.get("/audit/?action=worker.").content.decode()
    assert "worker.register" in html
