"""Label sets, their fingerprints and matchers, as Prometheus and
Alertmanager define them. Pure: no Django.

An alert's identity is the fingerprint of its label set: FNV-1a 64 over the
label names in sorted order, each name and value followed by the byte 0xff
(which cannot occur in UTF-8), printed as 16 hex digits. This is
``model.LabelSet.Fingerprint()`` of prometheus/common, so an alert forwarded
to an Alertmanager shows there under the fingerprint it has here.

Matchers are Alertmanager's: ``=``, ``!=``, ``=~``, ``!~``, regular
expressions anchored at both ends. A matcher on a label the alert lacks sees
the empty string (``foo=""`` matches alerts without ``foo``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

LabelSet = Mapping[str, str]

_FNV_OFFSET = 14695981039346656037
_FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1
_SEPARATOR = 0xFF

LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
ALERT_NAME = LABEL_NAME  # rule names double as the alertname label; keep them tidy


def fingerprint(labels: LabelSet) -> str:
    """The 16-hex-digit fingerprint of a label set (order-independent)."""
    return _fingerprint(tuple(sorted(labels.items())))


@lru_cache(maxsize=65536)  # evaluation asks again for the same label sets every cycle
def _fingerprint(items: tuple[tuple[str, str], ...]) -> str:
    h = _FNV_OFFSET
    for name, value in items:
        for chunk in (name.encode(), value.encode()):
            for byte in chunk:
                h = ((h ^ byte) * _FNV_PRIME) & _MASK
            h = ((h ^ _SEPARATOR) * _FNV_PRIME) & _MASK
    return f"{h:016x}"


def label_errors(labels: Any, what: str = "label") -> list[str]:
    """Why ``labels`` is not a valid label set (names as Prometheus allows,
    string values); empty when it is."""
    if not isinstance(labels, Mapping):
        return ["must be an object of label names to string values."]
    errors = []
    for name, value in labels.items():
        if not isinstance(name, str) or not LABEL_NAME.match(name):
            errors.append(f"`{name}` is not a {what} name ([a-zA-Z_][a-zA-Z0-9_]*).")
        elif name.startswith("__"):
            errors.append(f"`{name}`: names starting with __ are reserved.")
        if not isinstance(value, str):
            errors.append(f"`{name}`: values are strings.")
    return errors


Op = Literal["=", "!=", "=~", "!~"]
OPS: tuple[Op, ...] = ("=", "!=", "=~", "!~")
# Longest operators first, so `!=` is not read as `!` + `=`.
_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^\s"=!~,{}]*))\s*$')


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(f"^(?:{pattern})$", re.DOTALL)


@dataclass(frozen=True)
class Matcher:
    name: str
    op: Op
    value: str

    @property
    def is_regex(self) -> bool:
        return self.op in ("=~", "!~")

    @property
    def is_equal(self) -> bool:
        return self.op in ("=", "=~")

    def matches(self, labels: LabelSet) -> bool:
        actual = labels.get(self.name, "")
        hit = bool(_compiled(self.value).match(actual)) if self.is_regex else actual == self.value
        return hit == self.is_equal

    def __str__(self) -> str:
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.name}{self.op}"{escaped}"'

    # ---- Alertmanager API v2 shape: {"name", "value", "isRegex", "isEqual"} ----
    def as_api(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "isRegex": self.is_regex, "isEqual": self.is_equal}

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> Matcher:
        is_regex, is_equal = bool(data.get("isRegex", False)), bool(data.get("isEqual", True))
        op: Op = ("=~" if is_equal else "!~") if is_regex else ("=" if is_equal else "!=")
        return cls(str(data.get("name", "")), op, str(data.get("value", "")))


class MatcherError(ValueError):
    pass


def parse_matcher(text: str) -> Matcher:
    """``severity="critical"``, ``pool=~"gpu-.*"``, ``cohort!=canary``."""
    m = _MATCHER.match(text)
    if not m:
        raise MatcherError(f'`{text}` is not a matcher (name="value", with =, !=, =~ or !~).')
    name, op, quoted, bare = m.groups()
    value = bare if quoted is None else re.sub(r"\\(.)", r"\1", quoted)
    matcher = Matcher(name, op, value)  # type: ignore[arg-type]
    check_matcher(matcher)
    return matcher


def check_matcher(matcher: Matcher) -> None:
    if not LABEL_NAME.match(matcher.name):
        raise MatcherError(f"`{matcher.name}` is not a label name.")
    if matcher.op not in OPS:
        raise MatcherError(f"`{matcher.op}` is not one of {', '.join(OPS)}.")
    if matcher.is_regex:
        try:
            _compiled(matcher.value)
        except re.error as exc:
            raise MatcherError(f"`{matcher.value}` is not a regular expression: {exc}.") from None


MATCHER_KEYS = {"name", "value", "isRegex", "isEqual"}  # Alertmanager's API shape


def coerce_matcher(item: Any) -> Matcher:
    """A matcher written as a string or in the API's dict shape."""
    if isinstance(item, str):
        return parse_matcher(item)
    if isinstance(item, Mapping):
        if not isinstance(item.get("name"), str) or not isinstance(item.get("value"), str):
            raise MatcherError("a matcher object has a string name and value.")
        if unknown := set(item) - MATCHER_KEYS:
            raise MatcherError(f"unknown matcher keys: {', '.join(sorted(map(str, unknown)))}.")
        matcher = Matcher.from_api(item)
        check_matcher(matcher)
        return matcher
    raise MatcherError('a matcher is a string (name="value") or {name, value, isRegex, isEqual}.')


def matches_all(matchers: Iterable[Matcher], labels: LabelSet) -> bool:
    return all(m.matches(labels) for m in matchers)


def format_labels(labels: LabelSet) -> str:
    """``{alertname="X", pool="a"}``, sorted: how Alertmanager prints a set."""
    return "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}"
