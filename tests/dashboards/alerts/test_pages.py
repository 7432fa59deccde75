"""The alert pages: alerts (firing and pending first, history below), the
rule editor with field errors and "test now", silences, and the banner on
every page while a critical alert fires."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.alerts.lifecycle import AlertState
from controlplane.alerts.models import AlertRule, AlertTransition, Silence
from controlplane.audit.models import AuditEvent
from controlplane.fleet.health import WorkerState
from controlplane.fleet.models import Worker
from tests.controlplane.alerts.support import firing_alert
from tests.controlplane.factories import enroll_worker, make_pool

RULE_FORM = {
    "name": "StallsOnGpuA",
    "enabled": "on",
    "figure": "client_stall_p99",
    "group_by": "pool",
    "window_seconds": "300",
    "compare_to": "",
    "comparator": ">",
    "threshold": "2",
    "floor": "",
    "for_seconds": "60",
    "keep_firing_for_seconds": "0",
    "no_data_state": "ok",
    "severity": "warning",
    "action": "notify",
    "summary": "stalls {{ $value }} s",
    "description": "",
    "runbook_url": "",
    "dashboard_url": "",
    "pool": "gpu-a",
    "cohort": "",
    "worker": "",
    "worker_labels": "",
    "extra_labels": "team=serving",
}


@pytest.mark.parametrize("path", ["/alerts/", "/alerts/rules/", "/alerts/silences/", "/alerts/rules/new/"])
def test_alert_pages_send_anonymous_visitors_to_login(client: Client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_the_alerts_page_lists_firing_then_pending_then_no_data_with_history_below(viewer_client: Client) -> None:
    now = timezone.now()
    pending = firing_alert({"alertname": "Slow", "pool": "p1"}, now, state=AlertState.PENDING)
    firing = firing_alert({"alertname": "Broken", "pool": "p2", "severity": "critical"}, now)
    nodata = firing_alert({"alertname": "Quiet", "pool": "p3"}, now, state=AlertState.NODATA, value=None)
    AlertTransition.objects.create(
        alert=firing,
        fingerprint=firing.fingerprint,
        from_state=AlertState.PENDING,
        to_state=AlertState.FIRING,
        value=3.5,
        reason="held for 1m",
        at=now,
    )
    html = viewer_client.get("/alerts/").content.decode()
    order = [html.index(f'data-fingerprint="{a.fingerprint}"') for a in (firing, pending, nodata)]
    assert order == sorted(order)
    history = html[html.index('id="alert-history"') :]
    assert "held for 1m" in history and "Broken" in history
    # The live part alone, for htmx.
    partial = viewer_client.get("/alerts/", HTTP_HX_REQUEST="true").content.decode()
    assert partial.lstrip().startswith('<div id="active-alerts" hx-get="/alerts/"') and "<html" not in partial
    assert 'id="active-table"' in partial and 'id="alert-history"' not in partial


def test_a_silenced_alert_still_shows_marked_silenced(viewer_client: Client) -> None:
    now = timezone.now()
    alert = firing_alert({"alertname": "Broken", "pool": "p2"}, now)
    Silence.objects.create(
        matchers=[{"name": "pool", "value": "p2", "isRegex": False, "isEqual": True}],
        starts_at=now - timedelta(minutes=1),
        ends_at=now + timedelta(hours=1),
        created_by="op",
        comment="known",
    )
    html = viewer_client.get("/alerts/").content.decode()
    row = html[html.index(f'data-fingerprint="{alert.fingerprint}"') :]
    assert 'class="badge silenced"' in row[:800]
    assert alert.fingerprint not in viewer_client.get("/alerts/?silenced=hide").content.decode()


def test_the_banner_shows_on_every_page_while_a_critical_alert_fires(viewer_client: Client) -> None:
    assert "alert-banner" not in viewer_client.get("/").content.decode()
    firing_alert({"alertname": "ErrorRateHigh", "pool": "gpu-a", "severity": "critical"}, timezone.now())
    firing_alert({"alertname": "KVFragmentationHigh", "worker": "w1", "severity": "warning"}, timezone.now())
    for path in ("/", "/profiles/", "/audit/", "/alerts/rules/"):
        html = viewer_client.get(path).content.decode()
        assert 'class="alert-banner"' in html, path
        assert "1 critical alert firing" in html and "ErrorRateHigh" in html
        assert "KVFragmentationHigh" not in html[html.index("alert-banner") : html.index("See alerts")]
    assert "ErrorRateHigh" in viewer_client.get("/alerts/banner/").content.decode()


def test_a_silenced_critical_alert_does_not_raise_the_banner(viewer_client: Client) -> None:
    now = timezone.now()
    firing_alert({"alertname": "ErrorRateHigh", "pool": "gpu-a", "severity": "critical"}, now)
    Silence.objects.create(
        matchers=[{"name": "alertname", "value": "ErrorRateHigh", "isRegex": False, "isEqual": True}],
        starts_at=now - timedelta(minutes=1),
        ends_at=now + timedelta(hours=1),
        created_by="op",
        comment="on it",
    )
    assert "alert-banner" not in viewer_client.get("/").content.decode()


def test_saving_a_rule_from_the_editor_is_audited(operator_client: Client) -> None:
    response = operator_client.post("/alerts/rules/new/", {**RULE_FORM, "do": "save"})
    assert response.status_code == 302, response.content.decode()[:2000]
    rule = AlertRule.objects.get(name="StallsOnGpuA")
    assert rule.selector == {"pool": "gpu-a"} and rule.labels == {"team": "serving"}
    assert AuditEvent.objects.filter(action="alert_rule.create", object_id=str(rule.pk)).exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"figure": "nope"}, "figure"),
        ({"name": "has spaces"}, "name"),
        ({"threshold": "-3"}, "threshold"),
        ({"action": "abort_rollout"}, "action"),
        ({"extra_labels": "alertname=X"}, "extra_labels"),
        ({"worker_labels": "zone"}, "worker_labels"),
        ({"cohort": "canary", "compare_to": "baseline", "group_by": "worker"}, "compare_to"),
    ],
)
def test_the_editor_shows_each_error_beside_its_field(
    operator_client: Client, change: dict[str, str], field: str
) -> None:
    response = operator_client.post("/alerts/rules/new/", {**RULE_FORM, **change})
    assert response.status_code == 200
    assert f'data-field-error="{field}"' in response.content.decode()
    assert not AlertRule.objects.filter(name=RULE_FORM["name"]).exists()


def test_test_now_shows_the_current_value_and_stores_nothing(operator_client: Client) -> None:
    pool = make_pool("gpu-a")
    for name in ("w1", "w2"):
        enroll_worker(name, pool=pool)
    Worker.objects.filter(name="w2").update(state=WorkerState.UNHEALTHY)
    form = {
        **RULE_FORM,
        "name": "Missing",
        "figure": "worker_missing",
        "group_by": "worker",
        "threshold": "0",
        "pool": "",
        "no_data_state": "nodata",
    }
    partial = operator_client.post("/alerts/rules/test/", form).content.decode()
    assert 'id="test-groups"' in partial
    row = partial[partial.index("w2") :]
    assert '<td class="test-value">1</td>' in row[:300] and "holds" in row[:500]
    # Without JavaScript the button posts the whole form to the editor, which shows the same.
    page = operator_client.post("/alerts/rules/new/", {**form, "do": "test"}).content.decode()
    assert 'id="test-groups"' in page
    assert not AlertRule.objects.filter(name="Missing").exists()


def test_a_rule_is_switched_off_and_on_from_the_list(operator_client: Client, shipped_rules: None) -> None:
    rule = AlertRule.objects.get(key="kv-fragmentation-high")
    operator_client.post(f"/alerts/rules/{rule.pk}/toggle/")
    assert AlertRule.objects.get(pk=rule.pk).enabled is True  # the fixture switched them all off
    operator_client.post(f"/alerts/rules/{rule.pk}/toggle/")
    assert AlertRule.objects.get(pk=rule.pk).enabled is False
    assert AuditEvent.objects.filter(action="alert_rule.update", object_id=str(rule.pk)).count() == 2


def test_a_viewer_sees_rules_but_cannot_edit_them(viewer_client: Client) -> None:
    assert viewer_client.get("/alerts/rules/").status_code == 200
    assert viewer_client.get("/alerts/rules/new/").status_code == 403


def test_silencing_from_the_page_and_expiring(operator_client: Client) -> None:
    alert = firing_alert({"alertname": "Broken", "pool": "p2"}, timezone.now())
    page = operator_client.get(f"/alerts/{alert.pk}/").content.decode()
    assert "/alerts/silences/?matchers=" in page
    response = operator_client.post(
        "/alerts/silences/",
        {"matchers": 'alertname="Broken"\npool="p2"', "duration_hours": "1", "comment": "deploying a fix"},
    )
    assert response.status_code == 302
    silence = Silence.objects.get()
    assert silence.status() == "active" and silence.matches(alert.labels)
    assert "Broken" in operator_client.get("/alerts/silences/").content.decode()
    operator_client.post(f"/alerts/silences/{silence.pk}/expire/")
    assert Silence.objects.get().status() == "expired"
    assert list(AuditEvent.objects.filter(object_type="alerts.silence").values_list("action", flat=True)) == [
        "silence.expire",
        "silence.create",
    ]


def test_a_silence_without_a_comment_is_refused_by_field(operator_client: Client) -> None:
    response = operator_client.post(
        "/alerts/silences/", {"matchers": 'pool="p2"', "duration_hours": "1", "comment": ""}
    )
    assert 'data-field-error="comment"' in response.content.decode()
    assert not Silence.objects.exists()


def test_the_alert_page_shows_transitions_and_deliveries(viewer_client: Client) -> None:
    alert = firing_alert({"alertname": "Broken", "pool": "p2"}, timezone.now())
    AlertTransition.objects.create(
        alert=alert,
        fingerprint=alert.fingerprint,
        from_state=AlertState.INACTIVE,
        to_state=AlertState.FIRING,
        value=7.0,
        reason="condition holds",
        at=timezone.now(),
    )
    html = viewer_client.get(f"/alerts/{alert.pk}/").content.decode()
    assert alert.fingerprint in html and "condition holds" in html and 'id="deliveries"' in html
