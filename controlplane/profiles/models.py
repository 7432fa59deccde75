"""Engine profiles: named, and versioned by immutable revisions.

A ``Profile`` is a name and the engine kind it is written for. Its knobs live
in ``ProfileRevision`` rows numbered 1..n: an edit never changes a revision,
it adds the next one, so what a worker ran last Tuesday is still on record
and any two revisions can be diffed. Validation is the engine contract's own
(``workers.profile.profile_errors``); this module only decides which engine
kind and model length to check against.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Max
from django.utils import timezone

from controlplane import audit
from controlplane.profiles.diff import FieldChange, diff_fields
from workers.contract import ProfileRef
from workers.profile import ENGINE_KINDS, EngineProfile, ProfileError, profile_errors

ENGINE_KIND_CHOICES = [(kind, kind) for kind in ENGINE_KINDS]


class ProfileManager(models.Manager["Profile"]):
    def create_with_revision(
        self,
        *,
        name: str,
        engine_kind: str = "reference",
        description: str = "",
        fields: dict[str, Any],
        comment: str = "",
        actor: audit.Actor,
    ) -> Profile:
        """A new profile and its revision 1, audited as ``profile.create``
        (the API and the UI both create profiles here). Raises ProfileError
        naming each bad knob."""
        profile = self.model(name=name, engine_kind=engine_kind, description=description)
        with profile.changing(actor):
            profile.save()
            profile.add_revision(fields, author=actor, comment=comment or "created")
        return profile


class Profile(audit.Audited, models.Model):
    audit_name = "profile"

    name = models.SlugField(max_length=100, unique=True)
    engine_kind = models.CharField(max_length=16, choices=ENGINE_KIND_CHOICES, default="reference")
    description = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)

    objects = ProfileManager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def revise(
        self, fields: dict[str, Any] | None, *, actor: audit.Actor, comment: str = "", description: str | None = None
    ) -> ProfileRevision | None:
        """An edit, audited as ``profile.update``: a new description, and the
        next revision when ``fields`` (in full; missing knobs take defaults)
        differ from the latest revision's. Returns the revision added, if any.
        Raises ProfileError naming each bad knob."""
        with self.changing(actor):
            if description is not None and description != self.description:
                self.description = description
                self.save(update_fields=["description"])
            if fields is None:
                return None
            latest = self.latest_revision()
            normalized = EngineProfile.from_dict(fields, engine_kind=self.engine_kind).to_dict()
            if latest is not None and normalized == latest.fields:
                return None
            return self.add_revision(fields, author=actor, comment=comment)

    def latest_revision(self) -> ProfileRevision | None:
        return self.revisions.order_by("-revision").first()

    def audit_state(self) -> dict[str, Any]:
        """What an audit row records of a profile: its row and latest knobs."""
        latest = self.latest_revision()
        return {
            **audit.snapshot(self),
            "revision": latest.revision if latest else None,
            "fields": latest.fields if latest else None,
        }

    def max_model_len_in_use(self) -> int | None:
        """The longest model among workers that run or are meant to run any
        revision of this profile: an edit must stay valid for them. Read
        through the fleet's foreign keys to revisions (fleet sits above
        profiles and is not imported here), one aggregate each."""
        revisions = self.revisions.all()
        longest = [
            revisions.aggregate(n=Max("workers_running__max_model_len"))["n"],
            revisions.aggregate(n=Max("workers_desiring__max_model_len"))["n"],
            revisions.aggregate(
                n=Max("pools__workers__max_model_len", filter=models.Q(pools__workers__desired_revision__isnull=True))
            )["n"],
        ]
        return max((n for n in longest if n), default=None)

    def revision_errors(self, fields: dict[str, Any]) -> dict[str, list[str]]:
        return profile_errors(fields, engine_kind=self.engine_kind, max_model_len=self.max_model_len_in_use())

    def add_revision(
        self,
        fields: dict[str, Any],
        *,
        author: audit.Actor = None,
        comment: str = "",
        now: datetime | None = None,
    ) -> ProfileRevision:
        """Validate ``fields`` (partial is fine: missing knobs take their
        defaults) and store them as the next revision. Raises ProfileError
        naming each bad field."""
        errors = self.revision_errors(fields)
        if errors:
            raise ProfileError(errors)
        normalized = EngineProfile.from_dict(fields, engine_kind=self.engine_kind).to_dict()
        recorded_author: Any = author if getattr(author, "is_authenticated", False) else None
        with transaction.atomic():
            # The row lock serializes concurrent edits of one profile, so two
            # editors cannot both take revision n+1.
            Profile.objects.select_for_update().filter(pk=self.pk).first()
            last = self.revisions.aggregate(last=Max("revision"))["last"] or 0
            return ProfileRevision.objects.create(
                profile=self,
                revision=last + 1,
                fields=normalized,
                author=recorded_author,
                comment=comment,
                created=now or timezone.now(),
            )


class ProfileRevision(models.Model):
    profile = models.ForeignKey(Profile, on_delete=models.CASCADE, related_name="revisions")
    revision = models.PositiveIntegerField()
    fields = models.JSONField(help_text="EngineProfile.to_dict(): every knob, in full")
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)
    comment = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["profile__name", "revision"]
        constraints = [
            models.UniqueConstraint(fields=["profile", "revision"], name="profile_revision_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.revision}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise ValueError("profile revisions are immutable; add a new revision instead")
        super().save(*args, **kwargs)

    def engine_profile(self) -> EngineProfile:
        known = set(EngineProfile.field_names())
        return EngineProfile(**{k: v for k, v in self.fields.items() if k in known})

    def diff(self, other: ProfileRevision, *, include_unchanged: bool = False) -> list[FieldChange]:
        """What changes going from this revision to ``other``."""
        return diff_revisions(self, other, include_unchanged=include_unchanged)

    def as_ref(self) -> ProfileRef:
        """The revision as the agent contract carries it."""
        return ProfileRef(revision_id=self.pk, name=self.profile.name, revision=self.revision, fields=dict(self.fields))

    def errors_for_worker(self, engine_kind: str, max_model_len: int | None) -> dict[str, list[str]]:
        return profile_errors(self.fields, engine_kind=engine_kind, max_model_len=max_model_len or None)


def diff_revisions(
    before: ProfileRevision, after: ProfileRevision, *, include_unchanged: bool = False
) -> list[FieldChange]:
    """Any two revisions, of one profile or of two."""
    return diff_fields(before.fields, after.fields, include_unchanged=include_unchanged)
