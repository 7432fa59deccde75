"""What the apps' models share about who may act: ``IssuedSecret``, the rows
that stand for a secret shown once (enrollment tokens, gateway client keys).
This app keeps no tables of its own (roles are Django groups)."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from controlplane import audit
from controlplane.accounts.secrets import new_secret

S = TypeVar("S", bound="IssuedSecret")


class IssuedSecret(audit.Audited):
    """A model row that stands for a secret shown once (``EnrollmentToken``,
    ``ClientKey``): it has ``name`` and ``created_by``, and names the fields
    that hold the hash and the shown prefix."""

    SECRET_PREFIX: ClassVar[str]
    HASH_FIELD: ClassVar[str]
    SHOWN_PREFIX_FIELD: ClassVar[str]

    @classmethod
    def issue(
        cls: type[S], name: str, *, actor: audit.Actor = None, created_by: Any = None, **fields: Any
    ) -> tuple[S, str]:
        """Create one, with its audit row (``actor`` None: the system); the
        plaintext is returned once and never stored."""
        secret = new_secret(cls.SECRET_PREFIX)
        user = created_by if created_by is not None and created_by.is_authenticated else None
        row = cls.create_audited(
            actor,
            name=name,
            created_by=user,
            **{cls.HASH_FIELD: secret.hash, cls.SHOWN_PREFIX_FIELD: secret.shown_prefix},
            **fields,
        )
        row.issued()
        return row, secret.plaintext

    def issued(self) -> None:
        """After the row is written (in its transaction): what else must hear of it."""
