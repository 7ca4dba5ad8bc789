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
```
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.errors import ConfigError, Unauthorized

TOKEN_PREFIX = "rly_"  # noqa: S105 - a prefix, not a secret
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_LIMIT_KEYS = ("max_timeout_s", "max_concurrent", "runs_per_day", "usd_per_day")


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
    webhook_secret: str | None = field(default=None, repr=False)

    def may_run_job(self, job: str) -> bool:
        return "*" in self.jobs or job in self.jobs

    def may_use_provider(self, provider: str) -> bool:
        return "*" in self.providers or provider in self.providers


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


def _string_set(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{where}: must be a list of strings")
    return frozenset(value)


def _parse_entry(name: str, table: Any, path: Path) -> _Entry:
    where = f"{path}: tokens.{name}"
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"{where}: token names are lower-case letters, digits, '.', '_', '-'")
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    digest = table.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ConfigError(f"{where}.sha256: must be 64 lower-case hex digits")
    limits: dict[str, Any] = {}
    for key in _LIMIT_KEYS:
        value = table.get(key)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise ConfigError(f"{where}.{key}: must be a positive number")
        limits[key] = value
    secret = table.get("webhook_secret")
    principal = Principal(
        name=name,
        jobs=_string_set(table.get("jobs", ["*"]), f"{where}.jobs"),
        command=bool(table.get("command", False)),
        providers=_string_set(table.get("providers", ["*"]), f"{where}.providers"),
        webhook_secret=secret if isinstance(secret, str) else None,
        **limits,
    )
    return _Entry(bytes.fromhex(digest), principal)


class TokenStore:
    """The token file, re-read when it changes so new tokens work without a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: list[_Entry] = []
        self._mtime: float | None = None
        self.load()

    def load(self) -> None:
        try:
            stat = self.path.stat()
            data = tomllib.loads(self.path.read_text("utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(
                f"{self.path}: no token file; create a token with `relay tokens new NAME`"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{self.path}: not valid TOML ({exc})") from exc
        tokens = data.get("tokens", {})
        if not isinstance(tokens, dict):
            raise ConfigError(f"{self.path}: [tokens] must be a table")
        entries = [_parse_entry(name, table, self.path) for name, table in tokens.items()]
        if not entries:
            raise ConfigError(f"{self.path}: no token configured; the relay never runs open")
        self._entries = entries
        self._mtime = stat.st_mtime

    def _refresh(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return  # keep the tokens we had rather than fail open or closed mid-flight
        if mtime != self._mtime:
            try:
                self.load()
            except ConfigError:
                self._mtime = mtime  # a half-written file: keep the last good tokens

    def authenticate(self, token: str | None) -> Principal:
        """The principal for ``token``; compares every hash so timing reveals nothing."""
        if not token:
            raise Unauthorized("missing token")
        self._refresh()
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: Principal | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        if found is None:
            raise Unauthorized("unknown token")
        return found

    def webhook_secret(self, name: str) -> str | None:
        """The named token's own webhook secret (re-reading a changed file), if any."""
        self._refresh()
        for entry in self._entries:
            if entry.principal.name == name:
                return entry.principal.webhook_secret
        return None

    @property
    def principals(self) -> list[Principal]:
        return [entry.principal for entry in self._entries]


def _toml_value(value: Any) -> str:
    # json.dumps writes strings, numbers, booleans and lists of strings as valid TOML.
    return json.dumps(value)


def new_token(
    path: Path,
    name: str,
    *,
    jobs: list[str] | None = None,
    command: bool = False,
    providers: list[str] | None = None,
    limits: dict[str, float | int | None] | None = None,
    webhook_secret: str | None = None,
) -> str:
    """Append a new token to the file (mode 0600) and return it; it is shown only once."""
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"token name {name!r}: use lower-case letters, digits, '.', '_', '-'")
    existing: dict[str, Any] = {}
    if path.exists():
        existing = tomllib.loads(path.read_text("utf-8")).get("tokens", {})
    if name in existing:
        raise ConfigError(f"{path}: a token named {name!r} exists already")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    lines = [
        f"\n[tokens.{name}]",
        f"sha256 = {_toml_value(hash_token(token))}",
        f"jobs = {_toml_value(jobs or ['*'])}",
        f"command = {_toml_value(command)}",
        f"providers = {_toml_value(providers or ['*'])}",
    ]
    for key, value in (limits or {}).items():
        if value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    if webhook_secret is not None:
        lines.append(f"webhook_secret = {_toml_value(webhook_secret)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        if not existing and path.stat().st_size == 0:
            handle.write("# relay tokens: SHA-256 hashes only; see `relay tokens new --help`\n")
        handle.write("\n".join(lines) + "\n")
    return token
