"""Routing tables, client keys and the per-request log.

A ``RoutingTable`` says, for one model name, which pools take its traffic
and in what shares (basis points: 10000 is everything), with the salt that
makes cohorts sticky and an epoch that every change bumps. Gateways cache
the table; each acks every epoch it applies (``controlplane.gateway.bus``),
so a rollout can wait until no gateway routes by the old weights.

``RequestLog`` is written by gateways in batches, one row per client request
with what that client saw. Window queries (analysis, dashboards) go by time
and cohort, pool or worker; rows past ``GATEWAY_LOG_RETENTION_DAYS`` are
deleted by a beat task.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.utils import timezone

from controlplane import audit
from controlplane.accounts.models import IssuedSecret
from controlplane.fleet.models import Pool, Worker
from controlplane.fleet.pools import ROLES, PoolRole
from controlplane.gateway import bus
from controlplane.gateway.cohort import NUM_BUCKETS

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

    Actor = AbstractBaseUser | AnonymousUser | str | None

ROLE_CHOICES = [(role, role) for role in ROLES]
MAX_OUTPUT_TOKENS_LIMIT = 10_000_000  # bounds a cap's value, far above any context length
CLIENT_KEY_PREFIX = "cpk_"


def new_salt() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class PoolSpec:
    """One line of a table as an operator writes it."""

    pool: Pool
    role: str
    weight_bp: int


class RoutingTable(models.Model):
    model = models.CharField(max_length=200, unique=True, help_text="the model name clients send")
    salt = models.CharField(max_length=64, default=new_salt, help_text="changing it reshuffles every sticky key")
    epoch = models.PositiveBigIntegerField(default=1, help_text="bumped by every change; gateways ack it")
    updated_at = models.DateTimeField(default=timezone.now)
    max_output_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_OUTPUT_TOKENS_LIMIT)],
        help_text="the most output tokens one request to this model may ask for (a request asking for more is "
        "refused; one naming no limit gets this one); empty: no cap, the workers' default",
    )

    class Meta:
        ordering = ["model"]

    def __str__(self) -> str:
        return self.model

    # ---- reading ------------------------------------------------------------
    def members(self) -> list[RoutingPool]:
        return sorted(self.pools.select_related("pool"), key=lambda m: PoolRole(m.role).order)

    def weights(self) -> dict[str, int]:
        """Weight by role, e.g. {"canary": 2000, "stable": 8000}."""
        return {m.role: m.weight_bp for m in self.members()}

    def describe(self, members: list[RoutingPool] | None = None) -> dict[str, Any]:
        """The table as the audit log and the API show it."""
        members = self.members() if members is None else members
        return {
            "model": self.model,
            "epoch": self.epoch,
            "salt": self.salt,
            "max_output_tokens": self.max_output_tokens,
            "pools": [{"pool": m.pool.name, "role": m.role, "weight_bp": m.weight_bp} for m in members],
        }

    # ---- changing -----------------------------------------------------------------
    def set_weights(
        self,
        weights: Mapping[str, int],
        *,
        actor: Actor,
        reason: str = "",
        require_ready: bool = True,
        now: datetime | None = None,
    ) -> int:
        """Change weights of the table's pools, named by role or by pool name
        (``{"canary": 2000, "stable": 8000}``); pools not named keep theirs.
        Returns the epoch gateways must ack for the change to be in force.

        Validates that the weights sum to 10000 and that every pool whose
        weight rises has a routable worker (``require_ready=False`` skips the
        latter: an abort must move traffic off a canary even when the stable
        pool is short of workers). Raises ValidationError naming ``weights``.

        Idempotent: asking for the weights already in force changes nothing
        and returns the current epoch, so a reconciler may call it each tick."""
        now = now or timezone.now()
        with transaction.atomic():
            table = RoutingTable.objects.select_for_update().get(pk=self.pk)
            members = table.members()
            before = table.describe(members)
            by_name = {m.role: m for m in members} | {m.pool.name: m for m in members}
            errors: list[str] = []
            new_weights: dict[int, int] = {m.pk: m.weight_bp for m in members}
            for name, weight in weights.items():
                member = by_name.get(name)
                if member is None:
                    errors.append(f"`{name}` is neither a role nor a pool of the `{table.model}` table.")
                elif not _is_weight(weight):
                    errors.append(f"`{name}`: a weight is a whole number of basis points, 0 to {NUM_BUCKETS}.")
                else:
                    new_weights[member.pk] = weight
            if errors:
                raise ValidationError({"weights": errors})
            changed = [m for m in members if new_weights[m.pk] != m.weight_bp]
            if not changed:
                self._refresh_from(table)
                return table.epoch
            rising = [m for m in changed if new_weights[m.pk] > m.weight_bp]
            _validate_weights(
                [(m.pool, m.role, new_weights[m.pk]) for m in members],
                rising_pools={m.pool_id for m in rising} if require_ready else set(),
            )
            for m in changed:
                m.weight_bp = new_weights[m.pk]
            RoutingPool.objects.bulk_update(changed, ["weight_bp"])
            table._bump(now, members)
            audit.record(
                actor, "routing.set_weights", table, before, {**table.describe(members), "reason": reason}, time=now
            )
        self._refresh_from(table)
        return table.epoch

    def configure(
        self,
        specs: list[PoolSpec],
        *,
        actor: Actor,
        reason: str = "",
        salt: str | None = None,
        require_ready: bool = True,
        now: datetime | None = None,
    ) -> int:
        """Replace the table's pools, roles and weights (and its salt, if
        given). The table must be saved. Same validation as ``set_weights``,
        with every weighted pool needing a routable worker unless it already
        held that weight (or ``require_ready=False``: seeding a table before
        its workers are up); plus one pool per role and each pool once.
        Idempotent."""
        now = now or timezone.now()
        with transaction.atomic():
            table = RoutingTable.objects.select_for_update().get(pk=self.pk)
            members = table.members()
            before = table.describe(members)
            current = {(m.pool_id, m.role, m.weight_bp) for m in members}
            wanted = {(s.pool.pk, s.role, s.weight_bp) for s in specs}
            if current == wanted and len(specs) == len(members) and (salt is None or salt == table.salt):
                self._refresh_from(table)
                return table.epoch
            _validate_specs(specs)
            held = {m.pool_id: m.weight_bp for m in members}
            _validate_weights(
                [(s.pool, s.role, s.weight_bp) for s in specs],
                rising_pools={s.pool.pk for s in specs if s.weight_bp > held.get(s.pool.pk, 0)}
                if require_ready
                else set(),
            )
            table.pools.all().delete()
            RoutingPool.objects.bulk_create(
                [RoutingPool(table=table, pool=s.pool, role=s.role, weight_bp=s.weight_bp) for s in specs]
            )
            if salt is not None:
                table.salt = salt
            table._bump(now, list(table.pools.select_related("pool")))
            audit.record(actor, "routing.configure", table, before, {**table.describe(), "reason": reason}, time=now)
        self._refresh_from(table)
        return table.epoch

    def set_output_cap(
        self, max_output_tokens: int | None, *, actor: Actor, reason: str = "", now: datetime | None = None
    ) -> int:
        """Cap (or, with None, uncap) the output tokens one request to this
        model may ask for. Bumps the epoch like any change of the table, so
        the cap reaches every gateway with its notice. Idempotent; returns
        the epoch to wait for."""
        if max_output_tokens is not None and not (
            isinstance(max_output_tokens, int) and 1 <= max_output_tokens <= MAX_OUTPUT_TOKENS_LIMIT
        ):
            raise ValidationError(
                {"max_output_tokens": [f"a cap is a whole number of tokens, 1 to {MAX_OUTPUT_TOKENS_LIMIT}, or null."]}
            )
        now = now or timezone.now()
        with transaction.atomic():
            table = RoutingTable.objects.select_for_update().get(pk=self.pk)
            if table.max_output_tokens == max_output_tokens:
                self._refresh_from(table)
                return table.epoch
            members = table.members()
            before = table.describe(members)
            table.max_output_tokens = max_output_tokens
            table._bump(now, members)
            audit.record(
                actor, "routing.set_output_cap", table, before, {**table.describe(members), "reason": reason}, time=now
            )
        self._refresh_from(table)
        return table.epoch

    def delete_audited(self, *, actor: Actor, reason: str = "") -> None:
        with transaction.atomic():
            audit.record(actor, "routing.delete", self, self.describe(), {"reason": reason} if reason else None)
            table_id, model = self.pk, self.model
            self.delete()
            transaction.on_commit(lambda: bus.publish_notice(bus.NOTICE_ROUTING, table=table_id, model=model))

    @classmethod
    def create_audited(cls, model: str, *, actor: Actor, salt: str | None = None) -> RoutingTable:
        with transaction.atomic():
            table = cls.objects.create(model=model, **({"salt": salt} if salt else {}))
            audit.record(actor, "routing.create", table, None, table.describe([]))
        return table

    def _bump(self, now: datetime, members: list[RoutingPool]) -> None:
        """Called inside the transaction holding this row's lock, with the
        table's pools as they will be committed. The notice carries them, so
        a gateway applies a weight change without a database round trip."""
        self.epoch += 1
        self.updated_at = now
        self.save(update_fields=["epoch", "updated_at", "salt", "max_output_tokens"])
        notice = {
            "table": self.pk,
            "model": self.model,
            "epoch": self.epoch,
            "salt": self.salt,
            "max_output_tokens": self.max_output_tokens,
            "pools": [{"pool": m.pool_id, "role": m.role, "weight_bp": m.weight_bp} for m in members],
        }
        transaction.on_commit(lambda: bus.publish_notice(bus.NOTICE_ROUTING, **notice))

    def _refresh_from(self, table: RoutingTable) -> None:
        self.epoch, self.salt, self.updated_at = table.epoch, table.salt, table.updated_at
        self.max_output_tokens = table.max_output_tokens

    # ---- gateways and their acks -----------------------------------------------------
    def ack_status(self, epoch: int | None = None) -> bus.AckStatus:
        """Which live gateways have applied ``epoch`` (default: the current one)."""
        return bus.ack_status(self.pk, self.epoch if epoch is None else epoch)

    def wait_for_acks(self, epoch: int | None = None, timeout_seconds: float = 5.0) -> bus.AckStatus:
        """Block until every live gateway has applied ``epoch`` (default: the
        current one) or the time is up. Check ``.complete`` on the result."""
        return bus.wait_for_acks(self.pk, self.epoch if epoch is None else epoch, timeout_seconds)

    @staticmethod
    def live_gateways() -> list[bus.GatewayInfo]:
        return bus.live_gateways()


def _is_weight(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= NUM_BUCKETS


def _validate_specs(specs: list[PoolSpec]) -> None:
    errors: list[str] = []
    roles = [s.role for s in specs]
    for role in set(roles):
        if role not in ROLES:
            errors.append(f"`{role}` is not a role; roles are {', '.join(ROLES)}.")
        elif roles.count(role) > 1:
            errors.append(f"a table has at most one {role} pool.")
    names = [s.pool.name for s in specs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"pool `{name}` is listed twice.")
    for s in specs:
        if not _is_weight(s.weight_bp):
            errors.append(f"`{s.pool.name}`: a weight is a whole number of basis points, 0 to {NUM_BUCKETS}.")
    if errors:
        raise ValidationError({"pools": errors})


def _validate_weights(weighted: list[tuple[Pool, str, int]], *, rising_pools: set[int]) -> None:
    """The sum, then that each pool asked to take more traffic can."""
    total = sum(weight for _, _, weight in weighted)
    if total != NUM_BUCKETS:
        shares = ", ".join(f"{role} {weight}" for _, role, weight in weighted) or "no pools"
        raise ValidationError(
            {"weights": [f"weights must sum to {NUM_BUCKETS} basis points; {shares} sum to {total}."]}
        )
    needy = [pool for pool, _, weight in weighted if weight > 0 and pool.pk in rising_pools]
    if not needy:
        return
    routable = set(Worker.objects.routable().filter(pool__in=needy).values_list("pool_id", flat=True).distinct())
    errors = [
        f"pool `{pool.name}` has no ready worker (ready, not cordoned, not draining) to take its {weight} bp."
        for pool, _, weight in weighted
        if pool in needy and pool.pk not in routable
    ]
    if errors:
        raise ValidationError({"weights": errors})


class RoutingPool(models.Model):
    table = models.ForeignKey(RoutingTable, on_delete=models.CASCADE, related_name="pools")
    # PROTECT: a pool that takes traffic cannot vanish under the gateways.
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="routes")
    role = models.CharField(max_length=16, choices=ROLE_CHOICES)
    weight_bp = models.PositiveIntegerField(default=0, help_text="share of traffic in basis points (10000 = all)")

    class Meta:
        ordering = ["table", "role"]
        constraints = [
            models.UniqueConstraint(fields=["table", "pool"], name="routing_pool_once_per_table"),
            models.UniqueConstraint(fields=["table", "role"], name="routing_role_once_per_table"),
            models.CheckConstraint(condition=models.Q(weight_bp__lte=NUM_BUCKETS), name="routing_weight_at_most_all"),
        ]

    def __str__(self) -> str:
        return f"{self.table.model}: {self.role} {self.pool.name} {self.weight_bp}bp"


class ClientKey(IssuedSecret, models.Model):
    """A key clients send to the gateway (``Authorization: Bearer cpk_…``).
    Only its SHA-256 is stored; the plaintext is shown once, at issue."""

    audit_name = "clientkey"
    SECRET_PREFIX = CLIENT_KEY_PREFIX
    HASH_FIELD = "key_hash"
    SHOWN_PREFIX_FIELD = "key_prefix"

    name = models.CharField(max_length=100, help_text="whose key, e.g. 'search frontend'")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_prefix = models.CharField(max_length=12, editable=False, help_text="shown to tell keys apart")
    is_admin = models.BooleanField(default=False, help_text="may force a cohort with x-chunkpilot-cohort")
    max_output_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_OUTPUT_TOKENS_LIMIT)],
        help_text="the most output tokens one request with this key may ask for (with the model's cap, the "
        "smaller holds); empty: no cap",
    )
    active = models.BooleanField(default=True)
    created = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    last_used = models.DateTimeField(null=True, blank=True, help_text="as of the gateways' last log flush")

    class Meta:
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…)"

    def issued(self) -> None:
        self.announce()

    def announce(self) -> None:
        """Gateways reload their key set after this transaction commits."""
        transaction.on_commit(lambda: bus.publish_notice(bus.NOTICE_KEYS))


# A request that did not end ok (``RequestLog.ok`` is false). Every filter on a
# status other than 200, and ``status=failed``, implies it, so PostgreSQL can
# answer those from the partial indexes below.
NOT_OK = ~models.Q(status=200) | ~models.Q(error="")


class RequestLog(models.Model):
    """One client request, as the gateway that served it measured it."""

    request_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(help_text="arrival at the gateway")
    model = models.CharField(max_length=200)
    cohort = models.CharField(max_length=16, blank=True, help_text="the pool's role: stable, canary, baseline")
    # Composite indexes below lead with these, so no single-column ones.
    pool = models.ForeignKey(Pool, null=True, on_delete=models.SET_NULL, related_name="+", db_index=False)
    worker = models.ForeignKey(Worker, null=True, on_delete=models.SET_NULL, related_name="+", db_index=False)
    profile_revision = models.ForeignKey(
        "profiles.ProfileRevision", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    api_key = models.ForeignKey(ClientKey, null=True, on_delete=models.SET_NULL, related_name="+")
    prompt_tokens = models.PositiveIntegerField(null=True)
    cached_tokens = models.PositiveIntegerField(null=True)
    output_tokens = models.PositiveIntegerField(null=True)
    ttft_seconds = models.FloatField(null=True, help_text="arrival → first generated text; streams only")
    max_gap_seconds = models.FloatField(null=True, help_text="largest gap between two token events (stall)")
    tpot_seconds = models.FloatField(null=True, help_text="time per output token after the first")
    e2e_seconds = models.FloatField(null=True, help_text="arrival → end of the response")
    status = models.PositiveSmallIntegerField(
        help_text="HTTP status the client got; 499: it went away; 598: the gateway ended a stream the worker "
        "stopped feeding (GATEWAY_STREAM_IDLE_TIMEOUT_SECONDS)"
    )
    error = models.TextField(blank=True)
    stream = models.BooleanField(default=False)
    # The engine's own facts, as the worker reported them (null: it did not know).
    prefill_mode = models.CharField(max_length=16, blank=True, help_text="chunked or monolithic, as it ran")
    prompt_split = models.BooleanField(null=True, help_text="the prompt was prefilled in more than one chunk")
    num_prefill_chunks = models.PositiveIntegerField(null=True, help_text="prefill chunks or steps it took")
    computed_tokens = models.PositiveIntegerField(null=True, help_text="prompt tokens the engine computed")
    queue_seconds = models.FloatField(null=True, help_text="engine arrival → first scheduled")
    prefill_seconds = models.FloatField(null=True, help_text="first scheduled → first token")
    preemptions = models.PositiveIntegerField(null=True)
    timeline = models.JSONField(null=True, help_text='{"chunks": [[offset s, tokens]], "gaps": [s]}')

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["created_at"], name="reqlog_time"),
            models.Index(fields=["cohort", "created_at"], name="reqlog_cohort_time"),
            models.Index(fields=["pool", "created_at"], name="reqlog_pool_time"),
            models.Index(fields=["worker", "created_at"], name="reqlog_worker_time"),
            # The Requests page's keyset pagination: (sort key, id), one per sortable figure.
            models.Index(fields=["created_at", "id"], name="reqlog_time_id"),
            models.Index(fields=["ttft_seconds", "id"], name="reqlog_ttft_id"),
            models.Index(fields=["max_gap_seconds", "id"], name="reqlog_gap_id"),
            models.Index(fields=["e2e_seconds", "id"], name="reqlog_e2e_id"),
            models.Index(fields=["tpot_seconds", "id"], name="reqlog_tpot_id"),
            models.Index(fields=["queue_seconds", "id"], name="reqlog_queue_id"),
            models.Index(fields=["prefill_seconds", "id"], name="reqlog_prefill_id"),
            models.Index(fields=["profile_revision", "created_at"], name="reqlog_revision_time"),
            models.Index(fields=["prefill_mode", "prompt_split", "created_at"], name="reqlog_mode_time"),
            models.Index(fields=["status", "created_at"], name="reqlog_status_time"),
            # The same (sort key, id) over the rows that did not end ok only: a filter on a
            # rare status (598, 499, ``failed``) sorted by a figure otherwise walks the full
            # index past ~1 000 rows per match (10M rows: 190-280 ms a first page); these are
            # as small as failures are rare, and kept up only when a request fails.
            *(
                models.Index(fields=[column, "id"], name=f"reqlog_notok_{name}", condition=NOT_OK)
                for name, column in (
                    ("time", "created_at"),
                    ("ttft", "ttft_seconds"),
                    ("gap", "max_gap_seconds"),
                    ("e2e", "e2e_seconds"),
                    ("tpot", "tpot_seconds"),
                    ("queue", "queue_seconds"),
                    ("prefill", "prefill_seconds"),
                )
            ),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.cohort} {self.status}"

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @classmethod
    def purge(cls, *, older_than: timedelta, now: datetime | None = None, batch_size: int = 10_000) -> int:
        """Delete rows past retention in batches (short locks, no giant
        transaction). Returns how many went; safe to run twice at once."""
        cutoff = (now or timezone.now()) - older_than
        deleted = 0
        while True:
            ids = list(
                cls.objects.filter(created_at__lt=cutoff)
                .order_by("created_at")
                .values_list("id", flat=True)[:batch_size]
            )
            if not ids:
                return deleted
            deleted += cls.objects.filter(id__in=ids).delete()[0]
