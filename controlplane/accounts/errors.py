"""API errors: every 4xx has a JSON body; bad input names the field.

Validation raised from model methods (Django's ValidationError, the engine
contract's ProfileError, the agent contract's ContractError) becomes the same
400 shape DRF uses for serializer errors: ``{"field": ["reason", ...]}``.
Deleting a row that others still point at is 409 with what holds it.
A store that is down is 503 with a JSON body and ``Retry-After``
(``controlplane.outages``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError
from django.db.models import ProtectedError, RestrictedError
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane import outages
from workers.contract import ContractError
from workers.profile import ProfileError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if store := outages.store_down(exc):
        request = context.get("request")
        outages.note(store, exc, request.path if request is not None else "the API")
        return outages.quiet(Response(outages.payload(store), status=503, headers=outages.headers()))
    if isinstance(exc, (ProfileError, ContractError)):
        return Response(exc.errors, status=400)
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            return Response(exc.message_dict, status=400)
        return Response({"non_field_errors": exc.messages}, status=400)
    if isinstance(exc, DataError):
        # A value the column cannot hold that no serializer bound caught: the
        # request's fault, so a 400, never a 500.
        return Response({"detail": f"the database refused a value: {str(exc).splitlines()[0]}"}, status=400)
    if isinstance(exc, (ProtectedError, RestrictedError)):
        objects = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        holders = sorted({_describe(obj) for obj in objects})
        return Response(
            {"detail": "still in use; remove or repoint these first.", "in_use_by": holders[:20]}, status=409
        )
    return drf_exception_handler(exc, context)


def _describe(obj: Any) -> str:
    """A holder for the 409's list. Its ``__str__`` may read a related or
    deferred field of a row deleted since the check; the pk always stands."""
    try:
        return f"{obj._meta.verbose_name} {obj}"
    except ObjectDoesNotExist:
        return f"{obj._meta.verbose_name} {obj.pk}"


class RefuseBadQuery:
    """Middleware: a query parameter holding a NUL character is a 400 naming
    it. PostgreSQL text cannot hold NUL, so such a filter would fail in the
    database; bodies are covered by DRF's own CharField validator. Under
    /api/, a parameter sent as an object (``limit[a]=1``, OpenAPI's
    deepObject style) is a 400 naming it too: the API takes no object
    parameters, and read as an unknown name it would be quietly ignored."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        bad = sorted({key for key, values in request.GET.lists() if "\x00" in key or any("\x00" in v for v in values)})
        if bad:
            return JsonResponse(
                {key.replace("\x00", "\\0"): ["must not contain NUL characters."] for key in bad}, status=400
            )
        if request.path.startswith("/api/"):
            objects = sorted({key.partition("[")[0] for key in request.GET if "[" in key and key.endswith("]")})
            if objects:
                return JsonResponse({name: ["must be a single value, not an object."] for name in objects}, status=400)
        return self.get_response(request)
