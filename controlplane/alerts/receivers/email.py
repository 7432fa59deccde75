"""Email through Django's mail backend: Alertmanager's default subject line
and a plain-text body listing each alert."""

from __future__ import annotations

from typing import Any

from django.core.mail import send_mail

from controlplane.alerts import conf
from controlplane.alerts.receivers import DeliveryError
from controlplane.alerts.routing import summary_line


def render(message: Any) -> tuple[str, str]:
    lines = [summary_line(message), ""]
    for alert in message["alerts"]:
        labels = " ".join(f'{k}="{v}"' for k, v in sorted(alert["labels"].items()))
        lines.append(f"[{alert['status'].upper()}] {labels}")
        for key in ("summary", "description", "value", "value_detail", "runbook_url", "dashboard_url"):
            if alert["annotations"].get(key):
                lines.append(f"  {key}: {alert['annotations'][key]}")
        lines.append(
            f"  since {alert['startsAt']}" + (f", ended {alert['endsAt']}" if alert["status"] == "resolved" else "")
        )
        if alert.get("generatorURL"):
            lines.append(f"  {alert['generatorURL']}")
        lines.append("")
    if message.get("truncatedAlerts"):
        lines.append(f"... and {message['truncatedAlerts']} more.")
    lines.append(f"Alerts: {message['externalURL']}/alerts/")
    return summary_line(message), "\n".join(lines)


def send(receiver: Any, message: Any) -> None:
    subject, body = render(message)
    sender = conf.ALERT_EMAIL_FROM.get()
    try:
        send_mail(subject, body, sender, list(receiver.emails), fail_silently=False)
    except Exception as exc:  # SMTP errors come in many classes
        raise DeliveryError(f"{type(exc).__name__}: {exc}"[:300]) from exc
