"""The step plan (``controlplane.rollouts.steps``, pure): the stored JSON
form parsed to steps and back, every malformed step refused naming its
position, and the default plan."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.rollouts.steps import (
    ALL_TRAFFIC_BP,
    Analysis,
    Pause,
    SetWeight,
    Step,
    StepError,
    default_plan,
    parse,
    templates_named,
    to_json,
)


@pytest.mark.parametrize(
    ("raw", "step", "words"),
    [
        ({"set_weight": 0}, SetWeight(0), "set canary weight to 0%"),
        ({"set_weight": 1250}, SetWeight(1250), "set canary weight to 12.5%"),
        ({"set_weight": ALL_TRAFFIC_BP}, SetWeight(ALL_TRAFFIC_BP), "set canary weight to 100%"),
        ({"pause": {}}, Pause(None), "pause until promoted"),
        ({"pause": {"duration_seconds": 90}}, Pause(90.0), "pause 90 s"),
        ({"pause": {"duration_seconds": 0.5}}, Pause(0.5), "pause 0.5 s"),
        ({"analysis": {"template": "latency"}}, Analysis("latency"), "analysis (latency)"),
    ],
)
def test_each_step_parses_from_its_json_describes_itself_and_goes_back(
    raw: dict[str, Any], step: Step, words: str
) -> None:
    assert parse([raw]) == [step]
    assert step.describe() == words
    assert parse(to_json([step])) == [step]


def test_a_pause_duration_is_stored_as_seconds_whatever_number_was_posted() -> None:
    assert to_json(parse([{"pause": {"duration_seconds": 60}}])) == [{"pause": {"duration_seconds": 60.0}}]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"set_weight": -1}, "set_weight is a whole number of basis points, 0 to 10000."),
        ({"set_weight": ALL_TRAFFIC_BP + 1}, "set_weight is a whole number of basis points, 0 to 10000."),
        ({"set_weight": 12.5}, "set_weight is a whole number"),
        ({"set_weight": True}, "set_weight is a whole number"),
        ({"set_weight": "1000"}, "set_weight is a whole number"),
        ({"pause": None}, 'pause is {} or {"duration_seconds": N}.'),
        ({"pause": {"seconds": 5}}, 'pause is {} or {"duration_seconds": N}.'),
        ({"pause": {"duration_seconds": 0}}, "pause duration_seconds must be a positive number."),
        ({"pause": {"duration_seconds": -3}}, "pause duration_seconds must be a positive number."),
        ({"pause": {"duration_seconds": float("inf")}}, "pause duration_seconds must be a positive number."),
        ({"pause": {"duration_seconds": float("nan")}}, "pause duration_seconds must be a positive number."),
        ({"pause": {"duration_seconds": True}}, "pause duration_seconds must be a positive number."),
        ({"pause": {"duration_seconds": "60"}}, "pause duration_seconds must be a positive number."),
        ({"analysis": {}}, 'analysis is {"template": "<analysis template name>"}.'),
        ({"analysis": {"template": ""}}, 'analysis is {"template"'),
        ({"analysis": {"template": 3}}, 'analysis is {"template"'),
        ({"analysis": {"template": "a", "extra": 1}}, 'analysis is {"template"'),
        ({"analysis": "default"}, 'analysis is {"template"'),
        ({"canary": 10}, 'unknown step kind "canary"; one of set_weight, pause, analysis.'),
        ({}, "each step is an object with one key"),
        ({"set_weight": 1000, "pause": {}}, "each step is an object with one key"),
        (["set_weight", 1000], "each step is an object with one key"),
    ],
)
def test_a_bad_step_is_refused_with_the_accepted_form(raw: Any, message: str) -> None:
    with pytest.raises(StepError) as caught:
        parse([{"set_weight": 1000}, raw])
    (reason,) = caught.value.errors["steps"]
    assert reason.startswith(f"step 1: {message}")


def test_every_bad_step_is_named_by_its_position_in_one_error() -> None:
    with pytest.raises(StepError) as caught:
        parse([{"pause": {"duration_seconds": 0}}, {"set_weight": 500}, {"analysis": {}}])
    assert [reason.split(":")[0] for reason in caught.value.errors["steps"]] == ["step 0", "step 2"]


@pytest.mark.parametrize("raw", [None, {}, "[]", {"set_weight": 1000}])
def test_a_plan_that_is_not_a_list_is_refused(raw: Any) -> None:
    with pytest.raises(StepError, match="must be a list of steps"):
        parse(raw)


def test_an_empty_plan_is_a_plan_with_no_steps() -> None:
    assert parse([]) == []


def test_the_default_plan_raises_the_canary_in_four_weights_with_an_analysis_between_each() -> None:
    assert default_plan("latency") == [
        SetWeight(1000),
        Analysis("latency"),
        SetWeight(2500),
        Analysis("latency"),
        SetWeight(5000),
        Analysis("latency"),
        SetWeight(ALL_TRAFFIC_BP),
    ]
    assert default_plan()[1] == Analysis("default")


def test_templates_named_are_those_of_the_analysis_steps_only() -> None:
    steps = parse(
        [
            {"set_weight": 1000},
            {"analysis": {"template": "a"}},
            {"pause": {}},
            {"analysis": {"template": "b"}},
            {"analysis": {"template": "a"}},
        ]
    )
    assert templates_named(steps) == {"a", "b"}
    assert templates_named([SetWeight(1000), Pause(None)]) == set()
