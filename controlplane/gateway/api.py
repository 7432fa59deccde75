"""Routing tables, gateways and client keys over the API.

    GET    /api/v1/routing/                  every table, with its acks
    GET    /api/v1/routing/<model>/          one table, with its acks
    PUT    /api/v1/routing/<model>/          set its pools, roles and weights (creates it)
    PATCH  /api/v1/routing/<model>/          change weights and/or the output cap:
                                             {"weights": {"canary": 2000, "stable": 8000}, "max_output_tokens": 512}
    DELETE /api/v1/routing/<model>/
    GET    /api/v1/routing/<model>/acks/     ?epoch=N&wait=S: wait up to S seconds for every gateway's ack
    GET    /api/v1/gateways/                 live gateways and the epochs they applied
    CRUD   /api/v1/client-keys/              admins only; the key is in the create reply alone
    GET    /api/v1/requests/                 the request log: filters, sort, keyset cursor (explorer.py)
    GET    /api/v1/requests/export/          the same filtered set, streamed: ?as=csv or jsonl
    GET    /api/v1/requests/<id>/            one request with its timeline and token gaps

Views parse, call one model method, render. Every change is audited by the
model method (routing) or the audited viewset (keys).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ValidationError
from django.core.handlers.asgi import ASGIRequest
from django.db import DatabaseError, transaction
from django.db.models import QuerySet
from django.http import HttpResponseBase, StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.inputs import StrictSerializer
from controlplane.accounts.roles import Role
from controlplane.audit.api import AuditedModelViewSet, AuditedSerializer
from controlplane.fleet.models import Pool
from controlplane.fleet.pools import ROLES, PoolRole
from controlplane.gateway import bus, explorer
from controlplane.gateway.cohort import NUM_BUCKETS
from controlplane.gateway.models import (
    MAX_OUTPUT_TOKENS_LIMIT,
    ClientKey,
    PoolSpec,
    RequestLog,
    RoutingTable,
)

MAX_ACK_WAIT_SECONDS = 10.0


# ---- serializers -----------------------------------------------------------------
class RoutingPoolSerializer(StrictSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all())
    role = serializers.ChoiceField(choices=ROLES)
    weight_bp = serializers.IntegerField(min_value=0, max_value=NUM_BUCKETS)


class TableConfigSerializer(StrictSerializer):
    pools = RoutingPoolSerializer(many=True, help_text="the whole table: pools left out are removed")
    salt = serializers.CharField(
        max_length=64, required=False, help_text="changing it reshuffles every sticky key; omit to keep it"
    )
    max_output_tokens = serializers.IntegerField(
        min_value=1,
        max_value=MAX_OUTPUT_TOKENS_LIMIT,
        required=False,
        allow_null=True,
        help_text="cap on the output tokens one request may ask for (more is refused with a 400; a request naming "
        "no limit gets the cap); null: no cap; omit to keep it",
    )
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class WeightsSerializer(StrictSerializer):
    weights = serializers.DictField(
        child=serializers.IntegerField(min_value=0, max_value=NUM_BUCKETS),
        allow_empty=False,
        required=False,
        help_text='basis points by role or pool name, e.g. {"canary": 2000, "stable": 8000}; others keep theirs',
    )
    max_output_tokens = serializers.IntegerField(
        min_value=1,
        max_value=MAX_OUTPUT_TOKENS_LIMIT,
        required=False,
        allow_null=True,
        help_text="cap on the output tokens one request may ask for; null: no cap; omit to keep it",
    )
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "weights" not in attrs and "max_output_tokens" not in attrs:
            raise serializers.ValidationError({"weights": ["give `weights`, `max_output_tokens` or both."]})
        return attrs


class GatewayAckSerializer(StrictSerializer):
    id = serializers.CharField()
    address = serializers.CharField()
    hostname = serializers.CharField()
    pid = serializers.IntegerField()
    started_at = serializers.FloatField(help_text="unix time")
    last_seen = serializers.FloatField(help_text="unix time")
    acked_epoch = serializers.IntegerField()
    current = serializers.BooleanField(help_text="acked the table's current epoch (or a later one)")


class AckStatusSerializer(StrictSerializer):
    epoch = serializers.IntegerField()
    state = serializers.ChoiceField(
        choices=[bus.ACKS_COMPLETE, bus.ACKS_PENDING, bus.ACKS_UNKNOWN],
        help_text="unknown while Redis, where gateways ack, is unreachable (gateways is then empty)",
    )
    complete = serializers.BooleanField(help_text="every live gateway applied this epoch (false while unknown)")
    gateways = GatewayAckSerializer(many=True)


class RoutingTableSerializer(StrictSerializer):
    model = serializers.CharField()
    salt = serializers.CharField()
    epoch = serializers.IntegerField()
    updated_at = serializers.DateTimeField()
    max_output_tokens = serializers.IntegerField(
        allow_null=True, help_text="cap on one request's output tokens; null: none (the workers' default)"
    )
    pools = serializers.SerializerMethodField()
    acks = serializers.SerializerMethodField()

    @extend_schema_field(RoutingPoolSerializer(many=True))
    def get_pools(self, table: RoutingTable) -> list[dict[str, Any]]:
        return [{"pool": m.pool.name, "role": m.role, "weight_bp": m.weight_bp} for m in _members(table)]

    @extend_schema_field(AckStatusSerializer)
    def get_acks(self, table: RoutingTable) -> dict[str, Any]:
        gateways = self.context["gateways"] if "gateways" in self.context else bus.live_gateways_if_known()
        return bus.AckStatus(table.pk, table.epoch, gateways).as_dict()


def _members(table: RoutingTable) -> list[Any]:
    prefetched = getattr(table, "_prefetched_objects_cache", {}).get("pools")
    members = list(prefetched) if prefetched is not None else list(table.pools.select_related("pool"))
    return sorted(members, key=lambda m: PoolRole(m.role).order)


def _tables() -> QuerySet[RoutingTable]:
    return RoutingTable.objects.prefetch_related("pools__pool")


def _render(table: RoutingTable, **context: Any) -> dict[str, Any]:
    fresh = _tables().get(pk=table.pk)
    return RoutingTableSerializer(fresh, context=context).data


# ---- routing tables ------------------------------------------------------------------
class RoutingTableListView(APIView):
    """Every routing table, with where each live gateway stands on it."""

    @extend_schema(responses=RoutingTableSerializer(many=True))
    def get(self, request: Request) -> Response:
        gateways = bus.live_gateways_if_known()
        return Response(RoutingTableSerializer(_tables(), many=True, context={"gateways": gateways}).data)


class RoutingTableView(APIView):
    """One model's routing table. Weights are in basis points and sum to
    10000; a pool given more traffic must have a ready worker. Every change
    bumps the epoch, writes an audit row and tells the gateways."""

    @extend_schema(responses=RoutingTableSerializer)
    def get(self, request: Request, model: str) -> Response:
        return Response(RoutingTableSerializer(get_object_or_404(_tables(), model=model)).data)

    @extend_schema(request=TableConfigSerializer, responses={200: RoutingTableSerializer, 201: RoutingTableSerializer})
    def put(self, request: Request, model: str) -> Response:
        body = TableConfigSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        specs = [PoolSpec(p["pool"], p["role"], p["weight_bp"]) for p in data["pools"]]
        with transaction.atomic():
            table = RoutingTable.objects.filter(model=model).first()
            created = table is None
            if table is None:
                table = RoutingTable.create_audited(model, actor=request.user, salt=data.get("salt"))
            table.configure(specs, actor=request.user, reason=data["reason"], salt=data.get("salt"))
            if "max_output_tokens" in data:
                table.set_output_cap(data["max_output_tokens"], actor=request.user, reason=data["reason"])
        return Response(_render(table), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(request=WeightsSerializer, responses=RoutingTableSerializer)
    def patch(self, request: Request, model: str) -> Response:
        body = WeightsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        table = get_object_or_404(RoutingTable, model=model)
        data = body.validated_data
        with transaction.atomic():
            if "weights" in data:
                table.set_weights(data["weights"], actor=request.user, reason=data["reason"])
            if "max_output_tokens" in data:
                table.set_output_cap(data["max_output_tokens"], actor=request.user, reason=data["reason"])
        return Response(_render(table))

    @extend_schema(responses={204: None})
    def delete(self, request: Request, model: str) -> Response:
        table = get_object_or_404(RoutingTable, model=model)
        table.delete_audited(actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class RoutingAcksView(APIView):
    """Where the live gateways stand on an epoch of the table; with ``wait``,
    the reply comes as soon as all have acked or the wait is over."""

    @extend_schema(
        parameters=[
            OpenApiParameter("epoch", int, description="default: the table's current epoch"),
            OpenApiParameter(
                "wait", float, description=f"seconds to wait for every ack, at most {MAX_ACK_WAIT_SECONDS:g}"
            ),
        ],
        responses=AckStatusSerializer,
    )
    def get(self, request: Request, model: str) -> Response:
        table = get_object_or_404(RoutingTable, model=model)
        params = request.query_params
        epoch = _number(params, "epoch", int, table.epoch, minimum=1)
        wait = min(_number(params, "wait", float, 0.0, minimum=0.0), MAX_ACK_WAIT_SECONDS)
        result = table.wait_for_acks(epoch, wait) if wait > 0 else table.ack_status(epoch)
        return Response(result.as_dict())


def _number(params: Any, name: str, kind: type, default: Any, *, minimum: float) -> Any:
    raw = params.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise serializers.ValidationError({name: [f"must be a {'whole ' if kind is int else ''}number."]}) from None
    if value < minimum:
        raise serializers.ValidationError({name: [f"must be at least {minimum:g}."]})
    return value


class GatewayListView(APIView):
    """Gateways whose liveness record is fresh, with the epoch they applied
    of each table (by model)."""

    @extend_schema(
        responses=inline_serializer(
            "Gateway",
            {
                "id": serializers.CharField(),
                "address": serializers.CharField(),
                "hostname": serializers.CharField(),
                "pid": serializers.IntegerField(),
                "started_at": serializers.FloatField(),
                "last_seen": serializers.FloatField(),
                "epochs": serializers.DictField(child=serializers.IntegerField(), help_text="by model"),
            },
            many=True,
        )
    )
    def get(self, request: Request) -> Response:
        names = dict(RoutingTable.objects.values_list("id", "model"))
        out = []
        for gateway in bus.live_gateways():
            data = gateway.as_dict()
            acks = data.pop("acks")
            data["epochs"] = {names[int(t)]: e for t, e in acks.items() if t.isdigit() and int(t) in names}
            out.append(data)
        return Response(out)


# ---- client keys ----------------------------------------------------------------------
class ClientKeySerializer(AuditedSerializer):
    key = serializers.SerializerMethodField(help_text="the key itself: in the create reply only, never again")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = ClientKey
        fields = [
            "id",
            "name",
            "key",
            "key_prefix",
            "is_admin",
            "max_output_tokens",
            "active",
            "created",
            "created_by",
            "last_used",
        ]
        read_only_fields = ["key_prefix", "created", "last_used"]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_key(self, obj: ClientKey) -> str | None:
        return getattr(obj, "plaintext", None)

    def create(self, validated: dict[str, Any]) -> ClientKey:
        key, plaintext = ClientKey.issue(actor=self.actor(), created_by=self.actor(), **validated)
        key.plaintext = plaintext  # type: ignore[attr-defined]
        return key

    def update(self, instance: ClientKey, validated: dict[str, Any]) -> ClientKey:
        key = super().update(instance, validated)
        key.announce()
        return key


class ClientKeyViewSet(AuditedModelViewSet):
    """Keys clients send to the gateway. Admins only, reads included: even
    a key's name says who may call. ``active: false`` revokes a key and keeps
    its history; delete removes it."""

    serializer_class = ClientKeySerializer
    read_role = Role.ADMIN
    write_role = Role.ADMIN

    def get_queryset(self) -> QuerySet[ClientKey]:
        return ClientKey.objects.select_related("created_by")

    def perform_destroy(self, instance: ClientKey) -> None:
        with transaction.atomic():
            instance.announce()
            super().perform_destroy(instance)


# ---- the request log ---------------------------------------------------------------------
# An empty value of a filter is no filter (the explorer's form sends every field).
def _number_or_empty(name: str, kind: str, description: str = "") -> OpenApiParameter:
    """A numeric filter whose empty value is the same as leaving it out
    (``explorer.parse``: the page's filter form sends every field, empty
    or not), and the schema says so."""
    return OpenApiParameter(
        name, {"anyOf": [{"type": kind}, {"type": "string", "enum": [""]}]}, description=description
    )


_REQUEST_FILTERS = [
    OpenApiParameter("since", str, description="ISO 8601 time, inclusive"),
    OpenApiParameter("until", str, description="ISO 8601 time, exclusive"),
    OpenApiParameter("model", str),
    OpenApiParameter("cohort", str, enum=["", *ROLES]),
    OpenApiParameter("pool", str, description="pool name"),
    OpenApiParameter("worker", str, description="worker name"),
    _number_or_empty("revision", "integer", "profile revision id"),
    OpenApiParameter("prefill_mode", str, enum=["", "chunked", "monolithic"]),
    OpenApiParameter("split", str, enum=["", *explorer.SPLITS], description="chunked: the prompt was split"),
    OpenApiParameter("status", str, description="an HTTP status, ok or failed"),
    OpenApiParameter("bucket", str, description="prompt-length bucket: <=512, <=2K, <=8K, <=32K, >32K"),
    OpenApiParameter("slow_by", str, enum=["", *explorer.SLOW_BY]),
    _number_or_empty("slow_above", "number", "seconds: only rows whose slow_by figure is above"),
    OpenApiParameter("sort", str, enum=["", *explorer.SORTS]),
    OpenApiParameter("order", str, enum=["", "desc", "asc"]),
]
_STORE_DOWN = {"detail": "the request log's database is unavailable; retry shortly."}


class RequestListView(APIView):
    """The gateways' request log, filtered and sorted, one keyset page at a
    time: pass ``next`` back as ``cursor`` for the next page."""

    @extend_schema(
        operation_id="requests_list",
        parameters=[*_REQUEST_FILTERS, OpenApiParameter("cursor", str), _number_or_empty("limit", "integer")],
        responses=inline_serializer(
            "RequestPage",
            {
                "results": serializers.ListField(child=serializers.DictField()),
                "next": serializers.CharField(allow_null=True),
            },
        ),
    )
    def get(self, request: Request) -> Response:
        query = explorer.parse(request.query_params)
        try:
            rows, cursor = query.page()
        except DatabaseError:
            return Response(_STORE_DOWN, status=503)
        return Response({"results": rows, "next": cursor})


class RequestDetailView(APIView):
    """One request: its row, its timeline and the gaps between its tokens."""

    @extend_schema(
        responses=inline_serializer(
            "RequestDetail",
            {
                "request": serializers.DictField(),
                "timeline": serializers.ListField(child=serializers.DictField()),
                "gaps": serializers.ListField(child=serializers.FloatField()),
            },
        )
    )
    def get(self, request: Request, pk: int) -> Response:
        try:
            row = get_object_or_404(RequestLog.objects.select_related("pool", "worker"), pk=pk)
        except DatabaseError:
            return Response(_STORE_DOWN, status=503)
        data = {c: getattr(row, c) for c in explorer.COLUMNS if c not in ("pool", "worker")}
        data["pool"] = row.pool.name if row.pool else None
        data["worker"] = row.worker.name if row.worker else None
        return Response(
            {
                "request": data,
                "timeline": [dataclasses.asdict(e) for e in explorer.timeline(row)],
                "gaps": explorer.gaps(row),
            }
        )


async def _pulled(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Each chunk read on Django's one synchronous thread, where the export's cursor lives."""

    def pull() -> bytes | None:
        return next(chunks, None)

    read = sync_to_async(pull, thread_sensitive=True)
    while (chunk := await read()) is not None:
        yield chunk


