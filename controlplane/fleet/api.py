"""Fleet over the API: pools and enrollment tokens (full CRUD), workers
(read, repoint, drain, cordon, delete), and the agent's two endpoints.

The agent endpoints speak ``workers.contract`` exactly: they parse with its
functions and answer its TypedDicts. Register authenticates with the
enrollment token in the body; heartbeat with ``Authorization: Bearer
<worker secret>``. Both answer 401 to a bad credential and 400, by field, to
a body that breaks the contract.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Count, QuerySet
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.decorators import action
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane import live
from controlplane.accounts.inputs import StrictModelSerializer, query_id_or_name
from controlplane.accounts.roles import Role
from controlplane.audit.api import AuditedMixin, AuditedModelViewSet, AuditedSerializer
from controlplane.fleet.health import WorkerState
from controlplane.fleet.heartbeat import heartbeat_interval_seconds, heartbeat_response
from controlplane.fleet.models import EnrollmentRefused, EnrollmentToken, Pool, Worker
from controlplane.profiles.models import ProfileRevision
from workers import contract
from workers.profile import ENGINE_KINDS

STATE_BY_LABEL = {state.label: state for state in WorkerState}


class RevisionRefSerializer(StrictModelSerializer):
    """A revision named the way people say it: profile@revision."""

    name = serializers.CharField(source="profile.name", read_only=True)
    label = serializers.SerializerMethodField()

    class Meta:
        model = ProfileRevision
        fields = ["id", "name", "revision", "label"]
        read_only_fields = fields

    def get_label(self, obj: ProfileRevision) -> str:
        return f"{obj.profile.name}@{obj.revision}"


# ---- pools -----------------------------------------------------------------
class PoolSerializer(AuditedSerializer):
    desired_revision = serializers.PrimaryKeyRelatedField(
        queryset=ProfileRevision.objects.select_related("profile"), allow_null=True, required=False
    )
    desired = RevisionRefSerializer(source="desired_revision", read_only=True, allow_null=True)
    num_workers = serializers.SerializerMethodField()

    class Meta:
        model = Pool
        fields = ["id", "name", "description", "desired_revision", "desired", "num_workers", "created"]
        read_only_fields = ["created"]

    def get_num_workers(self, pool: Pool) -> int:
        # The list annotates it; a pool just created or changed counts here.
        count = getattr(pool, "num_workers", None)
        return count if count is not None else pool.workers.count()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if self.instance is not None and "desired_revision" in attrs:
            errors = self.instance.revision_errors(attrs["desired_revision"])
            if errors:
                raise serializers.ValidationError(errors)
        return attrs

    def apply(self, pool: Pool, validated: dict[str, Any]) -> None:
        if "desired_revision" in validated:
            revision = validated.pop("desired_revision")
            if revision != pool.desired_revision:
                pool.set_desired_revision(revision)
        super().apply(pool, validated)


class PoolViewSet(AuditedModelViewSet):
    serializer_class = PoolSerializer

    def get_queryset(self) -> QuerySet[Pool]:
        return Pool.objects.select_related("desired_revision__profile").annotate(num_workers=Count("workers"))


# ---- enrollment tokens -------------------------------------------------------
class EnrollmentTokenSerializer(AuditedSerializer):
    token = serializers.SerializerMethodField(help_text="the token itself: in the create reply only, never again")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    usable = serializers.SerializerMethodField()
    max_uses = serializers.IntegerField(required=False, allow_null=True, min_value=1)

    class Meta:
        model = EnrollmentToken
        fields = [
            "id",
            "name",
            "token",
            "token_prefix",
            "pool",
            "max_uses",
            "num_uses",
            "expires_at",
            "usable",
            "created_by",
            "created",
        ]
        read_only_fields = ["token_prefix", "num_uses", "created"]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_token(self, obj: EnrollmentToken) -> str | None:
        return getattr(obj, "plaintext", None)

    def get_usable(self, obj: EnrollmentToken) -> bool:
        return obj.is_usable(timezone.now())

    def validate_expires_at(self, value: Any) -> Any:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future.")
        return value

    def create(self, validated: dict[str, Any]) -> EnrollmentToken:
        token, plaintext = EnrollmentToken.issue(actor=self.actor(), created_by=self.actor(), **validated)
        token.plaintext = plaintext  # type: ignore[attr-defined]
        return token


class EnrollmentTokenViewSet(AuditedModelViewSet):
    """Tokens a worker exchanges for its own secret at registration. Only
    admins may make or change them; deleting one revokes it."""

    serializer_class = EnrollmentTokenSerializer
    write_role = Role.ADMIN

    def get_queryset(self) -> QuerySet[EnrollmentToken]:
        return EnrollmentToken.objects.select_related("created_by", "pool")


# ---- workers -------------------------------------------------------------------
@extend_schema_field({"type": "string", "enum": [state.label for state in WorkerState]})
class StateField(serializers.Field):
    def to_representation(self, value: int) -> str:
        return WorkerState(value).label

    def to_internal_value(self, data: Any) -> WorkerState:
        if data not in STATE_BY_LABEL:
            raise serializers.ValidationError(f"must be one of {', '.join(STATE_BY_LABEL)}.")
        return STATE_BY_LABEL[data]


class WorkerSerializer(AuditedSerializer):
    state = StateField(read_only=True)
    pool = serializers.PrimaryKeyRelatedField(queryset=Pool.objects.all(), allow_null=True, required=False)
    pool_name = serializers.SlugRelatedField(source="pool", slug_field="name", read_only=True, allow_null=True)
    desired_revision = serializers.PrimaryKeyRelatedField(
        queryset=ProfileRevision.objects.select_related("profile"),
        allow_null=True,
        required=False,
        help_text="per-worker override of the pool's desired revision (a canary); null: follow the pool",
    )
    desired = serializers.SerializerMethodField(help_text="what it should run: the override, else the pool's")
    running = RevisionRefSerializer(source="running_revision", read_only=True, allow_null=True)
    drifting = serializers.SerializerMethodField(help_text="desired ≠ running for longer than the grace period")
    simulated = serializers.BooleanField(
        read_only=True, help_text="a simulated engine: step times from a GPU performance database, no real inference"
    )

    class Meta:
        model = Worker
        fields = [
            "id",
            "name",
            "url",
            "pool",
            "pool_name",
            "labels",
            "hardware",
            "engine_kind",
            "simulated",
            "model",
            "max_model_len",
            "state",
            "state_changed_at",
            "cordoned",
            "drain_requested",
            "last_heartbeat_at",
            "load",
            "desired_revision",
            "desired",
            "running",
            "running_profile",
            "apply_error",
            "health_error",
            "drift_since",
            "drifting",
            "registered_at",
        ]
        read_only_fields = [
            "name",
            "url",
            "hardware",
            "engine_kind",
            "model",
            "max_model_len",
            "state_changed_at",
            "cordoned",
            "drain_requested",
            "last_heartbeat_at",
            "load",
            "running_profile",
            "apply_error",
            "health_error",
            "drift_since",
            "registered_at",
        ]

    @extend_schema_field(RevisionRefSerializer(allow_null=True))
    def get_desired(self, obj: Worker) -> dict[str, Any] | None:
        revision = obj.effective_desired_revision()
        return RevisionRefSerializer(revision).data if revision is not None else None

    def get_drifting(self, obj: Worker) -> bool:
        return obj.is_drifting(self.context.get("now"))

    def validate_labels(self, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise serializers.ValidationError("must be an object of string values.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        worker = self.instance
        assert worker is not None  # workers are created by registering, never here
        if "desired_revision" in attrs:
            errors = worker.revision_errors(attrs["desired_revision"])
            if errors:
                raise serializers.ValidationError(errors)
        if "pool" in attrs and attrs["pool"] is not None and worker.desired_revision_id is None:
            errors = worker.revision_errors(attrs["pool"].desired_revision)
            if errors:
                raise serializers.ValidationError({"pool": errors["desired_revision"]})
        return attrs

    def apply(self, worker: Worker, validated: dict[str, Any]) -> None:
        worker.labels = validated.get("labels", worker.labels)
        if "pool" in validated:
            worker.pool = validated["pool"]
        worker.save(update_fields=["labels", "pool"])
        revision = validated.get("desired_revision", worker.desired_revision)
        # set_desired_revision re-derives drift, which a pool move changes too.
        worker.set_desired_revision(revision, now=timezone.now())


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("pool", str, description="pool id or name"),
            OpenApiParameter("state", str, enum=[state.label for state in WorkerState]),
            OpenApiParameter("drifting", bool, description="desired ≠ running past the grace period"),
        ]
    )
)
class WorkerViewSet(
    AuditedMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Workers enroll themselves (POST /agent/register/); here they are read,
    repointed (pool, per-worker revision override, labels), drained,
    cordoned and deleted."""

    serializer_class = WorkerSerializer
    http_method_names = ["get", "patch", "post", "delete", "head", "options"]  # no PUT: few fields are writable

    def get_queryset(self) -> QuerySet[Worker]:
        qs = Worker.objects.select_related(
            "pool__desired_revision__profile", "desired_revision__profile", "running_revision__profile"
        )
        params = self.request.query_params
        pool_id, pool_name = query_id_or_name(self.request, "pool")
        if pool_id is not None:
            qs = qs.filter(pool_id=pool_id)
        elif pool_name is not None:
            qs = qs.filter(pool__name=pool_name)
        if (state := params.get("state")) is not None:
            if state not in STATE_BY_LABEL:
                raise serializers.ValidationError({"state": [f"must be one of {', '.join(STATE_BY_LABEL)}."]})
            qs = qs.filter(state=STATE_BY_LABEL[state])
        drifting = params.get("drifting")
        if drifting in ("true", "1"):
            qs = qs.drifting()
        elif drifting in ("false", "0"):
            qs = qs.exclude(pk__in=Worker.objects.drifting().values("pk"))
        elif drifting is not None:  # a filter that is not a boolean must not read as no filter
            raise serializers.ValidationError({"drifting": ["must be true or false."]})
        return qs

    def _flag(self, request: Request, verb: str) -> Response:
        worker = self.get_object()
        worker.flag_action(verb, request.user)
        return Response(self.get_serializer(worker).data)

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Tell the worker to stop admitting and finish what it runs (and cordon it)."""
        return self._flag(request, "drain")

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str | None = None) -> Response:
        """Let it admit again; it stays cordoned until uncordoned."""
        return self._flag(request, "undrain")

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str | None = None) -> Response:
        """The gateway sends it no new requests; it keeps serving what it has."""
        return self._flag(request, "cordon")

    @extend_schema(request=None, responses=WorkerSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str | None = None) -> Response:
        return self._flag(request, "uncordon")

    def perform_destroy(self, instance: Worker) -> None:
        pk = instance.pk
        super().perform_destroy(instance)
        live.publish(live.Event.WORKER_CHANGED, worker_id=pk, deleted=True)


# ---- the agent's endpoints -------------------------------------------------------
class WorkerSecretAuthentication(BaseAuthentication):
    """``Authorization: Bearer <worker secret>``; request.auth is the Worker."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[Any, Worker] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("expected 'Authorization: Bearer <worker secret>'.")
        worker = Worker.authenticate(header[1].decode(errors="replace"))
        if worker is None:
            raise exceptions.AuthenticationFailed("unknown worker secret; register again.")
        from django.contrib.auth.models import AnonymousUser

        return AnonymousUser(), worker

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="worker"'


