"""What the API accepts (controlplane/accounts/inputs.py): numeric ids in
paths, bounded pages, query parameters and integer fields, and strict bodies.
Each case was a 500 or a silent drop before; now a 404 or a 400 naming the
field."""

from __future__ import annotations

import importlib
import inspect
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from rest_framework import serializers
from rest_framework.test import APIClient

from controlplane import api_urls
from controlplane.accounts.inputs import StrictMixin
from controlplane.alerts.models import Silence
from controlplane.fleet.models import EnrollmentToken
from controlplane.profiles.models import Profile
from tests.controlplane.factories import make_pool, make_profile

HUGE = "99999999999999999999"
# Every app that contributes to /api/v1/ (controlplane/api_urls.py), so that an
# app added later is checked without being listed here.
API_APPS = [p.urlconf_name.__name__.rpartition(".")[0] for p in api_urls.urlpatterns]  # type: ignore[union-attr]
API_MODULES = [f"{app}.api" for app in API_APPS]
ROUTERS = {
    app: router
    for app in API_APPS
    if (router := getattr(importlib.import_module(f"{app}.urls"), "router", None)) is not None
}
DETAIL_ROUTES = sorted(
    (prefix, action.url_path, next(iter(action.mapping)))
    for router in ROUTERS.values()
    for prefix, viewset, _ in router.registry
    for action in viewset.get_extra_actions()
    if action.detail
)


# ---- paths -----------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["promote", "abort", "promote-full", "skip-step", "retry", "rollback"])
@pytest.mark.parametrize("rollout_id", ["abc", HUGE, "1.5", "-1"])
def test_a_rollout_action_on_an_id_that_is_no_number_is_404(admin_api: APIClient, verb: str, rollout_id: str) -> None:
    response = admin_api.post(f"/api/v1/rollouts/{rollout_id}/{verb}/", {}, format="json")
    assert response.status_code == 404


def test_every_app_routes_its_viewsets_through_the_numeric_id_router() -> None:
    assert {app: type(router).__name__ for app, router in ROUTERS.items()} == dict.fromkeys(ROUTERS, "ApiRouter")
    assert "controlplane.experiments" in ROUTERS  # the list is read from api_urls, not empty


@pytest.mark.parametrize(
    "path",
    sorted(
        prefix for router in ROUTERS.values() for prefix, viewset, _ in router.registry if hasattr(viewset, "retrieve")
    ),
)
def test_every_detail_route_takes_only_numeric_ids(admin_api: APIClient, path: str) -> None:
    assert admin_api.get(f"/api/v1/{path}/abc/").status_code == 404
    assert admin_api.get(f"/api/v1/{path}/{HUGE}/").status_code == 404


@pytest.mark.parametrize(("prefix", "url_path", "method"), DETAIL_ROUTES)
def test_every_detail_action_takes_only_numeric_ids(
    admin_api: APIClient, prefix: str, url_path: str, method: str
) -> None:
    # The fuzzer's case: POST /api/v1/experiments/%10%40%C2%A6/abort/ was a 500.
    for key in ("abc", "\x10@\xa6\xcc4", HUGE):
        response = getattr(admin_api, method)(f"/api/v1/{prefix}/{quote(key)}/{url_path}/", {}, format="json")
        assert response.status_code == 404, (prefix, url_path, key, response.status_code)


# ---- query parameters ---------------------------------------------------------------------
@pytest.mark.parametrize("param", ["limit", "offset"])
@pytest.mark.parametrize("value", [HUGE, "x", "-3"])
def test_a_page_parameter_out_of_bounds_is_a_400_naming_it(admin_api: APIClient, param: str, value: str) -> None:
    response = admin_api.get(f"/api/v1/audit/?{param}={value}")
    assert response.status_code == 400
    assert param in response.json()


