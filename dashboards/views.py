"""Pages: thin views that read, call one model method, render.

Each page has one template; its live part is a partial that htmx fetches on
its own (``request.htmx``) and the fleet consumer pushes.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST
from django_htmx.middleware import HtmxDetails

from controlplane import audit
from controlplane.accounts.roles import Role
from controlplane.audit.models import AuditEvent
from controlplane.fleet.models import FLAG_ACTIONS, Worker
from controlplane.profiles.models import Profile, ProfileRevision, diff_revisions
from dashboards import fleet_view
from dashboards.access import role_required
from dashboards.forms import ProfileForm

AUDIT_PAGE_SIZE = 200


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


# ---- fleet -------------------------------------------------------------------
@role_required(Role.VIEWER)
def fleet(request: HtmxHttpRequest) -> HttpResponse:
    context = fleet_view.page_context()
    if request.htmx:
        return render(request, "dashboards/partials/fleet_rows.html", context)
    return render(request, "dashboards/fleet.html", context)


@role_required(Role.VIEWER)
def worker_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    worker = get_object_or_404(fleet_view.workers(), pk=pk)
    now = timezone.now()
    events = AuditEvent.objects.filter(object_type="fleet.worker", object_id=str(worker.pk))[:50]
    return render(
        request,
        "dashboards/worker_detail.html",
        {**fleet_view.row_context(worker, now), "events": events, "flag_actions": FLAG_ACTIONS},
    )


@require_POST
@role_required(Role.OPERATOR)
def worker_action(request: HtmxHttpRequest, pk: int, verb: str) -> HttpResponse:
    if verb not in FLAG_ACTIONS:
        raise Http404(f"no action {verb}")
    worker = get_object_or_404(Worker, pk=pk)
    worker.flag_action(verb, request.user)
    if request.htmx:
        worker = fleet_view.workers().get(pk=pk)
        return render(request, "dashboards/partials/worker_row.html", fleet_view.row_context(worker, timezone.now()))
    messages.success(request, f"{worker.name}: {verb} requested.")
    next_url = request.POST.get("next", "")
    if next_url and url_has_allowed_host_and_scheme(next_url, allowed_hosts={request.get_host()}):
        return redirect(next_url)
    return redirect("worker-detail", pk=pk)


# ---- profiles ----------------------------------------------------------------
@role_required(Role.VIEWER)
def profiles(request: HtmxHttpRequest) -> HttpResponse:
    rows = []
    for profile in Profile.objects.prefetch_related("revisions__pools", "revisions__author"):
        revisions = sorted(profile.revisions.all(), key=lambda r: r.revision)
        pools = sorted({pool.name for r in revisions for pool in r.pools.all()})
        rows.append({"profile": profile, "latest": revisions[-1] if revisions else None, "pools": pools})
    return render(request, "dashboards/profiles.html", {"rows": rows})


@role_required(Role.VIEWER)
def profile_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    profile = get_object_or_404(Profile, pk=pk)
    revisions = list(profile.revisions.select_related("author").order_by("-revision"))
    diff = _diff_context(request, revisions)
    if request.htmx and request.htmx.target == "diff":
        return render(request, "dashboards/partials/profile_diff.html", diff)
    latest = revisions[0] if revisions else None
    context = {
        "profile": profile,
        "revisions": revisions,
        "latest": latest,
        "knobs": latest.diff(latest, include_unchanged=True) if latest else [],
        "pools": sorted({p.name for r in revisions for p in r.pools.all()}),
        **diff,
    }
    return render(request, "dashboards/profile_detail.html", context)


def _diff_context(request: HtmxHttpRequest, revisions: list[ProfileRevision]) -> dict[str, Any]:
    """?from=N&to=M (revision numbers); default: latest against the one before."""
    by_number = {r.revision: r for r in revisions}
    if not revisions:
        return {"diff_error": None, "before": None, "after": None, "changes": []}
    error = None
    try:
        to_number = int(request.GET.get("to") or revisions[0].revision)
        from_number = int(request.GET.get("from") or max(to_number - 1, 1))
    except ValueError:
        to_number, from_number, error = revisions[0].revision, max(revisions[0].revision - 1, 1), "revision numbers are integers"
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


@role_required(Role.OPERATOR)
def profile_edit(request: HtmxHttpRequest, pk: int | None = None) -> HttpResponse:
    """New profile (pk None) or its next revision. Field errors come from the
    engine contract, shown beside each knob."""
    profile = get_object_or_404(Profile, pk=pk) if pk is not None else None
    latest = profile.latest_revision() if profile else None
    form = ProfileForm(request.POST or None, profile=profile, initial_fields=latest.fields if latest else None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            if profile is None:
                profile = Profile.objects.create(**form.profile_attrs())
                profile.add_revision(form.knobs(), author=request.user, comment=form.cleaned_data["comment"] or "created")
                audit.record(request.user, "profile.create", profile, None, profile.audit_state())
                messages.success(request, f"Profile {profile.name} created.")
            else:
                before = profile.audit_state()
                if form.knobs_changed(latest):
                    added = profile.add_revision(form.knobs(), author=request.user, comment=form.cleaned_data["comment"])
                    audit.record(request.user, "profile.update", profile, before, profile.audit_state())
                    messages.success(request, f"{profile.name}: revision {added.revision} saved.")
                else:
                    messages.info(request, "No knob changed; no new revision.")
        return redirect("profile-detail", pk=profile.pk)
    return render(request, "dashboards/profile_form.html", {"form": form, "profile": profile, "latest": latest})


# ---- audit -------------------------------------------------------------------
@role_required(Role.VIEWER)
def audit_log(request: HtmxHttpRequest) -> HttpResponse:
    events = AuditEvent.objects.all()
    if prefix := request.GET.get("action", "").strip():
        events = events.filter(action__startswith=prefix)
    if actor := request.GET.get("actor", "").strip():
        events = events.filter(actor_repr=actor)
    return render(
        request,
        "dashboards/audit.html",
        {"events": events[:AUDIT_PAGE_SIZE], "action": prefix, "actor": actor, "page_size": AUDIT_PAGE_SIZE},
    )


__all__ = ["fleet", "worker_detail", "worker_action", "profiles", "profile_detail", "profile_edit", "audit_log"]
