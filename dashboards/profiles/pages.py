"""What the profile pages show: every profile with its latest revision, and
one profile with its revisions and a diff of any two."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.experiments.models import arm_profile_ids
from controlplane.profiles.models import Profile, ProfileRevision, diff_revisions


def list_context() -> dict[str, Any]:
    rows = []
    # Experiments' arm profiles are the lab's, not the fleet's (issue 26).
    listed = Profile.objects.exclude(pk__in=arm_profile_ids())
    for profile in listed.prefetch_related("revisions__pools", "revisions__author"):
        revisions = sorted(profile.revisions.all(), key=lambda r: r.revision)
        pools = sorted({pool.name for r in revisions for pool in r.pools.all()})
        rows.append({"profile": profile, "latest": revisions[-1] if revisions else None, "pools": pools})
    return {"rows": rows}


def revisions_of(profile: Profile) -> list[ProfileRevision]:
    """Newest first."""
    return list(profile.revisions.select_related("author").order_by("-revision"))


def detail_context(profile: Profile, revisions: list[ProfileRevision], diff: dict[str, Any]) -> dict[str, Any]:
    latest = revisions[0] if revisions else None
    return {
        "profile": profile,
        "revisions": revisions,
        "latest": latest,
        "knobs": latest.diff(latest, include_unchanged=True) if latest else [],
        "pools": sorted({p.name for r in revisions for p in r.pools.all()}),
        **diff,
    }


def diff_context(revisions: list[ProfileRevision], params: Mapping[str, str]) -> dict[str, Any]:
    """?from=N&to=M (revision numbers); default: latest against the one before."""
    by_number = {r.revision: r for r in revisions}
    if not revisions:
        return {"diff_error": None, "before": None, "after": None, "changes": []}
    error = None
    try:
        to_number = int(params.get("to") or revisions[0].revision)
        from_number = int(params.get("from") or max(to_number - 1, 1))
    except ValueError:
        to_number, from_number, error = (
            revisions[0].revision,
            max(revisions[0].revision - 1, 1),
            "revision numbers are integers",
        )
    after, before = by_number.get(to_number), by_number.get(from_number)
    if after is None or before is None:
        error = f"no revision {to_number if after is None else from_number}"
        after, before = revisions[0], by_number.get(max(revisions[0].revision - 1, 1))
    return {
        "diff_error": error,
        "before": before,
        "after": after,
        "changes": diff_revisions(before, after, include_unchanged=True) if before and after else [],
    }
