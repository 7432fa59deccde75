"""The profile pages: every profile, one with its revisions and diffs, and
the editor that adds a revision (or a profile).

The editor creates and revises through the same audited model methods the
API calls (``Profile.objects.create_with_revision``, ``Profile.revise``).
"""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from controlplane.accounts.roles import Role
from controlplane.profiles.models import Profile
from dashboards.access import role_required
from dashboards.live import HtmxHttpRequest
from dashboards.profiles import pages
from dashboards.profiles.forms import ProfileForm


@role_required(Role.VIEWER)
def profiles(request: HtmxHttpRequest) -> HttpResponse:
    return render(request, "profiles/profiles.html", pages.list_context())


@role_required(Role.VIEWER)
def profile_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    profile = get_object_or_404(Profile, pk=pk)
    revisions = pages.revisions_of(profile)
    diff = pages.diff_context(revisions, request.GET)
    if request.htmx and request.htmx.target == "diff":
        return render(request, "profiles/partials/profile_diff.html", diff)
    return render(request, "profiles/profile_detail.html", pages.detail_context(profile, revisions, diff))


@role_required(Role.OPERATOR)
def profile_edit(request: HtmxHttpRequest, pk: int | None = None) -> HttpResponse:
    """New profile (pk None) or its next revision. Field errors come from the
    engine contract, shown beside each knob."""
    profile = get_object_or_404(Profile, pk=pk) if pk is not None else None
    latest = profile.latest_revision() if profile else None
    form = ProfileForm(request.POST or None, profile=profile, initial_fields=latest.fields if latest else None)
    if request.method == "POST" and form.is_valid():
        comment = form.cleaned_data["comment"]
        if profile is None:
            profile = Profile.objects.create_with_revision(
                **form.profile_attrs(), fields=form.knobs(), comment=comment, actor=request.user
            )
            messages.success(request, f"Profile {profile.name} created.")
        elif (added := profile.revise(form.knobs(), actor=request.user, comment=comment)) is not None:
            messages.success(request, f"{profile.name}: revision {added.revision} saved.")
        else:
            messages.info(request, "No knob changed; no new revision.")
        return redirect("profile-detail", pk=profile.pk)
    return render(request, "profiles/profile_form.html", {"form": form, "profile": profile, "latest": latest})
