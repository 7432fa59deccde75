"""Role checks for pages, the same ladder the API uses."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

from controlplane.accounts.roles import Role, role_of


def role_required(role: Role) -> Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]]:
    """Anonymous visitors go to the login page; a signed-in user below
    ``role`` gets 403."""

    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @login_required
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if role_of(request.user) < role:
                raise PermissionDenied(f"this needs the {role.group_name} role")
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def role_context(request: HttpRequest) -> dict[str, Any]:
    """Template context processor: what the user may do."""
    role = role_of(getattr(request, "user", None))
    return {"role": role.group_name, "can_operate": role >= Role.OPERATOR, "is_admin": role >= Role.ADMIN}
