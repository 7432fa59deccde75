"""Experiments: a chunk-size sweep on the fleet's own traffic.

* A **workload** is what a window of the gateway's request log (or a loadgen
  scenario) looked like: lengths, rate, burstiness, prefix reuse
  (``workers.replay.WorkloadSpec``), never the users' text. Versioned by
  name: capturing a name again adds the next version.
* An **experiment** runs each of its **arms** (a monolithic baseline and a
  grid of chunked profiles) on a set of workers taken out of traffic: it
  cordons them (the gateway routes nothing to a cordoned worker, so their
  share of any routing table is 0), points them at the arm's revision
  exactly as a rollout moves a worker (a per-worker ``desired_revision``
  that the agent applies), warms up, replays the workload at its recorded
  rate and measures; at the end, or on abort, the workers go back to the
  revision and the cordon they had before.

Every arm is validated against every worker's engine when the experiment is
created, so an arm the engine would refuse is a 400 naming the arm and the
field, never a failure halfway through. ``runner`` drives an experiment
from this stored state; buttons only set flags.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Max, Q, QuerySet
from django.utils import timezone

from controlplane import audit, live
from controlplane.experiments.measure import Conditions, arm_conditions
from controlplane.experiments.recommend import DEFAULT_REPEATS
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog, RoutingPool
from controlplane.metrics.figures import DEFAULT_OBJECTIVES as SERVICE_OBJECTIVES
from controlplane.profiles.models import Profile, ProfileRevision
from workers import loadgen, predict
from workers.profile import EngineProfile, profile_errors
from workers.replay import Observed, WorkloadSpec, capture, from_plan

if TYPE_CHECKING:
    from controlplane.experiments.recommend import Recommendation

DEFAULT_CHUNK_SIZES = (256, 512, 1024, 2048)
# The service's default objectives (the overview's), in this app's milliseconds.
DEFAULT_OBJECTIVES = {
    "ttft_ms": 1000 * SERVICE_OBJECTIVES.ttft_seconds,
    "tpot_ms": 1000 * SERVICE_OBJECTIVES.tpot_seconds,
}


class Phase(IntEnum):
    """Ordered so that "finished" is one comparison."""

    PENDING = 0
    RUNNING = 10
    RESTORING = 20  # putting the workers back (after the last arm, or on abort)
    SUCCEEDED = 30
    ABORTED = 31
    FAILED = 32

    @property
    def finished(self) -> bool:
        return self >= Phase.SUCCEEDED

    @property
    def label(self) -> str:
        return self.name.lower()


class Mode(models.TextChoices):
    """How an experiment's arms run: on the lab workers, or in virtual time
    on the simulated device of the lab worker's own GPU and model."""

    MEASURE = "measure", "measured on lab workers"
    PREDICT = "predict", "predicted in virtual time"


# What a verification sets beside its prediction, arm by arm (measure.FIGURES keys).
COMPARED_FIGURES = ("goodput", "output_throughput", "client_ttft_p99", "client_stall_p99", "client_tpot_p99")
# A prediction repeats every arm until the intervals are narrow, or this many times.
PREDICT_MAX_REPEATS = 20
# "Verify on lab workers" measures the baseline and this many of the predicted best arms.
VERIFY_NUM_ARMS = 2


class ArmStatus(IntEnum):
    PENDING = 0
    RUNNING = 1
    SUCCEEDED = 2
    FAILED = 3
    SKIPPED = 4  # never run: the experiment was aborted first

    @property
    def finished(self) -> bool:
        return self >= ArmStatus.SUCCEEDED

    @property
    def label(self) -> str:
        return self.name.lower()


# ---- workloads ---------------------------------------------------------------------------