def test_a_large_limit_is_capped_not_refused(admin_api: APIClient) -> None:
    for name in ("a", "b"):
        make_pool(name)
    response = admin_api.get("/api/v1/pools/?limit=5000")
    assert response.status_code == 200
    assert len(response.json()["results"]) == 2


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/api/v1/alerts/", "rule"),
        ("/api/v1/workers/", "pool"),
        ("/api/v1/profile-revisions/", "profile"),
    ],
)
def test_a_huge_id_in_a_query_is_a_400_naming_it(admin_api: APIClient, path: str, param: str) -> None:
    response = admin_api.get(f"{path}?{param}={HUGE}")
    assert response.status_code == 400
    assert param in response.json()


def test_a_profile_diff_with_a_huge_revision_number_is_a_400(admin_api: APIClient) -> None:
    revision = make_profile("p")
    response = admin_api.get(f"/api/v1/profiles/{revision.profile_id}/diff/?to={HUGE}")
    assert response.status_code == 400
    assert "to" in response.json()


@pytest.mark.parametrize("end", ["1e20", "inf", "-inf", "nan", "-1e20", "9999-12-31T00:00:00"])
def test_query_range_with_an_end_out_of_range_is_a_400_naming_end(admin_api: APIClient, end: str) -> None:
    response = admin_api.get(f"/api/v1/metrics/query_range/?figure=ttft_p99&end={end}")
    assert response.status_code == 400
    assert "end" in response.json()


@pytest.mark.parametrize("param", ["range", "window", "step"])
def test_a_duration_past_any_datetime_is_a_400_naming_it(admin_api: APIClient, param: str) -> None:
    response = admin_api.get(f"/api/v1/metrics/query_range/?figure=ttft_p99&{param}=1e20s")
    assert response.status_code == 400
    assert param in response.json()


def test_a_nul_character_in_a_query_is_a_400_naming_the_parameter(admin_api: APIClient) -> None:
    response = admin_api.get("/api/v1/audit/?actor=a%00b")
    assert response.status_code == 400
    assert response.json() == {"actor": ["must not contain NUL characters."]}


# ---- bodies: bounded integers ----------------------------------------------------------------
def test_a_huge_max_uses_is_a_400_naming_it(admin_api: APIClient) -> None:
    response = admin_api.post("/api/v1/enrollment-tokens/", {"name": "t", "max_uses": int(HUGE)}, format="json")
    assert response.status_code == 400
    assert "max_uses" in response.json()
    assert not EnrollmentToken.objects.exists()


def test_an_integer_field_gets_its_columns_range(admin_api: APIClient) -> None:
    """weight_bp has a bound of its own; position takes its column's."""
    response = admin_api.post("/api/v1/alert-routes/", {"position": 2**40}, format="json")
    assert response.status_code == 400
    assert "position" in response.json()


# ---- bodies: unknown fields ---------------------------------------------------------------------
def test_profile_knobs_at_the_top_level_are_refused_by_name(admin_api: APIClient) -> None:
    body = {"name": "chunked", "engine_kind": "reference", "prefill_mode": "chunked", "max_num_batched_tokens": 256}
    response = admin_api.post("/api/v1/profiles/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"max_num_batched_tokens": ["unknown field."], "prefill_mode": ["unknown field."]}
    assert not Profile.objects.exists()


def test_an_unknown_field_in_a_patch_is_refused(admin_api: APIClient) -> None:
    pool = make_pool("p")
    response = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {"descripton": "typo"}, format="json")
    assert response.status_code == 400
    assert response.json() == {"descripton": ["unknown field."]}


