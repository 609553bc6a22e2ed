"""API keys: read from files, kept and compared only as SHA-256 hashes.

A keys file (``--api-keys-file``, ``--admin-keys-file``; a mounted Secret in Kubernetes) holds one
key per line, optionally followed by whitespace, a name and the key's limits (`TenantLimits`)::

    # comments and blank lines are skipped
    sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8  team-a
    a-raw-key-of-at-least-16-characters                                     team-b  max_running=8 max_waiting=16 weight=2

A line is either the key itself (at least `MIN_KEY_CHARS` characters; only its hash is kept) or
``sha256:`` and the 64 hex digits of the key's SHA-256 (``printf %s KEY | sha256sum``), so the
file need not hold the secret. The name (letters, digits, ``_.-``; default ``key-`` and the
first 8 hex digits of the hash) is the key's identity in logs and the owner of the request ids it
creates. A presented key is hashed and compared with every stored hash by
:func:`hmac.compare_digest` (time independent of where the hashes differ).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_CHARS = 16
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LIMIT_FIELDS = ("weight", "max_running", "max_waiting")


@dataclass(frozen=True)
class TenantLimits:
    """What one key's requests may hold (the keys file's ``weight=``, ``max_running=``,
    ``max_waiting=`` after the name; prepare's scheduler applies them per device).

    Attributes:
        weight: admissions per turn when several keys' requests wait (2: twice as often as 1).
        max_running: the key's sequences holding a slot at once; ``None`` = no limit.
        max_waiting: its requests waiting for admission, beyond which new ones are refused with
            ``RESOURCE_EXHAUSTED`` (HTTP 429) and a Retry-After; ``None`` = only the queue's bound.
    """

    weight: int = 1
    max_running: int | None = None
    max_waiting: int | None = None


NO_LIMITS = TenantLimits()


@dataclass(frozen=True)
class Principal:
    """Who an accepted key belongs to.

    Attributes:
        name: the key's name (``[A-Za-z0-9_.-]``, never empty).
        admin: the key came from the admin keys file: it may call ``stageserve.v1.Admin`` too.
        limits: what its requests may hold.
    """

    name: str
    admin: bool = False
    limits: TenantLimits = NO_LIMITS


class KeyRing:
    """The accepted keys, by SHA-256 hash.

    Args:
        entries: ``(sha256 digest, principal)`` pairs; a digest given twice keeps the admin one.
    """

    def __init__(self, entries: list[tuple[bytes, Principal]]) -> None:
        self._entries = sorted(entries, key=lambda entry: entry[1].admin)  # admin last: it wins a tie below

    @classmethod
    def from_files(cls, api_keys_file: Path | None, admin_keys_file: Path | None = None) -> "KeyRing":
        """The keys of ``api_keys_file`` (public API) and ``admin_keys_file`` (public API and Admin).

        Raises:
            ValueError: a file cannot be read, or a line is not a key, a hash or a name (the
                message names the flag and the line, never a key).
        """
        entries = []
        for flag, path, admin in (("--api-keys-file", api_keys_file, False), ("--admin-keys-file", admin_keys_file, True)):
            if path is not None:
                entries += _read_keys(flag, path, admin)
        return cls(entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def limits(self) -> dict[str, TenantLimits]:
        """Each key name's limits (a name given twice: its last line's)."""
        return {principal.name: principal.limits for _, principal in self._entries}

    def lookup(self, key: str) -> Principal | None:
        """The principal of ``key``, ``None`` when it is not an accepted key."""
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, principal in self._entries:  # every entry, found or not: no early exit to time
            if hmac.compare_digest(stored, digest):
                found = principal
        return found


def bearer_key(authorization: str) -> str | None:
    """The key of an ``authorization`` value ``Bearer KEY`` (scheme case-insensitive); ``None`` when it is not one."""
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _read_keys(flag: str, path: Path, admin: bool) -> list[tuple[bytes, Principal]]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.__class__.__name__})") from None
    entries = []
    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 + len(_LIMIT_FIELDS):
            raise ValueError(f"{flag} {path} line {number}: expected a key or sha256:HEX, then optionally a name and limits"
                             f" ({', '.join(f'{f}=N' for f in _LIMIT_FIELDS)})")
        hashed = _HASHED.fullmatch(fields[0])
        if hashed is None and len(fields[0]) < MIN_KEY_CHARS:
            raise ValueError(f"{flag} {path} line {number}: a key has at least {MIN_KEY_CHARS} characters"
                             " (or write sha256: and its 64 hex digits)")
        digest = bytes.fromhex(hashed.group(1)) if hashed else hashlib.sha256(fields[0].encode()).digest()
        name = fields[1] if len(fields) >= 2 else f"key-{digest.hex()[:8]}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{flag} {path} line {number}: the name {name!r} may hold only letters, digits and _.- (64 at most)")
        entries.append((digest, Principal(name, admin, _limits(fields[2:], f"{flag} {path} line {number}"))))
    if not entries:
        raise ValueError(f"{flag} {path}: holds no key; give one key per line")
    return entries


def _limits(fields: list[str], where: str) -> TenantLimits:
    """The `TenantLimits` of a line's ``name=N`` fields after the key's name (each a positive integer).

    Raises:
        ValueError: an unknown field or a value that is not a positive integer (``where`` names the line).
    """
    values = {}
    for item in fields:
        field, _, value = item.partition("=")
        if field not in _LIMIT_FIELDS or field in values:
            raise ValueError(f"{where}: {item!r} is not a limit; write {', '.join(f'{f}=N' for f in _LIMIT_FIELDS)} after the name, once each")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{where}: {field} must be a positive integer, got {value!r}")
        values[field] = int(value)
    return TenantLimits(**values)
