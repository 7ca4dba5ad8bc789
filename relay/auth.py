"""Tokens: the file of hashed tokens, the constant-time check, and the Principal.

The token file (``RELAY_TOKENS_FILE``, TOML) holds one table per token name with the
token's SHA-256 and its scopes and limits; the clear token is printed once by
``relay tokens new`` and stored nowhere. A relay with no token refuses to start.

```toml
[tokens.nightly]
sha256 = "9f86d0…"
jobs = ["echo", "python"]      # "*" for every job
command = false                # may send a raw argv
providers = ["*"]
max_timeout_s = 300
max_artifact_bytes = 268435456 # its runs' artifacts together (RELAY_ARTIFACTS_MAX_TOKEN_BYTES)
admin = false                  # may read every token's runs and cancel any (the console)
expires = 2026-07-01T00:00:00Z # refused from then on (401 token_expired); none: never
previous_sha256 = "…"          # the value before `relay tokens rotate --overlap`,
previous_until = 2026-06-01T13:00:00Z   # valid until then
```

Each authenticated value's last use is noted in memory (:meth:`TokenStore.take_uses`), for a
writer to store now and then (relay/store/token_uses.py): a request never waits on a write.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import logging
import math
import os
import re
import stat
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from relay.errors import ConfigError, TokenExpired, Unauthorized
from relay.token_file import NAME_PATTERN, utc_text
from relay.token_file import hash_token as hash_token
from relay.token_file import new_token as new_token
from relay.token_file import revoke_token as revoke_token
from relay.token_file import rotate_token as rotate_token

_LIMIT_KEYS = (
    "max_timeout_s",
    "max_concurrent",
    "runs_per_day",
    "usd_per_day",
    "max_artifact_bytes",
)
_COUNT_KEYS = ("max_concurrent", "runs_per_day", "max_artifact_bytes")
"""Limits that count things: a whole number (``2.0`` is read as 2)."""
_ROTATION_KEYS = ("expires", "previous_sha256", "previous_until")
TOKEN_KEYS = (
    "sha256",
    "jobs",
    "command",
    "providers",
    *_LIMIT_KEYS,
    "webhook_secret",
    "admin",
    *_ROTATION_KEYS,
)
"""Every key a token's table may have; any other is refused with the file and key named."""

log = logging.getLogger("relay.auth")


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name, what it may run, and its limits."""

    name: str
    jobs: frozenset[str] = frozenset({"*"})
    command: bool = False
    providers: frozenset[str] = frozenset({"*"})
    max_timeout_s: float | None = None
    max_concurrent: int | None = None
    runs_per_day: int | None = None
    usd_per_day: float | None = None
    max_artifact_bytes: int | None = None
    """What all its runs' artifacts may keep together (RELAY_ARTIFACTS_MAX_TOKEN_BYTES for
    this token alone); None: that setting."""
    webhook_secret: str | None = field(default=None, repr=False)
    admin: bool = False
    """Reads every token's runs and may cancel any; runs and limits stay its own."""
    expires_at: float | None = None
    """Unix time from which the token is refused (``token_expired``); None: never."""
    previous_until: float | None = None
    """Until when the value before the last rotation stays valid, if it was kept."""

    def may_read_run(self, token: str) -> bool:
        """Whether this principal may read (and cancel) a run of ``token``."""
        return self.admin or token == self.name

    def may_run_job(self, job: str) -> bool:
        return "*" in self.jobs or job in self.jobs

    def may_use_provider(self, provider: str) -> bool:
        return "*" in self.providers or provider in self.providers


@dataclass(frozen=True)
class _Entry:
    """One value that authenticates as ``principal``, until ``until`` (None: for ever)."""

    digest: bytes
    principal: Principal
    until: float | None = None
    previous: bool = False
    """The value the last ``relay tokens rotate --overlap`` replaced."""

    def valid(self, now: float) -> bool:
        return self.until is None or now < self.until

    def refusal(self) -> TokenExpired:
        moment = utc_text(self.until or 0)
        if self.previous:
            return TokenExpired(
                f"this token value was replaced and its overlap ended at {moment}: "
                "use the token's new value"
            )
        return TokenExpired(f"the token expired at {moment}; ask its owner for a new one")


def _moment(value: Any, where: str) -> float | None:
    """A TOML date-time with its zone (``2026-06-01T13:00:00Z``) as unix time."""
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ConfigError(f"{where}: must be a date-time with its zone, like 2026-06-01T13:00:00Z")
    return value.timestamp()


