"""The API's one permission class: reads need viewer, writes need a role that
the view names (``write_role``, operator unless said otherwise)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from controlplane.accounts.roles import Role, role_of


class RolePermission(BasePermission):
    message = "Your role does not allow this."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False  # DRF turns this into 401 with TokenAuthentication first
        needed = getattr(view, "read_role", Role.VIEWER)
        if request.method not in SAFE_METHODS:
            needed = getattr(view, "write_role", Role.OPERATOR)
        # A view may ask more for single actions: {"rotate": Role.ADMIN}.
        action = getattr(view, "action", None)
        needed = getattr(view, "action_roles", {}).get(action, needed)
        return role_of(request.user) >= needed
