"""A property-based fuzz of the whole admin API from its own OpenAPI document.

Schemathesis generates requests for every operation in /api/schema/, valid
ones and ones that break the schema (wrong types, values out of bounds,
missing and unknown fields), and sends them as an admin through Django's
WSGI handler in this process, on the test database. Every answer must be
something other than a 5xx, its status must be one the document lists for
the operation, its body must match the document, and a request that breaks
the schema must be refused with a 4xx. Rows with the fields that may be
null left null (an alert that never fired, a token and a rollout without a
creator, a rollout without a baseline pool) are in place so that the list
and detail answers show them. The run is bounded: FUZZ_EXAMPLES examples
per operation (``CHUNKPILOT_FUZZ_EXAMPLES``), about two minutes in all.
Nothing is downloaded while it runs; Hypothesis keeps no example database.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.accounts.roles import Role
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import Alert
from controlplane.fleet.models import EnrollmentToken
from controlplane.rollouts.models import Rollout
from tests.controlplane.factories import api_client, make_profile, make_user
from tests.controlplane.rollouts.factories import make_fleet

FUZZ_EXAMPLES = int(os.environ.get("CHUNKPILOT_FUZZ_EXAMPLES", "12"))

CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, negative_data_rejection]

pytestmark = pytest.mark.slow


@pytest.fixture
def admin_token(db: Any) -> str:
    token, _ = Token.objects.get_or_create(user=make_user(Role.ADMIN))
    return token.key


@pytest.fixture
def rows(db: Any) -> None:
    """Rows, so that some generated ids name something that exists, with the
    fields that may be null left null. Made through the test client before
    ``wsgi_app`` unhooks the connection closing (the client hooks it back)."""
    make_profile("fuzz-profile")
    admin = api_client(make_user(Role.ADMIN))
    fleet = make_fleet("fuzz-model", num_baseline=0)
    created = admin.post(
        "/api/v1/rollouts/",
        {
            "model": fleet.table.model,
            "stable_pool": fleet.stable.name,
            "canary_pool": fleet.canary.name,
            "target_revision": fleet.target_revision.pk,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    Rollout.objects.filter(pk=created.json()["id"]).update(created_by=None)
    EnrollmentToken.issue("fuzz-token")  # no creator
    Alert.objects.create(
        fingerprint="fuzz0000fuzz0000", labels={"alertname": "Fuzz"}, state=AlertState.PENDING, value=1.0
    )  # pending: never fired, so no starts_at or ends_at


@pytest.fixture
def wsgi_app(rows: None) -> Iterator[Any]:
    """Django's WSGI handler, minus what a real server's request end does to
    the database connection (close it), as Django's own test client: the
    requests share the test's transaction."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app: Any) -> Any:
    config = schemathesis.Config.from_dict({"generation": {"max-examples": FUZZ_EXAMPLES}})
    return schemathesis.openapi.from_wsgi("/api/schema/?format=json", wsgi_app, config=config)


def test_no_operation_answers_5xx_or_off_its_schema(api_schema: Any, admin_token: str) -> None:
    headers = {"Authorization": f"Token {admin_token}"}
    failures: dict[str, str] = {}
    num_operations = 0
    statuses: Counter[int] = Counter()
    for result in api_schema.get_all_operations():
        operation = result.ok()
        num_operations += 1
        # Form encodings carry only text (a number where text belongs arrives as the
        # text "0"), so schema-breaking bodies go as JSON, where a type can be wrong.
        negative = operation.as_strategy(GenerationMode.NEGATIVE).filter(
            lambda case: case.media_type in (None, "application/json")
        )
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), negative)

        @given(case=cases)
        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            with transaction.atomic():  # a savepoint: one request's database error stays its own
                response = case.call_and_validate(headers=headers, checks=CHECKS)
            statuses[response.status_code] += 1

        try:
            fuzz()
        # FailureGroup, a BaseExceptionGroup, is what schemathesis raises for its checks' findings.
        except (Exception, FailureGroup) as exc:  # noqa: BLE001 - every operation runs; the report lists each failure
            failures[operation.label] = f"{type(exc).__name__}: {exc}"[:3000]
    print(f"{num_operations} operations, answers by status: {dict(sorted(statuses.items()))}")
    assert num_operations >= 90, num_operations  # the whole document, not a part of it
    assert statuses[200] + statuses[201] >= num_operations // 2  # it got past validation, not only 4xx
    assert not failures, f"{len(failures)} operations failed:\n\n" + "\n\n".join(
        f"{label}\n{text}" for label, text in failures.items()
    )
