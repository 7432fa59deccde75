"""The profile pages: diffs of any two revisions, and the editor whose
errors come from the engine contract, beside each knob."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.audit.models import AuditEvent
from controlplane.profiles.models import Profile
from tests.controlplane.factories import make_profile

pytestmark = pytest.mark.django_db


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
    form = {
        **{k: ("" if v is None else v) for k, v in first.fields.items()},
        "max_num_batched_tokens": 1024,
        "comment": "more budget",
    }
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
        {
            "name": "fresh",
            "engine_kind": "vllm",
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 64,
            "block_size": 16,
            "enable_prefix_caching": "on",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    profile = Profile.objects.get(name="fresh")
    assert profile.engine_kind == "vllm" and profile.latest_revision().fields["max_num_batched_tokens"] == 2048
    assert AuditEvent.objects.filter(action="profile.create", object_repr="fresh").exists()


def test_new_vllm_profile_with_a_reference_only_knob_is_refused(operator_client: Client) -> None:
    response = operator_client.post(
        "/profiles/new/",
        {
            "name": "wrong",
            "engine_kind": "vllm",
            "prefill_mode": "chunked",
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 64,
            "block_size": 16,
            "short_prompt_threshold": 64,
        },
    )
    assert response.status_code == 200
    assert 'data-field-error="short_prompt_threshold"' in response.content.decode()
    assert not Profile.objects.filter(name="wrong").exists()


def test_each_revision_names_who_made_it_a_seeded_one_the_system(operator_client: Client) -> None:
    import re

    seeded = make_profile("seeded", max_num_batched_tokens=512)  # no user: as the demo seeds it
    form = {
        **{k: ("" if v is None else v) for k, v in seeded.fields.items()},
        "max_num_batched_tokens": 1024,
        "comment": "by hand",
    }
    assert operator_client.post(f"/profiles/{seeded.profile_id}/edit/", form).status_code == 302
    html = operator_client.get(f"/profiles/{seeded.profile_id}/").content.decode()
    authors = [re.sub(r"<[^>]+>", "", a).strip() for a in re.findall(r"<td data-author>(.*?)</td>", html, re.S)]
    user = seeded.profile.latest_revision().author
    assert user is not None and authors == [user.get_username(), "system"]  # newest first
