"""Canary rollouts: a pool of workers moved from a stable profile revision to
a target revision in declared steps, with measured analysis, a consistency
gate and one-click rollback. Argo Rollouts' semantics (docs/architecture.md, "Rollouts").

How a rollout uses the fleet and the routing table:

* **Canary = a pool.** A rollout names a routing table and, in it, the
  stable pool (the pool being moved: role ``stable``), a canary pool (role
  ``canary``) and optionally a baseline pool (role ``baseline``: fresh
  workers on the stable revision, so analysis compares like with like). The
  canary pool is pointed at the target revision while it carries no
  traffic; only when every live canary worker reports ready on it — and, for
  a chunked target, the consistency gate has passed — does a ``set_weight``
  step give it traffic.
* **Weights** change only through ``RoutingTable.set_weights``; a
  ``set_weight`` step is complete when every live gateway has acked the new
  epoch.
* **Abort** (a button, a failed analysis or gate, the progress deadline, or
  the alerts kill switch through ``request_abort``): canary weight → 0 first,
  and the rollout waits for every live gateway's ack of that epoch; then the
  canary pool goes back to the stable revision (each agent drains before it
  switches, and no traffic reaches it any more).
* **Promotion**, after the last step (or promote-full): all traffic to the
  canary, acked; the stable pool moves to the target one worker at a time
  (a per-worker ``desired_revision`` override, then wait for that worker to
  report ready on the target, then the next); then the pool's own desired
  revision is set and the overrides cleared; then the weights return to the
  stable pool 100%. No request is lost: no pool that takes traffic ever has
  all its workers switching at once.
* **Rolling back a finished rollout** to the previous revision makes a new,
  fast-tracked rollout with no steps and no gate: the stable pool keeps its
  traffic and moves back one worker at a time the same way (a draining
  worker's refusals are retried by the gateway on the pool's others), and
  the canary pool follows while it carries nothing.

The decisions are pure (``evaluator``, ``judge``); ``controller`` performs
them; ``tasks.reconcile`` drives it. Buttons only set flags here.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from controlplane import audit, live
from controlplane.fleet.models import Worker
from controlplane.metrics.figures import FIGURES
from controlplane.rollouts import measure
from controlplane.rollouts import steps as plan
from controlplane.rollouts.evaluator import (
    Flags,
    GateStatus,
    PauseCondition,
    PauseReason,
    Phase,
    RolloutState,
)
from controlplane.rollouts.forecast import AnalysisForecast, forecast
from controlplane.rollouts.gate import (
    GateSettings,
    Prompt,
    default_prompts,
    prompt_errors,
    settings_errors,
)
from controlplane.rollouts.judge import (
    AnalysisPhase,
    Check,
    Direction,
    MetricResult,
    MetricRule,
    RunSpec,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

    from controlplane.fleet.models import Pool
    from controlplane.gateway.models import RoutingTable
    from controlplane.profiles.models import ProfileRevision

    Actor = AbstractBaseUser | AnonymousUser | str | None

PHASE_CHOICES = [(p.value, p.label) for p in Phase]
ANALYSIS_PHASE_CHOICES = [(p.value, p.label) for p in AnalysisPhase]
GATE_CHOICES = [(g.value, g.value) for g in GateStatus]
DEFAULT_PROGRESS_DEADLINE_SECONDS = 600.0
# Which button sets which flag; the reconciler clears it when it acts.
FLAG_FIELDS = {
    "abort": "abort_requested",
    "promote": "promote_requested",
    "promote_full": "promote_full_requested",
    "skip_step": "skip_step_requested",
    "retry": "retry_requested",
}


def actor_name(actor: Actor) -> str:
    if actor is None:
        return audit.SYSTEM
    if isinstance(actor, str):
        return actor
    return actor.get_username() if getattr(actor, "is_authenticated", False) else "anonymous"


# ---- analysis templates ---------------------------------------------------------------

DEFAULT_METRICS: tuple[MetricRule, ...] = (
    MetricRule("ttft", "client_ttft_p99", Direction.LOWER, Check.RATIO, max_ratio=1.5, floor=0.05),
    MetricRule("itl", "itl_p99", Direction.LOWER, Check.RATIO, max_ratio=1.5, floor=0.01),
    MetricRule("stalls", "client_stall_p99", Direction.LOWER, Check.RATIO, max_ratio=1.5, floor=0.05),
    MetricRule("tpot", "client_tpot_p99", Direction.LOWER, Check.RATIO, max_ratio=1.5, floor=0.01),
    MetricRule("errors", "error_rate", Direction.LOWER, Check.ERROR_RATE, floor=0.01),
    # Silent or timed-out canary streams fail the analysis outright: a wedged
    # scheduler aborts before those requests would ever finish.
    MetricRule("hanging", "timed_out_streams", Direction.LOWER, Check.HANGING, floor=0.0),
    # Requests finished per 100% of traffic (measure.py scales each pool by
    # its weight): a canary that falls behind its share finishes fewer. The
    # cohorts split by hash, not exactly, hence the wide ratio.
    MetricRule("throughput", "client_requests_per_second", Direction.HIGHER, Check.RATIO, max_ratio=2.0),
)


class AnalysisTemplate(audit.Audited, models.Model):
    """What an ``analysis`` step measures and how it decides (Argo's
    AnalysisTemplate). A run snapshots it when it starts, so an edit never
    changes a verdict under way."""

    audit_name = "analysis_template"

    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    metrics = models.JSONField(
        default=list, help_text="[{name, figure, direction, test, max_ratio, floor, min_samples}]"
    )
    interval_seconds = models.FloatField(default=30.0, help_text="between measurements")
    count = models.PositiveIntegerField(default=3, help_text="measurements for a verdict")
    initial_delay_seconds = models.FloatField(default=0.0, help_text="before the first measurement")
    window_seconds = models.FloatField(
        null=True, blank=True, help_text="each measurement looks back this far; empty: the interval"
    )
    failure_limit = models.PositiveIntegerField(default=0, help_text="failed measurements tolerated per metric")
    inconclusive_limit = models.PositiveIntegerField(
        default=0, help_text="inconclusive measurements tolerated per metric"
    )
    consecutive_error_limit = models.PositiveIntegerField(default=2, help_text="errors in a row tolerated per metric")
    sample_wait_seconds = models.FloatField(
        default=0.0,
        help_text="up to this long after the analysis starts, a measurement short of samples is not "
        "counted and the next looks back to the start; 0: inconclusive at once",
    )
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def spec(self) -> RunSpec:
        return RunSpec(
            metrics=tuple(MetricRule.from_json(m) for m in self.metrics),
            interval_seconds=self.interval_seconds,
            count=self.count,
            initial_delay_seconds=self.initial_delay_seconds,
            window_seconds=self.window_seconds,
            failure_limit=self.failure_limit,
            inconclusive_limit=self.inconclusive_limit,
            consecutive_error_limit=self.consecutive_error_limit,
            sample_wait_seconds=self.sample_wait_seconds,
        )

    @classmethod
    def default(cls) -> AnalysisTemplate:
        template, _ = cls.objects.get_or_create(
            name=plan.DEFAULT_TEMPLATE,
            defaults={
                "description": "TTFT, ITL, stalls and TPOT P99 within 1.5× the baseline (with absolute floors), "
                "no significant rise in the error rate, and throughput per share of traffic at "
                "least half the baseline's.",
                "metrics": [m.to_json() for m in DEFAULT_METRICS],
                "interval_seconds": 60.0,
                "count": 3,
                "initial_delay_seconds": 30.0,
                "failure_limit": 0,
                "inconclusive_limit": 1,
                "consecutive_error_limit": 2,
            },
        )
        return template

    def clean(self) -> None:
        errors = metrics_errors(self.metrics)
        for name in ("interval_seconds", "initial_delay_seconds"):
            value = getattr(self, name)
            if value is None or value < 0 or (name == "interval_seconds" and value <= 0):
                errors.setdefault(name, []).append("must be a positive number of seconds.")
        if self.sample_wait_seconds is None or self.sample_wait_seconds < 0:
            errors.setdefault("sample_wait_seconds", []).append("must be 0 (off) or a positive number of seconds.")
        if self.window_seconds is not None and self.window_seconds <= 0:
            errors.setdefault("window_seconds", []).append("must be a positive number of seconds, or empty.")
        if not self.count:
            errors.setdefault("count", []).append("at least one measurement.")
        if errors:
            raise ValidationError(errors)


def metrics_errors(metrics: Any) -> dict[str, list[str]]:
    """Field errors for a template's ``metrics`` list, each naming its position."""
    if not isinstance(metrics, list) or not metrics:
        return {"metrics": ["must be a non-empty list of metric rules."]}
    problems: list[str] = []
    names: set[str] = set()
    known = {"name", "figure", "direction", "test", "max_ratio", "floor", "min_samples", "confidence"}
    for i, m in enumerate(metrics):
        where = f"metric {i}"
        if not isinstance(m, dict):
            problems.append(f"{where}: must be an object.")
            continue
        if unknown := set(m) - known:
            problems.append(f"{where}: unknown keys {', '.join(sorted(unknown))}.")
        name, figure = m.get("name"), m.get("figure")
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: name is required.")
        elif name in names:
            problems.append(f"{where}: name `{name}` is used twice.")
        else:
            names.add(name)
        if figure not in FIGURES:
            problems.append(f"{where}: figure must be one of the registry's ({', '.join(sorted(FIGURES))}).")
        if m.get("direction", "lower") not in ("lower", "higher"):
            problems.append(f"{where}: direction is lower or higher.")
        if m.get("test", "ratio") not in ("ratio", "error_rate", "hanging"):
            problems.append(f"{where}: test is ratio, error_rate or hanging.")
        for key, lo, hi in (("max_ratio", 1.0, 1e6), ("floor", 0.0, 1e9), ("confidence", 0.5, 0.9999)):
            value = m.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi
            ):
                problems.append(f"{where}: {key} must be a number from {lo:g} to {hi:g}.")
        samples = m.get("min_samples")
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            problems.append(f"{where}: min_samples must be a whole number ≥ 1.")
    return {"metrics": problems} if problems else {}


