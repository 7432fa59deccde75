"""Forwarding to an external Alertmanager: ``POST <url>/api/v2/alerts`` with
the postable alerts, as Prometheus sends them. That Alertmanager does its
own routing, grouping and silencing."""

from __future__ import annotations

from typing import Any

from controlplane.alerts.receivers.webhook import post_json


def alerts_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/api/v2/alerts") else f"{base}/api/v2/alerts"


def send(receiver: Any, alerts: Any) -> None:
    post_json(alerts_url(receiver.url), alerts, receiver.bearer_token)
