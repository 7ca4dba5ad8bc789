"""``relay tokens``: new, list, revoke, rotate, secret (the token file, RELAY_TOKENS_FILE)."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time

from relay.auth import TokenStore, new_token, revoke_token, rotate_token
from relay.cli.configuration import load_settings, open_store
from relay.errors import ConfigError
from relay.settings import Settings


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
    if args.action == "new":
        limits = {
            "max_timeout_s": args.max_timeout_s,
            "max_concurrent": args.max_concurrent,
            "runs_per_day": args.runs_per_day,
            "usd_per_day": args.usd_per_day,
        }
        token = new_token(
            settings.tokens_file,
            args.name,
            jobs=args.job or None,
            command=args.command,
            providers=args.provider or None,
            limits=limits,
            webhook_secret=secrets.token_hex(32) if args.webhook_secret else None,
            admin=args.admin,
        )
        print(token)
        print(f"(shown once; its hash is in {settings.tokens_file})", file=sys.stderr)
        if args.webhook_secret:
            print(f"(its webhook_secret is in {settings.tokens_file})", file=sys.stderr)
        return 0
    if args.action == "revoke":
        revoke_token(settings.tokens_file, args.name)
        print(f"revoked {args.name}: a running relay refuses it from its next request")
        return 0
    if args.action == "rotate":
        print(rotate_token(settings.tokens_file, args.name))
        print(f"(shown once; the old value of {args.name} no longer works)", file=sys.stderr)
        return 0
    principals = TokenStore(settings.tokens_file).principals
    if args.action == "secret":
        principal = next((p for p in principals if p.name == args.name), None)
        if principal is None:
            names = ", ".join(p.name for p in principals)
            raise ConfigError(f"no token named {args.name!r}; the tokens are: {names}")
        if principal.webhook_secret is None:
            raise ConfigError(
                f"token {args.name!r} has no webhook secret of its own: its callbacks are "
                "signed with RELAY_WEBHOOK_SECRET; for a token with its own, "
                "`relay tokens new NAME --webhook-secret`"
            )
        print(principal.webhook_secret)
        return 0
    usage = asyncio.run(_usage_today(settings, [p.name for p in principals]))
    for principal in principals:
        shown = [
            f"{key}={value:g}"
            for key in ("max_timeout_s", "max_concurrent", "runs_per_day", "usd_per_day")
            if (value := getattr(principal, key)) is not None
        ]
        runs, usd = usage.get(principal.name, (0, 0.0))
        print(
            f"{principal.name}\tjobs={','.join(sorted(principal.jobs))}"
            f"{' command' if principal.command else ''}{' admin' if principal.admin else ''}"
            f"\tproviders={','.join(sorted(principal.providers))}"
            f"\t{' '.join(shown) or 'no limits'}\ttoday: {runs} runs, ${usd:.4f}"
        )
    return 0


async def _usage_today(settings: Settings, names: list[str]) -> dict[str, tuple[int, float]]:
    from relay.store.limits import day_start

    store = await open_store(settings.database_url)
    try:
        since = day_start(time.time())
        found = {}
        for name in names:
            usage = await store.usage(name, since)
            found[name] = (usage.runs, usage.usd)
        return found
    finally:
        await store.close()
