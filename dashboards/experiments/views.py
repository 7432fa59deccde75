"""The experiment pages: the list, a workload, one experiment live, and
"New experiment".

Each page has one template; the experiment's live part
(``dashboards.experiments.pages``) is a partial that htmx fetches on its
own and the consumer pushes on every change the runner records. Buttons
are plain POST forms; they only set flags (abort) or call one model method
(adopt, which then opens "New rollout" with the revision it made; verify,
which opens the verification it started).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.accounts.roles import Role
from controlplane.experiments.models import Experiment, Mode, Workload, current_fields, default_arms
from controlplane.fleet.models import Worker
from controlplane.gateway.models import RequestLog
from dashboards.access import role_required
from dashboards.experiments import pages
from dashboards.experiments.forms import CAPTURE, SCENARIO, ExperimentForm
from dashboards.live import HtmxHttpRequest

LAB_LABEL = ("demo_pool", "lab")  # the demo's lab worker; a fleet names its own in the form


@role_required(Role.VIEWER)
def experiment_list(request: HtmxHttpRequest) -> HttpResponse:
    context = pages.list_context()
    if request.htmx:
        return render(request, "experiments/partials/rows.html", context)
    return render(request, "experiments/list.html", context)


@role_required(Role.VIEWER)
def workload_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    return render(request, "experiments/workload.html", pages.workload_context(get_object_or_404(Workload, pk=pk)))


@role_required(Role.VIEWER)
def experiment_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    experiment = get_object_or_404(pages.base_queryset(), pk=pk)
    context = pages.detail_context(experiment)
    if request.htmx:
        return render(request, "experiments/partials/live.html", context)
    return render(request, "experiments/detail.html", context)


@require_POST
@role_required(Role.OPERATOR)
def experiment_action(request: HtmxHttpRequest, pk: int, verb: str) -> HttpResponse:
    experiment = get_object_or_404(Experiment, pk=pk)
    if verb == "abort":
        if experiment.request_abort(request.user, request.POST.get("reason", "").strip()[:500]):
            messages.success(request, "Abort requested: the workers are restored first.")
        else:
            messages.error(request, f"The experiment is {experiment.phase_label}; nothing to abort.")
        return redirect("experiment-detail", pk=pk)
    if verb == "adopt":
        try:
            revision = experiment.adopt(request.user)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect("experiment-detail", pk=pk)
        messages.success(
            request,
            f"{revision.profile.name}@{revision.revision} holds the recommended arm; roll it "
            "out from here (it still passes the consistency gate and the canary analysis).",
        )
        return redirect(f"{reverse('rollout-new')}?revision={revision.pk}")
    if verb == "verify":
        try:
            verification = experiment.verify(request.user)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return redirect("experiment-detail", pk=pk)
        messages.success(
            request,
            f"Experiment {verification.pk} measures the predicted best arms and the baseline on the lab workers.",
        )
        return redirect("experiment-detail", pk=verification.pk)
    raise Http404(f"no action {verb}")


# What a link may prefill (the advisor's "run an experiment with these arms"):
# the form still checks every value when it is posted.
PREFILLED = ("name", "chunk_sizes", "budgets", "short_prompt_thresholds")


def _initial(query: Mapping[str, str]) -> dict[str, Any]:
    lab = list(Worker.objects.filter(**{f"labels__{LAB_LABEL[0]}": LAB_LABEL[1]}).values_list("name", flat=True))
    recent = RequestLog.objects.filter(created_at__gte=timezone.now() - timedelta(minutes=15), status=200).exists()
    initial: dict[str, Any] = {"workers": lab, "workload": CAPTURE if recent else SCENARIO}
    initial.update({key: query[key][:200] for key in PREFILLED if query.get(key)})
    return initial


def _workload(form: ExperimentForm, actor: Any) -> Workload:
    v = form.cleaned_data
    choice = v["workload"]
    name = f"{v['name']}".lower().replace(" ", "-")[:60] or "workload"
    if choice == CAPTURE:
        end = timezone.now()
        return Workload.capture(
            name=f"{name}-capture", start=end - timedelta(minutes=v.get("capture_minutes") or 15), end=end, actor=actor
        )
    if choice == SCENARIO:
        return Workload.from_scenario(
            name=f"{name}-{v.get('scenario') or 'long-tail'}",
            scenario=v.get("scenario") or "long-tail",
            rate=v.get("scenario_rate") or 1.0,
            duration_seconds=300,
            actor=actor,
        )
    workload = Workload.objects.filter(pk=choice).first()
    if workload is None:
        raise ValidationError({"workload": ["no such workload."]})
    return workload


@role_required(Role.OPERATOR)
def experiment_new(request: HtmxHttpRequest) -> HttpResponse:
    form = ExperimentForm(request.POST or None, initial=_initial(request.GET))
    if request.method == "POST" and form.is_valid():
        v = form.cleaned_data
        workers = list(v["workers"])
        max_len = min((w.max_model_len for w in workers if w.max_model_len), default=2048)
        arms = default_arms(
            max_len,
            v["chunk_sizes"],
            v["budgets"],
            v["short_prompt_thresholds"] or (None,),
            # the baseline: the revision picked, else the profile the workers run now
            current=dict(v["baseline_revision"].fields) if v.get("baseline_revision") else current_fields(workers),
        )
        try:
            with transaction.atomic():  # a refused experiment keeps no workload it captured
                experiment = Experiment.create(
                    name=v["name"],
                    workload=_workload(form, request.user),
                    workers=workers,
                    arms=arms,
                    duration_seconds=v["duration_seconds"],
                    warmup_seconds=v["warmup_seconds"],
                    repeats=v["repeats"],
                    rate_scale=v["rate_scale"],
                    objectives={"ttft_ms": v["ttft_ms"], "tpot_ms": v["tpot_ms"]},
                    capacity_rate_scales=v["capacity_rate_scales"],
                    capacity_seconds=v["capacity_seconds"] or 20.0,
                    mode=v.get("mode") or Mode.MEASURE,
                    actor=request.user,
                )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(field if field in form.fields else None, error)
        else:
            messages.success(request, f"Experiment {experiment.pk} started.")
            return redirect("experiment-detail", pk=experiment.pk)
    return render(request, "experiments/new.html", {"form": form})
