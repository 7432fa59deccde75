"""The error replies every admin API operation can give, written into the
OpenAPI document (a drf-spectacular postprocessing hook), so that the
document lists each status a client can meet and the body that comes with it.

They come from one place, ``accounts/errors.py`` and DRF's own handling:
400 for bad input (``{"field": ["reason"]}``), 401 without credentials, 403
for a role that may not, 404 for an id or name that names nothing, 409 for a
delete of a row still in use, 503 while a store is down. Each is added where
it can happen and the operation does not already describe it.
"""

from __future__ import annotations

from typing import Any

ERROR_COMPONENT = "Error"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": (
        "An error: `detail` says why; a 400 names each field with its reasons instead "
        '(`{"field": ["reason"]}`), a 409 lists what still holds the row in `in_use_by`.'
    ),
    "properties": {
        "detail": {"type": "string"},
        "in_use_by": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": True,
}
DESCRIPTIONS = {
    "400": "Bad input: each field named with its reasons.",
    "401": "No credentials, or credentials that are not valid.",
    "403": "The caller's role may not do this.",
    "404": "Nothing with that id or name.",
    "409": "Still in use: what holds it is listed.",
    "503": "A store (PostgreSQL or Redis) is down; retry after Retry-After.",
}
METHODS = ("get", "put", "post", "patch", "delete")


def document_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    result.setdefault("components", {}).setdefault("schemas", {})[ERROR_COMPONENT] = ERROR_SCHEMA
    reference = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_COMPONENT}"}}}
    for path, item in result.get("paths", {}).items():
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            statuses = ["400", "401", "403", "503"]
            if "{" in path or _has_parameters(operation):
                statuses.append("404")  # a path id, or a filter naming a row, that names nothing
            if method == "delete":
                statuses.append("409")
            responses = operation.setdefault("responses", {})
            for status in statuses:
                responses.setdefault(status, {"description": DESCRIPTIONS[status], "content": reference})
    return result


def _has_parameters(operation: dict[str, Any]) -> bool:
    return any(p.get("in") == "query" for p in operation.get("parameters", []))
