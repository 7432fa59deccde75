"""Every page needs a signed-in user with a role, the same ladder the API
uses (``dashboards/access.py``)."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.accounts.roles import Role
from tests.controlplane.factories import make_user

pytestmark = pytest.mark.django_db

PAGES = ["/", "/profiles/", "/audit/"]


@pytest.mark.parametrize("path", PAGES + ["/profiles/new/"])
def test_pages_send_anonymous_visitors_to_login(client: Client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_a_user_without_a_role_is_refused(client: Client) -> None:
    client.force_login(make_user(Role.NONE))
    assert client.get("/").status_code == 403