# ---- rollouts ------------------------------------------------------------------------------


BUSY_MESSAGE = "another rollout is still running on this routing table or these pools; finish or abort it first."


class RolloutQuerySet(models.QuerySet["Rollout"]):
    def with_related(self) -> RolloutQuerySet:
        """With the rows a rollout is shown and reconciled by: its routing
        table, its pools, both revisions with their profiles, its creator."""
        return self.select_related(
            "routing_table",
            "stable_pool",
            "canary_pool",
            "baseline_pool",
            "stable_revision__profile",
            "target_revision__profile",
            "created_by",
        )

    def active(self) -> RolloutQuerySet:
        return self.filter(phase__lt=Phase.ABORTED)

    def overdue(self, now: datetime, grace_seconds: float) -> RolloutQuerySet:
        """Unfinished rollouts whose next reconcile should have run by now."""
        return self.active().filter(next_run_at__lt=now - timedelta(seconds=grace_seconds))


class Rollout(audit.Audited, models.Model):
    audit_name = "rollout"
    Phase = Phase

    # ---- what it rolls --------------------------------------------------------
    routing_table = models.ForeignKey("gateway.RoutingTable", on_delete=models.PROTECT, related_name="rollouts")
    stable_pool = models.ForeignKey(
        "fleet.Pool", on_delete=models.PROTECT, related_name="rollouts", help_text="the pool being moved (role stable)"
    )
    canary_pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="canary_rollouts")
    baseline_pool = models.ForeignKey(
        "fleet.Pool", null=True, blank=True, on_delete=models.PROTECT, related_name="baseline_rollouts"
    )
    stable_revision = models.ForeignKey("profiles.ProfileRevision", on_delete=models.PROTECT, related_name="+")
    target_revision = models.ForeignKey("profiles.ProfileRevision", on_delete=models.PROTECT, related_name="+")
    steps = models.JSONField(default=list, help_text="the step plan (steps.py)")
    progress_deadline_seconds = models.FloatField(default=DEFAULT_PROGRESS_DEADLINE_SECONDS)
    gate = models.JSONField(default=dict, blank=True, help_text="consistency gate: {enabled, prompts, max_tokens}")
    fast_track = models.BooleanField(default=False, help_text="a rollback: no steps, no gate")
    rollback_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rollbacks")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    # ---- status (the reconciler writes these) ------------------------------------
    phase = models.PositiveSmallIntegerField(choices=PHASE_CHOICES, default=Phase.PENDING.value, db_index=True)
    step_index = models.PositiveIntegerField(default=0)
    step_started_at = models.DateTimeField(null=True, blank=True)
    pause_conditions = models.JSONField(default=list, blank=True, help_text="[{reason, since}]")
    weights = models.JSONField(default=dict, blank=True, help_text="role → basis points, as last seen")
    message = models.TextField(blank=True)
    abort_reason = models.TextField(blank=True)
    attempt = models.PositiveIntegerField(default=1, help_text="bumped by each retry")
    gate_status = models.CharField(max_length=8, choices=GATE_CHOICES, default=GateStatus.PENDING.value)
    gate_result = models.JSONField(default=dict, blank=True)
    progress_at = models.DateTimeField(default=timezone.now, help_text="last progress, for the deadline")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, help_text="the last action that failed, and why")

    # ---- flags (buttons set them; the reconciler clears them) -------------------
    abort_requested = models.BooleanField(default=False)
    promote_requested = models.BooleanField(default=False)
    promote_full_requested = models.BooleanField(default=False)
    skip_step_requested = models.BooleanField(default=False)
    retry_requested = models.BooleanField(default=False)

    # ---- scheduling -------------------------------------------------------------
    next_run_at = models.DateTimeField(
        null=True,
        blank=True,
        db_index=True,
        help_text="when reconcile should next run; the sweeper restarts overdue ones",
    )
    schedule_token = models.CharField(
        max_length=32, blank=True, help_text="the scheduled run that is current; older ones exit"
    )
    updated_at = models.DateTimeField(default=timezone.now)

    objects = RolloutQuerySet.as_manager()

    class Meta:
        ordering = ["-created", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["routing_table"],
                condition=models.Q(phase__lt=Phase.ABORTED.value),
                name="one_unfinished_rollout_per_table",
            )
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk}: {self.stable_pool_id and self.stable_pool.name} → {self.target_revision}"

    @property
    def actor(self) -> str:
        """How the rollout names itself in audit rows."""
        return f"rollout:{self.pk}"

    @property
    def phase_label(self) -> str:
        return Phase(self.phase).label

    @property
    def is_finished(self) -> bool:
        return Phase(self.phase).finished

    def step_plan(self) -> list[plan.Step]:
        return plan.parse(self.steps)

    def current_step(self) -> plan.Step | None:
        steps = self.step_plan()
        return steps[self.step_index] if self.step_index < len(steps) else None

    def gate_settings(self) -> GateSettings:
        return GateSettings.from_json(self.gate)

    def gate_required(self) -> bool:
        return not self.fast_track and self.gate_settings().enabled and self.target_revision.engine_profile().is_chunked

    def canary_weight_bp(self) -> int:
        return int(self.weights.get("canary", 0))

    def sample_forecast(self, now: datetime | None = None) -> list[AnalysisForecast]:
        """For each analysis step, how long it needs to reach its minimum
        sample count at the model's traffic of the last few minutes."""
        now = now or timezone.now()
        steps = self.step_plan()
        specs = {t.name: t.spec() for t in AnalysisTemplate.objects.filter(name__in=plan.templates_named(steps))}
        members = list(self.routing_table.pools.select_related("pool"))
        pools = {m.pool.name for m in members} | {self.stable_pool.name, self.canary_pool.name}
        roles = frozenset(m.role for m in members) | ({"baseline"} if self.baseline_pool_id else set())
        return forecast(
            steps,
            specs,
            measure.requests_per_second(pools, now),
            roles=roles,
            has_baseline=self.baseline_pool_id is not None,
        )

    def state(self) -> RolloutState:
        """The row as the evaluator takes it."""
        return RolloutState(
            phase=Phase(self.phase),
            steps=tuple(self.step_plan()),
            step_index=self.step_index,
            step_started_at=self.step_started_at,
            pause_conditions=tuple(
                PauseCondition(PauseReason(c["reason"]), datetime.fromisoformat(c["since"]))
                for c in self.pause_conditions
            ),
            flags=Flags(**{flag: getattr(self, field) for flag, field in FLAG_FIELDS.items()}),
            stable_revision=self.stable_revision_id,
            target_revision=self.target_revision_id,
            gate=GateStatus(self.gate_status),
            progress_at=self.progress_at,
            progress_deadline_seconds=self.progress_deadline_seconds,
            fast_track=self.fast_track,
            has_baseline=self.baseline_pool_id is not None,
            abort_reason=self.abort_reason,
            gate_message=str(self.gate_result.get("message", "")),
            last_error=self.last_error,
        )

    def audit_state(self) -> dict[str, Any]:
        return {
            "phase": self.phase_label,
            "step_index": self.step_index,
            "weights": self.weights,
            "stable_pool": self.stable_pool_id,
            "canary_pool": self.canary_pool_id,
            "baseline_pool": self.baseline_pool_id,
            "stable_revision": self.stable_revision_id,
            "target_revision": self.target_revision_id,
            "steps": self.steps,
            "fast_track": self.fast_track,
            "flags": [flag for flag, field in FLAG_FIELDS.items() if getattr(self, field)],
        }

    # ---- creating ----------------------------------------------------------------
    @classmethod
    def start(
        cls,
        *,
        routing_table: RoutingTable,
        stable_pool: Pool,
        canary_pool: Pool,
        target_revision: ProfileRevision,
        baseline_pool: Pool | None = None,
        stable_revision: ProfileRevision | None = None,
        steps: list[Any] | None = None,
        progress_deadline_seconds: float = DEFAULT_PROGRESS_DEADLINE_SECONDS,
        gate: dict[str, Any] | None = None,
        actor: Actor = None,
        fast_track: bool = False,
        rollback_of: Rollout | None = None,
        now: datetime | None = None,
    ) -> Rollout:
        """Validate, create, audit and kick the first reconcile. Raises
        ValidationError naming each bad field."""
        now = now or timezone.now()
        stable_revision = stable_revision or stable_pool.desired_revision
        if steps is None:
            steps = [] if fast_track else plan.to_json(plan.default_plan())

        def check() -> None:
            errors = creation_errors(
                routing_table,
                stable_pool,
                canary_pool,
                baseline_pool,
                stable_revision,
                target_revision,
                steps,
                gate,
                progress_deadline_seconds,
                fast_track,
            )
            if errors:
                raise ValidationError(errors)

        check()
        if plan.DEFAULT_TEMPLATE in plan.templates_named(plan.parse(steps)):
            AnalysisTemplate.default()
        with transaction.atomic():
            # "One unfinished rollout per routing table" holds in the database:
            # creates on one table queue on its row lock and each re-checks
            # after the one before it committed; the partial unique constraint
            # (one_unfinished_rollout_per_table) catches any path that skips
            # the lock, or a database without row locks (SQLite serialises
            # writers instead).
            type(routing_table).objects.select_for_update().filter(pk=routing_table.pk).first()
            check()
            try:
                with transaction.atomic():
                    rollout = cls.objects.create(
                        routing_table=routing_table,
                        stable_pool=stable_pool,
                        canary_pool=canary_pool,
                        baseline_pool=baseline_pool,
                        stable_revision=stable_revision,
                        target_revision=target_revision,
                        steps=steps,
                        progress_deadline_seconds=progress_deadline_seconds,
                        gate=gate or {},
                        fast_track=fast_track,
                        rollback_of=rollback_of,
                        created_by=actor if getattr(actor, "is_authenticated", False) else None,
                        created=now,
                        progress_at=now,
                        next_run_at=now,
                        weights=routing_table.weights(),
                    )
            except IntegrityError as exc:
                raise ValidationError({"non_field_errors": [BUSY_MESSAGE]}) from exc
            rollout.gate_status = GateStatus.PENDING if rollout.gate_required() else GateStatus.SKIPPED
            rollout.save(update_fields=["gate_status"])
            verb = "rollback" if fast_track else "create"
            audit.record(actor, f"rollout.{verb}", rollout, None, rollout.audit_state(), time=now)
            rollout.record(
                "created",
                f"{'rollback' if fast_track else 'rollout'} of {stable_pool.name} from "
                f"{stable_revision} to {target_revision} created",
                actor_name(actor),
                now=now,
            )
            rollout.kick()
            rollout.changed()
        return rollout

    def rollback(self, actor: Actor, *, now: datetime | None = None) -> Rollout:
        """Back to the revision before this (succeeded) rollout, fast-tracked."""
        if self.phase != Phase.SUCCEEDED:
            raise ValidationError(
                {"non_field_errors": ["only a succeeded rollout can be rolled back; abort a running one instead."]}
            )
        return Rollout.start(
            routing_table=self.routing_table,
            stable_pool=self.stable_pool,
            canary_pool=self.canary_pool,
            baseline_pool=self.baseline_pool,
            stable_revision=self.target_revision,
            target_revision=self.stable_revision,
            steps=[],
            fast_track=True,
            rollback_of=self,
            actor=actor,
            progress_deadline_seconds=self.progress_deadline_seconds,
            now=now,
        )

    # ---- buttons: set a flag, audit, kick ---------------------------------------
    def request_abort(self, actor: Actor, reason: str = "", source: str = "api") -> bool:
        """Ask the reconciler to abort. Returns False when the rollout has
        already finished (nothing to abort). Safe to call any number of
        times from anywhere (the API, the UI, the alerts kill switch)."""
        who = actor_name(actor)
        text = f"abort requested by {who}" + (f" ({source})" if source else "") + (f": {reason}" if reason else "")
        with transaction.atomic():
            claimed = Rollout.objects.filter(pk=self.pk, phase__lt=Phase.ABORTED, abort_requested=False).update(
                abort_requested=True, abort_reason=text, updated_at=timezone.now()
            )
            if not claimed:
                self.refresh_from_db(fields=["phase", "abort_requested", "abort_reason"])
                return not self.is_finished
            self.abort_requested, self.abort_reason = True, text
            audit.record(
                actor,
                "rollout.abort",
                self,
                {"abort_requested": False},
                {"abort_requested": True, "reason": reason, "source": source},
            )
            self.record("abort_requested", text, who, data={"reason": reason, "source": source})
            self.kick()  # first: the reconciler must not wait for a page to be told
            self.changed()
        return True

    def request(self, flag: str, actor: Actor) -> None:
        """promote, promote_full, skip_step or retry. Raises ValidationError
        when the rollout's phase does not allow it."""
        field = FLAG_FIELDS[flag]
        allowed = {
            "promote": lambda p: p in (Phase.PROGRESSING, Phase.PAUSED),
            "skip_step": lambda p: p in (Phase.PROGRESSING, Phase.PAUSED),
            "promote_full": lambda p: p in (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED),
            "retry": lambda p: p == Phase.ABORTED,
        }[flag]
        verb = flag.replace("_", "-")
        with transaction.atomic():
            phases = [p for p in Phase if allowed(p)]
            claimed = Rollout.objects.filter(pk=self.pk, phase__in=phases).update(
                **{field: True}, updated_at=timezone.now()
            )
            if not claimed:
                if not Rollout.objects.filter(pk=self.pk).exists():
                    raise Rollout.DoesNotExist(f"rollout {self.pk} was deleted")
                self.refresh_from_db(fields=["phase"])
                raise ValidationError({"non_field_errors": [f"cannot {verb} a rollout that is {self.phase_label}."]})
            setattr(self, field, True)
            audit.record(actor, f"rollout.{flag}", self, {field: False}, {field: True})
            self.record(f"{flag}_requested", f"{verb} requested by {actor_name(actor)}", actor_name(actor))
            self.kick()
            self.changed()

    def kick(self) -> None:
        """Reconcile now (after this transaction commits)."""
        # Imported here: tasks.py imports this module.
        from controlplane.rollouts.tasks import reconcile

        rollout_id = self.pk
        transaction.on_commit(lambda: reconcile.delay(rollout_id))

    # ---- the timeline ----------------------------------------------------------------
    def record(
        self,
        kind: str,
        message: str,
        actor: str = "",
        *,
        data: dict[str, Any] | None = None,
        now: datetime | None = None,
    ) -> RolloutEvent:
        """One timeline entry. Callers push the change to live pages once per
        transaction (``changed()``), after whatever else must go out first."""
        return RolloutEvent.objects.create(
            rollout=self,
            time=now or timezone.now(),
            kind=kind,
            message=message[:2000],
            actor=actor or self.actor,
            phase=self.phase,
            step_index=self.step_index,
            data=data or {},
        )

    def changed(self) -> None:
        """Live pages re-render this rollout after the transaction commits."""
        live.publish(live.Event.ROLLOUT_CHANGED, scopes=[self.pk], rollout_id=self.pk)

    def current_analysis(self) -> AnalysisRun | None:
        return self.analysis_runs.filter(attempt=self.attempt, step_index=self.step_index).first()


