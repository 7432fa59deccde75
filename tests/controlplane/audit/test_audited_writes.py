"""Audited writes are model methods that the API and the UI both call: each
writes its change and its audit row in one transaction."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework import serializers

from controlplane.accounts.secrets import hash_secret
from controlplane.alerts.models import AlertRule, Silence
from controlplane.audit.api import AuditedModelViewSet
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import EnrollmentToken, Pool
from controlplane.gateway.models import ClientKey
from controlplane.profiles.models import Profile
from tests.controlplane.factories import make_pool, make_profile
from workers.profile import ProfileError

pytestmark = pytest.mark.django_db


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action).order_by("id"))


def test_a_profile_is_created_with_its_first_revision_and_one_audit_row(operator: Any) -> None:
    profile = Profile.objects.create_with_revision(
        name="made", fields={"max_num_batched_tokens": 1024}, comment="", actor=operator
    )
    latest = profile.latest_revision()
    assert latest is not None and (latest.revision, latest.author, latest.comment) == (1, operator, "created")
    [event] = events("profile.create")
    assert (event.actor, event.before) == (operator, None)
    assert event.after["revision"] == 1 and event.after["fields"]["max_num_batched_tokens"] == 1024


def test_bad_knobs_create_nothing_and_write_no_row(operator: Any) -> None:
    with pytest.raises(ProfileError) as raised:
        Profile.objects.create_with_revision(name="bad", fields={"max_num_batched_tokens": -1}, actor=operator)
    assert "max_num_batched_tokens" in raised.value.errors
    assert not Profile.objects.filter(name="bad").exists() and events("profile.create") == []


def test_a_revision_is_added_only_when_the_knobs_change_and_the_edit_is_audited(operator: Any) -> None:
    profile = make_profile("edited").profile
    same = dict(profile.latest_revision().fields)  # type: ignore[union-attr]
    assert profile.revise(same, actor=operator, comment="no change") is None
    added = profile.revise({**same, "max_num_batched_tokens": 2048}, actor=operator, comment="bigger")
    assert added is not None and (added.revision, added.comment) == (2, "bigger")
    unchanged, changed = events("profile.update")
    assert unchanged.before == unchanged.after
    assert (changed.before["revision"], changed.after["revision"]) == (1, 2)


def test_before_is_the_stored_row_even_when_the_instance_changed_in_memory(operator: Any) -> None:
    pool = make_pool("stored")
    pool.description = "edited by a bound form before the save"
    pool.save_audited(operator)
    [event] = events("pool.update")
    assert (event.before["description"], event.after["description"]) == ("", pool.description)


def test_writes_inside_changing_are_one_change_with_one_row(operator: Any) -> None:
    revision = make_profile("pointed")
    pool = Pool(name="fresh")
    with pool.changing(operator):
        pool.save()
        pool.set_desired_revision(revision)
    [event] = events("pool.create")
    assert event.before is None and event.after["desired_revision"] == revision.pk


def test_a_failed_change_leaves_neither_the_change_nor_its_row(operator: Any) -> None:
    pool = make_pool("kept")
    with pytest.raises(RuntimeError), pool.changing(operator):
        pool.description = "half done"
        pool.save()
        raise RuntimeError("the rest of the change failed")
    pool.refresh_from_db()
    assert pool.description == "" and events("pool.update") == []


def test_switching_a_rule_records_just_that(operator: Any) -> None:
    rule = AlertRule.objects.create(name="Switched", figure="ttft_p99", comparator=">", threshold=1.0)
    rule.set_enabled(False, operator)
    rule.refresh_from_db()
    [event] = events("alert_rule.update")
    assert rule.enabled is False and (event.before, event.after) == ({"enabled": True}, {"enabled": False})


def test_expiring_a_silence_ends_it_now_and_is_audited(operator: Any) -> None:
    now = timezone.now()
    silence = Silence.create_audited(
        operator,
        matchers=[{"name": "pool", "value": "a", "isRegex": False, "isEqual": True}],
        starts_at=now - timedelta(minutes=5),
        ends_at=now + timedelta(hours=1),
        comment="maintenance",
        created_by=operator.username,
        author=operator,
    )
    silence.expire_by(operator, now)
    silence.refresh_from_db()
    assert silence.status(now + timedelta(seconds=1)) == "expired"
    [event] = events("silence.expire")
    assert event.before["ends_at"] > event.after["ends_at"] == now.isoformat()
    assert [e.actor for e in events("silence.create")] == [operator]


@pytest.mark.parametrize("model", [EnrollmentToken, ClientKey])
def test_a_secret_is_issued_once_stored_as_its_hash_and_audited(model: Any, admin_user: Any) -> None:
    row, plaintext = model.issue("issued", actor=admin_user, created_by=admin_user)
    stored = model.objects.get(pk=row.pk)
    assert getattr(stored, model.HASH_FIELD) == hash_secret(plaintext)
    assert plaintext.startswith(model.SECRET_PREFIX) and plaintext.startswith(getattr(stored, model.SHOWN_PREFIX_FIELD))
    assert plaintext not in str(model.objects.values().get(pk=row.pk))
    [event] = events(f"{model.audit_name}.create")
    assert event.actor == admin_user and model.HASH_FIELD not in event.after


def test_a_viewset_refuses_to_write_through_a_serializer_that_does_not_audit(operator: Any) -> None:
    class Plain(serializers.ModelSerializer):
        class Meta:
            model = Pool
            fields = ["name"]

    serializer = Plain(data={"name": "unaudited"})
    serializer.is_valid(raise_exception=True)
    with pytest.raises(TypeError, match="AuditedSerializer"):
        AuditedModelViewSet().perform_create(serializer)
    assert not Pool.objects.filter(name="unaudited").exists()
