from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.accounts.roles import Role
from tests.controlplane.factories import api_client, make_user


@pytest.fixture
def viewer(db: Any) -> Any:
    return make_user(Role.VIEWER)


@pytest.fixture
def operator(db: Any) -> Any:
    return make_user(Role.OPERATOR)


@pytest.fixture
def admin_user(db: Any) -> Any:
    return make_user(Role.ADMIN)


@pytest.fixture
def anon_api(db: Any) -> APIClient:
    return APIClient()


@pytest.fixture
def viewer_api(viewer: Any) -> APIClient:
    return api_client(viewer)


@pytest.fixture
def operator_api(operator: Any) -> APIClient:
    return api_client(operator)


@pytest.fixture
def admin_api(admin_user: Any) -> APIClient:
    return api_client(admin_user)
