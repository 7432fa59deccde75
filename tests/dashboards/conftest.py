from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from controlplane.accounts.roles import Role
from tests.controlplane.factories import make_user


@pytest.fixture
def viewer_client(db: Any) -> Client:
    client = Client()
    client.force_login(make_user(Role.VIEWER))
    return client


@pytest.fixture
def operator_client(db: Any) -> Client:
    client = Client()
    client.force_login(make_user(Role.OPERATOR))
    return client
