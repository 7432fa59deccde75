"""Workloads and experiments over the API.

    GET    /api/v1/workloads/                  newest versions first
    POST   /api/v1/workloads/                  {name, source: request_log, start, end, pool?, model?}
                                               {name, source: loadgen, scenario, rate, duration_seconds, seed?}
    GET    /api/v1/workloads/<id>/             with its histograms (``spec``: what ``python -m workers replay`` takes)
    DELETE /api/v1/workloads/<id>/             one no experiment uses
    GET    /api/v1/experiments/                newest first
    POST   /api/v1/experiments/                {name, workload, workers: [names], arms?: [{name, fields}],
                                                baseline?: arm name, baseline_revision?: revision id,
                                                duration_seconds?, warmup_seconds?, repeats? (3), rate_scale?,
                                                objectives?: {ttft_ms, tpot_ms, stall_ms?},
                                                capacity_rate_scales?: [rising multiples of the rate],
                                                capacity_seconds?, mode?: measure | predict}
    GET    /api/v1/experiments/<id>/           with its arms, their results, each arm's conditions beside the
                                               workload's (``conditions``) and the recommendation
    POST   /api/v1/experiments/<id>/abort/     {reason?}: the workers are restored first
    POST   /api/v1/experiments/<id>/adopt/     {arm?, profile?}: the arm (default: the recommended one) as a
                                               profile revision, for "New rollout"
    POST   /api/v1/experiments/<id>/verify/    {repeats?}: a prediction's best arms and baseline measured on its
                                               lab workers (a new experiment, ``verifies`` the prediction)

Predict mode (``mode: predict``) runs the arms in virtual time on the
simulated device of the lab worker's own GPU and model; a worker none can
stand for (a vLLM worker) is a 400 naming ``mode``. A verification's detail
has ``predicted``: per arm, the prediction's figures beside its own.

Every write is a model method with its audit row. An arm an engine refuses
is a 400 naming ``arms[i].<field>``; an empty window a 400 with its count.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.urls import reverse
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.inputs import StrictModelSerializer, StrictSerializer
from controlplane.audit.api import AuditedMixin
from controlplane.experiments.models import DEFAULT_OBJECTIVES, Arm, Experiment, Mode, Workload
from controlplane.experiments.recommend import DEFAULT_REPEATS
from controlplane.fleet.models import Pool, Worker
from controlplane.profiles.models import Profile, ProfileRevision
from workers import loadgen

# Upper bounds of what a client controls: every size, count and duration.
MAX_LOADGEN_RATE = 1000.0  # requests per second
MAX_LOADGEN_SECONDS = 24 * 3600.0
MAX_LOADGEN_REQUESTS = 10_000  # rate × duration, drawn in the request: 2.3 s and a 50 MB heap peak (bench_workload)


class WorkloadSerializer(StrictModelSerializer):
    class Meta:
        model = Workload
        fields = ["id", "name", "version", "source", "filters", "spec", "num_requests", "created"]
        read_only_fields = fields


class WorkloadCreateSerializer(StrictSerializer):
    name = serializers.SlugField(max_length=100)
    source = serializers.ChoiceField(choices=["request_log", "loadgen"])
    start = serializers.DateTimeField(required=False, help_text="request_log: the window's start")
    end = serializers.DateTimeField(required=False, help_text="request_log: the window's end")
    pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all(), required=False, allow_null=True)
    model = serializers.CharField(required=False, allow_blank=True, default="")
    scenario = serializers.ChoiceField(choices=list(loadgen.SCENARIOS), required=False)
    rate = serializers.FloatField(required=False, min_value=0.001, max_value=MAX_LOADGEN_RATE)
    duration_seconds = serializers.FloatField(required=False, min_value=1.0, max_value=MAX_LOADGEN_SECONDS)
    seed = serializers.IntegerField(required=False, default=0, min_value=0, max_value=2**32 - 1)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        needed = ("start", "end") if attrs["source"] == "request_log" else ("scenario", "rate", "duration_seconds")
        missing = {name: [f"required for source {attrs['source']}."] for name in needed if attrs.get(name) is None}
        if missing:
            raise serializers.ValidationError(missing)
        if attrs["source"] == "loadgen" and attrs["rate"] * attrs["duration_seconds"] > MAX_LOADGEN_REQUESTS:
            # The workload is drawn inside the request: bounded so one call
            # cannot take the web process's memory (1.6e308 s grew it to 18 GB).
            raise serializers.ValidationError(
                {
                    "duration_seconds": [
                        f"rate × duration_seconds is {attrs['rate'] * attrs['duration_seconds']:.0f} requests; "
                        f"a loadgen workload holds at most {MAX_LOADGEN_REQUESTS}."
                    ]
                }
            )
        return attrs


class ArmSerializer(StrictModelSerializer):
    status = serializers.CharField(source="status_label", read_only=True)
    chunk_size = serializers.IntegerField(read_only=True, allow_null=True)
    conditions = serializers.SerializerMethodField(
        help_text="requests sent and completed, achieved rate and prefix-hit share beside the workload's; "
        "not_comparable: each way they were more than 10% off"
    )

    def get_conditions(self, arm: Arm) -> dict[str, Any]:
        return arm.conditions().to_json()

    class Meta:
        model = Arm
        fields = [
            "id",
            "index",
            "name",
            "fields",
            "revision",
            "chunk_size",
            "status",
            "conditions",
            "attempts",
            "results",
            "ramp",
            "capacity",
            "summary",
            "error",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class ExperimentSerializer(StrictModelSerializer):
    phase = serializers.CharField(source="phase_label", read_only=True)
    workers = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)

    class Meta:
        model = Experiment
        fields = [
            "id",
            "name",
            "workload",
            "workers",
            "profile",
            "duration_seconds",
            "warmup_seconds",
            "repeats",
            "baseline",
            "rate_scale",
            "objectives",
            "capacity_rate_scales",
            "capacity_seconds",
            "mode",
            "simulation",
            "verifies",
            "phase",
            "message",
            "abort_requested",
            "abort_reason",
            "progress",
            "recommendation",
            "created",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class ExperimentDetailSerializer(ExperimentSerializer):
    arms = ArmSerializer(many=True, read_only=True)
    verifications = serializers.PrimaryKeyRelatedField(many=True, read_only=True)
    predicted = serializers.SerializerMethodField(
        help_text="a verification: per arm, the prediction's figures (predicted) beside the measured ones"
    )

    def get_predicted(self, experiment: Experiment) -> list[dict[str, Any]] | None:
        return experiment.predicted_against_measured() if experiment.verifies_id else None

    class Meta(ExperimentSerializer.Meta):
        fields = [*ExperimentSerializer.Meta.fields, "previous", "arms", "verifications", "predicted"]
        read_only_fields = fields


class ArmInputSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    fields = serializers.DictField(help_text="engine profile knobs; missing ones take their defaults")


class ExperimentCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    workload = serializers.PrimaryKeyRelatedField(queryset=Workload.objects.all())
    workers = serializers.SlugRelatedField(slug_field="name", queryset=Worker.objects.all(), many=True)
    arms = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="[{name, fields}]; default: the pools' current profile as the baseline (a monolithic arm beside a "
        "chunked one) and chunk caps 256, 512, 1024, 2048 that keep its other knobs",
    )
    duration_seconds = serializers.FloatField(required=False, default=60.0, max_value=3600.0)
    warmup_seconds = serializers.FloatField(required=False, default=10.0, max_value=600.0)
    repeats = serializers.IntegerField(
        required=False,
        default=DEFAULT_REPEATS,
        min_value=1,
        max_value=20,
        help_text="paired repeats; one names no winner",
    )
    baseline = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        help_text="the arm the others are set beside; default: the one named baseline, else the first",
    )
    baseline_revision = serializers.PrimaryKeyRelatedField(
        queryset=ProfileRevision.objects.all(),
        required=False,
        allow_null=True,
        help_text="default arms only: the baseline runs this revision instead of the pools' current profile",
    )
    rate_scale = serializers.FloatField(required=False, default=1.0, min_value=0.001, max_value=100.0)
    objectives = serializers.DictField(
        child=serializers.FloatField(min_value=0.001, max_value=3_600_000.0),
        required=False,
        help_text=f"P99 objectives in ms; default {DEFAULT_OBJECTIVES}",
    )
    capacity_rate_scales = serializers.ListField(
        child=serializers.FloatField(min_value=0.001, max_value=100.0),
        required=False,
        default=list,
        max_length=20,
        help_text="measure each arm's serving capacity: replay at these rising multiples of the rate, up to the "
        "first at which fewer than 90% of the requests meet both objectives; default: not measured",
    )
    capacity_seconds = serializers.FloatField(
        required=False, default=30.0, max_value=600.0, help_text="replay per ramp point"
    )
    mode = serializers.ChoiceField(
        choices=Mode.choices,
        required=False,
        default=Mode.MEASURE,
        help_text="measure: on the lab workers, out of traffic; predict: in virtual time on the simulated device "
        "of the lab worker's own GPU and model, repeated until the intervals are narrow",
    )


class AbortSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class AdoptSerializer(StrictSerializer):
    arm = serializers.CharField(required=False, help_text="an arm's name; default: the recommended one")
    profile = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Profile.objects.all(),
        required=False,
        help_text="revise this profile; default: what the workers ran before",
    )


class VerifySerializer(StrictSerializer):
    repeats = serializers.IntegerField(required=False, default=DEFAULT_REPEATS, min_value=1, max_value=20)


class AdoptedSerializer(StrictSerializer):
    revision = serializers.IntegerField()
    profile = serializers.CharField()
    new_rollout_url = serializers.CharField()


@extend_schema_view(create=extend_schema(request=WorkloadCreateSerializer, responses={201: WorkloadSerializer}))
class WorkloadViewSet(
    AuditedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """Workloads captured from the request log or a loadgen scenario."""

    serializer_class = WorkloadSerializer
    queryset = Workload.objects.all()

    def create(self, request: Request) -> Response:
        body = WorkloadCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = body.validated_data
        if v["source"] == "request_log":
            workload = Workload.capture(
                name=v["name"],
                start=v["start"],
                end=v["end"],
                pool=v.get("pool"),
                model=v.get("model", ""),
                actor=request.user,
            )
        else:
            workload = Workload.from_scenario(
                name=v["name"],
                scenario=v["scenario"],
                rate=v["rate"],
                duration_seconds=v["duration_seconds"],
                seed=v.get("seed", 0),
                actor=request.user,
            )
        return Response(WorkloadSerializer(workload).data, status=status.HTTP_201_CREATED)


@extend_schema_view(
    create=extend_schema(request=ExperimentCreateSerializer, responses={201: ExperimentDetailSerializer}),
    retrieve=extend_schema(responses=ExperimentDetailSerializer),
)
class ExperimentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Chunk-size sweeps. Buttons set flags; the runner acts on them."""

    def get_queryset(self) -> QuerySet[Experiment]:
        qs = Experiment.objects.prefetch_related("workers")
        if self.action == "retrieve":
            qs = qs.prefetch_related("arms")
        return qs

    def get_serializer_class(self) -> type[serializers.BaseSerializer]:
        if self.action == "create":
            return ExperimentCreateSerializer
        return ExperimentDetailSerializer if self.action == "retrieve" else ExperimentSerializer

    def create(self, request: Request) -> Response:
        body = ExperimentCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = body.validated_data
        experiment = Experiment.create(
            name=v["name"],
            workload=v["workload"],
            workers=list(v["workers"]),
            arms=v.get("arms"),
            duration_seconds=v["duration_seconds"],
            warmup_seconds=v["warmup_seconds"],
            repeats=v["repeats"],
            baseline=v["baseline"],
            baseline_revision=v.get("baseline_revision"),
            rate_scale=v["rate_scale"],
            objectives=v.get("objectives"),
            capacity_rate_scales=v["capacity_rate_scales"],
            capacity_seconds=v["capacity_seconds"],
            mode=v["mode"],
            actor=request.user,
        )
        return Response(
            ExperimentDetailSerializer(self.get_queryset().get(pk=experiment.pk)).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(request=VerifySerializer, responses={201: ExperimentDetailSerializer})
    @action(detail=True, methods=["post"])
    def verify(self, request: Request, pk: str | None = None) -> Response:
        body = VerifySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        experiment = get_object_or_404(Experiment, pk=pk)
        verification = experiment.verify(request.user, repeats=body.validated_data["repeats"])
        return Response(
            ExperimentDetailSerializer(
                Experiment.objects.prefetch_related("workers", "arms").get(pk=verification.pk)
            ).data,
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(request=AbortSerializer, responses=ExperimentSerializer)
    @action(detail=True, methods=["post"])
    def abort(self, request: Request, pk: str | None = None) -> Response:
        body = AbortSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        experiment = get_object_or_404(Experiment, pk=pk)
        if not experiment.request_abort(request.user, body.validated_data["reason"]):
            raise serializers.ValidationError(
                {"non_field_errors": [f"the experiment is {experiment.phase_label}; nothing to abort."]}
            )
        return Response(ExperimentSerializer(self.get_queryset().get(pk=experiment.pk)).data)

    @extend_schema(request=AdoptSerializer, responses={201: AdoptedSerializer})
    @action(detail=True, methods=["post"])
    def adopt(self, request: Request, pk: str | None = None) -> Response:
        body = AdoptSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        experiment = get_object_or_404(Experiment, pk=pk)
        arm = None
        if name := body.validated_data.get("arm"):
            arm = experiment.arms.filter(name=name).first()
            if arm is None:
                raise serializers.ValidationError({"arm": [f"no arm named {name!r}."]})
        revision = experiment.adopt(request.user, profile=body.validated_data.get("profile"), arm=arm)
        return Response(
            {
                "revision": revision.pk,
                "profile": revision.profile.name,
                "new_rollout_url": f"{reverse('rollout-new')}?revision={revision.pk}",
            },
            status=status.HTTP_201_CREATED,
        )
