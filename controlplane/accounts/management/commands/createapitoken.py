"""``python manage.py createapitoken USER [--role R] [--create] [--rotate]``:
print an API token for USER (``Authorization: Token <token>``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rest_framework.authtoken.models import Token

from controlplane import audit
from controlplane.accounts.roles import grant_role, parse_role, role_of


class Command(BaseCommand):
    help = "Print (creating if needed) the API token of a user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", help="also give the user this role: viewer, operator or admin")
        parser.add_argument("--create", action="store_true", help="create the user if missing (no password)")
        parser.add_argument("--rotate", action="store_true", help="replace an existing token")

    def handle(self, *args: Any, **options: Any) -> None:
        role = None
        if options["role"]:
            try:
                role = parse_role(options["role"])
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        User = get_user_model()
        username = options["username"]
        user = User.objects.filter(username=username).first()
        if user is None:
            if not options["create"]:
                raise CommandError(f"no user {username!r}; pass --create to make one")
            user = User.objects.create_user(username=username)
            user.set_unusable_password()
            user.save()
        if role is not None:
            grant_role(user, role)
        if options["rotate"]:
            Token.objects.filter(user=user).delete()
        token, created = Token.objects.get_or_create(user=user)
        if created:
            audit.record("system:createapitoken", "apitoken.create", user, None, {"role": role_of(user).group_name})
        self.stdout.write(token.key)
