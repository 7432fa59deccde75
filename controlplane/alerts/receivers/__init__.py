"""Notification channels, one module each, chosen by the receiver's kind
through import strings (as healthchecks picks its transports). A channel
module has one function:

    send(receiver: Receiver, message: WebhookMessage | list[PostableAlert]) -> None

It raises ``DeliveryError`` when the far end did not take the message; the
caller records the attempt and retries with backoff. Webhook and email get
one group's message; an ``alertmanager`` receiver gets the postable alerts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.utils.module_loading import import_string

CHANNELS: dict[str, str] = {
    "webhook": "controlplane.alerts.receivers.webhook.send",
    "email": "controlplane.alerts.receivers.email.send",
    "alertmanager": "controlplane.alerts.receivers.alertmanager.send",
}


class DeliveryError(Exception):
    """The receiver did not take the message; ``str()`` says why, briefly."""


def channel(kind: str) -> Callable[[Any, Any], None]:
    return import_string(CHANNELS[kind])
