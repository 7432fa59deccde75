"""The rollout pages: the list, one rollout live, and "New rollout".

Each page has one template; its live part (the rollout's status, weights,
steps, buttons, timeline and analyses; the list's rows) is a partial that
htmx fetches on its own and the rollout consumers push on every
transition. Buttons are plain POST forms that ask for confirmation when
JavaScript is there and work without it; they only set flags.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.http import require_POST

from controlplane.accounts.roles import Role
from controlplane.fleet.models import Pool
from controlplane.gateway.models import RoutingTable
from controlplane.metrics import figures
from controlplane.profiles.models import ProfileRevision
from controlplane.rollouts import steps as plan
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.models import AnalysisTemplate, Rollout
from dashboards.access import role_required
from dashboards.views import HtmxHttpRequest

LIST_LIMIT = 200
TIMELINE_LIMIT = 300
# Button → (flag for Rollout.request, label, confirmation, which phases show it)
BUTTONS: dict[str, tuple[str, str, str, tuple[Phase, ...]]] = {
    "abort": ("abort", "Abort", "Abort this rollout? The canary's weight goes to 0 at once and its workers return "
              "to the stable revision.", (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED, Phase.PROMOTING)),
    "promote": ("promote", "Promote", "Leave this pause (or accept the inconclusive analysis) and go on to the next "
                "step?", (Phase.PAUSED,)),
    "skip-step": ("skip_step", "Skip step", "Skip the current step?", (Phase.PROGRESSING, Phase.PAUSED)),
    "promote-full": ("promote_full", "Promote fully", "Skip every remaining step and analysis and move the whole "
                     "stable pool to the target now?", (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED)),
    "retry": ("retry", "Retry", "Start this rollout again from its first step?", (Phase.ABORTED,)),
    "rollback": ("", "Roll back", "Move the stable pool back to the previous revision, one worker at a time, with "
                 "no steps?", (Phase.SUCCEEDED,)),
}


def base_queryset() -> Any:
    return Rollout.objects.select_related(
        "routing_table", "stable_pool", "canary_pool", "baseline_pool", "stable_revision__profile",
        "target_revision__profile", "created_by",
    )


# ---- what the pages show -----------------------------------------------------------
def list_context() -> dict[str, Any]:
    return {"rollouts": list(base_queryset()[:LIST_LIMIT])}


def detail_context(rollout: Rollout, user_context: dict[str, Any] | None = None) -> dict[str, Any]:
    phase = Phase(rollout.phase)
    steps = rollout.step_plan()
    step_rows = [
        {"index": i, "step": s, "describe": s.describe(),
         "state": "done" if i < rollout.step_index else "current" if i == rollout.step_index and not phase.finished
         else "todo"}
        for i, s in enumerate(steps)
    ]
    events = list(rollout.events.order_by("-time", "-id")[:TIMELINE_LIMIT])[::-1]
    runs = list(rollout.analysis_runs.prefetch_related("measurements").order_by("-attempt", "-step_index"))
    return {
        "rollout": rollout,
        "phase": phase,
        "steps": step_rows,
        "weights": weight_rows(rollout),
        "events": events,
        "runs": [run_context(run) for run in runs],
        "buttons": [
            {"verb": verb, "label": label, "confirm": confirm}
            for verb, (_, label, confirm, phases) in BUTTONS.items() if phase in phases
        ],
        "pause_conditions": [
            {"reason": c["reason"].replace("_", " "), "since": datetime.fromisoformat(c["since"])}
            for c in rollout.pause_conditions
        ],
        **(user_context or {}),
    }


def weight_rows(rollout: Rollout) -> list[dict[str, Any]]:
    baseline = rollout.baseline_pool
    pools = {"canary": rollout.canary_pool.name, "stable": rollout.stable_pool.name,
             "baseline": baseline.name if baseline is not None else ""}
    order = ["canary", "baseline", "stable"]
    return [
        {"role": role, "pool": pools.get(role, ""), "bp": bp, "percent": bp / 100}
        for role, bp in sorted(rollout.weights.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9)
    ]


def run_context(run: Any) -> dict[str, Any]:
    """One analysis run: each measurement's verdicts as rows, and per metric
    a chart of canary against baseline over the run."""
    measurements = list(run.measurements.all())
    spec = run.spec or {}
    charts = []
    for rule in spec.get("metrics", []):
        name, figure_name = rule["name"], rule["figure"]
        try:
            figure = figures.get(figure_name)
            display, unit = figure.display_kind, figure.unit
        except KeyError:
            display, unit = "number", ""
        canary, baseline = [], []
        for m in measurements:
            verdict: dict[str, Any] = next((v for v in m.verdicts if v.get("metric") == name), {})
            canary.append(verdict.get("canary"))
            baseline.append(verdict.get("baseline"))
        charts.append({
            "id": f"run-{run.pk}-{name}", "title": f"{name} ({figure_name}): canary against baseline",
            "times": [m.taken_at.timestamp() for m in measurements],
            "lines": [{"label": f"canary {run.canary_pool_name}", "values": canary},
                      {"label": f"baseline {run.baseline_pool_name}", "values": baseline}],
            "display": display, "unit": unit,
        })
    return {"run": run, "measurements": measurements, "charts": charts, "spec": spec}


def render_list_push() -> str:
    return render_to_string("rollouts/partials/rows.html", {**list_context(), "oob": True})


def render_detail_push(rollout_id: int, user_context: dict[str, Any]) -> str | None:
    rollout = base_queryset().filter(pk=rollout_id).first()
    if rollout is None:
        return None
    return render_to_string("rollouts/partials/live.html", {**detail_context(rollout, user_context), "oob": True})


# ---- pages ---------------------------------------------------------------------
@role_required(Role.VIEWER)
def rollout_list(request: HtmxHttpRequest) -> HttpResponse:
    context = list_context()
    if request.htmx:
        return render(request, "rollouts/partials/rows.html", context)
    return render(request, "rollouts/list.html", context)


@role_required(Role.VIEWER)
def rollout_detail(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    rollout = get_object_or_404(base_queryset(), pk=pk)
    context = detail_context(rollout)
    if request.htmx:
        return render(request, "rollouts/partials/live.html", context)
    return render(request, "rollouts/detail.html", context)


@require_POST
@role_required(Role.OPERATOR)
def rollout_action(request: HtmxHttpRequest, pk: int, verb: str) -> HttpResponse:
    if verb not in BUTTONS:
        raise Http404(f"no action {verb}")
    rollout = get_object_or_404(base_queryset(), pk=pk)
    flag = BUTTONS[verb][0]
    error = False
    try:
        if verb == "abort":
            reason = request.POST.get("reason", "").strip()[:500]
            if not rollout.request_abort(request.user, reason, source="ui"):
                raise ValidationError(f"the rollout has {rollout.phase_label}; nothing to abort.")
        elif verb == "rollback":
            back = rollout.rollback(request.user)
            messages.success(request, f"Rollback started: rollout {back.pk}.")
            location = reverse("rollout-detail", args=[back.pk])
            if request.htmx:  # a new page: let htmx navigate there
                return HttpResponse(status=204, headers={"HX-Redirect": location})
            return redirect(location)
        else:
            rollout.request(flag, request.user)
    except ValidationError as exc:
        text, error = " ".join(exc.messages), True
    else:
        text = f"{BUTTONS[verb][1]} requested; the reconciler acts on it."
    if request.htmx:
        rollout = base_queryset().get(pk=pk)
        return render(request, "rollouts/partials/live.html",
                      {**detail_context(rollout), "action_message": text, "action_error": error})
    (messages.error if error else messages.success)(request, text)
    return redirect("rollout-detail", pk=pk)


class RolloutForm(forms.Form):
    target_revision = forms.ModelChoiceField(
        queryset=ProfileRevision.objects.select_related("profile").order_by("profile__name", "-revision"),
        help_text="the profile revision to roll out")
    model = forms.ModelChoiceField(queryset=RoutingTable.objects.all(), to_field_name="model",
                                   help_text="the routing table (model name) whose traffic it takes")
    stable_pool = forms.ModelChoiceField(queryset=Pool.objects.all(), to_field_name="name",
                                         help_text="the pool being moved: the table's stable pool")
    canary_pool = forms.ModelChoiceField(queryset=Pool.objects.all(), to_field_name="name",
                                         help_text="the table's canary pool")
    baseline_pool = forms.ModelChoiceField(queryset=Pool.objects.all(), to_field_name="name", required=False,
                                           help_text="optional: fresh workers on the stable revision, to compare with")
    analysis_template = forms.ModelChoiceField(queryset=AnalysisTemplate.objects.all(), to_field_name="name",
                                               required=False, help_text="for the default plan's analyses; empty: "
                                                                         "the template named default")
    progress_deadline_seconds = forms.FloatField(initial=600, min_value=1,
                                                 help_text="abort when a step makes no progress this long")
    gate_enabled = forms.BooleanField(required=False, initial=True, label="Consistency gate",
                                      help_text="replay fixed prompts greedily on canary and stable before a "
                                                "chunked target takes traffic")


@role_required(Role.OPERATOR)
def rollout_new(request: HtmxHttpRequest) -> HttpResponse:
    initial: dict[str, Any] = {}
    if revision := request.GET.get("revision"):
        initial["target_revision"] = revision
    tables = list(RoutingTable.objects.prefetch_related("pools__pool"))
    if len(tables) == 1:
        roles = {m.role: m.pool.name for m in tables[0].pools.all()}
        initial.update(model=tables[0].model, stable_pool=roles.get("stable"), canary_pool=roles.get("canary"),
                       baseline_pool=roles.get("baseline"))
    form = RolloutForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        v = form.cleaned_data
        template = v.get("analysis_template")
        try:
            rollout = Rollout.start(
                routing_table=v["model"], stable_pool=v["stable_pool"], canary_pool=v["canary_pool"],
                baseline_pool=v.get("baseline_pool"), target_revision=v["target_revision"],
                steps=plan.to_json(plan.default_plan(template.name if template else plan.DEFAULT_TEMPLATE)),
                progress_deadline_seconds=v["progress_deadline_seconds"],
                gate={"enabled": bool(v["gate_enabled"])}, actor=request.user,
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                target = field if field in form.fields else None
                if field == "gate":
                    target = "gate_enabled"
                for error in errors:
                    form.add_error(target, error)
        else:
            messages.success(request, f"Rollout {rollout.pk} started.")
            return redirect("rollout-detail", pk=rollout.pk)
    default_steps = [s.describe() for s in plan.default_plan()]
    return render(request, "rollouts/new.html", {"form": form, "default_steps": default_steps, "tables": tables})