class Workload(audit.Audited, models.Model):
    audit_name = "workload"
    SOURCES = [("request_log", "request log"), ("loadgen", "loadgen scenario")]

    name = models.SlugField(max_length=100)
    version = models.PositiveIntegerField(default=1)
    source = models.CharField(max_length=16, choices=SOURCES)
    filters = models.JSONField(default=dict, blank=True, help_text="the window and filters, or the scenario")
    spec = models.JSONField(help_text="workers.replay.WorkloadSpec: histograms, rate, burstiness, prefix reuse")
    num_requests = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="workload_name_version")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"

    def workload_spec(self) -> WorkloadSpec:
        return WorkloadSpec.from_dict(self.spec)

    def audit_state(self) -> dict[str, Any]:
        data = audit.snapshot(self, fields=["name", "version", "source", "filters", "num_requests"])
        spec = self.spec or {}
        data.update({k: spec.get(k) for k in ("rate_per_second", "burstiness", "prefix_hit_share")})
        return data

    @classmethod
    def _next_version(cls, name: str) -> int:
        return (cls.objects.filter(name=name).aggregate(v=Max("version"))["v"] or 0) + 1

    @classmethod
    def _store(
        cls, actor: audit.Actor, name: str, source: str, filters: dict[str, Any], spec: WorkloadSpec
    ) -> Workload:
        user = actor if getattr(actor, "is_authenticated", False) else None
        with transaction.atomic():
            # Serialize versions of one name: the unique constraint would refuse a race.
            list(cls.objects.select_for_update().filter(name=name).values_list("pk", flat=True))
            return cls.create_audited(
                actor,
                name=name,
                version=cls._next_version(name),
                source=source,
                filters=filters,
                spec=spec.to_dict(),
                num_requests=spec.num_requests,
                created_by=user,
            )

    @classmethod
    def capture(
        cls,
        *,
        name: str,
        start: datetime,
        end: datetime,
        pool: Pool | None = None,
        model: str = "",
        actor: audit.Actor = None,
    ) -> Workload:
        """The workload of the request log's finished requests in
        [start, end), optionally of one pool or model. An empty window is
        refused, saying how many requests it held."""
        if end <= start:
            raise ValidationError({"end": ["must be after start."]})
        rows = RequestLog.objects.filter(created_at__gte=start, created_at__lt=end)
        if pool is not None:
            rows = rows.filter(pool=pool)
        if model:
            rows = rows.filter(model=model)
        held = rows.count()
        usable = rows.filter(status=200, error="", prompt_tokens__gt=0, output_tokens__gt=0)
        observed = [
            Observed((created - start).total_seconds(), prompt or 0, output or 0, cached or 0)
            for created, prompt, output, cached in usable.values_list(
                "created_at", "prompt_tokens", "output_tokens", "cached_tokens"
            ).iterator()
        ]
        if not observed:
            raise ValidationError(
                {
                    "window": [
                        f"the window held {held} request{'s' if held != 1 else ''}, none finished with its lengths "
                        "logged; a workload needs at least one."
                    ]
                }
            )
        spec = capture(observed, (end - start).total_seconds())
        filters = {
            "start": start.isoformat(),
            "end": end.isoformat(),
            "pool": pool.name if pool else None,
            "model": model or None,
            "requests_in_window": held,
        }
        return cls._store(actor, name, "request_log", filters, spec)

    @classmethod
    def from_scenario(
        cls, *, name: str, scenario: str, rate: float, duration_seconds: float, seed: int = 0, actor: audit.Actor = None
    ) -> Workload:
        if scenario not in loadgen.SCENARIOS:
            raise ValidationError({"scenario": [f"one of {', '.join(loadgen.SCENARIOS)}."]})
        if rate <= 0 or duration_seconds <= 0:
            raise ValidationError({"rate": ["rate and duration must be positive."]})
        planned = loadgen.plan(scenario, duration_seconds=duration_seconds, rate=rate, seed=seed)
        if not planned:
            raise ValidationError({"duration_seconds": ["the scenario planned no request in that time."]})
        spec = from_plan(planned, duration_seconds)
        filters = {"scenario": scenario, "rate": rate, "duration_seconds": duration_seconds, "seed": seed}
        return cls._store(actor, name, "loadgen", filters, spec)


# ---- experiments ---------------------------------------------------------------------------


# Knobs a grid arm sets; every other knob is the baseline's, so an arm
# differs from the baseline in what it tests and nothing else.
GRID_FIELDS = ("prefill_mode", "max_num_batched_tokens", "long_prefill_token_threshold", "short_prompt_threshold")


