"""``relay tokens``: new, list, rotate, secret, revoke (the token file, RELAY_TOKENS_FILE).

``list`` reads each value's last use from the store, where the relays write it once a
minute and at shutdown (relay/store/token_uses.py), and today's runs and spend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from relay.auth import Principal, TokenStore
from relay.cli.configuration import load_settings, open_store
from relay.cli.output import columns, moment
from relay.errors import ConfigError, NotFound
from relay.runs.catalog import Catalog
from relay.settings import Settings
from relay.token_file import (
    KEEP,
    new_token,
    new_webhook_secret,
    revoke_token,
    rotate_token,
    set_webhook_secret,
)

LIMIT_KEYS = (
    "max_timeout_s",
    "max_concurrent",
    "runs_per_day",
    "usd_per_day",
    "max_artifact_bytes",
)


def cmd_tokens(args: argparse.Namespace) -> int:
    settings = load_settings()
    try:
        return _tokens(args, settings)
    except OSError as exc:  # its folder missing or not writable, or a folder in its place
        raise ConfigError(
            f"RELAY_TOKENS_FILE: cannot write {settings.tokens_file} ({exc.strerror}); it must "
            "name a file in a folder this user can write"
        ) from None


def _tokens(args: argparse.Namespace, settings: Settings) -> int:
    path = settings.tokens_file
    if args.action == "new":
        return _new(args, settings)
    if args.action == "revoke":
        revoke_token(path, args.name)
        print(f"revoked {args.name}: a running relay refuses it from its next request")
        return 0
    if args.action == "rotate":
        expires = KEEP if args.expires is False else _expiry(args.expires)
        print(rotate_token(path, args.name, overlap_s=args.overlap, expires_at=expires))
        old = f"the old value of {args.name}"
        if args.overlap:
            until = moment(time.time() + args.overlap)
            print(f"(shown once; {old} works until {until})", file=sys.stderr)
        else:
            print(f"(shown once; {old} no longer works)", file=sys.stderr)
        return 0
    if args.action == "secret":
        return _secret(args, settings)
    return _list(args, settings)


def _expiry(lifetime: float | None) -> float | None:
    return None if lifetime is None else time.time() + lifetime


def _new(args: argparse.Namespace, settings: Settings) -> int:
    _check_scopes(args, settings)
    limits = {key: getattr(args, key) for key in LIMIT_KEYS}
    token = new_token(
        settings.tokens_file,
        args.name,
        jobs=args.job or None,
        command=args.command,
        providers=args.provider or None,
        limits=limits,
        webhook_secret=new_webhook_secret() if args.webhook_secret else None,
        admin=args.admin,
        expires_at=_expiry(args.expires or None),
    )
    print(token)
    print(f"(shown once; its hash is in {settings.tokens_file})", file=sys.stderr)
    if args.webhook_secret:
        print(f"(its webhook_secret is in {settings.tokens_file})", file=sys.stderr)
        _warn_if_exposed(settings)
    return 0


def _check_scopes(args: argparse.Namespace, settings: Settings) -> None:
    """A job or provider named that does not exist is refused, naming those that do: a
    typo would otherwise make a token that can run nothing, silently."""
    if args.job and "*" not in args.job:
        known = sorted(Catalog.load(settings.jobs_dir).jobs)
        unknown = [job for job in args.job if job not in known]
        if unknown:
            raise ConfigError(
                f"--job {unknown[0]}: no such job in {settings.jobs_dir}; the jobs are: "
                f"{', '.join(known) or 'none'} (or * for every job)"
            )
    if args.provider and "*" not in args.provider:
        from relay.providers.registry import PROVIDERS

        known = [name for name in PROVIDERS if name != "memory"]
        unknown = [name for name in args.provider if name not in PROVIDERS]
        if unknown:
            raise ConfigError(
                f"--provider {unknown[0]}: no such provider; the providers are: "
                f"{', '.join(known)} (or * for every enabled one)"
            )


def _warn_if_exposed(settings: Settings) -> None:
    exposed = TokenStore(settings.tokens_file).exposed_secrets()
    if exposed is not None:
        print(f"warning: {exposed}", file=sys.stderr)


def _secret(args: argparse.Namespace, settings: Settings) -> int:
    if args.new:
        set_webhook_secret(settings.tokens_file, args.name, new_webhook_secret())
        _warn_if_exposed(settings)
    principals = TokenStore(settings.tokens_file).principals
    principal = next((p for p in principals if p.name == args.name), None)
    if principal is None:
        names = ", ".join(p.name for p in principals)
        raise NotFound(f"no token named {args.name!r}; the tokens are: {names}")
    if principal.webhook_secret is None:
        raise ConfigError(
            f"token {args.name!r} has no webhook secret of its own: its callbacks are "
            "signed with RELAY_WEBHOOK_SECRET; to give it one, "
            f"`relay tokens secret {args.name} --new`"
        )
    print(principal.webhook_secret)
    return 0


def _list(args: argparse.Namespace, settings: Settings) -> int:
    tokens = TokenStore(settings.tokens_file)
    values = tokens.values()
    usage, uses = asyncio.run(_usage_today(settings, [p.name for p in tokens.principals]))
    listed = []
    for principal in tokens.principals:
        current, previous = values[principal.name]
        runs, usd = usage.get(principal.name, (0, 0.0))
        last_previous = uses.get(previous) if previous is not None else None
        listed.append(_entry(principal, runs, usd, uses.get(current), last_previous))
    if args.json:
        print(json.dumps(listed, indent=2))
        return 0
    header = ("NAME", "MAY RUN", "PROVIDERS", "LIMITS", "EXPIRES", "LAST USED", "TODAY")
    print(columns(header, [_row(entry) for entry in listed]))
    for entry in listed:
        if entry["previous_until"] is not None:
            print(
                f"{entry['name']}: its previous value is valid until "
                f"{moment(entry['previous_until'])}, last used "
                f"{moment(entry['previous_last_used_at'], none='never')}"
            )
    return 0


def _entry(
    principal: Principal, runs: int, usd: float, last: float | None, previous_last: float | None
) -> dict[str, Any]:
    return {
        "name": principal.name,
        "jobs": sorted(principal.jobs),
        "command": principal.command,
        "admin": principal.admin,
        "providers": sorted(principal.providers),
        "limits": {key: getattr(principal, key) for key in LIMIT_KEYS},
        "webhook_secret": principal.webhook_secret is not None,
        "expires_at": principal.expires_at,
        "last_used_at": last,
        "previous_until": principal.previous_until,
        "previous_last_used_at": previous_last,
        "today": {"runs": runs, "usd": usd},
    }


def _row(entry: dict[str, Any]) -> list[str]:
    scopes = "jobs=" + ",".join(entry["jobs"])
    scopes += " command" if entry["command"] else ""
    scopes += " admin" if entry["admin"] else ""
    limits = " ".join(f"{key}={value:g}" for key, value in entry["limits"].items() if value)
    expires = entry["expires_at"]
    ended = expires is not None and expires <= time.time()
    return [
        entry["name"],
        scopes,
        ",".join(entry["providers"]),
        limits or "none",
        ("EXPIRED " if ended else "") + (moment(expires) if expires else "never"),
        moment(entry["last_used_at"], none="never"),
        f"{entry['today']['runs']} runs, ${entry['today']['usd']:.4f}",
    ]


async def _usage_today(
    settings: Settings, names: list[str]
) -> tuple[dict[str, tuple[int, float]], dict[str, float]]:
    """Each token's runs and spend today (UTC), and each value's last use."""
    from relay.store import token_uses
    from relay.store.limits import day_start

    store = await open_store(settings.database_url)
    try:
        since = day_start(time.time())
        found = {}
        for name in names:
            usage = await store.usage(name, since)
            found[name] = (usage.runs, usage.usd)
        return found, await store.read(token_uses.read)
    finally:
        await store.close()
