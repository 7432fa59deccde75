"""Webhook: Alertmanager's v4 JSON, POSTed as Alertmanager posts it."""

from __future__ import annotations

from typing import Any

import httpx

from controlplane.alerts import conf
from controlplane.alerts.receivers import DeliveryError


def post_json(url: str, body: Any, bearer_token: str = "") -> None:
    headers = {"Content-Type": "application/json", "User-Agent": "Chunkpilot-Alerting/1"}
    if bearer_token:
        headers["Authorization"] = f"Bearer {bearer_token}"
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=conf.ALERT_DELIVERY_TIMEOUT_SECONDS.get())
    except httpx.HTTPError as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}"[:300]) from exc
    if response.status_code // 100 != 2:
        # Alertmanager retries 5xx and gives up on 4xx; we retry both, since a
        # misconfigured receiver fixed within the backoff still gets the news.
        raise DeliveryError(f"HTTP {response.status_code}: {response.text[:200]}")


def send(receiver: Any, message: Any) -> None:
    post_json(receiver.url, message, receiver.bearer_token)
