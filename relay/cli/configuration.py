"""What every command reads first: the settings and the store, each failure one line
naming the setting to fix."""

from __future__ import annotations

import difflib
import os
import re
import sqlite3
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError
from pydantic_settings import SettingsError
from sqlalchemy.exc import DBAPIError

from relay import client as relay_client
from relay.errors import ConfigError
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.store.database import Store


CALLER_VARIABLES = {"RELAY_URL", "RELAY_TOKEN"}
"""Read by ``relay run`` (relay/client.py) on the caller's side, not settings."""


def _warn_unknown_variables(enabled: list[str]) -> None:
    """A mistyped ``RELAY_`` name (environment or .env) is never silently ignored.

    An ``enabled`` provider's own variables are checked against its settings model; another
    provider's are let be (checking them would import its SDK for nothing)."""
    from relay.providers.registry import PROVIDERS, provider_variables

    known = {f"RELAY_{name.upper()}" for name in Settings.model_fields} | CALLER_VARIABLES
    found = {name: "environment" for name in os.environ if name.startswith("RELAY_")}
    found.update({n: ".env" for n in relay_client.dotenv() if n.startswith("RELAY_")})
    for provider in PROVIDERS:
        # Its module (and SDK) is imported only when it is enabled and one of them is set.
        prefix = f"RELAY_{provider.upper()}_"
        named = {name for name in found if name.startswith(prefix)}
        if named:
            variables = provider_variables(provider) if provider in enabled else None
            known |= named if variables is None else variables
    for name, where in sorted(found.items()):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            print(f"warning: {name} (in the {where}) is not a relay setting{hint}", file=sys.stderr)


def load_settings() -> Settings:
    try:
        settings = Settings()
    except ValidationError as exc:
        _warn_unknown_variables([])
        first = exc.errors()[0]
        field = "RELAY_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        raise ConfigError(f"{field}: {first['msg'].removeprefix('Value error, ')}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f".env: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except SettingsError as exc:
        # A JSON setting (RELAY_COST_RATES, RELAY_POOL_WARM) that does not parse: pydantic
        # raises before validation, naming the field only in its message.
        _warn_unknown_variables([])
        named = re.search(r'field "(\w+)"', str(exc))
        field = "RELAY_" + named.group(1).upper() if named else "a RELAY_ setting"
        raise ConfigError(f"{field}: not valid JSON (see .env.example for its form)") from None
    _warn_unknown_variables(settings.providers)
    return settings


async def open_store(url: str) -> Store:
    """The store, or one line naming ``RELAY_DATABASE_URL`` (never the URL: it may hold a
    password), for every command that uses it."""
    from relay.store.database import STORE_FAILURES, Store

    failures: tuple[type[BaseException], ...] = (*STORE_FAILURES, OSError)
    try:
        return await Store.open(url)
    except ImportError:  # the PostgreSQL driver (the only one not always installed)
        raise ConfigError(
            "RELAY_DATABASE_URL names PostgreSQL but asyncpg is not installed: "
            "pip install 'sandbox-relay[postgres]' (or use sqlite:///relay.db)"
        ) from None
    except failures as exc:
        cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        if isinstance(cause, sqlite3.Error):
            # SQLite's own words name the cause (a full disk, a folder that is not there)
            # and never hold a credential.
            raise ConfigError(
                f"RELAY_DATABASE_URL: the SQLite database cannot be opened or written "
                f"({type(cause).__name__}: {cause}); is its folder there and writable, "
                f"with free space?"
            ) from None
        raise ConfigError(
            f"RELAY_DATABASE_URL: the database cannot be reached or used "
            f"({type(cause).__name__}); is it running, and are its address and credentials right?"
        ) from None
