"""Writing the token file: a new token, a rotation, a revocation, a new webhook secret.

Reading it (and checking tokens) is relay/auth.py's; this module only changes the file, as
``relay tokens`` does, line by line so that an operator's comments and order stay. A new
file is made mode 0600; a rewrite keeps the file's mode and group (an operator's ``0640``
with the relay's group stays so) and lands in one rename, so a relay never reads half of it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import secrets
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from relay.errors import ConfigError, NotFound

TOKEN_PREFIX = "rly_"  # noqa: S105 - a prefix, not a secret
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
STANDARD_SECRET_PREFIX = "whsec_"  # noqa: S105 - a prefix, not a secret
KEEP: Literal["keep"] = "keep"
"""``rotate_token(expires_at=KEEP)``: the token keeps the expiry it has."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def utc_text(moment: float) -> str:
    """``2026-06-01T13:00:00Z``: how the token file (a TOML date-time) and messages write a
    moment."""
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_webhook_secret() -> str:
    """A webhook secret in the Standard Webhooks form, ``whsec_`` + the base64 of 32 random
    bytes: ``Webhook(secret)`` of any Standard Webhooks library verifies deliveries as is."""
    return STANDARD_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _new_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


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
    expires_at: float | None = None,
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
    token = _new_value()
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
    if expires_at is not None:
        lines.append(f"expires = {utc_text(math.ceil(expires_at))}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        if not existing and path.stat().st_size == 0:
            handle.write(
                "# relay tokens: SHA-256 hashes, scopes and limits; webhook_secret values are\n"
                "# in clear, so keep this file the relay's user's only (0600, or 0640 and a\n"
                "# group it is in). See `relay tokens --help`.\n"
            )
        handle.write("\n".join(lines) + "\n")
    return token


def _names(path: Path) -> list[str]:
    try:
        tokens = tomllib.loads(path.read_text("utf-8")).get("tokens", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    return sorted(tokens) if isinstance(tokens, dict) else []


def _token_block(lines: list[str], name: str, path: Path) -> tuple[int, int]:
    """Where ``[tokens.NAME]`` starts and ends (the next table header) in the file's lines."""
    header = re.compile(rf"^\s*\[\s*tokens\s*\.\s*(\"{re.escape(name)}\"|{re.escape(name)})\s*\]")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        raise NotFound(
            f"{path}: no token named {name!r}; the tokens are: {', '.join(_names(path)) or 'none'}"
        )
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines)
    )
    return start, end


def _rewrite(path: Path, lines: list[str]) -> None:
    """Replace the file in one rename, with the mode and group it had (0600 for a new one)."""
    try:
        before = path.stat()
        mode, group = before.st_mode & 0o777, before.st_gid
    except FileNotFoundError:
        mode, group = 0o600, None
    spare = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        if group is not None and group != os.getegid():
            try:
                os.fchown(handle.fileno(), -1, group)
            except PermissionError:  # not in that group: the file stays the user's own
                mode &= 0o700
        os.fchmod(handle.fileno(), mode)
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


def _key_lines(lines: list[str], start: int, end: int, *keys: str) -> list[int]:
    """Indexes of the lines in ``[start, end)`` that set one of ``keys``."""
    pattern = re.compile(rf"^\s*({'|'.join(map(re.escape, keys))})\s*=")
    return [i for i in range(start, end) if pattern.match(lines[i])]


def revoke_token(path: Path, name: str) -> None:
    """Remove the named token from the file; a running relay stops accepting it at once."""
    lines = _lines(path)
    start, end = _token_block(lines, name, path)
    _rewrite(path, lines[:start] + lines[end:])


def rotate_token(
    path: Path,
    name: str,
    *,
    overlap_s: float | None = None,
    expires_at: float | Literal["keep"] | None = KEEP,
    now: float | None = None,
) -> str:
    """Give the named token a new value (same name, scopes and limits); returns it once.

    With ``overlap_s`` the old value stays valid that long (``previous_sha256`` and
    ``previous_until``); a value kept by an earlier rotation stops at once. ``expires_at``:
    a new expiry, None for none, or :data:`KEEP` (refused if the token has expired)."""
    moment = datetime.now(UTC).timestamp() if now is None else now
    lines = _lines(path)
    start, end = _token_block(lines, name, path)
    found = _key_lines(lines, start, end, "sha256")
    if not found:
        raise ConfigError(f"{path}: token {name!r} has no sha256 line; fix the file first")
    table = tomllib.loads("".join(lines[start:end])).get("tokens", {}).get(name, {})
    expiry = table.get("expires")
    if expires_at == KEEP and isinstance(expiry, datetime) and expiry.timestamp() <= moment:
        raise ConfigError(
            f"token {name!r} expired at {utc_text(expiry.timestamp())}; rotate it with "
            "--expires 30d (or --expires never)"
        )
    old = str(table.get("sha256", ""))
    token = _new_value()
    added = [f"sha256 = {_toml_value(hash_token(token))}\n"]
    if overlap_s is not None and overlap_s > 0 and old:
        added.append(f"previous_sha256 = {_toml_value(old)}\n")
        # Whole seconds, rounded up: at least the overlap asked for.
        added.append(f"previous_until = {utc_text(math.ceil(moment + overlap_s))}\n")
    replaced = ["sha256", "previous_sha256", "previous_until"]
    if expires_at != KEEP:
        replaced.append("expires")
        if expires_at is not None:
            added.append(f"expires = {utc_text(math.ceil(expires_at))}\n")
    gone = set(_key_lines(lines, start, end, *replaced))
    block = [line for i, line in enumerate(lines[start:end], start) if i not in gone]
    at = found[0] - start - sum(1 for i in gone if i < found[0])
    _rewrite(path, lines[:start] + block[:at] + added + block[at:] + lines[end:])
    return token


def set_webhook_secret(path: Path, name: str, secret: str) -> None:
    """Give the named token this webhook secret, replacing the one it had."""
    lines = _lines(path)
    start, end = _token_block(lines, name, path)
    found = _key_lines(lines, start, end, "webhook_secret")
    line = f"webhook_secret = {_toml_value(secret)}\n"
    if found:
        lines[found[0]] = line
    else:
        body_end = end
        while body_end > start + 1 and not lines[body_end - 1].strip():
            body_end -= 1  # before the blank lines that part it from the next table
        if not lines[body_end - 1].endswith("\n"):
            lines[body_end - 1] += "\n"
        lines.insert(body_end, line)
    _rewrite(path, lines)