def creation_errors(
    table: RoutingTable,
    stable_pool: Pool,
    canary_pool: Pool,
    baseline_pool: Pool | None,
    stable_revision: ProfileRevision | None,
    target_revision: ProfileRevision,
    steps: Any,
    gate: Any,
    progress_deadline_seconds: float,
    fast_track: bool,
) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}

    def add(field: str, message: str) -> None:
        errors.setdefault(field, []).append(message)

    roles = {m.pool_id: m.role for m in table.pools.all()}
    for field, pool, role in (
        ("stable_pool", stable_pool, "stable"),
        ("canary_pool", canary_pool, "canary"),
        ("baseline_pool", baseline_pool, "baseline"),
    ):
        if pool is not None and roles.get(pool.pk) != role:
            add(field, f"pool `{pool.name}` must be the {role} pool of the `{table.model}` routing table.")
    if canary_pool.pk == stable_pool.pk or (
        baseline_pool is not None and baseline_pool.pk in (canary_pool.pk, stable_pool.pk)
    ):
        add("canary_pool", "the stable, canary and baseline pools must be three different pools.")
    if stable_revision is None:
        add("stable_revision", "the stable pool has no desired revision; name the stable revision.")
    elif stable_revision.pk == target_revision.pk:
        add("target_revision", "the target is the stable revision already.")
    for field, pool in (("target_revision", canary_pool), ("target_revision", stable_pool)):
        for message in pool.revision_errors(target_revision).get("desired_revision", []):
            add(field, message)
    try:
        parsed = plan.parse(steps)
    except plan.StepError as exc:
        errors.update(exc.errors)
        parsed = []
    if fast_track and parsed:
        add("steps", "a fast-tracked rollback has no steps.")
    missing = (
        plan.templates_named(parsed)
        - {plan.DEFAULT_TEMPLATE}
        - set(AnalysisTemplate.objects.filter(name__in=plan.templates_named(parsed)).values_list("name", flat=True))
    )
    for name in sorted(missing):
        add("steps", f"analysis template `{name}` does not exist.")
    gate_errors = settings_errors(gate)
    if not gate_errors and not fast_track:
        gate_errors = gate_prompt_errors(
            GateSettings.from_json(gate),
            target_revision,
            [p for p in (stable_pool, canary_pool, baseline_pool) if p is not None],
        )
    for message in gate_errors:
        add("gate", message)
    if not (progress_deadline_seconds and progress_deadline_seconds > 0):
        add("progress_deadline_seconds", "must be a positive number of seconds.")
    busy = Rollout.objects.active().filter(
        models.Q(routing_table=table)
        | models.Q(stable_pool__in=[stable_pool, canary_pool])
        | models.Q(canary_pool__in=[stable_pool, canary_pool])
    )
    if (running := busy.first()) is not None:
        add(
            "non_field_errors",
            f"rollout {running.pk} is still running on this routing table or these pools; finish or abort it first.",
        )
    if not fast_track and table.weights().get("canary", 0) != 0:
        add("canary_pool", "the canary pool already takes traffic; set its weight to 0 first.")
    return errors


