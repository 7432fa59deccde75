"""Engine profiles over the API.

    POST   /profiles/                 {name, engine_kind, description, fields, comment} → revision 1
    PATCH  /profiles/{id}/            fields merge into the latest revision's → next revision
    PUT    /profiles/{id}/            fields replace (missing knobs take defaults) → next revision
    GET    /profiles/{id}/revisions/  every revision
    GET    /profiles/{id}/diff/?from=N&to=M   revision numbers; default: latest vs the one before
    GET    /profile-revisions/{id}/   one revision by id (what the agent contract names)
    GET    /profile-revisions/{id}/diff/?to=ID   any two revisions, of any profiles

An edit whose fields equal the latest revision's adds no revision.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Count, QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.audit.api import AuditedModelViewSet
from controlplane.profiles.models import Profile, ProfileRevision, diff_revisions
from workers.profile import EngineProfile, profile_errors


class RevisionSerializer(serializers.ModelSerializer):
    profile_name = serializers.CharField(source="profile.name", read_only=True)
    author = serializers.CharField(source="author.username", read_only=True, allow_null=True, default=None)
    fields = serializers.DictField(read_only=True, help_text="every knob of the engine contract")

    class Meta:
        model = ProfileRevision
        fields = ["id", "profile", "profile_name", "revision", "fields", "author", "created", "comment"]
        read_only_fields = fields


class FieldChangeSerializer(serializers.Serializer):
    field = serializers.CharField()
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class DiffSerializer(serializers.Serializer):
    before = RevisionSerializer()
    after = RevisionSerializer()
    changes = FieldChangeSerializer(many=True)


class ProfileSerializer(serializers.ModelSerializer):
    fields = serializers.DictField(
        write_only=True,
        required=False,
        help_text="engine profile knobs; on create and PUT missing knobs take defaults, on PATCH they keep the latest revision's",
    )
    comment = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=500)
    latest_revision = serializers.SerializerMethodField()
    num_revisions = serializers.IntegerField(read_only=True)

    class Meta:
        model = Profile
        fields = [
            "id", "name", "engine_kind", "description", "created",
            "fields", "comment", "latest_revision", "num_revisions",
        ]
        read_only_fields = ["created"]

    @extend_schema_field(RevisionSerializer(allow_null=True))
    def get_latest_revision(self, obj: Profile) -> dict[str, Any] | None:
        latest = obj.latest_revision()
        return RevisionSerializer(latest).data if latest is not None else None

    def validate_name(self, value: str) -> str:
        # A name is how people, rollouts and the audit log say "chunked@3";
        # renaming would rewrite what history appears to say.
        if self.instance is not None and value != self.instance.name:
            raise serializers.ValidationError("a profile's name cannot change; create a new profile.")
        return value

    def validate_engine_kind(self, value: str) -> str:
        if self.instance is not None and value != self.instance.engine_kind:
            raise serializers.ValidationError(
                "a profile's engine kind cannot change; create a new profile for the other engine."
            )
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Knob errors come back by knob name, beside any other field's."""
        fields = attrs.get("fields")
        if self.instance is None:
            errors = profile_errors(fields or {}, engine_kind=attrs.get("engine_kind", "reference"))
        elif fields is not None:
            latest = self.instance.latest_revision()
            if self.partial and latest is not None:
                attrs["fields"] = fields = {**latest.fields, **fields}
            errors = self.instance.revision_errors(fields)
        else:
            errors = {}
        if errors:
            raise serializers.ValidationError(errors)
        return attrs

    def create(self, validated: dict[str, Any]) -> Profile:
        fields = validated.pop("fields", {})
        comment = validated.pop("comment", "")
        with transaction.atomic():
            profile = Profile.objects.create(**validated)
            profile.add_revision(fields, author=self.context["request"].user, comment=comment or "created")
        return profile

    def update(self, profile: Profile, validated: dict[str, Any]) -> Profile:
        fields = validated.pop("fields", None)
        comment = validated.pop("comment", "")
        with transaction.atomic():
            for name, value in validated.items():
                setattr(profile, name, value)
            profile.save()
            if fields is not None:
                latest = profile.latest_revision()
                normalized = EngineProfile.from_dict(fields, engine_kind=profile.engine_kind).to_dict()
                if latest is None or normalized != latest.fields:
                    profile.add_revision(fields, author=self.context["request"].user, comment=comment)
        return profile


class ProfileViewSet(AuditedModelViewSet):
    serializer_class = ProfileSerializer
    audit_name = "profile"

    def get_queryset(self) -> QuerySet[Profile]:
        return Profile.objects.annotate(num_revisions=Count("revisions"))

    def audit_snapshot(self, obj: Profile) -> dict[str, Any]:
        return obj.audit_state()

    @extend_schema(responses=RevisionSerializer(many=True))
    @action(detail=True, methods=["get"])
    def revisions(self, request: Request, pk: str | None = None) -> Response:
        profile = self.get_object()
        page = self.paginate_queryset(profile.revisions.select_related("profile", "author").order_by("-revision"))
        data = RevisionSerializer(page, many=True).data
        return self.get_paginated_response(data)

    @extend_schema(
        parameters=[
            OpenApiParameter("from", int, description="revision number; default: the one before `to`"),
            OpenApiParameter("to", int, description="revision number; default: the latest"),
        ],
        responses=DiffSerializer,
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, pk: str | None = None) -> Response:
        profile = self.get_object()
        revisions = profile.revisions.select_related("profile", "author")
        to_number = _int_param(request, "to")
        after = revisions.filter(revision=to_number).first() if to_number else revisions.order_by("-revision").first()
        if after is None:
            raise serializers.ValidationError({"to": [f"profile {profile.name} has no revision {to_number}."]})
        from_number = _int_param(request, "from") or max(after.revision - 1, 1)
        before = revisions.filter(revision=from_number).first()
        if before is None:
            raise serializers.ValidationError({"from": [f"profile {profile.name} has no revision {from_number}."]})
        return Response(_diff_payload(before, after))


class ProfileRevisionViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = RevisionSerializer

    def get_queryset(self) -> QuerySet[ProfileRevision]:
        qs = ProfileRevision.objects.select_related("profile", "author")
        if profile := self.request.query_params.get("profile"):
            qs = qs.filter(profile__name=profile) if not profile.isdigit() else qs.filter(profile_id=profile)
        return qs

    @extend_schema(
        parameters=[OpenApiParameter("to", int, required=True, description="id of the other revision")],
        responses=DiffSerializer,
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, pk: str | None = None) -> Response:
        before = self.get_object()
        to_id = _int_param(request, "to")
        if to_id is None:
            raise serializers.ValidationError({"to": ["this parameter is required."]})
        after = get_object_or_404(self.get_queryset(), pk=to_id)
        return Response(_diff_payload(before, after))


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise serializers.ValidationError({name: ["must be an integer."]}) from None


def _diff_payload(before: ProfileRevision, after: ProfileRevision) -> dict[str, Any]:
    return {
        "before": RevisionSerializer(before).data,
        "after": RevisionSerializer(after).data,
        "changes": [change.to_dict() for change in diff_revisions(before, after)],
    }