def _digest(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ConfigError(f"{where}: must be 64 lower-case hex digits")
    return bytes.fromhex(value)


def _string_set(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where}: must be a list of strings")
    return frozenset(value)


def _suggestion(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_entries(name: str, table: Any, path: Path) -> list[_Entry]:
    where = f"{path}: tokens.{name}"
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"{where}: token names are lower-case letters, digits, '.', '_', '-'")
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    for key in table:
        if key not in TOKEN_KEYS:
            # A typo must not quietly widen a token (`job =` would leave it every job).
            raise ConfigError(f"{where}.{key}: unknown key{_suggestion(key, TOKEN_KEYS)}")
    for flag in ("command", "admin"):
        if not isinstance(table.get(flag, False), bool):
            raise ConfigError(f"{where}.{flag}: must be true or false")
    secret = table.get("webhook_secret")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise ConfigError(f"{where}.webhook_secret: must be a non-empty string")
    digest = _digest(table.get("sha256"), f"{where}.sha256")
    expires = _moment(table.get("expires"), f"{where}.expires")
    previous = table.get("previous_sha256")
    until = _moment(table.get("previous_until"), f"{where}.previous_until")
    if (previous is None) != (until is None):
        raise ConfigError(f"{where}: previous_sha256 and previous_until go together")
    limits: dict[str, Any] = {}
    for key in _LIMIT_KEYS:
        value = table.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        # TOML's nan and inf are floats: nan passes every comparison's test (never reached)
        if value is not None and (not number or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"{where}.{key}: must be a positive number")
        if key in _COUNT_KEYS and value is not None:
            if value != int(value):  # 0.5 bytes would be a cap of 0, 1.5 runs no count
                raise ConfigError(f"{where}.{key}: must be a positive whole number")
            value = int(value)
        limits[key] = value
    principal = Principal(
        name=name,
        jobs=_string_set(table.get("jobs", ["*"]), f"{where}.jobs"),
        command=table.get("command", False),
        providers=_string_set(table.get("providers", ["*"]), f"{where}.providers"),
        webhook_secret=secret,
        admin=table.get("admin", False),
        expires_at=expires,
        previous_until=until,
        **limits,
    )
    entries = [_Entry(digest, principal, expires)]
    if previous is not None and until is not None:
        ends = until if expires is None else min(until, expires)
        entries.append(_Entry(_digest(previous, f"{where}.previous_sha256"), principal, ends, True))
    return entries


class TokenStore:
    """The token file, re-read when it changes so new tokens work without a restart.

    It never fails open: at startup a missing or invalid file stops the relay. Later, a
    change that does not load is logged and turns ``/readyz`` failing (:attr:`problem`);
    the last good tokens stay only while the file exists. A deleted file revokes them all.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: list[_Entry] = []
        self._seen: tuple[int, int, int] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._uses: dict[bytes, tuple[str, float]] = {}
        self.next_expiry: float | None = None
        """The next moment a value in use stops being valid (None: none will)."""
        self.problem: str | None = None
        """Why the file on disk is not what the relay uses (None while they agree)."""
        self.load()

    def on_reload(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after each reload of a changed file (and when the file is gone):
        what holds on to a token's value (an ``/mcp`` session) lets go of revoked ones."""
        self._listeners.append(listener)

    def _reloaded(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # one listener's fault must not fail the request that reloaded
                log.exception("a token file reload listener failed")

    def load(self) -> None:
        try:
            found = self.path.stat()
            data = tomllib.loads(self.path.read_text("utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(
                f"{self.path}: no token file (RELAY_TOKENS_FILE); create a token with "
                "`relay tokens new NAME`"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{self.path}: cannot be read ({type(exc).__name__}); RELAY_TOKENS_FILE must "
                "name a file this user can read (mode 0600, owned by the relay's user)"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{self.path}: not valid TOML ({exc})") from exc
        extra = sorted(set(data) - {"tokens"})
        if extra:
            raise ConfigError(
                f"{self.path}: {extra[0]}: unknown key{_suggestion(extra[0], ('tokens',))}"
            )
        tokens = data.get("tokens", {})
        if not isinstance(tokens, dict):
            raise ConfigError(f"{self.path}: [tokens] must be a table")
        entries = [
            entry
            for name, table in tokens.items()
            for entry in _parse_entries(name, table, self.path)
        ]
        if not entries:
            raise ConfigError(f"{self.path}: no token configured; the relay never runs open")
        self._entries = entries
        self._seen = _signature(found)
        self.problem = None
        self._plan_expiry(time.time())

    def _plan_expiry(self, now: float) -> None:
        ahead = [entry.until for entry in self._entries if entry.until and entry.until > now]
        self.next_expiry = min(ahead, default=None)

    def refresh(self) -> None:
        """Re-read the file if it changed since the last look; tell the listeners when a
        value stopped being valid since (a rotated token's old value, an expired token)."""
        if self.next_expiry is not None and time.time() >= self.next_expiry:
            self._plan_expiry(time.time())
            self._reloaded()
        try:
            seen = _signature(self.path.stat())
        except FileNotFoundError:
            revoked = bool(self._entries)
            if revoked or self.problem is None:
                log.error("token file %s is gone: every token is revoked", self.path)
            self._entries = []
            self._seen = None
            self.problem = "the token file is gone: every token is revoked"
            if revoked:
                self._reloaded()
            return
        except OSError:
            seen = None
        if seen is not None and seen == self._seen:
            return
        try:
            self.load()
        except ConfigError as exc:
            self._seen = seen
            self.problem = "the token file does not load; "
            if self._entries:
                self.problem += "the last good tokens are in use"
            else:
                self.problem += "no token is valid"
            log.error("token file reload failed, %s: %s", self.problem, exc.message)
        else:
            log.info("token file reloaded: %d token(s)", len(self._entries))
            self._reloaded()

    def authenticate(self, token: str | None) -> Principal:
        """The principal for ``token``; compares every hash so timing reveals nothing."""
        if not token:
            raise Unauthorized("missing token")
        self.refresh()
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: _Entry | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        if found is None:
            raise Unauthorized.token_refused("unknown token")
        now = time.time()
        if not found.valid(now):
            raise found.refusal()
        self._uses[digest] = (found.principal.name, now)  # memory only: see take_uses
        return found.principal

    def take_uses(self) -> dict[str, tuple[str, float]]:
        """The values used since the last call: SHA-256 (hex) → token name, last use."""
        taken, self._uses = self._uses, {}
        return {digest.hex(): use for digest, use in taken.items()}

    def webhook_secret(self, name: str) -> str | None:
        """The named token's own webhook secret (re-reading a changed file), if any."""
        self.refresh()
        for entry in self._entries:
            if entry.principal.name == name:
                return entry.principal.webhook_secret
        return None

    @property
    def principals(self) -> list[Principal]:
        return [entry.principal for entry in self._entries if not entry.previous]

    def values(self) -> dict[str, tuple[str, str | None]]:
        """Each token's name → its value's SHA-256 (hex), and the value its last rotation
        kept (None: none), as written in the file and whether still valid or not."""
        found: dict[str, tuple[str, str | None]] = {}
        for entry in self._entries:
            current, previous = found.get(entry.principal.name, ("", None))
            if entry.previous:
                previous = entry.digest.hex()
            else:
                current = entry.digest.hex()
            found[entry.principal.name] = (current, previous)
        return found

    def holds_value(self, digest: str) -> bool:
        """Whether a token value with this SHA-256 (hex, as :func:`hash_token`) is valid now:
        in the file, not expired, and not a rotated value past its overlap."""
        wanted, now = bytes.fromhex(digest), time.time()
        return any(
            hmac.compare_digest(wanted, entry.digest) and entry.valid(now)
            for entry in self._entries
        )

    def exposed_secrets(self) -> str | None:
        """Why the token file should not be readable by others, when it is and holds a webhook
        secret (in clear, unlike the tokens' hashes); None when all is well."""
        try:
            mode = stat.S_IMODE(self.path.stat().st_mode)
        except OSError:
            return None
        if not mode & stat.S_IROTH or not any(p.webhook_secret for p in self.principals):
            return None
        return (
            f"{self.path} holds webhook secrets and is readable by every user (mode "
            f"{mode:04o}): chmod 600 {self.path.name}, or chmod 640 with a group the "
            "relay's user is in"
        )


def _signature(info: os.stat_result) -> tuple[int, int, int]:
    # Size and inode as well as mtime: a rewrite within one mtime tick, or a file
    # renamed into place, is still a change.
    return info.st_mtime_ns, info.st_size, info.st_ino
