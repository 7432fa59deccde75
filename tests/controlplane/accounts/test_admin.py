from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane import audit
from controlplane.fleet.models import EnrollmentToken
from tests.controlplane.factories import enroll_worker, make_pool, make_profile

pytestmark = pytest.mark.django_db

MODELS = ["audit/auditevent", "fleet/pool", "fleet/worker", "fleet/enrollmenttoken", "profiles/profile", "profiles/profilerevision"]


@pytest.fixture
def admin_client_with_rows(client: Client) -> Client:
    revision = make_profile("admin-seen")
    worker, _ = enroll_worker("admin-w", pool=make_pool("admin-p", revision))
    EnrollmentToken.issue("admin-t")
    audit.record(None, "x.y", worker)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", None))
    return client


@pytest.mark.parametrize("model", MODELS)
def test_every_core_model_has_a_working_django_admin(admin_client_with_rows: Client, model: str) -> None:
    changelist = admin_client_with_rows.get(f"/admin/{model}/")
    assert changelist.status_code == 200
    app_label, model_name = model.split("/")
    from django.apps import apps

    obj: Any = apps.get_model(app_label, model_name).objects.first()
    assert admin_client_with_rows.get(f"/admin/{model}/{obj.pk}/change/").status_code == 200


def test_audit_rows_cannot_be_deleted_in_the_admin(admin_client_with_rows: Client) -> None:
    from controlplane.audit.models import AuditEvent

    event = AuditEvent.objects.first()
    assert admin_client_with_rows.post(f"/admin/audit/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEvent.objects.filter(pk=event.pk).exists()
