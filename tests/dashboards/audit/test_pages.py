"""The audit log page."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.controlplane.factories import enroll_worker, make_pool

pytestmark = pytest.mark.django_db


def test_audit_page_filters_by_action_prefix(viewer_client: Client) -> None:
    enroll_worker("gpu-7")
    make_pool("audited")
    html = viewer_client.get("/audit/?action=worker.").content.decode()
    assert "worker.register" in html


def test_each_event_shows_what_changed_not_the_dicts() -> None:
    from dashboards.audit.pages import changes

    diff = changes(
        {"name": "gpu-a", "fields": {"max_num_batched_tokens": 512, "max_num_seqs": 32}, "gone": True},
        {"name": "gpu-a", "fields": {"max_num_batched_tokens": 1024, "max_num_seqs": 32}, "labels": {"zone": "eu"}},
    )
    assert [(c.key, c.before, c.after, c.kind) for c in diff.changes] == [
        ("fields.max_num_batched_tokens", "512", "1024", "changed"),
        ("gone", "true", None, "removed"),
        ("labels.zone", None, "eu", "added"),
    ]
    assert diff.num_unchanged == 2  # name, fields.max_num_seqs
    created = changes(None, {"name": "p"})
    assert [(c.key, c.kind) for c in created.changes] == [("name", "added")] and created.num_unchanged == 0


def test_the_audit_page_shows_a_diff_and_pages_through_the_log(viewer_client: Client) -> None:
    from controlplane import audit
    from controlplane.audit.models import AuditEvent
    from dashboards.audit.views import AUDIT_PAGE_SIZE

    pool = make_pool("audited")
    for i in range(AUDIT_PAGE_SIZE + 5):
        audit.record("someone", "pool.update", pool, {"note": f"n{i}"}, {"note": f"n{i + 1}"})
    html = viewer_client.get("/audit/?action=pool.update").content.decode()
    assert html.count("data-audit=") == AUDIT_PAGE_SIZE
    newest = AuditEvent.objects.filter(action="pool.update").first()
    assert newest is not None
    row = html.split(f'data-audit="{newest.pk}"', 1)[1].split("</tr>\n    </tr>", 1)[0]
    assert "<code>note</code>" in row and f"<del>n{AUDIT_PAGE_SIZE + 4}</del>" in row
    assert f"<ins>n{AUDIT_PAGE_SIZE + 5}</ins>" in row and "{&#x27;" not in html
    assert 'href="?action=pool.update&amp;page=2"' in html and 'data-page="newer"' not in html
    older = viewer_client.get("/audit/?action=pool.update&page=2").content.decode()
    assert older.count("data-audit=") == 5 and 'data-page="older"' not in older
    assert 'href="?action=pool.update&amp;page=1"' in older
    assert viewer_client.get("/audit/?page=banana").status_code == 200
