"""Who changed what: the one function every app calls after a state change.

    from controlplane import audit

    before = audit.snapshot(pool)
    pool.weight_bps = 500
    pool.save()
    audit.record(request.user, "pool.update", pool, before, audit.snapshot(pool))

Models are imported inside the functions: this package is imported while
Django loads its apps, before models may be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django.db import transaction

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
    from django.db.models import Model

    from controlplane.audit.models import AuditEvent

SYSTEM = "system"


@dataclass(frozen=True)
class Subject:
    """An audited object named by hand: for things that are not model rows
    (a routing table epoch) or that no longer exist."""

    object_type: str
    object_id: str | int
    object_repr: str


def record(
    actor: AbstractBaseUser | AnonymousUser | str | None,
    action: str,
    obj: Model | Subject,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    *,
    time: datetime | None = None,
) -> AuditEvent:
    """Write one audit row and return it.

    ``actor``  the user who acted (request.user), or a string naming an
               automatic actor ("system:health-sweep", "worker:gpu-3",
               "rollout:12"); None means "system".
    ``action`` "<object>.<verb>", e.g. "pool.create", "profile.update",
               "worker.drain", "worker.state_change".
    ``obj``    the model instance acted on (its type is ``app_label.model``,
               its id the pk, its repr ``str(obj)``), or a ``Subject``. For a
               delete, call this before ``obj.delete()`` so the pk is known.
    ``before``/``after``  JSON-able dicts (datetimes and decimals are fine):
               None for the side that does not exist (create/delete).
    ``time``   the operation's ``now`` when the caller already read it.

    Call it inside the same transaction as the change, so that a change
    without its audit row (or the reverse) cannot be committed.
    """
    from django.utils import timezone

    # Imported here: this package is imported while Django loads its apps, before models may be.
    from controlplane.audit.models import AuditEvent

    user: Any = None
    if actor is None:
        actor_repr = SYSTEM
    elif isinstance(actor, str):
        actor_repr = actor
    elif getattr(actor, "is_authenticated", False):
        user = actor
        actor_repr = actor.get_username()
    else:
        actor_repr = "anonymous"

    if isinstance(obj, Subject):
        object_type, object_id, object_repr = obj.object_type, str(obj.object_id), obj.object_repr
    else:
        object_type = obj._meta.label_lower
        object_id = "" if obj.pk is None else str(obj.pk)
        object_repr = str(obj)

    return AuditEvent.objects.create(
        time=time or timezone.now(),
        actor=user,
        actor_repr=actor_repr[:150],
        action=action,
        object_type=object_type,
        object_id=object_id,
        object_repr=object_repr[:200],
        before=before,
        after=after,
    )


def snapshot(obj: Model, fields: list[str] | None = None) -> dict[str, Any]:
    """The concrete field values of ``obj`` as a JSON-able dict (foreign keys
    as their ids, under the field's name): the usual before/after. Secrets
    (``*_hash``, ``password``) are left out."""
    data: dict[str, Any] = {}
    for field in obj._meta.concrete_fields:
        if fields is not None and field.name not in fields:
            continue
        if field.name.endswith("_hash") or field.name == "password":
            continue
        value = getattr(obj, field.attname)
        data[field.name] = value.isoformat() if isinstance(value, datetime) else value
    return data


Actor = Any  # request.user, a string naming an automatic actor, or None (system): see ``record``
A = TypeVar("A", bound="Audited")


class Audited:
    """For a model whose rows are created, edited and deleted as a whole, each
    write with its audit row ("<audit_name>.create" / ".update" / ".delete") in
    the same transaction. ``audit_state()`` is what a row records (the
    concrete fields, secrets left out, unless the model says otherwise)."""

    audit_name: ClassVar[str] = ""

    def audit_state(self) -> dict[str, Any]:
        return snapshot(self)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def changing(self, actor: Actor, verb: str | None = None, *, now: datetime | None = None) -> Iterator[None]:
        """The writes inside the block are one change: ``before`` is the row
        as stored when the block starts (so changes already made to the
        instance in memory, as a bound form makes them, count), ``after`` the
        instance when it ends. ``verb`` defaults to create for a new row."""
        model: Any = self
        with transaction.atomic():
            adding = model._state.adding
            before = None if adding else type(model)._default_manager.get(pk=model.pk).audit_state()
            yield
            record(
                actor,
                f"{self.audit_name}.{verb or ('create' if adding else 'update')}",
                model,
                before,
                self.audit_state(),
                time=now,
            )

    def save_audited(self, actor: Actor, *, now: datetime | None = None) -> None:
        with self.changing(actor, now=now):
            self.save()  # type: ignore[attr-defined]

    @classmethod
    def create_audited(cls: type[A], actor: Actor, **fields: Any) -> A:
        row = cls(**fields)
        row.save_audited(actor)
        return row

    def delete_audited(self, actor: Actor) -> None:
        model: Any = self
        with transaction.atomic():
            record(actor, f"{self.audit_name}.delete", model, self.audit_state(), None)
            model.delete()


__all__ = ["record", "snapshot", "Subject", "SYSTEM", "Audited", "Actor"]
