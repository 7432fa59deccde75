"""One way for every app to read a tunable: ``settings.NAME`` when the project
sets it, else the environment variable ``NAME`` (parsed as the default's
type), else the app's default. README.md lists the variables."""

from __future__ import annotations

import os
from typing import Any, TypeVar

from django.conf import settings

T = TypeVar("T", int, float, str, bool)


def setting(name: str, default: T) -> T:
    configured = getattr(settings, name, None)
    if configured is not None:
        return type(default)(configured)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in {"1", "true", "yes", "on"}  # type: ignore[return-value]
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {type(default).__name__}") from None


def setting_from(defaults: dict[str, Any], name: str) -> Any:
    """``setting`` for an app that keeps its defaults in one table."""
    return setting(name, defaults[name])
