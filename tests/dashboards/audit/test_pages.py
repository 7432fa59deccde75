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
