"""The fleet registry: pools, workers and the tokens workers enroll with.

Which revision a worker should run: its own ``desired_revision`` when set (a
per-worker override, used to make single canaries), else its pool's. Which it
runs: what its agent last reported (``running_revision``). The two differ
during every rollout; ``drift_since`` records since when, and a worker counts
as drifting once that is older than ``DRIFT_GRACE_SECONDS``.

Secrets (enrollment tokens, worker secrets) are stored as SHA-256 hashes
(``accounts.secrets``): a leaked database lets no one heartbeat as a worker.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane import audit, live, outages
from controlplane.accounts.models import IssuedSecret
from controlplane.accounts.secrets import hash_secret, new_secret
from controlplane.fleet import conf
from controlplane.fleet.health import (
    AGENT_STATE_MAP,
    Thresholds,
    WorkerState,
    drift_since,
    is_drifting,
    liveness,
)
from controlplane.profiles.models import ENGINE_KIND_CHOICES, ProfileRevision
from workers.contract import HeartbeatReply, HeartbeatRequest, ProfileRef, RegisterRequest

STATE_CHOICES = [(state.value, state.label) for state in WorkerState]
# Operator actions on a worker: the flags each sets. Buttons only set flags;
# the agent (drain) and the gateway (cordon) act on them.
FLAG_ACTIONS: dict[str, dict[str, bool]] = {
    "drain": {"drain_requested": True},
    "undrain": {"drain_requested": False},
    "cordon": {"cordoned": True},
    "uncordon": {"cordoned": False, "drain_requested": False},
}
AUDITED_WORKER_FIELDS = [
    "name",
    "url",
    "pool",
    "labels",
    "engine_kind",
    "state",
    "cordoned",
    "drain_requested",
    "desired_revision",
    "running_revision",
    "drift_since",
]
ENROLLMENT_TOKEN_PREFIX = "cpe_"
WORKER_SECRET_PREFIX = "cpw_"


def liveness_thresholds() -> Thresholds:
    return Thresholds(
        unhealthy_after_seconds=conf.WORKER_UNHEALTHY_AFTER_SECONDS.get(),
        offline_after_seconds=conf.WORKER_OFFLINE_AFTER_SECONDS.get(),
        heartbeat_interval_seconds=conf.HEARTBEAT_INTERVAL_SECONDS.get(),
        outage_grace_seconds=conf.WORKER_OUTAGE_GRACE_SECONDS.get(),
    )


def control_plane_failed_at() -> datetime | None:
    """When the control plane last failed to reach its database (any
    process: ``controlplane.outages``), as an aware datetime."""
    failed_at = outages.last_database_failure()
    return None if failed_at is None else datetime.fromtimestamp(failed_at, tz=UTC)


class EnrollmentRefused(Exception):
    """Unknown, used-up or expired enrollment token."""


class Pool(audit.Audited, models.Model):
    audit_name = "pool"

    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    desired_revision = models.ForeignKey(
        ProfileRevision, null=True, blank=True, on_delete=models.PROTECT, related_name="pools"
    )
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def revision_errors(self, revision: ProfileRevision | None) -> dict[str, list[str]]:
        """Why ``revision`` cannot be this pool's desired revision: every
        worker in the pool must be able to run it. Empty when it can."""
        if revision is None:
            return {}
        return _revision_errors_for(revision, self.workers.filter(desired_revision__isnull=True))

    def set_desired_revision(self, revision: ProfileRevision | None, *, now: datetime | None = None) -> None:
        """Point the pool at ``revision`` and start its workers' drift clocks.
        Callers validate first (``revision_errors``) and write the audit row."""
        now = now or timezone.now()
        with transaction.atomic():
            self.desired_revision = revision
            self.save(update_fields=["desired_revision"])
            Worker.refresh_drift(self.workers.all(), now)


class EnrollmentToken(IssuedSecret, models.Model):
    audit_name = "enrollment_token"
    SECRET_PREFIX = ENROLLMENT_TOKEN_PREFIX
    HASH_FIELD = "token_hash"
    SHOWN_PREFIX_FIELD = "token_prefix"

    name = models.CharField(max_length=100, help_text="what the token is for, e.g. 'rack 4 GPUs'")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    token_prefix = models.CharField(max_length=12, editable=False, help_text="shown to tell tokens apart")
    pool = models.ForeignKey(
        Pool,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="enrollment_tokens",
        help_text="workers that enroll with this token join this pool",
    )
    max_uses = models.PositiveIntegerField(null=True, blank=True, help_text="null: unlimited")
    num_uses = models.PositiveIntegerField(default=0)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="null: never")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.token_prefix}…)"

    def is_usable(self, now: datetime) -> bool:
        if self.expires_at is not None and self.expires_at <= now:
            return False
        return self.max_uses is None or self.num_uses < self.max_uses

    @classmethod
    def redeem(cls, plaintext: str, now: datetime) -> EnrollmentToken:
        """Use the token once. The conditional update claims the use, so two
        workers racing for the last use cannot both get it."""
        usable = cls.objects.filter(token_hash=hash_secret(plaintext)).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now),
            Q(max_uses__isnull=True) | Q(num_uses__lt=F("max_uses")),
        )
        token = usable.first()
        if token is None or usable.filter(pk=token.pk).update(num_uses=F("num_uses") + 1) != 1:
            raise EnrollmentRefused("unknown, used-up or expired enrollment token")
        token.refresh_from_db(fields=["num_uses"])
        return token


class WorkerQuerySet(models.QuerySet["Worker"]):
    def for_heartbeat(self) -> WorkerQuerySet:
        """What the heartbeat needs from the database, in one small query:
        the revision itself comes from ``revision_ref`` (immutable, cached)."""
        return self.select_related("pool")

    def drifting(self, now: datetime | None = None) -> WorkerQuerySet:
        now = now or timezone.now()
        return self.filter(drift_since__lte=now - timedelta(seconds=conf.DRIFT_GRACE_SECONDS.get()))

    def with_stale_drift_clock(self) -> WorkerQuerySet:
        """Workers whose ``drift_since`` disagrees with desired vs running:
        a clock that should run and does not, or the reverse."""
        effective = Coalesce("desired_revision_id", "pool__desired_revision_id")
        qs = self.annotate(effective_desired_id=effective)
        differs = Q(effective_desired_id__isnull=False) & (
            Q(running_revision__isnull=True) | ~Q(running_revision_id=F("effective_desired_id"))
        )
        return qs.filter((Q(drift_since__isnull=True) & differs) | (Q(drift_since__isnull=False) & ~differs))

    def routable(self) -> WorkerQuerySet:
        """Workers a gateway may send new requests to."""
        return self.filter(state=WorkerState.READY, cordoned=False, drain_requested=False)


class Worker(audit.Audited, models.Model):
    audit_name = "worker"
    State = WorkerState  # so that queries read Worker.State.READY

    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(max_length=300, help_text="where the worker's OpenAI server listens")
    pool = models.ForeignKey(Pool, null=True, blank=True, on_delete=models.PROTECT, related_name="workers")
    labels = models.JSONField(default=dict, blank=True)
    hardware = models.JSONField(default=dict, blank=True)
    engine_kind = models.CharField(max_length=16, choices=ENGINE_KIND_CHOICES, default="reference")
    model = models.CharField(max_length=200, blank=True)
    max_model_len = models.PositiveIntegerField(default=0, help_text="0: unknown")

    state = models.PositiveSmallIntegerField(choices=STATE_CHOICES, default=WorkerState.REGISTERING, db_index=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    cordoned = models.BooleanField(default=False, help_text="the gateway sends it no new requests")
    drain_requested = models.BooleanField(default=False, help_text="the agent is told to stop admitting")
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    heartbeat_interval_seconds = models.FloatField(
        null=True,
        blank=True,
        help_text="the interval it was last told to heartbeat at; the health sweep scales with it",
    )
    load = models.JSONField(default=dict, blank=True)

    desired_revision = models.ForeignKey(
        ProfileRevision,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="workers_desiring",
        help_text="per-worker override of the pool's desired revision; null: the pool's",
    )
    running_revision = models.ForeignKey(
        ProfileRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers_running"
    )
    running_profile = models.JSONField(default=dict, blank=True, help_text="as the agent reported it, in full")
    apply_error = models.TextField(blank=True, help_text="why the agent's last apply failed")
    health_error = models.TextField(
        blank=True, help_text="why the agent reports its engine unhealthy (empty while it serves)"
    )
    drift_since = models.DateTimeField(null=True, blank=True, db_index=True)

    secret_hash = models.CharField(max_length=64, unique=True, null=True, blank=True, editable=False)
    enrollment_token = models.ForeignKey(
        EnrollmentToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="workers"
    )
    registered_at = models.DateTimeField(default=timezone.now)

    objects = WorkerQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "last_heartbeat_at"], name="worker_state_heartbeat")]

    def __str__(self) -> str:
        return self.name

    @property
    def simulated(self) -> bool:
        """A simulated engine (``workers serve --engine sim``): step times from a
        GPU performance database, no real inference. Shown on every worker."""
        return self.engine_kind == "sim" or bool((self.hardware or {}).get("simulated"))

    # ---- what it should run -------------------------------------------
    @property
    def state_label(self) -> str:
        return WorkerState(self.state).label

    def effective_desired_revision(self) -> ProfileRevision | None:
        if self.desired_revision_id is not None:
            return self.desired_revision
        return self.pool.desired_revision if self.pool is not None else None

    def effective_desired_revision_id(self) -> int | None:
        if self.desired_revision_id is not None:
            return self.desired_revision_id
        return self.pool.desired_revision_id if self.pool is not None else None

    def desired_revision_for_agent(self) -> ProfileRef | None:
        revision_id = self.effective_desired_revision_id()
        return revision_ref(revision_id) if revision_id is not None else None

    def is_drifting(self, now: datetime | None = None) -> bool:
        return is_drifting(self.drift_since, now or timezone.now(), conf.DRIFT_GRACE_SECONDS.get())

    def revision_errors(self, revision: ProfileRevision | None) -> dict[str, list[str]]:
        if revision is None:
            return {}
        return _revision_errors_for(revision, [self])

    # ---- agent contract -----------------------------------------------
    @classmethod
    def register(
        cls, req: RegisterRequest, *, now: datetime | None = None, heartbeat_interval_seconds: float | None = None
    ) -> tuple[Worker, str]:
        """Enroll a worker (or re-enroll one that restarted: same name, same
        row, new secret), recording the heartbeat interval it is told (None:
        the base interval). Returns the worker and its secret, which is shown
        once. Raises EnrollmentRefused."""
        now = now or timezone.now()
        secret = new_secret(WORKER_SECRET_PREFIX)
        with transaction.atomic():
            token = EnrollmentToken.redeem(req["enroll_token"], now)
            existing = cls.objects.select_for_update().filter(name=req["name"]).first()
            created = existing is None
            before = None if existing is None else existing.audit_state()
            worker = existing if existing is not None else cls(name=req["name"])
            worker.url = req["url"]
            worker.engine_kind = req["engine_kind"]
            worker.model = req["model"]
            worker.max_model_len = req["max_model_len"]
            worker.hardware = dict(req["hardware"])
            worker.labels = dict(req["labels"])
            if token.pool_id is not None:
                worker.pool_id = token.pool_id
            worker.enrollment_token = token
            worker.secret_hash = secret.hash
            worker.registered_at = now
            worker.heartbeat_interval_seconds = heartbeat_interval_seconds
            worker.state = WorkerState.REGISTERING
            worker.state_changed_at = now
            worker.drift_since = drift_since(
                worker.drift_since, worker.effective_desired_revision_id(), worker.running_revision_id, now
            )
            worker.save()
            audit.record(f"worker:{worker.name}", "worker.register", worker, before, worker.audit_state(), time=now)
            live.publish(live.Event.WORKER_CHANGED, worker_id=worker.pk, created=created)
        return worker, secret.plaintext

    @classmethod
    def authenticate(cls, secret: str) -> Worker | None:
        try:
            return cls.objects.for_heartbeat().get(secret_hash=hash_secret(secret))
        except cls.DoesNotExist:
            return None

    def record_heartbeat(
        self, hb: HeartbeatRequest, *, now: datetime | None = None, heartbeat_interval_seconds: float | None = None
    ) -> HeartbeatReply:
        """Take in one heartbeat: state, load, what it runs. Returns the reply
        that tells the agent what to run, whether to drain, and when to
        heartbeat next (``heartbeat_interval_seconds``, recorded: the health
        sweep judges the worker's next silence by it; None: the base interval).

        One UPDATE; the dashboard hears of it only when something it shows
        (state, running revision, drift) changed."""
        now = now or timezone.now()
        old = (self.state, self.running_revision_id, self.drift_since)
        old_url, old_health_error = self.url, self.health_error

        self.state = AGENT_STATE_MAP[hb["state"]]
        if self.state != old[0]:
            self.state_changed_at = now
        running_id = hb["running_revision_id"]
        if running_id != self.running_revision_id:
            # An id we do not know (deleted, or another control plane's) is
            # as good as none: the worker runs a profile we cannot name.
            if running_id is not None and not ProfileRevision.objects.filter(pk=running_id).exists():
                running_id = None
            self.running_revision_id = running_id
        self.drift_since = drift_since(self.drift_since, self.effective_desired_revision_id(), running_id, now)
        self.last_heartbeat_at = now
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.load = dict(hb["load"])
        if hb["hardware"]:
            self.hardware = dict(hb["hardware"])
        self.running_profile = dict(hb["running_profile"])
        self.apply_error = hb["apply_error"] or ""
        self.health_error = (hb.get("health_error") or "") if self.state == WorkerState.UNHEALTHY else ""
        url = hb.get("url")
        if url and url != self.url:
            # Restarted on another port with its state file: it kept its
            # secret, so this is where the control plane hears the new URL.
            self.url = url
        # Into or out of lost (silent, or its engine broke), recorded once per change.
        state_change = self.state != old[0] and (WorkerState(old[0]).is_lost or WorkerState(self.state).is_lost)
        applied = self.running_revision_id != old[1] and self.running_revision_id is not None
        moved = self.url != old_url
        # A routine heartbeat is one UPDATE in autocommit; one that also
        # writes audit rows commits them together with the state they describe.
        with transaction.atomic() if state_change or applied or moved else contextlib.nullcontext():
            self.save(
                update_fields=[
                    "state",
                    "state_changed_at",
                    "running_revision",
                    "drift_since",
                    "last_heartbeat_at",
                    "heartbeat_interval_seconds",
                    "load",
                    "hardware",
                    "running_profile",
                    "apply_error",
                    "health_error",
                    "url",
                ]
            )
            if state_change:
                after: dict[str, Any] = {"state": self.state_label}
                if self.health_error:
                    after["reason"] = self.health_error
                audit.record(
                    f"worker:{self.name}",
                    "worker.state_change",
                    self,
                    {"state": WorkerState(old[0]).label},
                    after,
                    time=now,
                )
            if moved:
                audit.record(
                    f"worker:{self.name}",
                    "worker.url_change",
                    self,
                    {"url": old_url},
                    {"url": self.url},
                    time=now,
                )
            if applied:
                audit.record(
                    f"worker:{self.name}",
                    "worker.profile_applied",
                    self,
                    {"running_revision": old[1]},
                    {"running_revision": self.running_revision_id},
                    time=now,
                )
            if (
                (self.state, self.running_revision_id, self.drift_since) != old
                or moved
                or (self.health_error != old_health_error)
            ):
                live.publish(live.Event.WORKER_CHANGED, worker_id=self.pk)
        return HeartbeatReply(
            worker_id=self.pk,
            desired=self.desired_revision_for_agent(),
            drain=self.drain_requested,
            heartbeat_interval_seconds=heartbeat_interval_seconds or conf.HEARTBEAT_INTERVAL_SECONDS.get(),
        )

    # ---- operator actions ---------------------------------------------
    def audit_state(self) -> dict[str, Any]:
        """What an audit row records of a worker (never its secret)."""
        data = audit.snapshot(self, fields=AUDITED_WORKER_FIELDS)
        data["state"] = WorkerState(self.state).label
        return data

    def flag_action(self, verb: str, actor: Any) -> None:
        """Run one of FLAG_ACTIONS for ``actor`` and write its audit row."""
        with transaction.atomic():
            before = self.audit_state()
            self.set_flags(**FLAG_ACTIONS[verb])
            audit.record(actor, f"worker.{verb}", self, before, self.audit_state())

    def set_flags(self, **flags: bool) -> None:
        """cordoned / drain_requested. Draining implies cordoned: a worker
        told to stop admitting must not be sent new requests meanwhile."""
        for name, value in flags.items():
            if name not in ("cordoned", "drain_requested"):
                raise TypeError(f"unknown flag {name}")
            setattr(self, name, value)
        if self.drain_requested:
            self.cordoned = True
        self.save(update_fields=["cordoned", "drain_requested"])
        live.publish(live.Event.WORKER_CHANGED, worker_id=self.pk)

    def set_desired_revision(self, revision: ProfileRevision | None, *, now: datetime | None = None) -> None:
        """Override the pool's revision for this worker alone (None: follow
        the pool again). Callers validate first and write the audit row."""
        now = now or timezone.now()
        self.desired_revision = revision
        self.drift_since = drift_since(
            self.drift_since, self.effective_desired_revision_id(), self.running_revision_id, now
        )
        self.save(update_fields=["desired_revision", "drift_since"])
        live.publish(live.Event.WORKER_CHANGED, worker_id=self.pk)

    @staticmethod
    def refresh_drift(workers: models.QuerySet[Worker] | list[Worker], now: datetime) -> int:
        """Re-derive ``drift_since`` from stored desired vs running; returns
        how many workers changed. Safe to run any time (the health sweep does)."""
        changed = 0
        for worker in workers.select_related("pool") if isinstance(workers, models.QuerySet) else workers:
            since = drift_since(
                worker.drift_since, worker.effective_desired_revision_id(), worker.running_revision_id, now
            )
            if since != worker.drift_since:
                Worker.objects.filter(pk=worker.pk).update(drift_since=since)
                worker.drift_since = since
                live.publish(live.Event.WORKER_CHANGED, worker_id=worker.pk)
                changed += 1
        return changed

    # ---- health sweep ---------------------------------------------------
    @classmethod
    def sweep_liveness(cls, now: datetime | None = None) -> list[tuple[int, WorkerState, WorkerState]]:
        """Mark silent workers unhealthy, then offline. Each transition is a
        conditional update (the worker may heartbeat meanwhile, and two
        sweeps may run at once) and writes one audit row. Silence while the
        control plane itself could not record heartbeats does not count
        (``health.liveness``). Each worker is judged against the heartbeat
        interval it was last told (``Thresholds.for_interval``): one silence
        condition per distinct interval, a handful in a fleet.
        Returns (worker id, from, to) for each transition made."""
        now = now or timezone.now()
        limits = liveness_thresholds()
        failed_at = control_plane_failed_at()
        not_offline = cls.objects.exclude(state=WorkerState.OFFLINE)
        silent = Q(pk__in=[])
        for interval in set(not_offline.order_by().values_list("heartbeat_interval_seconds", flat=True).distinct()):
            unhealthy_before = now - timedelta(seconds=limits.for_interval(interval).unhealthy_after_seconds)
            # interval=None filters IS NULL: told nothing yet, the base limits
            silent |= Q(heartbeat_interval_seconds=interval, last_seen__lte=unhealthy_before)
        candidates = (
            not_offline.annotate(last_seen=Coalesce("last_heartbeat_at", "registered_at"))
            .filter(silent)
            .only("id", "name", "state", "last_heartbeat_at", "registered_at", "heartbeat_interval_seconds")
        )
        transitions = []
        for worker in candidates:
            current = WorkerState(worker.state)
            worker_limits = limits.for_interval(worker.heartbeat_interval_seconds)
            target = liveness(current, worker.last_seen, now, worker_limits, failed_at)
            if target == current:
                continue
            with transaction.atomic():
                claimed = cls.objects.filter(
                    pk=worker.pk, state=current, last_heartbeat_at=worker.last_heartbeat_at
                ).update(state=target, state_changed_at=now)
                if claimed != 1:
                    continue  # it heartbeat, or another sweep got there first
                audit.record(
                    "system:health-sweep",
                    "worker.state_change",
                    worker,
                    {"state": current.label},
                    {"state": target.label, "silent_seconds": round((now - worker.last_seen).total_seconds(), 1)},
                    time=now,
                )
                live.publish(live.Event.WORKER_CHANGED, worker_id=worker.pk)
            transitions.append((worker.pk, current, target))
        return transitions


@functools.lru_cache(maxsize=1024)
def _cached_ref(revision_id: int) -> ProfileRef:
    return ProfileRevision.objects.select_related("profile").get(pk=revision_id).as_ref()


def revision_ref(revision_id: int) -> ProfileRef:
    """A revision as the agent contract carries it. Revisions never change,
    so each process reads one once: a heartbeat costs two queries, not a
    join across profiles. A copy, so callers may not spoil the cache."""
    ref = _cached_ref(revision_id)
    return ProfileRef(
        revision_id=ref["revision_id"], name=ref["name"], revision=ref["revision"], fields=dict(ref["fields"])
    )


def _revision_errors_for(revision: ProfileRevision, workers: Any) -> dict[str, list[str]]:
    """Each worker's engine must accept the revision, for its own engine kind
    and model length; errors name the worker."""
    messages: list[str] = []
    for worker in workers:
        for field, reasons in revision.errors_for_worker(worker.engine_kind, worker.max_model_len).items():
            messages.extend(f"worker {worker.name} ({worker.engine_kind}): {field}: {reason}" for reason in reasons)
    return {"desired_revision": messages} if messages else {}
