"""The audit log over the API (read-only), and the serializer and viewset
bases through which every write of a resource is the model's audited write."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, viewsets

from controlplane.accounts.inputs import StrictModelSerializer
from controlplane.audit.models import AuditEvent


class AuditEventSerializer(StrictModelSerializer):
    actor = serializers.CharField(source="actor_repr", read_only=True)
    actor_id = serializers.IntegerField(read_only=True, allow_null=True)

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "time",
            "actor",
            "actor_id",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "before",
            "after",
        ]
        read_only_fields = fields


_FILTERS = {
    "action": "action",
    "actor": "actor_repr",
    "object_type": "object_type",
    "object_id": "object_id",
}


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("action", str, description="exact action, e.g. pool.update"),
            OpenApiParameter("action_prefix", str, description="e.g. worker. for every worker action"),
            OpenApiParameter("actor", str, description="username or system:/worker: actor"),
            OpenApiParameter("object_type", str, description="app_label.model, e.g. fleet.worker"),
            OpenApiParameter("object_id", str),
            OpenApiParameter("since", str, description="ISO 8601 time; events at or after it"),
        ]
    )
)
class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    """Every state change, newest first."""

    serializer_class = AuditEventSerializer

    def get_queryset(self) -> QuerySet[AuditEvent]:
        qs = AuditEvent.objects.all()
        params = self.request.query_params
        for param, field in _FILTERS.items():
            if value := params.get(param):
                qs = qs.filter(**{field: value})
        if prefix := params.get("action_prefix"):
            qs = qs.filter(action__startswith=prefix)
        if since := params.get("since"):
            from django.utils.dateparse import parse_datetime

            try:
                when = parse_datetime(since)
                if when is not None and when.tzinfo is not None:
                    when.astimezone(UTC)  # year 1 at +14:00 is no datetime in UTC
            except (ValueError, OverflowError):
                when = None
            if when is None:
                raise serializers.ValidationError({"since": ["not an ISO 8601 date-time."]})
            qs = qs.filter(time__gte=when)
        return qs


class AuditedSerializer(StrictModelSerializer):
    """Creates and updates through the model's audited writes (``audit.Audited``),
    as the request's user: the audit row is the model's business, not the API's.
    A serializer with a workflow of its own overrides ``create``/``update``
    with the model method that does it (``Profile.objects.create_with_revision``)."""

    def actor(self) -> Any:
        return self.context["request"].user

    def create(self, validated: dict[str, Any]) -> Any:
        return self.Meta.model.create_audited(self.actor(), **validated)

    def update(self, instance: Any, validated: dict[str, Any]) -> Any:
        with instance.changing(self.actor()):
            self.apply(instance, validated)
        return instance

    def apply(self, instance: Any, validated: dict[str, Any]) -> None:
        """An update's writes, inside its one audited change."""
        for name, value in validated.items():
            setattr(instance, name, value)
        instance.save()


class AuditedMixin:
    """A viewset whose writes are audited by the model: its serializer is an
    ``AuditedSerializer`` (create, update) and destroy is ``delete_audited``."""

    request: Any

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        _audited(serializer).save()

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        _audited(serializer).save()

    def perform_destroy(self, instance: Any) -> None:
        instance.delete_audited(self.request.user)


def _audited(serializer: serializers.BaseSerializer) -> AuditedSerializer:
    if not isinstance(serializer, AuditedSerializer):
        raise TypeError(f"{type(serializer).__name__} would write without an audit row: make it an AuditedSerializer")
    return serializer


class AuditedModelViewSet(AuditedMixin, viewsets.ModelViewSet):
    """Full CRUD, every write audited."""
