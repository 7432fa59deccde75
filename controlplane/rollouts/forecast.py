"""How long each analysis of a plan needs to reach its minimum sample count
at the current traffic rate. Pure: no Django, no I/O.

A measurement counts the requests each side (canary, and baseline or
stable) got in its window. At R requests/s for the model and a share s of
the routing weights, a side gathers R·s samples a second, so it reaches
``min_samples`` after ``min_samples / (R·s)`` seconds. When that is longer
than the measurement's window, every measurement of that analysis will be
inconclusive ("canary has 3 < 20 samples") and the rollout pauses for a
person: better said when the rollout is created than found out at 10%,
unless the template's ``sample_wait_seconds`` lets it measure on that long.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.rollouts import steps as plan
from controlplane.rollouts.evaluator import weights_for
from controlplane.rollouts.judge import RunSpec


@dataclass(frozen=True)
class AnalysisForecast:
    step_index: int
    template: str
    canary_bp: int  # the canary's weight while this analysis runs
    baseline_role: str  # "baseline" or "stable": the side the canary is compared with
    baseline_bp: int
    min_samples: int  # the largest of the template's metrics: a verdict needs every one
    window_seconds: float  # what one measurement counts over
    sample_wait_seconds: float  # how long the analysis may wait for its samples (0: not at all)
    requests_per_second: float  # the model's traffic now, all pools
    canary_seconds: float | None  # to min_samples; None: this side gets no traffic
    baseline_seconds: float | None

    @property
    def seconds_to_min_samples(self) -> float | None:
        """When both sides have their samples; None: never at this rate."""
        if self.canary_seconds is None or self.baseline_seconds is None:
            return None
        return max(self.canary_seconds, self.baseline_seconds)

    @property
    def conclusive(self) -> bool:
        """Whether a measurement will have its samples: within one window,
        or within the analysis's sample wait."""
        seconds = self.seconds_to_min_samples
        return seconds is not None and seconds <= max(self.window_seconds, self.sample_wait_seconds)

    def describe(self) -> str:
        seconds = self.seconds_to_min_samples
        head = (
            f"analysis at step {self.step_index + 1} ({self.template}, canary {self.canary_bp / 100:g}%): "
            f"{self.min_samples} samples per side"
        )
        if seconds is None:
            return f"{head} never arrive: no traffic at {self.requests_per_second:.3g} requests/s"
        verdict = "within" if self.conclusive else "longer than"
        if self.sample_wait_seconds > self.window_seconds:
            return f"{head} take about {_duration(seconds)}, {verdict} its {_duration(self.sample_wait_seconds)} wait"
        return f"{head} take about {_duration(seconds)}, {verdict} its {_duration(self.window_seconds)} window"

    def to_json(self) -> dict[str, Any]:
        return {
            "step_index": self.step_index,
            "template": self.template,
            "canary_bp": self.canary_bp,
            "baseline_role": self.baseline_role,
            "baseline_bp": self.baseline_bp,
            "min_samples": self.min_samples,
            "window_seconds": self.window_seconds,
            "sample_wait_seconds": self.sample_wait_seconds,
            "requests_per_second": self.requests_per_second,
            "canary_seconds": self.canary_seconds,
            "baseline_seconds": self.baseline_seconds,
            "seconds_to_min_samples": self.seconds_to_min_samples,
            "conclusive": self.conclusive,
            "message": self.describe(),
        }


def forecast(
    steps: Sequence[plan.Step],
    specs: Mapping[str, RunSpec],
    requests_per_second: float,
    *,
    roles: frozenset[str],
    has_baseline: bool,
) -> list[AnalysisForecast]:
    """One forecast per analysis step whose template is known, at the canary
    weight the steps before it set."""
    out = []
    canary_bp = 0
    for index, step in enumerate(steps):
        if isinstance(step, plan.SetWeight):
            canary_bp = step.weight_bp
            continue
        if not isinstance(step, plan.Analysis) or step.template not in specs:
            continue
        spec = specs[step.template]
        if not spec.metrics:
            continue
        weights = weights_for(canary_bp, roles | {"canary", "stable"}, has_baseline)
        baseline_role = "baseline" if has_baseline else "stable"
        min_samples = max(rule.min_samples for rule in spec.metrics)
        out.append(
            AnalysisForecast(
                step_index=index,
                template=step.template,
                canary_bp=canary_bp,
                baseline_role=baseline_role,
                baseline_bp=weights.get(baseline_role, 0),
                min_samples=min_samples,
                window_seconds=spec.lookback_seconds,
                sample_wait_seconds=spec.sample_wait_seconds,
                requests_per_second=requests_per_second,
                canary_seconds=_seconds(min_samples, requests_per_second, canary_bp),
                baseline_seconds=_seconds(min_samples, requests_per_second, weights.get(baseline_role, 0)),
            )
        )
    return out


def _seconds(min_samples: int, requests_per_second: float, weight_bp: int) -> float | None:
    rate = requests_per_second * weight_bp / plan.ALL_TRAFFIC_BP
    if rate <= 0:
        return None
    return min_samples / rate


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
