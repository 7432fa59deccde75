"""Secrets that workers and clients present: enrollment tokens, worker
secrets, gateway client keys.

Each is a long random string shown once and stored as its SHA-256: a plain
hash is enough for 256 random bits, a leaked database lets no one pose as a
worker or a client, and the gateway compares hashes without ever holding the
keys. A short prefix of the plaintext is kept to tell secrets apart. Pure:
the gateway's request path hashes with it. ``models.IssuedSecret`` is the
rows that stand for such secrets.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

NUM_SHOWN_CHARS = 4  # of the random part, after the kind's prefix


def hash_secret(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


@dataclass(frozen=True)
class NewSecret:
    plaintext: str
    hash: str
    shown_prefix: str  # the kind's prefix and a few characters: "cpk_Ab3x"


def new_secret(kind_prefix: str) -> NewSecret:
    plaintext = kind_prefix + secrets.token_urlsafe(32)
    return NewSecret(plaintext, hash_secret(plaintext), plaintext[: len(kind_prefix) + NUM_SHOWN_CHARS])