def default_arms(
    max_model_len: int,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    budgets: tuple[int, ...] = (),
    short_thresholds: tuple[int | None, ...] = (None,),
    max_num_seqs: int | None = None,
    current: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The baseline, then a grid over the chunk cap
    (``long_prefill_token_threshold``), the step budget (default: the chunk
    cap, or the default budget when larger) and ``short_prompt_threshold``.

    The baseline is ``current`` (the pools' running profile, every knob of
    it, ``max_num_seqs`` included) when given, else a monolithic profile of
    the default knobs; every grid arm keeps the baseline's other knobs. A
    chunked current profile gets a monolithic arm beside it. A grid arm equal
    to the baseline is left out."""
    default_budget = EngineProfile().max_num_batched_tokens
    monolithic_budget = max(max_model_len, default_budget)
    base: dict[str, Any] = dict(current or {})
    if max_num_seqs:
        base["max_num_seqs"] = max_num_seqs
    if not current:
        base.update(prefill_mode="monolithic", max_num_batched_tokens=monolithic_budget)
    arms: list[dict[str, Any]] = [{"name": "baseline", "fields": dict(base)}]
    others = {k: v for k, v in base.items() if k not in GRID_FIELDS}
    defaults = EngineProfile().to_dict()

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Equal as the engine runs them: no chunk cap is a cap of the whole budget."""

        def effective(fields: dict[str, Any]) -> dict[str, Any]:
            full = {**defaults, **fields}
            full["long_prefill_token_threshold"] = (
                full["long_prefill_token_threshold"] or full["max_num_batched_tokens"]
            )
            return full

        return effective(a) == effective(b)

    if base.get("prefill_mode") == "chunked":
        arms.append(
            {
                "name": "monolithic",
                "fields": {**others, "prefill_mode": "monolithic", "max_num_batched_tokens": monolithic_budget},
            }
        )
    for chunk in chunk_sizes:
        for budget in budgets or (max(chunk, default_budget),):
            for short in short_thresholds:
                fields: dict[str, Any] = {
                    **others,
                    "prefill_mode": "chunked",
                    "max_num_batched_tokens": budget,
                    "long_prefill_token_threshold": chunk,
                }
                name = f"chunk-{chunk}" + (f"-budget-{budget}" if budgets else "")
                if short is not None:
                    fields["short_prompt_threshold"] = short
                    name += f"-short-{short}"
                if same(fields, base):
                    continue  # the baseline itself
                arms.append({"name": name, "fields": fields})
    return arms


def current_fields(workers: list[Worker]) -> dict[str, Any] | None:
    """The profile the workers run now (the first one's, by name, when they
    differ), in full; None when none runs one yet."""
    for w in sorted(workers, key=lambda w: w.name):
        revision_id = w.running_revision_id or w.effective_desired_revision_id()
        if revision_id and (revision := ProfileRevision.objects.filter(pk=revision_id).first()) is not None:
            return dict(revision.fields)
    return None


def arm_errors(arms: Any, workers: list[Worker]) -> dict[str, list[str]]:
    """Each arm against each worker's engine: errors keyed
    ``arms[i].<field>``, each message naming the arm (and the worker)."""
    if not isinstance(arms, list) or not arms:
        return {"arms": ["must be a non-empty list of {name, fields}."]}
    errors: dict[str, list[str]] = {}
    names: set[str] = set()
    for i, arm in enumerate(arms):
        if not isinstance(arm, dict) or not isinstance(arm.get("fields"), dict):
            errors.setdefault(f"arms[{i}]", []).append(f"arm {i}: must be an object with a `fields` object.")
            continue
        name = str(arm.get("name") or f"arm-{i}")
        if name in names:
            errors.setdefault(f"arms[{i}].name", []).append(f"arm {i}: the name {name!r} is used twice.")
        names.add(name)
        for worker in workers:
            for field, reasons in profile_errors(
                arm["fields"], engine_kind=worker.engine_kind, max_model_len=worker.max_model_len or None
            ).items():
                errors.setdefault(f"arms[{i}].{field}", []).extend(
                    f"arm {name!r} on worker {worker.name} ({worker.engine_kind}): {r}" for r in reasons
                )
    return errors


MAX_RAMP_POINTS = 20


def ramp_errors(ramp: Any, seconds: Any) -> dict[str, list[str]]:
    """The capacity ramp: at most MAX_RAMP_POINTS positive, strictly rising
    multiples of the replay rate, each replayed ``seconds`` (at least 1)."""
    errors: dict[str, list[str]] = {}
    if (
        not isinstance(ramp, list)
        or len(ramp) > MAX_RAMP_POINTS
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in ramp)
    ):
        errors["capacity_rate_scales"] = [f"a list of at most {MAX_RAMP_POINTS} positive numbers."]
    elif any(b <= a for a, b in zip(ramp, ramp[1:], strict=False)):
        errors["capacity_rate_scales"] = ["must rise strictly: the ramp stops at the first rate that misses."]
    if ramp and (not isinstance(seconds, (int, float)) or seconds < 1.0):
        errors["capacity_seconds"] = ["must be a number of at least 1."]
    return errors


