"""The experiment's recommendation against a rerun: the second comparison
of issue 23. A small sweep of arms (the scenario's monolithic baseline and
a few chunked profiles) runs the scenario's traffic in paired repeats, the
experiments' rule (``controlplane.experiments.recommend``) names a winner or
says there is none, and then the recommended arm and the arm it was judged
against run again on fresh repeats (seeds the sweep did not use). The rerun
confirms the recommendation or not.

Design note. The runs reuse the harness (``harness.Harness.ready`` serves a
profile, warms the workers up and empties their prefix cache; the plan is
driven open loop and read into an ``outcome.Outcome`` as the panel does).
Each arm's workers are started once and kept for the sweep and the rerun;
before every run their prefix cache is reset, so each run starts cold.
Repeat ``r`` replays the scenario planned with seed ``scenario.seed + r``
on every arm (paired repeats at equal offered load), and the arm order
rotates from repeat to repeat to cancel drift. The rerun's repeats carry on
from the sweep's last seed.

The rule "the rerun confirms it" (``confirms``, pure):

* a **winner** is confirmed when, in the rerun, it meets every objective
  and beats the arm it was judged against on the deciding figure (goodput,
  or throughput where goodput could not tell them apart), or that arm
  again breaks an objective as it did in the sweep. Against the baseline
  when the winner is another arm; against the sweep's runner-up when the
  winner is the baseline (keep it);
* **no significant winner** is confirmed when the rerun's paired difference
  between the two best tied arms (the baseline and the best other, when
  the baseline is among them) stays inside the sweep's 95% interval, or is
  under ``min_effect`` of the second's figure: the rerun does not find the
  difference the sweep could not (an arm that breaks an objective in the
  rerun is named in the reason);
* needing repeats or no arm qualifying names nothing to confirm.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controlplane.advisor.validation import harness as h
from controlplane.advisor.validation.outcome import Objectives, Outcome, outcome_of
from controlplane.advisor.validation.scenarios import MONOLITHIC, Scenario, profiles
from controlplane.experiments import recommend as rec
from workers import replay

DEFAULT_CAPS = (128, 512)
MIN_BUDGET = 256


def arms(max_model_len: int, caps: Sequence[int] = DEFAULT_CAPS) -> dict[str, dict[str, Any]]:
    """The sweep: monolithic (the baseline) and one chunked profile per
    chunk cap, with a budget of ``max(cap, 256)``."""
    out = {MONOLITHIC: profiles(max_model_len)[MONOLITHIC]}
    for cap in caps:
        out[f"chunk-{cap}"] = profiles(max_model_len, budget=max(cap, MIN_BUDGET), chunk_cap=cap)["chunked"]
    return out


def figures(name: str, outcomes: Sequence[Outcome]) -> rec.ArmFigures:
    """One arm's outcomes, one per repeat, as the experiments' rule reads them."""

    def values(get: Callable[[Outcome], float | None]) -> list[float]:
        return [v for o in outcomes if (v := get(o)) is not None]

    return rec.ArmFigures(
        name=name,
        goodput=[o.goodput for o in outcomes],
        throughput=[o.output_tokens_per_second for o in outcomes],
        ttft_p99_seconds=values(lambda o: o.ttft_p99_seconds),
        tpot_p99_seconds=values(lambda o: o.tpot_p99_seconds),
        stall_p99_seconds=values(lambda o: o.stall_p99_seconds),
        failed="" if any(o.num_ok for o in outcomes) else "no request succeeded",
    )


def objectives_of(objectives: Objectives) -> rec.Objectives:
    return rec.Objectives(objectives.ttft_seconds, objectives.tpot_seconds, objectives.tbt_seconds)


# ---- the rule --------------------------------------------------------------------------------


def deciding_figure(recommendation: rec.Recommendation) -> str:
    """``goodput`` (or ``capacity``), or ``throughput`` where the score could not tell the winner apart."""
    first = recommendation.reasons[0] if recommendation.reasons else ""
    return "throughput" if "cannot be told apart" in first else recommendation.basis


def _series(arm: rec.ArmFigures, figure: str) -> Sequence[float]:
    return {"throughput": arm.throughput, "capacity": arm.capacity}.get(figure, arm.goodput)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def rerun_pair(recommendation: rec.Recommendation, sweep: Sequence[rec.ArmFigures]) -> tuple[str, str] | None:
    """The two arms the rerun runs: (the recommended one, the one it was judged against)."""
    base = recommendation.baseline
    if recommendation.outcome == rec.Outcome.WINNER and recommendation.winner:
        if recommendation.winner != base and base is not None:
            return recommendation.winner, base
        figure = deciding_figure(recommendation)
        others = sorted(
            (a for a in sweep if a.name != recommendation.winner and not a.failed),
            key=lambda a: _mean(_series(a, figure)),
            reverse=True,
        )
        return (recommendation.winner, others[0].name) if others else None
    if recommendation.outcome == rec.Outcome.NO_SIGNIFICANT_WINNER and len(recommendation.tied) >= 2:
        tied = recommendation.tied
        if base in tied:
            return base, next(t for t in tied if t != base)
        return tied[0], tied[1]
    return None


@dataclass(frozen=True)
class Confirmation:
    confirmed: bool | None  # None: nothing to confirm
    reason: str


def confirms(
    recommendation: rec.Recommendation,
    sweep: Sequence[rec.ArmFigures],
    rerun: Sequence[rec.ArmFigures],
    objectives: rec.Objectives,
    *,
    seed: int = 0,
    min_effect: float = rec.MIN_EFFECT,
) -> Confirmation:
    """Whether ``rerun`` (the two arms of ``rerun_pair``, on fresh repeats) confirms the recommendation."""
    pair = rerun_pair(recommendation, sweep)
    if pair is None:
        return Confirmation(None, f"nothing to confirm: {recommendation.outcome.label}")
    by_name = {a.name: a for a in rerun}
    missing = [n for n in pair if n not in by_name]
    if missing:
        return Confirmation(False, f"the rerun has no figures for {', '.join(missing)}")
    first, second = by_name[pair[0]], by_name[pair[1]]
    figure = deciding_figure(recommendation)
    a, b = _mean(_series(first, figure)), _mean(_series(second, figure))
    unit = "tok/s" if figure == "throughput" else "req/s"
    figures_text = f"rerun {figure}: {first.name} {a:.3g}, {second.name} {b:.3g} {unit}"
    if recommendation.outcome == rec.Outcome.WINNER:
        broke = rec.violations(first, objectives)
        if broke:
            return Confirmation(False, f"{first.name} broke an objective in the rerun: {'; '.join(broke)}")
        if second.name in recommendation.broke and (again := rec.violations(second, objectives)):
            return Confirmation(
                True, f"{second.name} again broke an objective ({'; '.join(again)}), {first.name} met every one"
            )
        if a > b:
            return Confirmation(True, f"the direction holds: {figures_text}")
        return Confirmation(False, f"reversed: {figures_text}")
    # No significant winner: the rerun must not find the difference the sweep could not.
    before = rec.paired_difference(
        _series(_arm(sweep, pair[0]), figure), _series(_arm(sweep, pair[1]), figure), seed=seed
    )
    after = rec.paired_difference(_series(first, figure), _series(second, figure), seed=seed)
    inside = before.low <= after.mean <= before.high
    small = not math.isnan(b) and abs(after.mean) < min_effect * abs(b)
    text = (
        f"rerun difference {first.name} − {second.name} {after.mean:+.3g} {unit}; sweep's interval "
        f"{before.low:+.3g} to {before.high:+.3g}; {figures_text}"
    )
    # The tie is on the score; an arm that breaks an objective in the rerun is named beside it.
    noted = "".join(
        f"; in the rerun {arm_.name} broke an objective: {'; '.join(v)}"
        for arm_ in (first, second)
        if (v := rec.violations(arm_, objectives))
    )
    if inside or small:
        why = "inside the sweep's interval" if inside else f"under {min_effect:.0%}"
        return Confirmation(True, f"still a tie ({why}): {text}{noted}")
    return Confirmation(False, f"the rerun tells them apart: {text}{noted}")


def _arm(arms_: Sequence[rec.ArmFigures], name: str) -> rec.ArmFigures:
    return next(a for a in arms_ if a.name == name)


# ---- running it --------------------------------------------------------------------------------


@dataclass
class ExperimentRow:
    scenario: Scenario
    recommendation: rec.Recommendation
    sweep: dict[str, list[Outcome]]
    rerun: dict[str, list[Outcome]]
    confirmation: Confirmation
    profiles: dict[str, dict[str, Any]] = field(repr=False, default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "profiles": self.profiles,
            "recommendation": self.recommendation.to_json(),
            "deciding_figure": deciding_figure(self.recommendation),
            "sweep": {name: [o.to_json() for o in runs] for name, runs in self.sweep.items()},
            "rerun": {name: [o.to_json() for o in runs] for name, runs in self.rerun.items()},
            "confirmed": self.confirmation.confirmed,
            "confirmation": self.confirmation.reason,
        }


@dataclass
class Experiment:
    """A sweep of ``arms`` over ``repeats`` paired repeats on the harness's
    workers, the recommendation, and a rerun of its pair over ``rerun_repeats``."""

    harness: h.Harness
    arms: Mapping[str, Mapping[str, Any]]
    repeats: int = 2
    rerun_repeats: int = 2
    seed: int = 0  # the bootstrap's
    min_effect: float = rec.MIN_EFFECT

    def run(self, scenario: Scenario) -> ExperimentRow:
        hs = self.harness
        vocabulary = replay.vocabulary(hs.model_dir)
        objectives = objectives_of(hs.objectives)
        with contextlib.ExitStack() as stack:
            urls = {name: hs.ready(stack, name, fields, vocabulary) for name, fields in self.arms.items()}
            sweep = self._runs(scenario, list(urls), urls, range(self.repeats), vocabulary, "sweep")
            recommendation = rec.recommend(
                [figures(n, runs) for n, runs in sweep.items()],
                objectives,
                baseline=MONOLITHIC if MONOLITHIC in urls else None,
                seed=self.seed,
                min_effect=self.min_effect,
            )
            hs.say(f"  recommendation: {recommendation.outcome.label} {recommendation.winner or ''}")
            sweep_figures = [figures(n, runs) for n, runs in sweep.items()]
            pair = rerun_pair(recommendation, sweep_figures)
            rerun: dict[str, list[Outcome]] = {}
            if pair is not None:
                fresh = range(self.repeats, self.repeats + self.rerun_repeats)
                rerun = self._runs(scenario, list(pair), urls, fresh, vocabulary, "rerun")
        confirmation = confirms(
            recommendation,
            sweep_figures,
            [figures(n, runs) for n, runs in rerun.items()],
            objectives,
            seed=self.seed,
            min_effect=self.min_effect,
        )
        return ExperimentRow(
            scenario,
            recommendation,
            sweep,
            rerun,
            confirmation,
            {k: dict(v) for k, v in self.arms.items()},
        )

    def _runs(
        self,
        scenario: Scenario,
        names: list[str],
        urls: Mapping[str, list[str]],
        repeats: range,
        vocabulary: list[int],
        phase: str,
    ) -> dict[str, list[Outcome]]:
        """Each repeat's plan (seed ``scenario.seed + r``) on every arm, the arm order rotating."""
        hs = self.harness
        out: dict[str, list[Outcome]] = {n: [] for n in names}
        for i, r in enumerate(repeats):
            planned = replace(scenario, seed=scenario.seed + r).plan(
                max_model_len=hs.max_model_len,
                vocabulary=vocabulary,
                rate_scale=hs.rate_scale,
                duration_scale=hs.duration_scale,
            )
            for name in names[i % len(names) :] + names[: i % len(names)]:
                h.reset_prefix_cache(urls[name])
                records, wall = asyncio.run(h.drive(urls[name], planned))
                out[name].append(outcome_of(records, wall, hs.objectives))
                hs.say(f"  {scenario.name} {phase} repeat {r} on {name}: {h.describe(out[name][-1])}")
        return out
