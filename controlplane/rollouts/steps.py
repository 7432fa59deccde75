"""A rollout's step plan: ``set_weight``, ``pause`` and ``analysis``, as Argo
Rollouts spells them. Pure: no Django.

The stored form is a JSON list, one single-key object per step:

    [{"set_weight": 1000},
     {"analysis": {"template": "default"}},
     {"pause": {"duration_seconds": 60}},
     {"pause": {}}]

Weights are basis points of the routing table (10000 = all traffic). A pause
without a duration waits for a person (promote); an analysis names an
``AnalysisTemplate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ALL_TRAFFIC_BP = 10_000  # basis points: the routing table's whole
# The default plan: 10% → 25% → 50% → 100% with an analysis after each of
# the first three, then promotion.
DEFAULT_WEIGHTS_BP: tuple[int, ...] = (1000, 2500, 5000, 10000)
DEFAULT_TEMPLATE = "default"


class StepError(ValueError):
    """A plan that cannot run; ``errors`` maps ``steps`` to reasons."""

    def __init__(self, messages: list[str]):
        self.errors = {"steps": messages}
        super().__init__("; ".join(messages))


@dataclass(frozen=True)
class SetWeight:
    weight_bp: int

    def describe(self) -> str:
        return f"set canary weight to {self.weight_bp / 100:g}%"

    def to_json(self) -> dict[str, Any]:
        return {"set_weight": self.weight_bp}


@dataclass(frozen=True)
class Pause:
    duration_seconds: float | None = None  # None: until someone promotes

    def describe(self) -> str:
        if self.duration_seconds is None:
            return "pause until promoted"
        return f"pause {self.duration_seconds:g} s"

    def to_json(self) -> dict[str, Any]:
        return {"pause": {} if self.duration_seconds is None else {"duration_seconds": self.duration_seconds}}


@dataclass(frozen=True)
class Analysis:
    template: str

    def describe(self) -> str:
        return f"analysis ({self.template})"

    def to_json(self) -> dict[str, Any]:
        return {"analysis": {"template": self.template}}


Step = SetWeight | Pause | Analysis


def default_plan(template: str = DEFAULT_TEMPLATE) -> list[Step]:
    plan: list[Step] = []
    for i, weight in enumerate(DEFAULT_WEIGHTS_BP):
        plan.append(SetWeight(weight))
        if i < len(DEFAULT_WEIGHTS_BP) - 1:
            plan.append(Analysis(template))
    return plan


def to_json(steps: list[Step] | tuple[Step, ...]) -> list[dict[str, Any]]:
    return [step.to_json() for step in steps]


def parse(raw: Any) -> list[Step]:
    """The stored or posted form → steps. Raises StepError naming each bad
    step by its position."""
    if not isinstance(raw, list):
        raise StepError(["must be a list of steps."])
    steps: list[Step] = []
    errors: list[str] = []
    for i, item in enumerate(raw):
        try:
            steps.append(_parse_one(item))
        except ValueError as exc:
            errors.append(f"step {i}: {exc}")
    if errors:
        raise StepError(errors)
    return steps


def _parse_one(item: Any) -> Step:
    if not isinstance(item, dict) or len(item) != 1:
        raise ValueError('each step is an object with one key: "set_weight", "pause" or "analysis".')
    ((kind, body),) = item.items()
    if kind == "set_weight":
        if not isinstance(body, int) or isinstance(body, bool) or not 0 <= body <= ALL_TRAFFIC_BP:
            raise ValueError(f"set_weight is a whole number of basis points, 0 to {ALL_TRAFFIC_BP}.")
        return SetWeight(body)
    if kind == "pause":
        if not isinstance(body, dict) or set(body) - {"duration_seconds"}:
            raise ValueError('pause is {} or {"duration_seconds": N}.')
        duration = body.get("duration_seconds")
        if duration is None:
            return Pause(None)
        if (
            isinstance(duration, bool)
            or not isinstance(duration, int | float)
            or not math.isfinite(duration)
            or duration <= 0
        ):
            raise ValueError("pause duration_seconds must be a positive number.")
        return Pause(float(duration))
    if kind == "analysis":
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("template"), str)
            or not body["template"]
            or set(body) - {"template"}
        ):
            raise ValueError('analysis is {"template": "<analysis template name>"}.')
        return Analysis(body["template"])
    raise ValueError(f'unknown step kind "{kind}"; one of set_weight, pause, analysis.')


def templates_named(steps: list[Step] | tuple[Step, ...]) -> set[str]:
    return {step.template for step in steps if isinstance(step, Analysis)}
