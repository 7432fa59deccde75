"""API errors: every 4xx has a JSON body; bad input names the field.

Validation raised from model methods (Django's ValidationError, the engine
contract's ProfileError, the agent contract's ContractError) becomes the same
400 shape DRF uses for serializer errors: ``{"field": ["reason", ...]}``.
Deleting a row that others still point at is 409 with what holds it.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from workers.contract import ContractError
from workers.profile import ProfileError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, (ProfileError, ContractError)):
        return Response(exc.errors, status=400)
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            return Response(exc.message_dict, status=400)
        return Response({"non_field_errors": exc.messages}, status=400)
    if isinstance(exc, (ProtectedError, RestrictedError)):
        objects = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        holders = sorted({f"{obj._meta.verbose_name} {obj}" for obj in objects})
        return Response(
            {"detail": "still in use; remove or repoint these first.", "in_use_by": holders[:20]}, status=409
        )
    return drf_exception_handler(exc, context)
