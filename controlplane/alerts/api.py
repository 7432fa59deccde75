"""Alerting over the API.

    /api/v1/alerts/                  alerts, active first (read-only);
    ?state=firing|pending|nodata|resolved|inactive|active
    /api/v1/alerts/webhook/          POST: inbound Alertmanager webhooks (the kill switch)
    /api/v1/alert-rules/             rules, CRUD; /{id}/test/ and POST /test/ evaluate without storing
    /api/v1/silences/                silences; DELETE expires (Alertmanager's semantics)
    /api/v1/alert-receivers/         receivers: webhook, email, external Alertmanager
    /api/v1/alert-routes/            routes: matchers → receiver, grouping and timing

Every write writes its audit row in the same transaction. Bad input is 400
naming each field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.inputs import StrictModelSerializer, StrictSerializer, query_int
from controlplane.accounts.roles import Role
from controlplane.alerts import evaluation, killswitch, validation
from controlplane.alerts.labels import coerce_matcher
from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import (
    Alert,
    AlertRule,
    AlertTransition,
    Delivery,
    Receiver,
    Route,
    Silence,
)
from controlplane.audit.api import AuditedModelViewSet, AuditedSerializer
from controlplane.metrics.query import BackendUnavailable, QueryError

STATE_BY_LABEL = {s.label: s for s in AlertState}


# ---- rules ---------------------------------------------------------------------------


class AlertRuleSerializer(AuditedSerializer):
    condition = serializers.CharField(source="describe_condition", read_only=True)
    shipped = serializers.SerializerMethodField(help_text="one of the rules Chunkpilot ships")
    # JSON fields take any JSON here: rule_errors says, by field, what is wrong.
    selector = serializers.JSONField(required=False)
    labels = serializers.JSONField(required=False)

    class Meta:
        model = AlertRule
        fields = [
            "id",
            "name",
            "enabled",
            "shipped",
            "figure",
            "selector",
            "group_by",
            "window_seconds",
            "compare_to",
            "comparator",
            "threshold",
            "floor",
            "min_requests_per_second",
            "for_seconds",
            "keep_firing_for_seconds",
            "no_data_state",
            "severity",
            "labels",
            "summary",
            "description",
            "runbook_url",
            "dashboard_url",
            "action",
            "condition",
            "created_at",
            "updated_at",
            "last_evaluated_at",
            "last_error",
        ]
        read_only_fields = ["created_at", "updated_at", "last_evaluated_at", "last_error"]

    def get_shipped(self, obj: AlertRule) -> bool:
        return obj.key is not None

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        draft = (
            AlertRule(**{f.attname: getattr(self.instance, f.attname) for f in AlertRule._meta.concrete_fields})
            if self.instance is not None
            else AlertRule()
        )
        for name, value in attrs.items():
            setattr(draft, name, value)
        errors = validation.rule_errors(draft)
        if errors:
            raise serializers.ValidationError(errors)
        attrs["updated_at"] = timezone.now()
        return attrs


class PreviewSerializer(StrictSerializer):
    labels = serializers.DictField(child=serializers.CharField())
    fingerprint = serializers.CharField()
    value = serializers.FloatField(allow_null=True)
    raw = serializers.FloatField(allow_null=True)
    detail = serializers.CharField()
    condition = serializers.ChoiceField(choices=["holds", "clear", "no data"])


def _preview(rule: AlertRule) -> Response:
    try:
        groups = evaluation.preview(rule)
    except QueryError as exc:
        return Response({exc.field: [exc.message]}, status=400)
    except BackendUnavailable as exc:
        return Response({"detail": str(exc), "unavailable": "metrics_backend"}, status=503)
    return Response({"condition": rule.describe_condition(), "evaluated_at": timezone.now(), "groups": groups})


class AlertRuleViewSet(AuditedModelViewSet):
    """Alert rules. Shipped rules can be edited and switched off
    (``enabled: false``); deleting one is allowed too and is not undone by
    upgrades."""

    serializer_class = AlertRuleSerializer
    queryset = AlertRule.objects.all()
    action_roles = {"test_draft": Role.VIEWER}

    @extend_schema(
        responses=inline_serializer(
            "RuleTest",
            {
                "condition": serializers.CharField(),
                "evaluated_at": serializers.DateTimeField(),
                "groups": PreviewSerializer(many=True),
            },
        )
    )
    @action(detail=True, methods=["get"], url_path="test")
    def test(self, request: Request, pk: str | None = None) -> Response:
        """The rule's figure now, per group, and whether the condition holds."""
        return _preview(self.get_object())

    @extend_schema(
        request=AlertRuleSerializer,
        responses=inline_serializer(
            "DraftRuleTest",
            {
                "condition": serializers.CharField(),
                "evaluated_at": serializers.DateTimeField(),
                "groups": PreviewSerializer(many=True),
            },
        ),
    )
    @action(detail=False, methods=["post"], url_path="test")
    def test_draft(self, request: Request) -> Response:
        """Evaluate a rule that is not saved (the editor's "test now")."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = {k: v for k, v in serializer.validated_data.items() if k != "updated_at"}
        return _preview(AlertRule(**data))


# ---- alerts ----------------------------------------------------------------------------


class TransitionSerializer(StrictModelSerializer):
    from_state = serializers.CharField(source="from_label")
    to_state = serializers.CharField(source="to_label")

    class Meta:
        model = AlertTransition
        fields = ["at", "from_state", "to_state", "value", "reason"]
        read_only_fields = fields


class DeliverySerializer(StrictModelSerializer):
    receiver = serializers.CharField(source="receiver.name")

    class Meta:
        model = Delivery
        fields = [
            "id",
            "receiver",
            "reason",
            "status",
            "num_attempts",
            "last_error",
            "attempts",
            "created_at",
            "sent_at",
            "next_attempt_at",
        ]
        read_only_fields = fields


class AlertSerializer(StrictModelSerializer):
    name = serializers.CharField(read_only=True)
    state = serializers.CharField(source="state_label", read_only=True)
    severity = serializers.CharField(read_only=True)
    starts_at = serializers.DateTimeField(source="fired_at", read_only=True, allow_null=True)
    ends_at = serializers.DateTimeField(source="resolved_at", read_only=True, allow_null=True)
    silenced_by = serializers.SerializerMethodField()
    annotations = serializers.DictField(source="live_annotations", child=serializers.CharField(), read_only=True)

    class Meta:
        model = Alert
        fields = [
            "id",
            "fingerprint",
            "name",
            "state",
            "severity",
            "labels",
            "annotations",
            "value",
            "value_detail",
            "active_at",
            "starts_at",
            "ends_at",
            "keep_firing_since",
            "nodata_since",
            "flapping",
            "silenced_by",
            "rule",
            "source",
            "state_changed_at",
            "last_evaluated_at",
            "last_notified_at",
            "num_delivery_failures",
            "last_delivery_error",
            "abort_requested_at",
            "abort_rollout_id",
        ]
        read_only_fields = fields

    def get_silenced_by(self, obj: Alert) -> list[int]:
        silences = self.context.get("silences")
        if silences is None:
            silences = self.context["silences"] = list(Silence.objects.active_at(timezone.now()))
        return [s.pk for s in obj.silenced_by(silences)]


class AlertDetailSerializer(AlertSerializer):
    transitions = serializers.SerializerMethodField()
    deliveries = serializers.SerializerMethodField()

    class Meta(AlertSerializer.Meta):
        fields = [*AlertSerializer.Meta.fields, "transitions", "deliveries"]
        read_only_fields = fields

    @extend_schema_field(TransitionSerializer(many=True))
    def get_transitions(self, obj: Alert) -> list[dict[str, Any]]:
        return TransitionSerializer(obj.transitions.all()[:100], many=True).data

    @extend_schema_field(DeliverySerializer(many=True))
    def get_deliveries(self, obj: Alert) -> list[dict[str, Any]]:
        rows = Delivery.objects.carrying(obj.fingerprint).select_related("receiver")[:50]
        return DeliverySerializer(rows, many=True).data


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(
                "state", str, description="firing, pending, nodata, resolved, inactive, or active (the first three)"
            ),
            OpenApiParameter("severity", str),
            OpenApiParameter("rule", int),
            OpenApiParameter("silenced", bool, description="true: only silenced; false: only audible"),
        ]
    )
)
class AlertViewSet(viewsets.ReadOnlyModelViewSet):
    """Alerts, firing first, then pending and no data, then history."""

    def get_serializer_class(self) -> type[serializers.Serializer]:
        return AlertDetailSerializer if self.action == "retrieve" else AlertSerializer

    def get_queryset(self) -> QuerySet[Alert]:
        qs = Alert.objects.select_related("rule")
        params = self.request.query_params
        if state := params.get("state"):
            if state == "active":
                qs = qs.active()
            elif state in STATE_BY_LABEL:
                qs = qs.filter(state=STATE_BY_LABEL[state])
            else:
                raise serializers.ValidationError({"state": [f"one of active, {', '.join(STATE_BY_LABEL)}."]})
        if severity := params.get("severity"):
            qs = qs.filter(labels__severity=severity)
        if (rule := query_int(self.request, "rule", minimum=1)) is not None:
            qs = qs.filter(rule_id=rule)
        return qs

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        silenced = request.query_params.get("silenced")
        if silenced not in (None, "", "true", "false"):
            raise serializers.ValidationError({"silenced": ["true or false."]})
        if silenced:
            silences = list(Silence.objects.active_at(timezone.now()))
            want = silenced == "true"
            ids = [a.pk for a in self.get_queryset() if bool(a.silenced_by(silences)) == want]
            self.queryset_override = Alert.objects.filter(pk__in=ids)
        return super().list(request, *args, **kwargs)

    def filter_queryset(self, queryset: QuerySet[Alert]) -> QuerySet[Alert]:
        override = getattr(self, "queryset_override", None)
        if override is not None:
            return override.select_related("rule").order_by("-state", "-state_changed_at")
        return queryset


WEBHOOK_TEXT_FIELDS = ("version", "receiver", "groupKey", "status")


def _text_or_absent(body: Mapping[str, Any], name: str) -> bool:
    return name not in body or isinstance(body[name], str)


class InboundWebhookView(APIView):
    """Alertmanager's webhook (version 4) in: a firing alert labelled
    ``chunkpilot_action="abort_rollout"`` asks the rollout its ``rollout``
    label names, else the running rollouts owning its ``pool`` as canary, to
    abort, once per fingerprint and startsAt; its resolved notification is
    recorded. Other alerts are accepted and ignored. Point an Alertmanager ``webhook_configs`` entry here
    with ``http_config.authorization: {type: Token, credentials: <API token>}``."""

    write_role = Role.OPERATOR

    @extend_schema(
        request=inline_serializer(
            "AlertmanagerWebhook",
            {
                # Only the alerts are acted on; the rest, when sent, is text (Alertmanager's v4).
                **{name: serializers.CharField(required=False, allow_blank=True) for name in WEBHOOK_TEXT_FIELDS},
                "alerts": serializers.ListField(child=serializers.DictField()),
            },
        ),
        responses=inline_serializer(
            "WebhookOutcome",
            {
                "num_alerts": serializers.IntegerField(),
                "num_acted": serializers.IntegerField(),
                "num_duplicates": serializers.IntegerField(),
                "num_ignored": serializers.IntegerField(),
                "num_resolved": serializers.IntegerField(),
                "outcomes": serializers.ListField(child=serializers.DictField()),
            },
        ),
    )
    def post(self, request: Request) -> Response:
        body = request.data
        if isinstance(body, Mapping) and (wrong := [n for n in WEBHOOK_TEXT_FIELDS if not _text_or_absent(body, n)]):
            return Response({name: ["must be a string."] for name in wrong}, status=400)
        try:
            result = killswitch.receive_webhook(body, request.user)
        except killswitch.PayloadError as exc:
            return Response(exc.errors, status=400)
        return Response(
            {
                "num_alerts": result.num_alerts,
                "num_acted": result.num_acted,
                "num_duplicates": result.num_duplicates,
                "num_ignored": result.num_ignored,
                "num_resolved": result.num_resolved,
                "outcomes": result.outcomes,
            }
        )


# ---- silences ----------------------------------------------------------------------------


class SilenceSerializer(AuditedSerializer):
    matchers = serializers.JSONField(help_text='[{"name", "value", "isRegex", "isEqual"}] or ["name=\\"value\\"", ...]')
    status = serializers.SerializerMethodField()
    created_by = serializers.CharField(read_only=True)
    starts_at = serializers.DateTimeField(required=False)

    class Meta:
        model = Silence
        fields = [
            "id",
            "matchers",
            "starts_at",
            "ends_at",
            "created_by",
            "comment",
            "status",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_by", "created_at", "updated_at"]
        extra_kwargs = {"comment": {"required": True, "allow_blank": True}}

    def get_status(self, obj: Silence) -> str:
        return obj.status()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        now = timezone.now()
        current = self.instance
        matchers = attrs.get("matchers", current.matchers if current else None)
        starts_at = attrs.get("starts_at", current.starts_at if current else now)
        ends_at = attrs.get("ends_at", current.ends_at if current else None)
        comment = attrs.get("comment", current.comment if current else "")
        errors = validation.silence_errors(matchers, starts_at, ends_at, comment, now, creating=current is None)
        if errors:
            raise serializers.ValidationError(errors)
        attrs["matchers"] = [coerce_matcher(m).as_api() for m in matchers or []]
        attrs["starts_at"] = starts_at
        attrs["updated_at"] = now
        return attrs

    def create(self, validated: dict[str, Any]) -> Silence:
        user = self.actor()
        return Silence.create_audited(user, created_by=user.get_username(), author=user, **validated)


@extend_schema_view(
    destroy=extend_schema(
        summary="Expire a silence",
        description="As in Alertmanager, DELETE expires the silence: its end becomes now, and it stays listed, with "
        "status expired, as history. The reply is the expired silence.",
        responses={200: SilenceSerializer},
    )
)
class SilenceViewSet(AuditedModelViewSet):
    """Silences: matchers and a time window, with author and comment.
    Silenced alerts keep their state and show, marked; they are not notified.
    DELETE expires a silence (it stays, as history)."""

    serializer_class = SilenceSerializer
    queryset = Silence.objects.all()

    def perform_destroy(self, instance: Silence) -> None:
        instance.expire_by(self.request.user)

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        silence = self.get_object()
        self.perform_destroy(silence)
        return Response(self.get_serializer(silence).data, status=status.HTTP_200_OK)


# ---- receivers and routes --------------------------------------------------------------------


class ReceiverSerializer(AuditedSerializer):
    bearer_token = serializers.CharField(write_only=True, required=False, allow_blank=True)
    emails = serializers.JSONField(required=False)

    class Meta:
        model = Receiver
        fields = [
            "id",
            "name",
            "kind",
            "url",
            "bearer_token",
            "emails",
            "send_resolved",
            "max_alerts",
            "is_default",
            "enabled",
            "last_forwarded_at",
            "created_at",
        ]
        read_only_fields = ["last_forwarded_at", "created_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        def get(name: str, default: Any) -> Any:
            return attrs.get(name, getattr(self.instance, name, default))

        errors = validation.receiver_errors(str(get("kind", "")), str(get("url", "") or ""), get("emails", []))
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class ReceiverViewSet(AuditedModelViewSet):
    serializer_class = ReceiverSerializer
    queryset = Receiver.objects.all()


class RouteSerializer(AuditedSerializer):
    matchers = serializers.JSONField(required=False)
    group_by = serializers.JSONField(required=False)

    class Meta:
        model = Route
        fields = [
            "id",
            "position",
            "matchers",
            "receiver",
            "group_by",
            "group_wait_seconds",
            "group_interval_seconds",
            "repeat_interval_seconds",
            "continue_matching",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        defaults = Route()

        def get(name: str) -> Any:
            return attrs.get(name, getattr(self.instance or defaults, name))

        timings = {f: get(f) for f in ("group_wait_seconds", "group_interval_seconds", "repeat_interval_seconds")}
        errors = validation.route_errors(get("matchers"), get("group_by"), timings)
        receiver = attrs.get("receiver", getattr(self.instance, "receiver", None))
        if receiver is not None and receiver.kind == Receiver.KIND_ALERTMANAGER:
            errors.setdefault("receiver", []).append(
                "an external Alertmanager gets every alert unrouted; route to webhook or email receivers."
            )
        if errors:
            raise serializers.ValidationError(errors)
        if "matchers" in attrs:
            attrs["matchers"] = [str(coerce_matcher(m)) for m in attrs["matchers"]]
        return attrs


class RouteViewSet(AuditedModelViewSet):
    """Routes, tried in ``position`` order under an implicit root that sends
    what no route takes to the default receivers."""

    serializer_class = RouteSerializer
    queryset = Route.objects.select_related("receiver")