class RequestExportView(APIView):
    """The whole filtered set, streamed: ``as=csv`` or ``as=jsonl`` (not
    ``format``, which DRF keeps for its own renderers)."""

    @extend_schema(
        parameters=[*_REQUEST_FILTERS, OpenApiParameter("as", str, enum=["csv", "jsonl"])],
        responses={(200, "text/csv"): str, (200, "application/jsonl"): str},
    )
    def get(self, request: Request) -> HttpResponseBase:
        fmt = request.query_params.get("as", "csv")
        if fmt not in ("csv", "jsonl"):
            raise ValidationError({"as": ["csv or jsonl."]})
        query = explorer.parse(request.query_params)
        lines = explorer.csv_lines(query) if fmt == "csv" else explorer.jsonl_lines(query)
        try:
            first = next(lines, b"")  # opens the cursor: a database that is away is a 503, not a broken stream
        except DatabaseError:
            return Response(_STORE_DOWN, status=503)
        content_type = "text/csv; charset=utf-8" if fmt == "csv" else "application/jsonl; charset=utf-8"
        chunks = itertools.chain([first], lines)
        # Under ASGI a synchronous iterator would be read whole into memory
        # before the first byte went out: hand Django an async one there.
        body = _pulled(chunks) if isinstance(request._request, ASGIRequest) else chunks
        response = StreamingHttpResponse(body, content_type=content_type)
        response["Content-Disposition"] = f'attachment; filename="requests.{fmt}"'
        return response
