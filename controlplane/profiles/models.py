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
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Max
from django.utils import timezone

from controlplane.profiles.diff import FieldChange, diff_fields
from workers.contract import ProfileRef
from workers.profile import ENGINE_KINDS, EngineProfile, ProfileError, profile_errors

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

ENGINE_KIND_CHOICES = [(kind, kind) for kind in ENGINE_KINDS]


class Profile(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    engine_kind = models.CharField(max_length=16, choices=ENGINE_KIND_CHOICES, default="reference")
    description = models.TextField(blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def latest_revision(self) -> ProfileRevision | None:
        return self.revisions.order_by("-revision").first()

    def audit_state(self) -> dict[str, Any]:
        """What an audit row records of a profile: its row and latest knobs."""
        from controlplane import audit

        latest = self.latest_revision()
        return {
            **audit.snapshot(self),
            "revision": latest.revision if latest else None,
            "fields": latest.fields if latest else None,
        }

    def max_model_len_in_use(self) -> int | None:
        """The longest model among workers that run or are meant to run any
        revision of this profile: an edit must stay valid for them."""
        from controlplane.fleet.models import Worker

        workers = Worker.objects.filter(
            models.Q(running_revision__profile=self)
            | models.Q(desired_revision__profile=self)
            | models.Q(desired_revision__isnull=True, pool__desired_revision__profile=self)
        )
        longest = workers.aggregate(longest=Max("max_model_len"))["longest"]
        return longest or None

    def revision_errors(self, fields: dict[str, Any]) -> dict[str, list[str]]:
        return profile_errors(fields, engine_kind=self.engine_kind, max_model_len=self.max_model_len_in_use())

    def add_revision(
        self,
        fields: dict[str, Any],
        *,
        author: AbstractBaseUser | AnonymousUser | None = None,
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
        recorded_author: Any = author if author is not None and author.is_authenticated else None
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
        return ProfileRef(
            revision_id=self.pk, name=self.profile.name, revision=self.revision, fields=dict(self.fields)
        )

    def errors_for_worker(self, engine_kind: str, max_model_len: int | None) -> dict[str, list[str]]:
        return profile_errors(self.fields, engine_kind=engine_kind, max_model_len=max_model_len or None)


def diff_revisions(
    before: ProfileRevision, after: ProfileRevision, *, include_unchanged: bool = False
) -> list[FieldChange]:
    """Any two revisions, of one profile or of two."""
    return diff_fields(before.fields, after.fields, include_unchanged=include_unchanged)
