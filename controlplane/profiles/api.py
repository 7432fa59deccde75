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

from django.db.models import Count, QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.inputs import (
    StrictModelSerializer,
    StrictSerializer,
    query_id_or_name,
    query_int,
)
from controlplane.audit.api import AuditedModelViewSet, AuditedSerializer
from controlplane.profiles.models import Profile, ProfileRevision, diff_revisions
from workers.profile import profile_errors


class RevisionSerializer(StrictModelSerializer):
    profile_name = serializers.CharField(source="profile.name", read_only=True)
    author = serializers.CharField(source="author.username", read_only=True, allow_null=True, default=None)
    fields = serializers.DictField(read_only=True, help_text="every knob of the engine contract")

    class Meta:
        model = ProfileRevision
        fields = ["id", "profile", "profile_name", "revision", "fields", "author", "created", "comment"]
        read_only_fields = fields


class FieldChangeSerializer(StrictSerializer):
    field = serializers.CharField()
    before = serializers.JSONField(allow_null=True)
    after = serializers.JSONField(allow_null=True)


class DiffSerializer(StrictSerializer):
    before = RevisionSerializer()
    after = RevisionSerializer()
    changes = FieldChangeSerializer(many=True)


class ProfileSerializer(AuditedSerializer):
    fields = serializers.DictField(
        write_only=True,
        required=False,
        help_text="engine profile knobs; on create and PUT missing knobs take defaults, on PATCH they keep the "
        "latest revision's",
    )
    comment = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=500)
    latest_revision = serializers.SerializerMethodField()
    num_revisions = serializers.SerializerMethodField()

    class Meta:
        model = Profile
        fields = [
            "id",
            "name",
            "engine_kind",
            "description",
            "created",
            "fields",
            "comment",
            "latest_revision",
            "num_revisions",
        ]
        read_only_fields = ["created"]

    @extend_schema_field(RevisionSerializer(allow_null=True))
    def get_latest_revision(self, obj: Profile) -> dict[str, Any] | None:
        latest = obj.latest_revision()
        return RevisionSerializer(latest).data if latest is not None else None

    def get_num_revisions(self, profile: Profile) -> int:
        # The list annotates it; a profile just created or revised counts here.
        count = getattr(profile, "num_revisions", None)
        return count if count is not None else profile.revisions.count()

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
        return Profile.objects.create_with_revision(
            name=validated["name"],
            engine_kind=validated.get("engine_kind", "reference"),
            description=validated.get("description", ""),
            fields=validated.get("fields", {}),
            comment=validated.get("comment", ""),
            actor=self.actor(),
        )

    def update(self, profile: Profile, validated: dict[str, Any]) -> Profile:
        # name and engine kind cannot change (validate_name, validate_engine_kind)
        profile.revise(
            validated.get("fields"),
            actor=self.actor(),
            comment=validated.get("comment", ""),
            description=validated.get("description"),
        )
        return profile


class ProfileViewSet(AuditedModelViewSet):
    serializer_class = ProfileSerializer

    def get_queryset(self) -> QuerySet[Profile]:
        return Profile.objects.annotate(num_revisions=Count("revisions"))

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
        to_number = query_int(request, "to", minimum=1)
        after = revisions.filter(revision=to_number).first() if to_number else revisions.order_by("-revision").first()
        if after is None:
            raise serializers.ValidationError({"to": [f"profile {profile.name} has no revision {to_number}."]})
        from_number = query_int(request, "from", minimum=1) or max(after.revision - 1, 1)
        before = revisions.filter(revision=from_number).first()
        if before is None:
            raise serializers.ValidationError({"from": [f"profile {profile.name} has no revision {from_number}."]})
        return Response(_diff_payload(before, after))


class ProfileRevisionViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = RevisionSerializer

    def get_queryset(self) -> QuerySet[ProfileRevision]:
        qs = ProfileRevision.objects.select_related("profile", "author")
        profile_id, profile_name = query_id_or_name(self.request, "profile")
        if profile_id is not None:
            qs = qs.filter(profile_id=profile_id)
        elif profile_name is not None:
            qs = qs.filter(profile__name=profile_name)
        return qs

    @extend_schema(
        parameters=[OpenApiParameter("to", int, required=True, description="id of the other revision")],
        responses=DiffSerializer,
    )
    @action(detail=True, methods=["get"])
    def diff(self, request: Request, pk: str | None = None) -> Response:
        before = self.get_object()
        to_id = query_int(request, "to", minimum=1)
        if to_id is None:
            raise serializers.ValidationError({"to": ["this parameter is required."]})
        after = get_object_or_404(self.get_queryset(), pk=to_id)
        return Response(_diff_payload(before, after))


def _diff_payload(before: ProfileRevision, after: ProfileRevision) -> dict[str, Any]:
    return {
        "before": RevisionSerializer(before).data,
        "after": RevisionSerializer(after).data,
        "changes": [change.to_dict() for change in diff_revisions(before, after)],
    }
