"""Roles are Django groups, ordered: each role can do what the ones below it can.

viewer   reads everything
operator changes fleets, profiles, routing, rollouts and alerts
admin    also manages API tokens, enrollment tokens, users and overrides
"""

from __future__ import annotations

from enum import IntEnum

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser


class Role(IntEnum):
    NONE = 0
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def group_name(self) -> str:
        return self.name.lower()


ROLE_GROUPS = [Role.VIEWER, Role.OPERATOR, Role.ADMIN]


def role_of(user: AbstractBaseUser | AnonymousUser | None) -> Role:
    """The highest role the user holds; superusers are admins."""
    if user is None or not user.is_authenticated:
        return Role.NONE
    if getattr(user, "is_superuser", False):
        return Role.ADMIN
    names = set(user.groups.values_list("name", flat=True))  # type: ignore[union-attr]
    for role in sorted(ROLE_GROUPS, reverse=True):
        if role.group_name in names:
            return role
    return Role.NONE