class ExperimentQuerySet(models.QuerySet["Experiment"]):
    def active(self) -> ExperimentQuerySet:
        return self.filter(phase__lt=Phase.SUCCEEDED)

    def overdue(self, now: datetime) -> ExperimentQuerySet:
        """Unfinished experiments nobody holds: their task was lost."""
        return self.active().filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))


def arm_profile_ids() -> QuerySet[Experiment, Any]:
    """The profiles that hold experiments' arms (``experiment-N``, one
    revision per arm): the lab's, not the fleet's, so the profiles list and
    the rollout target leave them out. An adopted arm becomes a revision of
    a profile of the fleet's (``Experiment.adopt``) and is listed there."""
    return Experiment.objects.exclude(profile=None).values("profile")


def _busy_errors(workers: list[Worker]) -> dict[str, list[str]]:
    """The unfinished measuring experiments that already use some of ``workers``."""
    busy = Experiment.objects.active().filter(workers__in=workers).exclude(mode=Mode.PREDICT).distinct()
    return {"workers": [f"{other} already uses some of these workers." for other in busy]} if busy else {}


class Experiment(audit.Audited, models.Model):
    audit_name = "experiment"

    name = models.CharField(max_length=100)
    workload = models.ForeignKey(Workload, on_delete=models.PROTECT, related_name="experiments")
    workers = models.ManyToManyField(Worker, related_name="experiments")
    profile = models.ForeignKey(
        Profile,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="holds one revision per arm",
    )
    duration_seconds = models.FloatField(default=60.0, help_text="measured replay per arm and repeat")
    warmup_seconds = models.FloatField(default=10.0, help_text="replay before measuring, per arm")
    repeats = models.PositiveIntegerField(
        default=DEFAULT_REPEATS, help_text="paired repeats: repeat r of every arm replays the same requests"
    )
    baseline = models.CharField(
        max_length=100,
        blank=True,
        help_text="the arm every other is set beside; by default the pools' current profile, named baseline",
    )
    rate_scale = models.FloatField(default=1.0, help_text="replay at this multiple of the recorded rate")
    objectives = models.JSONField(default=dict, help_text="{ttft_ms, tpot_ms, stall_ms?}: P99 objectives")
    capacity_rate_scales = models.JSONField(
        default=list,
        blank=True,
        help_text="the capacity ramp per arm: rising multiples of the replay rate; empty: capacity not measured",
    )
    capacity_seconds = models.FloatField(default=30.0, help_text="replay per point of the capacity ramp")
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.MEASURE)
    simulation = models.JSONField(
        default=dict, blank=True, help_text="predict mode: the simulated device the arms ran on ({label, device})"
    )
    verifies = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="verifications",
        help_text="the prediction this experiment measures on lab workers",
    )

    phase = models.PositiveSmallIntegerField(default=Phase.PENDING, db_index=True)
    message = models.TextField(blank=True)
    abort_requested = models.BooleanField(default=False)
    abort_reason = models.TextField(blank=True)
    previous = models.JSONField(
        default=dict, blank=True, help_text="{worker id: {desired_revision, cordoned}} before the experiment"
    )
    progress = models.JSONField(default=dict, blank=True)
    recommendation = models.JSONField(default=dict, blank=True)
    lease_token = models.CharField(max_length=32, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True, help_text="the workers were out of traffic")
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = ExperimentQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]

    def __str__(self) -> str:
        return f"experiment {self.pk} {self.name}"

    @property
    def phase_label(self) -> str:
        return Phase(self.phase).label

    @property
    def is_finished(self) -> bool:
        return Phase(self.phase).finished

    @property
    def actor(self) -> str:
        return f"experiment:{self.pk}"

    def audit_state(self) -> dict[str, Any]:
        data = audit.snapshot(
            self,
            fields=[
                "name",
                "workload",
                "duration_seconds",
                "warmup_seconds",
                "repeats",
                "baseline",
                "rate_scale",
                "objectives",
                "capacity_rate_scales",
                "capacity_seconds",
                "mode",
                "verifies",
                "phase",
                "abort_requested",
                "abort_reason",
            ],
        )
        data["phase"] = self.phase_label
        data["workers"] = sorted(self.workers.values_list("name", flat=True)) if self.pk else []
        return data

    def changed(self) -> None:
        live.publish(live.Event.EXPERIMENT_CHANGED, scopes=[self.pk], experiment_id=self.pk)

    def slos(self) -> dict[str, float]:
        """The objectives as loadgen's goodput SLOs (milliseconds)."""
        o = {**DEFAULT_OBJECTIVES, **(self.objectives or {})}
        return {"ttft": float(o["ttft_ms"]), "tpot": float(o["tpot_ms"])}

    # ---- creation -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        name: str,
        workload: Workload,
        workers: list[Worker],
        arms: list[dict[str, Any]] | None = None,
        duration_seconds: float = 60.0,
        warmup_seconds: float = 10.0,
        repeats: int = DEFAULT_REPEATS,
        rate_scale: float = 1.0,
        objectives: dict[str, float] | None = None,
        capacity_rate_scales: list[float] | None = None,
        capacity_seconds: float = 30.0,
        baseline: str = "",
        baseline_revision: ProfileRevision | None = None,
        chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
        mode: str = Mode.MEASURE,
        verifies: Experiment | None = None,
        actor: audit.Actor = None,
    ) -> Experiment:
        """Validate everything the run will need, then store the experiment,
        its arms and one profile revision per arm, audited as
        ``experiment.create``, and start it on commit. Raises
        ValidationError naming the field (``arms[i].<knob>`` for an arm).

        Without ``arms``: the baseline is the profile the workers run now
        (or ``baseline_revision``), and a chunk-size grid that keeps its
        other knobs. ``baseline`` names the arm the others are set beside
        (default: the one named "baseline", else the first).

        ``mode`` predict: the arms run in virtual time on the simulated
        device of the workers' own GPU and model (``predict``); the workers
        are never taken out of traffic, so neither their state nor another
        experiment on them stands in the way, but a worker no simulation
        can stand for is a 400 on ``mode``."""
        errors: dict[str, list[str]] = {}
        predicting = mode == Mode.PREDICT
        if mode not in Mode.values:
            errors["mode"] = [f"one of {', '.join(Mode.values)}."]
        if not workers:
            errors["workers"] = ["at least one worker."]
        kinds = {w.engine_kind for w in workers}
        if len(kinds) > 1:
            errors.setdefault("workers", []).append(f"the workers run different engines ({', '.join(sorted(kinds))}).")
        if predicting:
            for w in workers:
                if why := predict.why_not(w.engine_kind, w.hardware):
                    errors.setdefault("mode", []).append(f"worker {w.name} cannot be simulated: {why}.")
            if capacity_rate_scales:
                errors.setdefault("capacity_rate_scales", []).append(
                    "a prediction runs no capacity ramp; leave it empty in predict mode."
                )
        else:
            for w in workers:
                if WorkerState(w.state).is_lost:
                    errors.setdefault("workers", []).append(f"worker {w.name} is {w.state_label}.")
            errors.update(_busy_errors(workers))
            errors.update(cls._traffic_errors(workers))
        if arms is None:
            max_len = min((w.max_model_len for w in workers if w.max_model_len), default=2048)
            current = dict(baseline_revision.fields) if baseline_revision is not None else current_fields(workers)
            arms = default_arms(max_len, chunk_sizes, current=current)
        errors.update(arm_errors(arms, workers))
        names = (
            [str(a.get("name") or f"arm-{i}") for i, a in enumerate(arms) if isinstance(a, dict)]
            if isinstance(arms, list)
            else []
        )
        if baseline and baseline not in names:
            errors.setdefault("baseline", []).append(f"names no arm: one of {', '.join(names)}.")
        baseline = baseline or ("baseline" if "baseline" in names else (names[0] if names else ""))
        for field, value, least in (
            ("duration_seconds", duration_seconds, 1.0),
            ("warmup_seconds", warmup_seconds, 0.0),
            ("rate_scale", rate_scale, 0.001),
        ):
            if not isinstance(value, (int, float)) or value < least:
                errors.setdefault(field, []).append(f"must be a number of at least {least:g}.")
        if not isinstance(repeats, int) or repeats < 1:
            errors.setdefault("repeats", []).append("at least 1.")
        ramp = list(capacity_rate_scales or [])
        errors.update(ramp_errors(ramp, capacity_seconds))
        objectives = {**DEFAULT_OBJECTIVES, **(objectives or {})}
        for key, value in objectives.items():
            if key not in ("ttft_ms", "tpot_ms", "stall_ms") or not isinstance(value, (int, float)) or value <= 0:
                errors.setdefault("objectives", []).append(
                    f"{key}: a positive number of milliseconds (ttft_ms, tpot_ms, stall_ms)."
                )
        if errors:
            raise ValidationError(errors)
        user = actor if getattr(actor, "is_authenticated", False) else None
        with transaction.atomic():
            if not predicting:
                # "One experiment at a time on a worker" holds when creates race:
                # they queue on the workers' row locks (taken in id order, so two
                # cannot deadlock) and each checks again after the one before it
                # committed; the check above alone let 8 identical creates all in.
                list(Worker.objects.select_for_update().filter(pk__in=[w.pk for w in workers]).order_by("pk"))
                if busy := _busy_errors(workers):
                    raise ValidationError(busy)
            experiment = cls(
                name=name,
                workload=workload,
                duration_seconds=duration_seconds,
                warmup_seconds=warmup_seconds,
                repeats=repeats,
                baseline=baseline,
                rate_scale=rate_scale,
                objectives=objectives,
                capacity_rate_scales=[float(r) for r in ramp],
                capacity_seconds=capacity_seconds,
                mode=mode,
                verifies=verifies,
                created_by=user,
                message="waiting for the runner",
            )
            with experiment.changing(actor):
                experiment.save()
                experiment.workers.set(workers)
                profile = Profile(
                    name=f"experiment-{experiment.pk}",
                    engine_kind=kinds.pop(),
                    description=f"the arms of experiment {experiment.pk} ({name})",
                )
                profile.save()
                experiment.profile = profile
                experiment.save(update_fields=["profile"])
                for i, arm in enumerate(arms):
                    arm_name = str(arm.get("name") or f"arm-{i}")
                    revision = profile.add_revision(arm["fields"], author=actor, comment=f"arm {arm_name}")
                    Arm.objects.create(
                        experiment=experiment, index=i, name=arm_name, fields=revision.fields, revision=revision
                    )
            experiment.changed()
            experiment.kick()
        return experiment

    @staticmethod
    def _traffic_errors(workers: list[Worker]) -> dict[str, list[str]]:
        """Taking the workers out must not leave a pool that carries traffic
        with no worker to serve it."""
        messages = []
        taken = {w.pk for w in workers}
        for route in (
            RoutingPool.objects.filter(pool__workers__in=workers, weight_bp__gt=0)
            .select_related("pool", "table")
            .distinct()
        ):
            left = route.pool.workers.routable().exclude(pk__in=taken).count()
            if not left:
                messages.append(
                    f"pool {route.pool.name} carries {route.weight_bp / 100:g}% of {route.table.model}'s "
                    "traffic and would have no worker left; use a lab pool or set its weight to 0."
                )
        return {"workers": messages} if messages else {}

    def kick(self) -> None:
        """Run the runner after commit (it returns at once when another run holds the experiment)."""
        # Imported here: tasks imports the runner, which imports this module.
        from controlplane.experiments.tasks import drive

        pk = self.pk
        transaction.on_commit(lambda: drive.delay(pk))

    # ---- buttons ------------------------------------------------------------------

    def request_abort(self, actor: audit.Actor, reason: str = "") -> bool:
        """Set the abort flag (the runner restores the workers, then stops).
        False when there is nothing to abort."""
        with transaction.atomic():
            claimed = Experiment.objects.filter(pk=self.pk, phase__lt=Phase.RESTORING, abort_requested=False).update(
                abort_requested=True, abort_reason=reason or "aborted by an operator"
            )
            if not claimed:
                return False
            before = self.audit_state()
            self.refresh_from_db()
            audit.record(actor, "experiment.abort", self, before, self.audit_state())
            self.changed()
            self.kick()
        return True

    def adopt(self, actor: audit.Actor, profile: Profile | None = None, arm: Arm | None = None) -> ProfileRevision:
        """The recommended arm (or ``arm``) as the next revision of
        ``profile`` (default: the profile the workers ran before, when it is
        for the same engine; else a new one), audited as
        ``experiment.adopt``: "New rollout" takes it from there."""
        if arm is None:
            winner = (self.recommendation or {}).get("winner")
            arm = self.arms.filter(name=winner).first() if winner else None
        if arm is None:
            raise ValidationError({"arm": ["the experiment recommends no arm; name one."]})
        if profile is None:
            profile = self._previous_profile()
        with transaction.atomic():
            if profile is None:
                profile = Profile.objects.create_with_revision(
                    name=f"experiment-{self.pk}-{arm.name}"[:100],
                    engine_kind=self.profile.engine_kind if self.profile else "reference",
                    fields=arm.fields,
                    comment=f"from {self}, arm {arm.name}",
                    actor=actor,
                )
                revision = profile.latest_revision()
                assert revision is not None
            else:
                revision = (
                    profile.revise(arm.fields, actor=actor, comment=f"from {self}, arm {arm.name}")
                    or profile.latest_revision()
                )
                assert revision is not None
            audit.record(
                actor,
                "experiment.adopt",
                self,
                None,
                {"arm": arm.name, "revision": revision.pk, "profile": profile.name},
            )
        return revision

    def _previous_profile(self) -> Profile | None:
        ids = [p.get("running_revision") or p.get("desired_revision") for p in (self.previous or {}).values()]
        revision = ProfileRevision.objects.filter(pk__in=[i for i in ids if i]).select_related("profile").first()
        if revision is None or self.profile is None or revision.profile.engine_kind != self.profile.engine_kind:
            return None
        return revision.profile

    @property
    def predicts(self) -> bool:
        return self.mode == Mode.PREDICT

    @property
    def predicted_label(self) -> str:
        """How a prediction's figures are labelled: "predicted (simulated H200 SXM)"."""
        device = (self.simulation or {}).get("label")
        return f"predicted (simulated {device})" if device else "predicted (simulated)"

    def arms_to_verify(self) -> list[Arm]:
        """The baseline and the ``VERIFY_NUM_ARMS`` best predicted arms that
        met every objective (the recommended one first), in arm order."""
        rec = self.recommendation or {}
        broke = rec.get("broke") or {}
        arms = list(self.arms.filter(status=ArmStatus.SUCCEEDED).order_by("index"))
        basis = rec.get("basis") or "goodput"

        def score(arm: Arm) -> tuple[float, float]:
            summary = arm.summary or {}
            return (
                (summary.get(basis) or {}).get("mean") or 0.0,
                (summary.get("output_throughput") or {}).get("mean") or 0.0,
            )

        baseline = self.baseline or "baseline"
        ranked = sorted(
            (a for a in arms if a.name not in broke and a.name != baseline),
            key=lambda a: (a.name != rec.get("winner"), *(-v for v in score(a))),
        )
        chosen = {a.name for a in ranked[:VERIFY_NUM_ARMS]} | {baseline}
        return [a for a in self.arms.order_by("index") if a.name in chosen]

    def verify(self, actor: audit.Actor, repeats: int = DEFAULT_REPEATS) -> Experiment:
        """A measure-mode experiment of the prediction's best arms and its
        baseline, on the same workers and workload with the same arm
        lengths, seeds and objectives (``verifies`` links it back), started
        as any experiment is, audited as ``experiment.verify``."""
        if not self.predicts:
            raise ValidationError({"mode": ["only a prediction can be verified; this experiment was measured."]})
        if self.phase != Phase.SUCCEEDED:
            raise ValidationError({"phase": [f"the prediction is {self.phase_label}; verify it once it succeeded."]})
        arms = self.arms_to_verify()
        if not arms:
            raise ValidationError({"arms": ["the prediction has no arm that ran."]})
        with transaction.atomic():
            verification = Experiment.create(
                name=f"verify {self.name}"[:100],
                workload=self.workload,
                workers=list(self.workers.order_by("name")),
                arms=[{"name": a.name, "fields": dict(a.fields)} for a in arms],
                duration_seconds=self.duration_seconds,
                warmup_seconds=self.warmup_seconds,
                repeats=repeats,
                rate_scale=self.rate_scale,
                objectives=dict(self.objectives or {}),
                baseline=self.baseline if any(a.name == self.baseline for a in arms) else "",
                mode=Mode.MEASURE,
                verifies=self,
                actor=actor,
            )
            audit.record(
                actor,
                "experiment.verify",
                self,
                None,
                {"verification": verification.pk, "arms": [a.name for a in arms]},
            )
        return verification

    def predicted_against_measured(self) -> list[dict[str, Any]]:
        """A verification, arm by arm: the prediction's figures beside this
        experiment's measured ones (mean over repeats), and measured over
        predicted; figures not yet in are None."""
        if self.verifies is None:
            return []
        predicted = {a.name: a for a in self.verifies.arms.all()}
        rows = []
        for arm in self.arms.order_by("index"):
            other = predicted.get(arm.name)
            figures = {}
            for key in COMPARED_FIGURES:
                p = ((other.summary or {}).get(key) or {}).get("mean") if other else None
                m = ((arm.summary or {}).get(key) or {}).get("mean")
                figures[key] = {"predicted": p, "measured": m, "ratio": m / p if m is not None and p else None}
            rows.append({"arm": arm.name, "figures": figures})
        return rows

    # ---- what the runner writes -------------------------------------------------------

    def record(
        self,
        verb: str,
        before: dict[str, Any] | None = None,
        after: dict[str, Any] | None = None,
        *,
        now: datetime | None = None,
    ) -> None:
        audit.record(self.actor, f"experiment.{verb}", self, before, after, time=now)

    def set_progress(self, **progress: Any) -> None:
        self.progress = progress
        Experiment.objects.filter(pk=self.pk).update(progress=progress)
        self.changed()

    def seconds_per_arm(self) -> float:
        """Each repeat warms up afresh: arms interleave, so each repeat applies its arm again."""
        return (
            self.repeats * (self.warmup_seconds + self.duration_seconds)
            + len(self.capacity_rate_scales or []) * self.capacity_seconds
        )

    @property
    def measures_capacity(self) -> bool:
        return bool(self.capacity_rate_scales)

    def apply_recommendation(self, rec: Recommendation) -> None:
        self.recommendation = rec.to_json()

    def lease_expiry(self, seconds: float) -> datetime:
        return timezone.now() + timedelta(seconds=seconds)


