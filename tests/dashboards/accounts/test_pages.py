"""Signing in with a password."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.accounts.roles import Role
from tests.controlplane.factories import make_user

pytestmark = pytest.mark.django_db


def test_login_with_a_password_lands_on_the_fleet_page(client: Client) -> None:
    make_user(Role.VIEWER, username="ada", password="correct horse")
    assert client.post("/login/", {"username": "ada", "password": "wrong"}).status_code == 200
    response = client.post("/login/", {"username": "ada", "password": "correct horse"}, follow=True)
    assert response.redirect_chain[-1][0] == "/"
    assert b"Fleet" in response.content and b"ada" in response.content