def gate_prompt_errors(settings: GateSettings, target_revision: ProfileRevision, pools: list[Pool]) -> list[str]:
    """The gate's prompts (the operator's or the default set) must cross
    enough chunk boundaries of the target, as far as the pools' workers'
    context allows (their shortest; unknown when none says)."""
    profile = target_revision.engine_profile()
    if not (settings.enabled and profile.is_chunked):
        return []
    lengths = Worker.objects.filter(pool__in=pools, max_model_len__gt=0).values_list("max_model_len", flat=True)
    max_model_len = min(lengths, default=0)
    short = profile.short_prompt_threshold
    prompts: list[Prompt] = list(settings.prompts)
    if not prompts:
        prompts.extend(default_prompts(profile.chunk_cap, max_model_len, settings.max_tokens, short))
    return prompt_errors(prompts, profile.chunk_cap, max_model_len, settings.max_tokens, short)


class RolloutEvent(models.Model):
    """The timeline: every transition, with its reason and actor."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="events")
    time = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=32)
    message = models.TextField()
    actor = models.CharField(max_length=150, help_text="username, rollout:<id>, system, or the kill switch")
    phase = models.PositiveSmallIntegerField(choices=PHASE_CHOICES)
    step_index = models.PositiveIntegerField(default=0)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["time", "id"]

    def __str__(self) -> str:
        return f"{self.time:%H:%M:%S} {self.kind}: {self.message}"

    @property
    def phase_label(self) -> str:
        return Phase(self.phase).label


class AnalysisRun(models.Model):
    """One analysis step of one attempt (Argo's AnalysisRun)."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="analysis_runs")
    attempt = models.PositiveIntegerField()
    step_index = models.PositiveIntegerField()
    template_name = models.CharField(max_length=100)
    spec = models.JSONField(help_text="the template as it was when the run started")
    phase = models.PositiveSmallIntegerField(choices=ANALYSIS_PHASE_CHOICES, default=AnalysisPhase.PENDING.value)
    message = models.TextField(blank=True)
    results = models.JSONField(default=dict, blank=True, help_text="per metric: Argo's counters")
    canary_pool_name = models.CharField(max_length=100)
    baseline_pool_name = models.CharField(max_length=100)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    terminated = models.BooleanField(default=False, help_text="stopped before a verdict (skip, promote, abort)")

    class Meta:
        ordering = ["attempt", "step_index"]
        constraints = [
            models.UniqueConstraint(fields=["rollout", "attempt", "step_index"], name="analysis_run_once_per_step")
        ]

    def __str__(self) -> str:
        return f"analysis {self.template_name} of rollout {self.rollout_id} step {self.step_index}"

    @property
    def phase_label(self) -> str:
        return AnalysisPhase(self.phase).label

    def run_spec(self) -> RunSpec:
        return RunSpec.from_json(self.spec)

    def metric_results(self) -> dict[str, MetricResult]:
        return {name: MetricResult.from_json(data) for name, data in self.results.items()}


class Measurement(models.Model):
    """One measurement round, with the numbers behind every metric's verdict."""

    run = models.ForeignKey(AnalysisRun, on_delete=models.CASCADE, related_name="measurements")
    taken_at = models.DateTimeField()
    window_seconds = models.FloatField()
    phase = models.PositiveSmallIntegerField(choices=ANALYSIS_PHASE_CHOICES, help_text="the worst metric's verdict")
    verdicts = models.JSONField(default=list, help_text="per metric: values, samples, ratio, verdict, reason")
    weights = models.JSONField(default=dict, blank=True, help_text="the routing weights it was taken under")

    class Meta:
        ordering = ["taken_at", "id"]

    def __str__(self) -> str:
        return f"measurement {self.taken_at:%H:%M:%S} {AnalysisPhase(self.phase).label}"

    @property
    def phase_label(self) -> str:
        return AnalysisPhase(self.phase).label