class WorkerSecretScheme(OpenApiAuthenticationExtension):
    target_class = WorkerSecretAuthentication
    name = "workerSecret"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "the secret a worker got at registration"}


RegisterRequestDoc = inline_serializer(
    "AgentRegisterRequest",
    {
        "contract_version": serializers.IntegerField(),
        "enroll_token": serializers.CharField(),
        "name": serializers.CharField(),
        "url": serializers.URLField(),
        "engine_kind": serializers.ChoiceField(choices=list(ENGINE_KINDS)),
        "model": serializers.CharField(required=False),
        "max_model_len": serializers.IntegerField(required=False),
        "hardware": serializers.DictField(required=False),
        "labels": serializers.DictField(child=serializers.CharField(), required=False),
    },
)
RegisterReplyDoc = inline_serializer(
    "AgentRegisterReply",
    {
        "worker_id": serializers.IntegerField(),
        "secret": serializers.CharField(),
        "heartbeat_interval_seconds": serializers.FloatField(),
    },
)
ProfileRefDoc = inline_serializer(
    "AgentProfileRef",
    {
        "revision_id": serializers.IntegerField(),
        "name": serializers.CharField(),
        "revision": serializers.IntegerField(),
        "fields": serializers.DictField(),
    },
)
HeartbeatRequestDoc = inline_serializer(
    "AgentHeartbeatRequest",
    {
        "contract_version": serializers.IntegerField(),
        "state": serializers.ChoiceField(choices=list(contract.AGENT_STATES)),
        "load": serializers.DictField(required=False),
        "running_revision_id": serializers.IntegerField(allow_null=True, required=False),
        "running_profile": serializers.DictField(required=False),
        "hardware": serializers.DictField(required=False),
        "apply_error": serializers.CharField(allow_null=True, required=False),
        "url": serializers.URLField(
            allow_null=True, required=False, help_text="where the worker listens now; the control plane updates it"
        ),
        "health_error": serializers.CharField(
            allow_null=True, required=False, help_text="why the engine cannot serve (state unhealthy)"
        ),
    },
)
HeartbeatReplyDoc = inline_serializer(
    "AgentHeartbeatReply",
    {
        "worker_id": serializers.IntegerField(),
        "desired": ProfileRefDoc,
        "drain": serializers.BooleanField(),
        "heartbeat_interval_seconds": serializers.FloatField(),
    },
)


