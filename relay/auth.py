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
admin = false                  # may read every token's runs and cancel any (the console)
```
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.errors import ConfigError, Unauthorized

TOKEN_PREFIX = "rly_"  # noqa: S105 - a prefix, not a secret
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_LIMIT_KEYS = ("max_timeout_s", "max_concurrent", "runs_per_day", "usd_per_day")
TOKEN_KEYS = ("sha256", "jobs", "command", "providers", *_LIMIT_KEYS, "webhook_secret", "admin")
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
    webhook_secret: str | None = field(default=None, repr=False)
    admin: bool = False
    """Reads every token's runs and may cancel any; runs and limits stay its own."""

    def may_read_run(self, token: str) -> bool:
        """Whether this principal may read (and cancel) a run of ``token``."""
        return self.admin or token == self.name

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


def _suggestion(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _parse_entry(name: str, table: Any, path: Path) -> _Entry:
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
    digest = table.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ConfigError(f"{where}.sha256: must be 64 lower-case hex digits")
    limits: dict[str, Any] = {}
    for key in _LIMIT_KEYS:
        value = table.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and (not number or value <= 0):
            raise ConfigError(f"{where}.{key}: must be a positive number")
        limits[key] = value
    principal = Principal(
        name=name,
        jobs=_string_set(table.get("jobs", ["*"]), f"{where}.jobs"),
        command=table.get("command", False),
        providers=_string_set(table.get("providers", ["*"]), f"{where}.providers"),
        webhook_secret=secret,
        admin=table.get("admin", False),
        **limits,
    )
    return _Entry(bytes.fromhex(digest), principal)


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
            stat = self.path.stat()
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
        entries = [_parse_entry(name, table, self.path) for name, table in tokens.items()]
        if not entries:
            raise ConfigError(f"{self.path}: no token configured; the relay never runs open")
        self._entries = entries
        self._seen = _signature(stat)
        self.problem = None

    def refresh(self) -> None:
        """Re-read the file if it changed since the last look."""
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
        found: Principal | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        if found is None:
            raise Unauthorized("unknown token")
        return found

    def webhook_secret(self, name: str) -> str | None:
        """The named token's own webhook secret (re-reading a changed file), if any."""
        self.refresh()
        for entry in self._entries:
            if entry.principal.name == name:
                return entry.principal.webhook_secret
        return None

    @property
    def principals(self) -> list[Principal]:
        return [entry.principal for entry in self._entries]

    def holds_value(self, digest: str) -> bool:
        """Whether a token with this value's SHA-256 (hex, as :func:`hash_token`) is in use."""
        wanted = bytes.fromhex(digest)
        return any(hmac.compare_digest(wanted, entry.digest) for entry in self._entries)


def _signature(stat: os.stat_result) -> tuple[int, int, int]:
    # Size and inode as well as mtime: a rewrite within one mtime tick, or a file
    # renamed into place, is still a change.
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


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
    admin: bool = False,
) -> str:
    """Append a new token to the file (mode 0600) and return it; it is shown only once."""
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"token name {name!r}: use lower-case letters, digits, '.', '_', '-'")
    existing: dict[str, Any] = {}
    if path.exists():
        try:
            existing = tomllib.loads(path.read_text("utf-8")).get("tokens", {})
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc}); fix it first") from exc
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
    if admin:
        lines.append("admin = true")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        if not existing and path.stat().st_size == 0:
            handle.write("# relay tokens: SHA-256 hashes only; see `relay tokens new --help`\n")
        handle.write("\n".join(lines) + "\n")
    return token


def _token_block(lines: list[str], name: str, path: Path) -> tuple[int, int]:
    """Where ``[tokens.NAME]`` starts and ends (the next table header) in the file's lines."""
    header = re.compile(rf"^\s*\[\s*tokens\s*\.\s*(\"{re.escape(name)}\"|{re.escape(name)})\s*\]")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        names = [p.name for p in TokenStore(path).principals] if path.exists() else []
        raise ConfigError(
            f"{path}: no token named {name!r}; the tokens are: {', '.join(names) or 'none'}"
        )
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines)
    )
    return start, end


def _rewrite(path: Path, lines: list[str]) -> None:
    """Replace the file in one rename (mode 0600), so a relay never reads half of it."""
    spare = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("".join(lines))
    os.replace(spare, path)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text("utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no token file; create a token with `relay tokens new NAME`"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({type(exc).__name__})") from None


def revoke_token(path: Path, name: str) -> None:
    """Remove the named token from the file; a running relay stops accepting it at once."""
    lines = _lines(path)
    start, end = _token_block(lines, name, path)
    _rewrite(path, lines[:start] + lines[end:])


def rotate_token(path: Path, name: str) -> str:
    """Give the named token a new value (same name, scopes and limits); returns it once."""
    lines = _lines(path)
    start, end = _token_block(lines, name, path)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    digest = re.compile(r"^\s*sha256\s*=")
    found = [i for i in range(start, end) if digest.match(lines[i])]
    if not found:
        raise ConfigError(f"{path}: token {name!r} has no sha256 line; fix the file first")
    lines[found[0]] = f"sha256 = {_toml_value(hash_token(token))}\n"
    _rewrite(path, lines)
    return token
