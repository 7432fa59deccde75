"""Fingerprints, matchers, routes, group keys, Alertmanager's dedup decision
and the v4 payload: the pure parts of notification."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.alerts.labels import MatcherError, coerce_matcher, fingerprint, parse_matcher
from controlplane.alerts.routing import (
    LastNotice,
    OutAlert,
    Reason,
    RouteSpec,
    group_alerts,
    match_routes,
    needs_update,
    webhook_message,
)

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def test_fingerprint_is_prometheus_label_set_fingerprint() -> None:
    # Values from prometheus/common's model.LabelSet.Fingerprint (FNV-1a 64, 0xff separators).
    assert fingerprint({}) == "cbf29ce484222325"
    assert fingerprint({"foo": "bar"}) == "3fff2c2d7595e046"
    assert fingerprint({"foo": "bar", "baz": "qux"}) == fingerprint({"baz": "qux", "foo": "bar"}) == "e4d83091cd448e77"


@pytest.mark.parametrize(
    ("text", "labels", "hit"),
    [
        ('severity="critical"', {"severity": "critical"}, True),
        ('severity="critical"', {"severity": "warning"}, False),
        ('severity!="critical"', {"severity": "warning"}, True),
        ('pool=~"gpu-.*"', {"pool": "gpu-a"}, True),
        ('pool=~"gpu"', {"pool": "gpu-a"}, False),  # anchored at both ends
        ('pool!~"gpu-.*"', {"pool": "cpu-a"}, True),
        ('zone=""', {"pool": "x"}, True),  # a missing label reads as empty
        ("cohort=canary", {"cohort": "canary"}, True),
        ('summary="say \\"hi\\""', {"summary": 'say "hi"'}, True),
    ],
)
def test_matchers_follow_alertmanager(text: str, labels: dict[str, str], hit: bool) -> None:
    assert parse_matcher(text).matches(labels) is hit


@pytest.mark.parametrize("text", ["severity", "9x=1", 'pool=~"("', "a==b"])
def test_bad_matchers_are_refused(text: str) -> None:
    with pytest.raises(MatcherError):
        parse_matcher(text)


def test_api_shape_matchers_round_trip() -> None:
    m = coerce_matcher({"name": "pool", "value": "gpu-.*", "isRegex": True, "isEqual": False})
    assert str(m) == 'pool!~"gpu-.*"'
    assert coerce_matcher(m.as_api()) == m


def test_first_matching_route_wins_unless_it_continues_and_the_root_takes_the_rest() -> None:
    pager = RouteSpec("pager", (parse_matcher('severity="critical"'),), continue_matching=True)
    team = RouteSpec("team", (parse_matcher('pool="gpu-a"'),))
    other = RouteSpec("other", (parse_matcher('pool="gpu-a"'),))
    root = RouteSpec("default", is_root=True)
    routes = [pager, team, other]
    assert [r.receiver for r in match_routes(routes, [root], {"severity": "critical", "pool": "gpu-a"})] == [
        "pager",
        "team",
    ]
    assert [r.receiver for r in match_routes(routes, [root], {"severity": "warning", "pool": "gpu-a"})] == ["team"]
    assert [r.receiver for r in match_routes(routes, [root], {"severity": "warning"})] == ["default"]


def test_group_keys_read_like_alertmanagers() -> None:
    route = RouteSpec("pager", (parse_matcher('severity="critical"'),), group_by=("alertname", "pool"))
    alerts = [
        _alert("a", {"alertname": "X", "pool": "p1", "worker": "w1"}),
        _alert("b", {"alertname": "X", "pool": "p1", "worker": "w2"}),
        _alert("c", {"alertname": "X", "pool": "p2", "worker": "w3"}),
    ]
    for a in alerts:
        a.labels["severity"] = "critical"  # type: ignore[index]
    groups = group_alerts([route], [], alerts)
    assert sorted(key for _, key in groups) == [
        '{}/{severity="critical"}:{alertname="X",pool="p1"}',
        '{}/{severity="critical"}:{alertname="X",pool="p2"}',
    ]
    assert len(groups[("pager", '{}/{severity="critical"}:{alertname="X",pool="p1"}')].alerts) == 2


def _alert(
    fp: str, labels: dict[str, str], status: str = "firing", annotations: dict[str, str] | None = None
) -> OutAlert:
    return OutAlert(
        fp, dict(labels), annotations or {}, status, T0, None if status == "firing" else T0 + timedelta(minutes=5)
    )  # type: ignore[arg-type]


S = frozenset


DEDUP_TABLE = [
    # (last notice, firing, resolved, send_resolved, minutes since last, expected)
    pytest.param(None, S({"a"}), S(), True, 0, Reason.FIRST, id="first-notification"),
    pytest.param(None, S(), S({"a"}), True, 0, Reason.NONE, id="never-told-and-only-resolved"),
    pytest.param((S({"a"}), S()), S({"a", "b"}), S(), True, 1, Reason.NEW_ALERTS, id="new-alert-in-group"),
    pytest.param((S({"a", "b"}), S()), S({"a"}), S({"b"}), True, 1, Reason.NEW_RESOLVED, id="one-resolved"),
    pytest.param((S({"a", "b"}), S()), S({"a"}), S({"b"}), False, 1, Reason.NONE, id="one-resolved-no-send-resolved"),
    pytest.param((S({"a"}), S()), S(), S({"a"}), False, 1, Reason.ALL_RESOLVED, id="all-resolved-clears-the-log"),
    pytest.param((S({"a"}), S()), S({"a"}), S(), True, 30, Reason.NONE, id="nothing-new-before-repeat"),
    pytest.param((S({"a"}), S()), S({"a"}), S(), True, 240, Reason.REPEAT, id="repeat-interval-elapsed"),
    pytest.param((S(), S({"a"})), S({"a"}), S(), True, 1, Reason.FIRST, id="refired-after-all-resolved"),
]


@pytest.mark.parametrize(("last", "firing", "resolved", "send_resolved", "minutes", "expected"), DEDUP_TABLE)
def test_needs_update_is_alertmanagers_dedup_stage(last, firing, resolved, send_resolved, minutes, expected) -> None:  # type: ignore[no-untyped-def]
    notice = None if last is None else LastNotice(T0, last[0], last[1])
    got = needs_update(
        notice,
        firing,
        resolved,
        repeat_interval_seconds=4 * 3600,
        send_resolved=send_resolved,
        now=T0 + timedelta(minutes=minutes),
    )
    assert got == expected


def test_webhook_message_is_version_4_with_common_labels_and_truncation() -> None:
    alerts = [
        _alert("f1", {"alertname": "X", "pool": "p", "worker": "w1"}, annotations={"summary": "s", "runbook_url": "r"}),
        _alert("f2", {"alertname": "X", "pool": "p", "worker": "w2"}, status="resolved", annotations={"summary": "s"}),
    ]
    msg = webhook_message("ops", '{}:{alertname="X"}', {"alertname": "X"}, alerts, "http://cp", max_alerts=1)
    assert msg["version"] == "4"
    assert msg["status"] == "firing"
    assert msg["commonLabels"] == {"alertname": "X", "pool": "p"}
    assert msg["commonAnnotations"] == {"summary": "s"}
    assert msg["truncatedAlerts"] == 1
    (only,) = msg["alerts"]
    assert only == {
        "status": "firing",
        "labels": {"alertname": "X", "pool": "p", "worker": "w1"},
        "annotations": {"summary": "s", "runbook_url": "r"},
        "startsAt": "2025-01-01T12:00:00.000Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": "f1",
    }
