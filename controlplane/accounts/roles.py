"""Roles are Django groups, ordered: each role can do what the ones below it can.

viewer   reads everything
operator changes fleets, profiles, routing, rollouts and alerts
admin    also manages API tokens, enrollment tokens, users and overrides
"""

from __future__ import annotations

from enum import IntEnum

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, PermissionsMixin


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
    names = set(user.groups.values_list("name", flat=True))  # type: ignore[attr-defined]
    for role in sorted(ROLE_GROUPS, reverse=True):
        if role.group_name in names:
            return role
    return Role.NONE


def grant_role(user: PermissionsMixin, role: Role) -> None:
    """Make ``role`` the user's one role (the groups are made by a migration)."""
    from django.contrib.auth.models import Group

    groups = user.groups
    groups.remove(*Group.objects.filter(name__in=[r.group_name for r in ROLE_GROUPS]))
    if role != Role.NONE:
        groups.add(Group.objects.get_or_create(name=role.group_name)[0])


def parse_role(name: str) -> Role:
    try:
        return Role[name.upper()]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; one of {', '.join(r.group_name for r in ROLE_GROUPS)}") from None
