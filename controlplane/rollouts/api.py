"""Rollouts and analysis templates over the API.

    GET    /api/v1/rollouts/                     newest first; ?active=true for unfinished ones
    POST   /api/v1/rollouts/                     {model, stable_pool, canary_pool, baseline_pool?,
                                                  target_revision, stable_revision?, steps?,
                                                  analysis_template?, progress_deadline_seconds?, gate?}
    GET    /api/v1/rollouts/<id>/                with its timeline and analysis runs
    DELETE /api/v1/rollouts/<id>/                finished ones only
    POST   /api/v1/rollouts/<id>/abort/          {reason?}  one-click rollback
    POST   /api/v1/rollouts/<id>/promote/        leave a pause (or accept an inconclusive analysis)
    POST   /api/v1/rollouts/<id>/promote-full/   skip the remaining steps
    POST   /api/v1/rollouts/<id>/skip-step/
    POST   /api/v1/rollouts/<id>/retry/          an aborted rollout, from the first step
    POST   /api/v1/rollouts/<id>/rollback/       a succeeded rollout back to its previous revision
    CRUD   /api/v1/analysis-templates/

Actions only set flags (the reconciler acts on them) and answer at once
with the rollout as it stands; every one writes an audit row. Pools are
named as in the routing API, revisions by id.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.http import Http404
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.inputs import StrictModelSerializer, StrictSerializer
from controlplane.audit.api import AuditedMixin, AuditedModelViewSet, AuditedSerializer
from controlplane.fleet.api import RevisionRefSerializer
from controlplane.fleet.models import Pool
from controlplane.gateway.models import RoutingTable
from controlplane.profiles.models import ProfileRevision
from controlplane.rollouts import steps as plan
from controlplane.rollouts.models import (
    FLAG_FIELDS,
    AnalysisRun,
    AnalysisTemplate,
    Measurement,
    Rollout,
    RolloutEvent,
)

TIMELINE_LIMIT = 500


# ---- analysis templates ---------------------------------------------------------------
class AnalysisTemplateSerializer(AuditedSerializer):
    metrics = serializers.JSONField(help_text="[{name, figure, direction, test, max_ratio, floor, min_samples}]")

    class Meta:
        model = AnalysisTemplate
        fields = [
            "id",
            "name",
            "description",
            "metrics",
            "interval_seconds",
            "count",
            "initial_delay_seconds",
            "window_seconds",
            "failure_limit",
            "inconclusive_limit",
            "consecutive_error_limit",
            "sample_wait_seconds",
            "created",
            "updated",
        ]
        read_only_fields = ["created", "updated"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        from django.core.exceptions import ValidationError
        from django.utils import timezone

        instance = AnalysisTemplate(**{**(self._current() if self.instance else {}), **attrs})
        try:
            instance.clean()
        except ValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from exc
        attrs["updated"] = timezone.now()
        return attrs

    def _current(self) -> dict[str, Any]:
        return {f: getattr(self.instance, f) for f in self.Meta.fields if f not in ("id", "created", "updated")}


class AnalysisTemplateViewSet(AuditedModelViewSet):
    """What an analysis step measures and decides with. Runs snapshot the
    template when they start."""

    serializer_class = AnalysisTemplateSerializer
    queryset = AnalysisTemplate.objects.all()


# ---- rollouts: reading -------------------------------------------------------------
class EventSerializer(StrictModelSerializer):
    phase = serializers.CharField(source="phase_label")

    class Meta:
        model = RolloutEvent
        fields = ["id", "time", "kind", "message", "actor", "phase", "step_index", "data"]
        read_only_fields = fields


class MeasurementSerializer(StrictModelSerializer):
    phase = serializers.CharField(source="phase_label")

    class Meta:
        model = Measurement
        fields = ["id", "taken_at", "window_seconds", "phase", "verdicts", "weights"]
        read_only_fields = fields


class AnalysisRunSerializer(StrictModelSerializer):
    phase = serializers.CharField(source="phase_label")
    measurements = MeasurementSerializer(many=True, read_only=True)

    class Meta:
        model = AnalysisRun
        fields = [
            "id",
            "attempt",
            "step_index",
            "template_name",
            "spec",
            "phase",
            "message",
            "results",
            "canary_pool_name",
            "baseline_pool_name",
            "started_at",
            "finished_at",
            "terminated",
            "measurements",
        ]
        read_only_fields = fields


class RolloutSerializer(StrictModelSerializer):
    model = serializers.CharField(source="routing_table.model", read_only=True)
    stable_pool = serializers.CharField(source="stable_pool.name", read_only=True)
    canary_pool = serializers.CharField(source="canary_pool.name", read_only=True)
    baseline_pool = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    stable_revision = RevisionRefSerializer(read_only=True)
    target_revision = RevisionRefSerializer(read_only=True)
    phase = serializers.CharField(source="phase_label", read_only=True)
    finished = serializers.BooleanField(source="is_finished", read_only=True)
    current_step = serializers.SerializerMethodField()
    flags = serializers.SerializerMethodField(help_text="buttons pressed that the reconciler has not acted on yet")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = Rollout
        fields = [
            "id",
            "model",
            "stable_pool",
            "canary_pool",
            "baseline_pool",
            "stable_revision",
            "target_revision",
            "steps",
            "current_step",
            "progress_deadline_seconds",
            "gate",
            "fast_track",
            "rollback_of",
            "phase",
            "finished",
            "step_index",
            "pause_conditions",
            "weights",
            "message",
            "abort_reason",
            "attempt",
            "gate_status",
            "gate_result",
            "last_error",
            "flags",
            "created_by",
            "created",
            "started_at",
            "finished_at",
            "next_run_at",
        ]
        read_only_fields = fields

    def get_current_step(self, obj: Rollout) -> str | None:
        step = obj.current_step()
        return step.describe() if step is not None else None

    def get_flags(self, obj: Rollout) -> list[str]:
        return [flag.replace("_", "-") for flag, field in FLAG_FIELDS.items() if getattr(obj, field)]


class ForecastSerializer(StrictSerializer):
    step_index = serializers.IntegerField()
    template = serializers.CharField()
    canary_bp = serializers.IntegerField(help_text="the canary's weight while the analysis runs")
    baseline_role = serializers.CharField(help_text="baseline or stable: what the canary is compared with")
    baseline_bp = serializers.IntegerField()
    min_samples = serializers.IntegerField(help_text="per side, the largest of the template's metrics")
    window_seconds = serializers.FloatField(help_text="what one measurement counts over")
    sample_wait_seconds = serializers.FloatField(help_text="how long the analysis may measure on for its samples")
    requests_per_second = serializers.FloatField(help_text="the model's traffic over the last few minutes")
    canary_seconds = serializers.FloatField(allow_null=True)
    baseline_seconds = serializers.FloatField(allow_null=True)
    seconds_to_min_samples = serializers.FloatField(allow_null=True, help_text="null: never at this rate")
    conclusive = serializers.BooleanField(
        help_text="one window holds the samples; else each measurement is "
        "inconclusive and the rollout pauses for a person"
    )
    message = serializers.CharField()


class RolloutDetailSerializer(RolloutSerializer):
    timeline = serializers.SerializerMethodField()
    analysis_runs = AnalysisRunSerializer(many=True, read_only=True)
    sample_forecast = serializers.SerializerMethodField(
        help_text="unfinished rollouts: per analysis step, the time to its minimum sample count at the current "
        "traffic rate"
    )

    class Meta(RolloutSerializer.Meta):
        fields = [*RolloutSerializer.Meta.fields, "timeline", "analysis_runs", "sample_forecast"]
        read_only_fields = fields

    @extend_schema_field(ForecastSerializer(many=True))
    def get_sample_forecast(self, obj: Rollout) -> list[dict[str, Any]]:
        return [f.to_json() for f in obj.sample_forecast()] if not obj.is_finished else []

    @extend_schema_field(EventSerializer(many=True))
    def get_timeline(self, obj: Rollout) -> list[dict[str, Any]]:
        events = list(obj.events.order_by("-time", "-id")[:TIMELINE_LIMIT])
        return EventSerializer(reversed(events), many=True).data


# ---- rollouts: creating ------------------------------------------------------------
class RolloutCreateSerializer(StrictSerializer):
    model = serializers.SlugRelatedField(
        slug_field="model", queryset=RoutingTable.objects.all(), help_text="the routing table (its model name)"
    )
    stable_pool = serializers.SlugRelatedField(
        slug_field="name", queryset=Pool.objects.all(), help_text="the pool being moved: the table's stable pool"
    )
    canary_pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all())
    baseline_pool = serializers.SlugRelatedField(
        slug_field="name", queryset=Pool.objects.all(), required=False, allow_null=True
    )
    target_revision = serializers.PrimaryKeyRelatedField(queryset=ProfileRevision.objects.select_related("profile"))
    stable_revision = serializers.PrimaryKeyRelatedField(
        queryset=ProfileRevision.objects.select_related("profile"),
        required=False,
        allow_null=True,
        help_text="default: the stable pool's desired revision",
    )
    steps = serializers.JSONField(required=False, help_text="default: 10% → 25% → 50% → 100% with analysis between")
    analysis_template = serializers.SlugRelatedField(
        slug_field="name",
        queryset=AnalysisTemplate.objects.all(),
        required=False,
        allow_null=True,
        help_text="for the default plan's analyses (default: the template named default)",
    )
    progress_deadline_seconds = serializers.FloatField(required=False, min_value=1.0)
    gate = serializers.JSONField(required=False, help_text="consistency gate: {enabled, prompts, max_tokens}")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "steps" in attrs and attrs.get("analysis_template") is not None:
            raise serializers.ValidationError(
                {"analysis_template": ["only for the default plan; name templates in your steps instead."]}
            )
        return attrs


class ReasonSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


@extend_schema_view(
    list=extend_schema(parameters=[OpenApiParameter("active", bool, description="unfinished rollouts only")]),
    create=extend_schema(request=RolloutCreateSerializer, responses={201: RolloutDetailSerializer}),
    retrieve=extend_schema(responses=RolloutDetailSerializer),
)
class RolloutViewSet(
    AuditedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """Canary rollouts. Buttons set flags; the reconciler acts on them."""

    def get_queryset(self) -> QuerySet[Rollout]:
        qs = Rollout.objects.with_related()
        if self.action == "retrieve":
            qs = qs.prefetch_related("analysis_runs__measurements")
        active = self.request.query_params.get("active")
        if active in ("true", "1"):
            qs = qs.active()
        elif active in ("false", "0"):
            qs = qs.exclude(pk__in=Rollout.objects.active().values("pk"))
        elif active is not None:  # a filter that is not a boolean must not read as no filter
            raise serializers.ValidationError({"active": ["must be true or false."]})
        return qs

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        if self.action == "create":
            return RolloutCreateSerializer
        return RolloutDetailSerializer if self.action == "retrieve" else RolloutSerializer

    def create(self, request: Request) -> Response:
        data = RolloutCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        steps = v.get("steps")
        if steps is None and v.get("analysis_template") is not None:
            steps = plan.to_json(plan.default_plan(v["analysis_template"].name))
        rollout = Rollout.start(
            routing_table=v["model"],
            stable_pool=v["stable_pool"],
            canary_pool=v["canary_pool"],
            baseline_pool=v.get("baseline_pool"),
            target_revision=v["target_revision"],
            stable_revision=v.get("stable_revision"),
            steps=steps,
            progress_deadline_seconds=v.get(
                "progress_deadline_seconds", Rollout._meta.get_field("progress_deadline_seconds").default
            ),
            gate=v.get("gate"),
            actor=request.user,
        )
        return Response(
            RolloutDetailSerializer(self.get_queryset().get(pk=rollout.pk)).data, status=status.HTTP_201_CREATED
        )

    def perform_destroy(self, instance: Rollout) -> None:
        with transaction.atomic():
            # Lock first, then decide and collect what cascades: a reconcile
            # that holds the row (a retry just asked for) finishes before this
            # reads the rollout's phase and events, so no event it adds is
            # left pointing at a deleted rollout (an IntegrityError, a 500).
            locked = Rollout.objects.select_for_update().filter(pk=instance.pk).first()
            if locked is None:
                raise Http404("no such rollout (deleted meanwhile).")
            if not locked.is_finished:
                raise serializers.ValidationError({"non_field_errors": ["abort the rollout before deleting it."]})
            super().perform_destroy(locked)

    def _reply(self, pk: str | None) -> Response:
        rollout = get_object_or_404(self.get_queryset(), pk=pk)
        return Response(RolloutSerializer(rollout).data)

    def _flag(self, request: Request, pk: str | None, flag: str) -> Response:
        rollout = get_object_or_404(Rollout, pk=pk)
        try:
            rollout.request(flag, request.user)
        except Rollout.DoesNotExist as exc:  # deleted between the read and the claim
            raise Http404("no such rollout (deleted meanwhile).") from exc
        return self._reply(pk)

    @extend_schema(request=ReasonSerializer, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def abort(self, request: Request, pk: str | None = None) -> Response:
        """Canary weight to 0 first, acked by every gateway; then the canary
        workers drain and go back to the stable revision."""
        body = ReasonSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        rollout = get_object_or_404(Rollout, pk=pk)
        if not rollout.request_abort(request.user, body.validated_data["reason"], source="api"):
            raise serializers.ValidationError(
                {"non_field_errors": [f"the rollout has {rollout.phase_label}; nothing to abort."]}
            )
        return self._reply(pk)

    @extend_schema(request=None, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str | None = None) -> Response:
        return self._flag(request, pk, "promote")

    @extend_schema(request=None, responses=RolloutSerializer)
    @action(detail=True, methods=["post"], url_path="promote-full")
    def promote_full(self, request: Request, pk: str | None = None) -> Response:
        return self._flag(request, pk, "promote_full")

    @extend_schema(request=None, responses=RolloutSerializer)
    @action(detail=True, methods=["post"], url_path="skip-step")
    def skip_step(self, request: Request, pk: str | None = None) -> Response:
        return self._flag(request, pk, "skip_step")

    @extend_schema(request=None, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str | None = None) -> Response:
        return self._flag(request, pk, "retry")

    @extend_schema(request=None, responses={201: RolloutSerializer})
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str | None = None) -> Response:
        """A new, fast-tracked rollout back to the revision before this one."""
        rollout = get_object_or_404(self.get_queryset(), pk=pk)
        back = rollout.rollback(request.user)
        return Response(RolloutSerializer(self.get_queryset().get(pk=back.pk)).data, status=status.HTTP_201_CREATED)
