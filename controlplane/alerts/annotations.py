"""An alert's annotations from its rule's templates: Prometheus's two
template variables expanded, and the value added while it matters. Pure
strings in and out; the evaluator writes them, ``Alert.live_annotations``
renders them again as of the last evaluation."""

from __future__ import annotations

import re

_TEMPLATE = re.compile(r"\{\{\s*\$(value|labels\.([a-zA-Z_][a-zA-Z0-9_]*))\s*\}\}")


def expand(text: str, labels: dict[str, str], value: float | None) -> str:
    """Prometheus's two template variables: ``{{ $value }}``, ``{{ $labels.x }}``."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) == "value":
            return "no data" if value is None else f"{value:.4g}"
        return labels.get(m.group(2), "")

    return _TEMPLATE.sub(one, text) if "{{" in text else text


def render_annotations(
    templates: dict[str, str], labels: dict[str, str], value: float | None, detail: str, with_value: bool
) -> dict[str, str]:
    """A rule's annotation ``templates`` for one alert: rendered, plus the
    value (and for ratio rules both sides, ``detail``) while it matters."""
    annotations = {k: expand(v, labels, value) for k, v in templates.items()}
    if detail:
        annotations["value_detail"] = detail
    if with_value:
        annotations["value"] = "no data" if value is None else f"{value:.6g}"
    return annotations
