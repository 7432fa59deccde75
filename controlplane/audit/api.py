"""The audit log over the API (read-only), and the viewset base that makes
every mutating call of a resource write its audit row."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, viewsets
from rest_framework.serializers import BaseSerializer

from controlplane import audit
from controlplane.audit.models import AuditEvent


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_repr", read_only=True)
    actor_id = serializers.IntegerField(read_only=True, allow_null=True)

    class Meta:
        model = AuditEvent
        fields = ["id", "time", "actor", "actor_id", "action", "object_type", "object_id", "object_repr", "before", "after"]
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

            when = parse_datetime(since)
            if when is None:
                raise serializers.ValidationError({"since": ["not an ISO 8601 date-time."]})
            qs = qs.filter(time__gte=when)
        return qs


class AuditedMixin:
    """Makes a viewset's create, update and destroy each write one audit row
    ("<audit_name>.create" etc.) in the same transaction as the change.

    Subclasses set ``audit_name`` and may override ``audit_snapshot``; custom
    actions call ``self.audit(verb, obj, before, after)``."""

    request: Any

    audit_name = ""

    def audit_snapshot(self, obj: Any) -> dict[str, Any]:
        return audit.snapshot(obj)

    def audit(self, verb: str, obj: Any, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        audit.record(self.request.user, f"{self.audit_name}.{verb}", obj, before, after)

    def perform_create(self, serializer: BaseSerializer) -> None:
        with transaction.atomic():
            obj = serializer.save()
            self.audit("create", obj, None, self.audit_snapshot(obj))

    def perform_update(self, serializer: BaseSerializer) -> None:
        with transaction.atomic():
            before = self.audit_snapshot(serializer.instance)
            obj = serializer.save()
            self.audit("update", obj, before, self.audit_snapshot(obj))

    def perform_destroy(self, instance: Any) -> None:
        with transaction.atomic():
            self.audit("delete", instance, self.audit_snapshot(instance), None)
            instance.delete()


class AuditedModelViewSet(AuditedMixin, viewsets.ModelViewSet):
    """Full CRUD, every write audited."""
