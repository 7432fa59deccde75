"""API errors: every 4xx has a JSON body; bad input names the field.

Validation raised from model methods (Django's ValidationError, or the engine
contract's ProfileError) becomes the same 400 shape DRF uses for serializer
errors: ``{"field": ["reason", ...]}``.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from workers.profile import ProfileError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ProfileError):
        return Response(exc.errors, status=400)
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            return Response(exc.message_dict, status=400)
        return Response({"non_field_errors": exc.messages}, status=400)
    return drf_exception_handler(exc, context)
