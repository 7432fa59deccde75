"""The one way every app declares and reads its tunables.

An app's ``conf.py`` declares each tunable once, by the name an operator sets::

    SCRAPE_INTERVAL = Tunable("SCRAPE_INTERVAL", 5.0, "seconds between scrapes of every worker's /metrics")

and code reads it with ``conf.SCRAPE_INTERVAL.get()``: ``settings.NAME`` when
the project sets it (tests use ``override_settings``), else the environment
variable ``NAME`` parsed as the default's type, else the default. A default
that depends on another value is a function, with its type and the text the
README shows. README.md's tunables table is ``markdown_table()``; a test
keeps the two equal.

Deployment variables that Django itself needs before any app loads
(``DATABASE_URL``, ``REDIS_URL``, ``SECRET_KEY``, ...) are read once in
``settings.py`` instead, and listed in README's other table.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar

from django.apps import apps
from django.conf import settings

T = TypeVar("T", int, float, str, bool)

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Tunable(Generic[T]):
    """One tunable: ``name`` is the setting and the environment variable,
    ``meaning`` one line for the README. ``kind`` is needed only when
    ``default`` is a function; ``shown_default`` is how the README writes such a
    default (else ``str(default)``)."""

    name: str
    default: T | Callable[[], T]
    meaning: str
    kind: type[T] | None = None
    shown_default: str = ""

    def __post_init__(self) -> None:
        if callable(self.default) and (self.kind is None or not self.shown_default):
            raise TypeError(f"{self.name}: a computed default needs kind= and shown_default=")

    @property
    def type(self) -> type[T]:
        return self.kind or type(self.default)  # type: ignore[return-value]

    def get(self) -> T:
        configured = getattr(settings, self.name, None)
        if configured is not None:
            return self.type(configured)
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default() if callable(self.default) else self.default
        return self.parse(raw)

    def parse(self, raw: str) -> T:
        if self.type is bool:
            return raw.strip().lower() in _TRUE
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected {self.type.__name__}") from None

    @property
    def default_text(self) -> str:
        return self.shown_default or str(self.default)


def declared(module: ModuleType) -> list[Tunable[Any]]:
    """The tunables a ``conf`` module declares, in the order it declares them.
    Each is bound to its own name, so that grep finds the code that reads it."""
    found = []
    for attr, value in vars(module).items():
        if isinstance(value, Tunable):
            if attr != value.name:
                raise ValueError(f"{module.__name__}.{attr} declares {value.name}: bind it to its own name")
            found.append(value)
    return found


def all_tunables() -> list[Tunable[Any]]:
    """Every installed app's tunables (those with a ``conf`` module), app by app
    in INSTALLED_APPS order. Looked up by name, as the admin finds ``admin``
    modules: this module sits below every app and imports none of them."""
    found: list[Tunable[Any]] = []
    for app in apps.get_app_configs():
        name = f"{app.name}.conf"
        if app.name.startswith("controlplane.") and importlib.util.find_spec(name) is not None:
            found.extend(declared(importlib.import_module(name)))
    names = [t.name for t in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"declared twice: {', '.join(duplicates)}")
    return found


def markdown_table(tunables: list[Tunable[Any]]) -> str:
    """README.md's tunables table."""
    lines = ["| tunable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{t.name}` | {t.default_text} | {t.meaning} |" for t in tunables]
    return "\n".join(lines)