class AgentRegisterView(APIView):
    """Exchange an enrollment token for this worker's own secret."""

    authentication_classes: list[type[BaseAuthentication]] = []
    permission_classes: list[type[BasePermission]] = []

    @extend_schema(request=RegisterRequestDoc, responses={201: RegisterReplyDoc}, auth=[], tags=["agent"])
    def post(self, request: Request) -> Response:
        if not isinstance(request.data, dict) or not request.data.get("enroll_token"):
            # No credential at all is 401, like every other endpoint; a body
            # that carries one but breaks the contract is 400 by field.
            raise exceptions.NotAuthenticated("an enrollment token (enroll_token) is required.")
        req = contract.parse_register(request.data)
        interval_seconds = heartbeat_interval_seconds()  # grows with the fleet; the worker row records it
        try:
            worker, secret = Worker.register(req, heartbeat_interval_seconds=interval_seconds)
        except EnrollmentRefused as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from exc
        reply = contract.RegisterReply(worker_id=worker.pk, secret=secret, heartbeat_interval_seconds=interval_seconds)
        return Response(reply, status=status.HTTP_201_CREATED)

    def get_authenticate_header(self, request: Request) -> str:
        # An enrollment token is a credential too: a bad one is 401, not 403.
        return 'Bearer realm="enrollment"'


class AgentHeartbeatView(APIView):
    """A worker's periodic report; the reply says what it should run.

    Served in production by the ASGI fast path (``fleet.heartbeat``); this
    view runs the same ``heartbeat_response()`` for the test client and
    carries the endpoint's OpenAPI description."""

    authentication_classes = [WorkerSecretAuthentication]  # for the schema; checked below
    permission_classes: list[type[BasePermission]] = []

    def perform_authentication(self, request: Request) -> None:
        pass  # heartbeat_response authenticates, exactly as the fast path does

    @extend_schema(request=HeartbeatRequestDoc, responses=HeartbeatReplyDoc, tags=["agent"])
    def post(self, request: Request) -> Response:
        status_code, payload, headers = heartbeat_response(request.headers.get("Authorization"), request.body)
        return Response(payload, status=status_code, headers=headers)


__all__ = [
    "PoolViewSet",
    "EnrollmentTokenViewSet",
    "WorkerViewSet",
    "AgentRegisterView",
    "AgentHeartbeatView",
]