class Arm(models.Model):
    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="arms")
    index = models.PositiveIntegerField()
    name = models.CharField(max_length=100)
    fields = models.JSONField(help_text="the arm's engine profile, in full")
    revision = models.ForeignKey(ProfileRevision, on_delete=models.PROTECT, related_name="+")
    status = models.PositiveSmallIntegerField(default=ArmStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0, help_text="times a runner started it (resumed after a loss)")
    results = models.JSONField(default=list, blank=True, help_text="one entry per measured repeat")
    ramp = models.JSONField(default=list, blank=True, help_text="the capacity ramp: one entry per rate measured")
    capacity = models.FloatField(null=True, blank=True, help_text="serving capacity, req/s; null: not measured")
    summary = models.JSONField(default=dict, blank=True, help_text="per figure: mean, half range, values")
    error = models.TextField(blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["experiment", "index"]
        constraints = [models.UniqueConstraint(fields=["experiment", "index"], name="arm_once_per_index")]

    def __str__(self) -> str:
        return f"{self.experiment_id}/{self.name}"

    @property
    def status_label(self) -> str:
        return ArmStatus(self.status).label

    def conditions(self, experiment: Experiment | None = None) -> Conditions:
        """What the arm ran, beside the workload's own (``measure.arm_conditions``)."""
        exp = experiment or self.experiment
        spec = exp.workload.workload_spec()
        return arm_conditions(
            self.results,
            arrival_seconds=exp.duration_seconds,
            workload_rate=spec.rate_per_second * exp.rate_scale,
            workload_prefix_share=spec.prefix_hit_share,
        )

    @property
    def chunk_size(self) -> int | None:
        """The x of the plot: the chunk cap; None for the monolithic baseline."""
        if self.fields.get("prefill_mode") == "monolithic":
            return None
        return int(self.fields.get("long_prefill_token_threshold") or self.fields["max_num_batched_tokens"])
