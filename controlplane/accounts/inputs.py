"""What the API accepts, decided once for every endpoint.

- **Strict bodies.** A serializer refuses fields it does not know, with a 400
  naming each one (Kubernetes' strict field validation): a config API that
  drops what the operator wrote is worse than one that says no. Every
  serializer in the API is a ``StrictSerializer`` or ``StrictModelSerializer``
  (``tests/controlplane/accounts/test_inputs.py`` walks them), nested ones
  too, so a misplaced key is refused at any depth.
- **Bounded numbers.** An integer field with no upper bound of its own gets
  its model column's range, else a 64-bit one, so no value reaches the
  database that it cannot store (an ``OverflowError`` or ``DataError`` would
  be a 500). ``query_int`` does the same for query parameters.
- **Numeric ids in paths.** ``ApiRouter``'s ``<id:pk>`` converter matches only
  ids a ``bigint`` holds: ``/rollouts/abc/promote/`` is a 404 from the URL
  resolver, before any view.
- **Bounded pages.** ``Pagination`` caps ``limit`` and refuses an ``offset``
  past what a database can skip, by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.core.validators import MaxValueValidator, MinValueValidator
from django.urls import register_converter
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.routers import SimpleRouter

MAX_BIGINT = 2**63 - 1
MIN_BIGINT = -(2**63)
# Ids are bigint (DEFAULT_AUTO_FIELD); 18 digits always fit, 19 may not.
ID_REGEX = "[0-9]{1,18}"
MAX_ID = 10**18 - 1
MAX_PAGE_SIZE = 1000
MAX_OFFSET = 10**9


# ---- bodies --------------------------------------------------------------------------
_FORM_FIELDS = {"csrfmiddlewaretoken"}  # the browsable API's forms send it beside the fields


class StrictMixin:
    """Unknown fields are a 400 naming them; integers are bounded."""

    fields: Any
    initial_data: Any

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(str(name) for name in data if name not in self.fields and name not in _FORM_FIELDS)
            if unknown:
                raise serializers.ValidationError({name: ["unknown field."] for name in unknown})
            # DRF trims text before it checks the length; the document's maxLength is of the text as sent.
            too_long = {
                name: [f"Ensure this field has no more than {field.max_length} characters."]
                for name, field in self.fields.items()
                if isinstance(field, serializers.CharField)
                and field.max_length is not None
                and isinstance(data.get(name), str)
                and len(data[name]) > field.max_length
            }
            if too_long:
                raise serializers.ValidationError(too_long)
            # DRF's CharField takes a number and makes it text; the document says text.
            numbers = {
                name: ["Not a valid string."]
                for name, field in self.fields.items()
                if isinstance(field, serializers.CharField)
                and not field.read_only
                and isinstance(data.get(name), int | float)
                and not isinstance(data.get(name), bool)
            }
            if numbers:
                raise serializers.ValidationError(numbers)
        return super().to_internal_value(data)  # type: ignore[misc]

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()  # type: ignore[misc]
        model = getattr(getattr(self, "Meta", None), "model", None)
        for name, field in fields.items():
            _bound(field, _column_range(model, field.source or name))
        return fields


def _column_range(model: Any, source: str) -> tuple[int, int]:
    """The range the model's column stores (Django's backend-specific
    integer validators), else a 64-bit one."""
    low, high = MIN_BIGINT, MAX_BIGINT
    if model is None or "." in source or source == "*":
        return low, high
    try:
        column = model._meta.get_field(source)
    except FieldDoesNotExist:
        return low, high
    for validator in getattr(column, "validators", []):
        if isinstance(validator, MinValueValidator) and isinstance(validator.limit_value, int):
            low = max(low, validator.limit_value)
        elif isinstance(validator, MaxValueValidator) and isinstance(validator.limit_value, int):
            high = min(high, validator.limit_value)
    return low, high


def _bound(field: serializers.Field, column: tuple[int, int]) -> None:
    if field.read_only:
        return
    if isinstance(field, (serializers.ListField, serializers.DictField)):
        _bound(field.child, (MIN_BIGINT, MAX_BIGINT))
        return
    if not isinstance(field, serializers.IntegerField):
        return
    low, high = column
    if field.max_value is None or field.max_value > high:
        field.max_value = high
        field.validators.append(MaxValueValidator(high, message=f"Ensure this value is less than or equal to {high}."))
    if field.min_value is None or field.min_value < low:
        field.min_value = low
        field.validators.append(MinValueValidator(low, message=f"Ensure this value is greater than or equal to {low}."))


class StrictSerializer(StrictMixin, serializers.Serializer):
    pass


class StrictModelSerializer(StrictMixin, serializers.ModelSerializer):
    pass


# ---- query parameters ------------------------------------------------------------------
def query_int(request: Request, name: str, *, minimum: int = 0, maximum: int = MAX_ID) -> int | None:
    """An integer query parameter, or None when absent; else a 400 naming it."""
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    assert raw is not None  # for mypy: QueryDict.get is typed loosely
    if not raw.lstrip("-").isdigit() or len(raw) > 20:
        raise serializers.ValidationError({name: ["must be a whole number."]})
    value = int(raw)
    if not minimum <= value <= maximum:
        raise serializers.ValidationError({name: [f"must be between {minimum} and {maximum}."]})
    return value


def query_id_or_name(request: Request, name: str) -> tuple[int | None, str | None]:
    """``?pool=3`` or ``?pool=stable``: (id, None) or (None, name); a number too
    large for an id is a 400 naming the parameter."""
    raw = request.query_params.get(name)
    if not raw:
        return None, None
    if raw.isdigit():
        return query_int(request, name, minimum=1), None
    return None, raw


# ---- paths and pages ---------------------------------------------------------------------
class IdConverter:
    """``<id:pk>``: a row id, digits that a bigint holds, as an int."""

    regex = ID_REGEX

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: Any) -> str:
        return str(value)


# The OpenAPI document says so too (SPECTACULAR_SETTINGS' PATH_CONVERTER_OVERRIDES).
register_converter(IdConverter, "id")


class ApiRouter(SimpleRouter):
    """SimpleRouter with path converters: detail routes match only numeric
    ids (``<id:pk>``), unless a viewset names its ``lookup_value_converter``."""

    def __init__(self) -> None:
        super().__init__(use_regex_path=False)

    def get_lookup_regex(self, viewset: Any, lookup_prefix: str = "") -> str:
        lookup_field = getattr(viewset, "lookup_field", "pk")
        lookup_url_kwarg = getattr(viewset, "lookup_url_kwarg", None) or lookup_field
        converter = getattr(viewset, "lookup_value_converter", "id")
        return f"<{converter}:{lookup_prefix}{lookup_url_kwarg}>"


class Pagination(LimitOffsetPagination):
    """limit/offset pages: ``limit`` is capped at MAX_PAGE_SIZE; a value that
    is not a whole number, or an offset past MAX_OFFSET, is a 400 naming it."""

    max_limit = MAX_PAGE_SIZE

    def get_limit(self, request: Request) -> int | None:
        value = query_int(request, self.limit_query_param, minimum=0, maximum=MAX_ID)
        if value is None or value == 0:
            return self.default_limit
        return min(value, MAX_PAGE_SIZE)

    def get_offset(self, request: Request) -> int:
        return query_int(request, self.offset_query_param, minimum=0, maximum=MAX_OFFSET) or 0

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            schema = parameter["schema"]
            schema["minimum"] = 0
            schema["maximum"] = MAX_OFFSET if parameter["name"] == self.offset_query_param else MAX_ID
        return parameters