def test_an_unknown_field_in_a_nested_object_is_refused(admin_api: APIClient) -> None:
    make_pool("stable")
    body = {"pools": [{"pool": "stable", "role": "stable", "weight_bp": 10000, "weight": 1}]}
    response = admin_api.put("/api/v1/routing/tiny/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {"pools": {"0": {"weight": ["unknown field."]}}}


def test_read_only_fields_sent_back_are_accepted(admin_api: APIClient) -> None:
    """A GET's body PUT back unchanged is not refused for its read-only fields."""
    pool = admin_api.post("/api/v1/pools/", {"name": "p"}, format="json").json()
    response = admin_api.put(f"/api/v1/pools/{pool['id']}/", {**pool, "description": "d"}, format="json")
    assert response.status_code == 200, response.json()


def test_every_serializer_of_the_api_is_strict() -> None:
    loose = []
    for name in API_MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, serializers.BaseSerializer)
                and cls.__module__ == name
                and not issubclass(cls, StrictMixin)
            ):
                loose.append(f"{name}.{cls.__name__}")
    assert loose == []


# ---- replies match the document -------------------------------------------------------------------
def test_create_replies_carry_the_counts_the_schema_requires(admin_api: APIClient) -> None:
    pool = admin_api.post("/api/v1/pools/", {"name": "p"}, format="json")
    assert pool.status_code == 201
    assert pool.json()["num_workers"] == 0
    assert pool.json()["desired"] is None
    profile = admin_api.post("/api/v1/profiles/", {"name": "q", "fields": {"prefill_mode": "chunked"}}, format="json")
    assert profile.status_code == 201
    assert profile.json()["num_revisions"] == 1


def test_the_document_says_where_null_is_returned_and_what_prometheus_sd_is(admin_api: APIClient) -> None:
    document = yaml.safe_load(admin_api.get("/api/schema/").content)
    schemas = document["components"]["schemas"]
    assert schemas["Pool"]["properties"]["desired"]["nullable"] is True
    assert schemas["Worker"]["properties"]["desired"]["nullable"] is True
    assert schemas["Worker"]["properties"]["running"]["nullable"] is True
    sd = document["paths"]["/api/v1/metrics/prometheus-sd/"]["get"]["responses"]["200"]
    assert sd["content"]["application/json"]["schema"]["type"] == "array"


def test_silence_delete_expires_it_and_the_document_says_so(admin_api: APIClient) -> Any:
    body = {"matchers": ['alertname="x"'], "ends_at": "2999-01-01T00:00:00Z", "comment": "c"}
    created = admin_api.post("/api/v1/silences/", body, format="json").json()
    deleted = admin_api.delete(f"/api/v1/silences/{created['id']}/")
    assert deleted.status_code == 200
    assert deleted.json()["status"] == "expired"
    assert admin_api.get(f"/api/v1/silences/{created['id']}/").json()["status"] == "expired"
    assert Silence.objects.filter(pk=created["id"]).exists()
    document = yaml.safe_load(admin_api.get("/api/schema/").content)
    operation = document["paths"]["/api/v1/silences/{id}/"]["delete"]
    assert "200" in operation["responses"] and "204" not in operation["responses"]
    assert "stays listed" in operation["description"]


@pytest.mark.parametrize("since", ["2020-13-45T00:00:00", "0001-01-01T00:00:00+14:00", "soon"])
def test_an_impossible_audit_since_is_a_400_naming_it(admin_api: APIClient, since: str) -> None:
    response = admin_api.get("/api/v1/audit/", {"since": since})
    assert response.status_code == 400
    assert "since" in response.json()


def test_an_unknown_key_inside_a_silence_matcher_is_refused(admin_api: APIClient) -> None:
    matcher = {"name": "alertname", "value": "x", "isRegex": False, "isEqual": True, "is_regex": True}
    body = {"matchers": [matcher], "ends_at": "2999-01-01T00:00:00Z", "comment": "c"}
    response = admin_api.post("/api/v1/silences/", body, format="json")
    assert response.status_code == 400
    assert "is_regex" in str(response.json()["matchers"])
    assert not Silence.objects.exists()


def test_an_unknown_key_inside_an_analysis_step_is_refused() -> None:
    from controlplane.rollouts import steps

    with pytest.raises(steps.StepError) as refused:
        steps.parse([{"set_weight": 1000}, {"analysis": {"template": "default", "count": 5}}])
    assert "steps" in refused.value.errors
