"""What the rollout pages show: the list, and one rollout live (its status,
weights, steps, buttons, timeline and analyses), built once for the page,
the htmx refresh and the websocket push alike."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.template.loader import render_to_string

from controlplane.metrics import figures
from controlplane.rollouts.evaluator import Phase
from controlplane.rollouts.measure import TRAFFIC_WINDOW_SECONDS
from controlplane.rollouts.models import AnalysisRun, Rollout
from dashboards import axes

LIST_LIMIT = 200
TIMELINE_LIMIT = 300


@dataclass(frozen=True)
class Button:
    """One of a rollout's buttons. It only sets a flag (``Rollout.request``);
    the reconciler acts on it."""

    flag: str  # for Rollout.request; empty for rollback, which is its own method
    label: str
    confirm: str  # asked before it acts, where JavaScript runs
    phases: tuple[Phase, ...]  # the phases that show it


BUTTONS: dict[str, Button] = {
    "abort": Button(
        "abort",
        "Abort",
        "Abort this rollout? The canary's weight goes to 0 at once and its workers return to the stable revision.",
        (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED, Phase.PROMOTING),
    ),
    "promote": Button(
        "promote",
        "Promote",
        "Leave this pause (or accept the inconclusive analysis) and go on to the next step?",
        (Phase.PAUSED,),
    ),
    "skip-step": Button("skip_step", "Skip step", "Skip the current step?", (Phase.PROGRESSING, Phase.PAUSED)),
    "promote-full": Button(
        "promote_full",
        "Promote fully",
        "Skip every remaining step and analysis and move the whole stable pool to the target now?",
        (Phase.PENDING, Phase.PROGRESSING, Phase.PAUSED),
    ),
    "retry": Button("retry", "Retry", "Start this rollout again from its first step?", (Phase.ABORTED,)),
    "rollback": Button(
        "",
        "Roll back",
        "Move the stable pool back to the previous revision, one worker at a time, with no steps?",
        (Phase.SUCCEEDED,),
    ),
}


def base_queryset() -> QuerySet[Rollout]:
    return Rollout.objects.with_related()


def list_context() -> dict[str, Any]:
    return {"rollouts": list(base_queryset()[:LIST_LIMIT])}


def detail_context(rollout: Rollout, user_context: dict[str, Any] | None = None) -> dict[str, Any]:
    phase = Phase(rollout.phase)
    steps = rollout.step_plan()
    step_rows = [
        {
            "index": i,
            "step": s,
            "describe": s.describe(),
            "state": "done"
            if i < rollout.step_index
            else "current"
            if i == rollout.step_index and not phase.finished
            else "todo",
        }
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
        "forecast": rollout.sample_forecast() if not phase.finished else [],
        "traffic_window_minutes": TRAFFIC_WINDOW_SECONDS / 60,
        "buttons": [
            {"verb": verb, "label": button.label, "confirm": button.confirm}
            for verb, button in BUTTONS.items()
            if phase in button.phases
        ],
        "pause_conditions": [
            {"reason": c["reason"].replace("_", " "), "since": datetime.fromisoformat(c["since"])}
            for c in rollout.pause_conditions
        ],
        **(user_context or {}),
    }


def weight_rows(rollout: Rollout) -> list[dict[str, Any]]:
    baseline = rollout.baseline_pool
    pools = {
        "canary": rollout.canary_pool.name,
        "stable": rollout.stable_pool.name,
        "baseline": baseline.name if baseline is not None else "",
    }
    order = ["canary", "baseline", "stable"]
    return [
        {"role": role, "pool": pools.get(role, ""), "bp": bp, "percent": bp / 100}
        for role, bp in sorted(rollout.weights.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9)
    ]


def cohort_label(role: str, pool_name: str) -> str:
    """A line's legend: the role, and the pool when its name says more than
    the role does (a pool named "canary" read "canary canary")."""
    return role if not pool_name or pool_name == role else f"{role} ({pool_name})"


def run_context(run: AnalysisRun) -> dict[str, Any]:
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
        charts.append(
            axes.with_axes(
                {
                    "id": f"run-{run.pk}-{name}",
                    "title": f"{name} ({figure_name}): canary against baseline",
                    "times": [m.taken_at.timestamp() for m in measurements],
                    "lines": [
                        {"label": cohort_label("canary", run.canary_pool_name), "values": canary},
                        {"label": cohort_label("baseline", run.baseline_pool_name), "values": baseline},
                    ],
                    "display": display,
                    "unit": unit,
                }
            )
        )
    return {"run": run, "measurements": measurements, "charts": charts, "spec": spec}


def render_list_push() -> str:
    return render_to_string("rollouts/partials/rows.html", {**list_context(), "oob": True})


def render_detail_push(rollout_id: int, user_context: dict[str, Any]) -> str | None:
    rollout = base_queryset().filter(pk=rollout_id).first()
    if rollout is None:
        return None
    return render_to_string("rollouts/partials/live.html", {**detail_context(rollout, user_context), "oob": True})
