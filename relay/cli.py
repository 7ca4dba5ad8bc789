"""The ``relay`` command: serve | run | exec | runs | tokens | jobs | probe | reap | prune.

Every subcommand prints one ``error: …`` line that says what to do and exits 2 when
something is wrong, never a trace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import errno
import json
import math
import os
import re
import secrets
import shlex
import shutil
import sqlite3
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_settings import SettingsError
from sqlalchemy.exc import DBAPIError

from relay import __version__
from relay import client as relay_client
from relay.auth import TokenStore, new_token, revoke_token, rotate_token
from relay.errors import ConfigError
from relay.runs.catalog import Catalog
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.providers.contract import Provider
    from relay.providers.probe import ProbeResult
    from relay.store.database import Store

DEV_TOKEN_FILE = Path(".relay-dev-token")


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


def _settings() -> Settings:
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


def _dev_setup(settings: Settings) -> str | None:
    """For ``serve --dev``: a token named dev, kept in .relay-dev-token, if none exists."""
    if not settings.tokens_file.exists():
        token = new_token(settings.tokens_file, "dev")  # declared jobs only, never raw argv
        DEV_TOKEN_FILE.write_text(token + "\n")
        DEV_TOKEN_FILE.chmod(0o600)
        print(f"created a dev token in {settings.tokens_file} (and {DEV_TOKEN_FILE}, yours only)")
    if DEV_TOKEN_FILE.exists():
        return DEV_TOKEN_FILE.read_text().strip()
    return None


def _dev_isolation(settings: Settings) -> Settings:
    """``serve --dev`` on a machine without bubblewrap: say so loudly and run unisolated,
    so the first try works; a real deployment keeps ``auto``, which refuses instead."""
    from relay.providers.local.invocation import bwrap_works

    if settings.local_isolation != "auto" or "local" not in settings.providers or bwrap_works():
        return settings
    print(
        "warning: bubblewrap is not available here, so this dev relay runs jobs WITHOUT "
        "isolation (RELAY_LOCAL_ISOLATION=none): no network wall, no filesystem wall. "
        "Install bubblewrap (apt-get install bubblewrap) for real sandboxes.",
        file=sys.stderr,
    )
    return settings.model_copy(update={"local_isolation": "none"})


def _command_name() -> str:
    """How to run this same ``relay`` again from here: ``relay`` when PATH finds it (or when
    started as ``python -m relay``), else its path, ``.venv/bin/relay`` after ``make serve``."""
    script = Path(sys.argv[0])
    found = shutil.which("relay")
    if script.name != "relay" or (found and Path(found).resolve() == script.resolve()):
        return "relay"
    with contextlib.suppress(ValueError):
        return str(script.absolute().relative_to(Path.cwd()))
    return str(script.absolute())


def _print_howto(settings: Settings, token: str | None) -> None:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # IPv6
    url = f"http://{host}:{settings.port}"
    relay = shlex.quote(_command_name())
    shown = token or "<your token>"
    header = f"{settings.auth_header}: Bearer {shown}"
    caller = f"RELAY_URL={url} RELAY_TOKEN={shown}"
    if settings.auth_header.lower() != "authorization":
        header = f"{settings.auth_header}: {shown}"
        caller += f" RELAY_AUTH_HEADER={shlex.quote(settings.auth_header)}"
    body = '{"job": "echo", "params": {"message": "hello from the relay"}}'
    print("\nThe relay is starting. Try it:\n")
    print(f"  curl -sS {url}/v1/runs -H {shlex.quote(header)} \\")
    print(f"       -H 'Content-Type: application/json' -d {shlex.quote(body)}\n")
    print(f"  {caller} {relay} run echo -p message=hi\n")
    print(
        f"The console: {url}/console (log in with an admin token: {relay} tokens new NAME "
        "--admin)\n",
        flush=True,
    )


def _check_address(host: str, port: int) -> None:
    """Bind the address once before anything starts, so that a port in use (or a host that
    is not this machine's) is one line naming the setting, not uvicorn's log after a whole
    startup and its exit code 3."""
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"RELAY_HOST: {host!r} is not an address here ({exc.strerror})") from None
    family, kind, protocol, _, address = found[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"RELAY_PORT: {host}:{port} is in use by another process; stop it or "
                    "pick another port (RELAY_PORT or --port)"
                ) from None
            if exc.errno == errno.EACCES:
                raise ConfigError(
                    f"RELAY_PORT: this user may not listen on port {port} (ports below 1024 "
                    "need root); pick a port from 1024 up"
                ) from None
            raise ConfigError(
                f"RELAY_HOST: cannot listen on {host}:{port} ({exc.strerror})"
            ) from None


def _check_startup(settings: Settings) -> dict[str, Provider]:
    """What would otherwise fail inside the server's startup as a traceback: the database
    driver exists and the database answers, and each provider builds (its SDK installed,
    its keys set). The providers built are the ones the server uses (its lifespan closes
    them)."""
    from relay.providers.registry import load_providers

    asyncio.run(_check_database(settings.database_url))
    return load_providers(settings)


async def _check_database(url: str) -> None:
    """Open the store once (and bring its schema up to date), or one line saying why not:
    the service manager's restart policy tries again (a database still starting)."""
    store = await _open_store(url)
    await store.close()


async def _open_store(url: str) -> Store:
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


async def _close(providers: dict[str, Provider]) -> None:
    for provider in providers.values():
        await provider.aclose()


def _isolation_in_use(settings: Settings) -> str:
    from relay.providers.local.invocation import bwrap_works

    if settings.local_isolation == "none":
        return "none (RELAY_LOCAL_ISOLATION=none): jobs run WITHOUT a sandbox"
    if settings.local_isolation == "bwrap" or bwrap_works():
        return "bubblewrap"
    return "none available: RELAY_LOCAL_ISOLATION=auto refuses local runs; install bubblewrap"


FILES_BESIDE_CONNECTIONS = 256
"""Descriptors the relay needs besides its connections: database, sandboxes' pipes, logs."""


def _allow_connections(max_connections: int) -> None:
    """Raise this process's open-file limit (up to the hard limit) so that
    ``RELAY_MAX_CONNECTIONS`` connections fit; the cap, not the kernel, then decides."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FILES_BESIDE_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < wanted:
            print(
                f"warning: the open-file limit ({hard}) is below RELAY_MAX_CONNECTIONS + "
                f"{FILES_BESIDE_CONNECTIONS}; lower RELAY_MAX_CONNECTIONS or raise `ulimit -Hn`",
                file=sys.stderr,
            )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from relay.http.app import create_app
    from relay.http.connections import server_options
    from relay.http.server import RelayServer
    from relay.logs import configure

    settings = _settings()
    if args.host is not None or args.port is not None:
        chosen = {"host": args.host, "port": args.port}
        settings = settings.model_copy(update={k: v for k, v in chosen.items() if v is not None})
    configure(settings.log_level, "console" if args.dev else settings.log_format)
    _check_address(settings.host, settings.port)
    token = None
    if args.dev:
        token = _dev_setup(settings)
        settings = _dev_isolation(settings)
    providers = _check_startup(settings)
    try:
        app = create_app(settings, providers=providers)
    except BaseException:
        asyncio.run(_close(providers))
        raise
    if args.dev and "local" in settings.providers:
        print(f"local provider isolation: {_isolation_in_use(settings)}", flush=True)

    _allow_connections(settings.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.drain_s)),
        server_header=False,
        **server_options(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            keep_alive_s=settings.keep_alive_s,
            max_connections=settings.max_connections,
        ),
    )
    if args.dev:
        _print_howto(settings, token)
    RelayServer(config, app).run()
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    settings = _settings()
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

    store = await _open_store(settings.database_url)
    try:
        since = day_start(time.time())
        found = {}
        for name in names:
            usage = await store.usage(name, since)
            found[name] = (usage.runs, usage.usd)
        return found
    finally:
        await store.close()


def cmd_jobs(args: argparse.Namespace) -> int:
    settings = _settings()
    catalog = Catalog.load(settings.jobs_dir)
    for job in catalog.jobs.values():
        params = " ".join(
            f"{p.name}:{p.type}{'' if p.required else '?'}" for p in job.params.values()
        )
        print(f"{job.name:20} {job.timeout_s:>6.0f}s egress={list(job.egress)} {params}")
    print(f"{len(catalog.jobs)} job(s) valid in {settings.jobs_dir}", file=sys.stderr)
    return 0


def _client(args: argparse.Namespace) -> relay_client.Client:
    try:
        return relay_client.client_from_environment(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _summary(run: dict[str, Any]) -> str:
    code = run.get("exit_code")
    took = run.get("duration_ms")
    return "\t".join(
        [
            str(run.get("id")),
            str(run.get("state")),
            str(run.get("job") or " ".join(run.get("command") or []))[:40],
            "-" if code is None else f"exit {code}",
            str(run.get("created_at") or "")[:19],
            "-" if took is None else f"{took} ms",
        ]
    )


def cmd_runs(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        if args.action == "list":
            page = client.list_runs(state=args.state, job=args.job, limit=args.limit)
            if args.json:
                print(json.dumps(page, indent=2))
            for run in [] if args.json else page.get("runs", []):
                print(_summary(run))
            if page.get("next_cursor") and not args.json:
                print("(more: raise --limit, at most 200)", file=sys.stderr)
        elif args.action == "show":
            print(json.dumps(client.get(args.run_id), indent=2))
        elif args.action == "logs":
            if args.follow:
                run = client.follow(args.run_id)
            else:
                run = client.get(args.run_id)
                sys.stdout.write(run.get("stdout") or "")
                sys.stderr.write(run.get("stderr") or "")
        elif args.action == "cancel":
            run = client.cancel(args.run_id)
            print(f"canceled {run.get('id', args.run_id)} (was {run.get('state')})")
    except relay_client.RelayClientError as exc:
        if exc.code == "not_found":
            raise ConfigError(f"{exc}; list your runs with `relay runs list`") from None
        raise ConfigError(str(exc)) from None
    except KeyboardInterrupt:
        return 130
    return 0


async def _reap(settings: Settings, dry_run: bool, now: bool = False) -> int:
    from relay.providers.registry import load_providers
    from relay.runs.reaper import Reaper

    store = await _open_store(settings.database_url)
    providers = load_providers(settings)
    # One sweep from cron: the store was just reached, so the replicas' beats are judged.
    # This process holds no run, so every active run it finds is another replica's.
    reaper = Reaper(
        store,
        providers,
        settings,
        holds=lambda run_id: False,
        instance_id="reap_" + secrets.token_hex(8),
        grace_s=settings.grace_s,
        single_replica=False,
        beats_before_judging=0,
    )
    try:
        report = await reaper.sweep(dry_run=dry_run, judge_now=now)
    finally:
        for provider in providers.values():
            await provider.aclose()
        await store.close()
    listed = ", ".join(f"{name} {count}" for name, count in report.listed.items())
    print(f"found {report.active_runs} active run(s); sandboxes listed: {listed or 'none'}")
    verb = "would terminate" if dry_run else "terminated"
    for provider_name, sandbox_id in report.terminated:
        print(f"{verb} {provider_name} {sandbox_id}")
    for run_id in report.lost_runs:
        print(f"{'would mark' if dry_run else 'marked'} {run_id} lost")
    for provider_name, sandbox_id in report.failures:
        print(f"failed to terminate {provider_name} {sandbox_id}", file=sys.stderr)
    for waiting in report.waiting:
        print(f"left for now: {waiting.subject}: {waiting.reason}{_until(waiting.until)}")
    if any(waiting.subject.startswith("run ") for waiting in report.waiting) and not now:
        print("if you know no relay runs on this database: relay reap --now")
    return 1 if report.failures else 0


def _until(moment: float | None) -> str:
    """`` (until <UTC time>, in N s)`` for a report line; nothing for no time."""
    if moment is None:
        return ""
    at = datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f" (until {at}, in {max(0, math.ceil(moment - time.time()))} s)"


async def _prune(settings: Settings, older_than_days: float, dry_run: bool) -> int:
    from relay.store import retention

    store = await _open_store(settings.database_url)
    try:
        before = retention.cutoff(older_than_days)
        pruned = await retention.prune(store, before, dry_run=dry_run)
        size = await store.read(retention.size_bytes)
    finally:
        await store.close()
    verb = "would delete" if dry_run else "deleted"
    print(
        f"{verb} {pruned.runs} run(s) and {pruned.deliveries} delivery row(s) created before "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(before))} UTC"
    )
    if not dry_run and store.is_sqlite:
        size = retention.vacuum_if_needed(settings.database_url) or size
    print(f"store size: {size} bytes")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    settings = _settings()
    days = settings.retention_days if args.older_than is None else args.older_than
    if days < 1:
        raise ConfigError("--older-than: at least 1 day (today's runs count against limits)")
    return asyncio.run(_prune(settings, days, args.dry_run))


def _remove_empty_folders(top: Path) -> None:
    """``top`` and the folders under it that hold nothing (a sandbox left behind stays)."""
    for folder, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


async def _probe(name: str, settings: Settings) -> ProbeResult:
    """The probe, and the provider's warm pools where the store already holds some: today
    (UTC) and relay-wide, like an admin token's ``/v1/usage``."""
    from relay.providers.probe import run_probe
    from relay.store.limits import day_start
    from relay.store.pools import read_summary

    # The state directory follows RELAY_DATABASE_URL (a SQLite file's folder) and the
    # local provider makes its sandbox root there: where it did not exist, the probe leaves
    # none of it behind (a mistyped path, or a folder a relay of another user could not use).
    state = settings.state_directory().absolute()
    missing = next((p for p in reversed([state, *state.parents]) if not p.exists()), None)
    try:
        result = await run_probe(name, settings)
    finally:
        if missing is not None:
            _remove_empty_folders(missing)
    pools = await read_summary(settings.database_url, name, day_start(time.time()))
    if pools is not None:
        result.pool = {
            "pool_ready": str(pools.ready),
            "pool_claimed": str(pools.claimed),
            "pool_idle_s": str(round(pools.idle_s)),
            "pool_idle_usd": f"{pools.idle_usd:.6f}",
        }
    return result


def cmd_probe(args: argparse.Namespace) -> int:
    from relay.providers.registry import PROVIDERS

    settings = _settings()
    if args.provider not in PROVIDERS:  # the argument, not RELAY_PROVIDERS, is wrong
        known = ", ".join(name for name in PROVIDERS if name != "memory")
        raise ConfigError(f"no provider named {args.provider!r}; probe one of: {known}")
    result = asyncio.run(_probe(args.provider, settings))
    print(result.line(), flush=True)
    if not result.ok:
        print(f"error: {result.error}", file=sys.stderr)
        return 2
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    return asyncio.run(_reap(_settings(), args.dry_run, args.now))


DESCRIPTION = """\
relay: run declared jobs in sandboxes behind one host and one token.

Start here:
  relay serve --dev                  serve on 127.0.0.1:8080 with a dev token
  relay run echo -p message=hi       run a job, print its output as it happens
  relay runs list                    your runs (RELAY_URL, RELAY_TOKEN: env or .env)

Errors are one line, `error: ...`, saying what to do; exit code 2.
"""


def _port(text: str) -> int:
    """``--port``, held to what ``RELAY_PORT`` accepts (a socket wraps 70000 to 4464)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def parser() -> argparse.ArgumentParser:
    root = relay_client.OneLineParser(
        prog="relay", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    root.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve the relay")
    serve.add_argument(
        "--dev",
        action="store_true",
        help="make a dev token if there is none and print how to call the relay",
    )
    serve.add_argument("--host", help="address to listen on (default: RELAY_HOST)")
    serve.add_argument("--port", type=_port, help="port to listen on (default: RELAY_PORT)")
    serve.set_defaults(func=cmd_serve)
    tokens = sub.add_parser("tokens", help="manage tokens")
    tsub = tokens.add_subparsers(dest="action", required=True)
    new = tsub.add_parser("new", help="create a token (printed once)")
    new.add_argument("name", help="lower-case letters, digits, '.', '_', '-'")
    new.add_argument("--job", action="append", help="a job it may run (repeat); default all")
    new.add_argument("--command", action="store_true", help="may send a raw argv")
    new.add_argument("--provider", action="append", help="a provider it may use (repeat)")
    new.add_argument("--max-timeout-s", type=float, help="cap on each of its runs' timeout")
    new.add_argument("--max-concurrent", type=int, help="its runs in flight at once, cluster-wide")
    new.add_argument("--runs-per-day", type=int, help="runs it may start per UTC day")
    new.add_argument("--usd-per-day", type=float, help="what its runs may cost per UTC day")
    new.add_argument(
        "--webhook-secret", action="store_true", help="give it a secret to sign its callbacks"
    )
    new.add_argument(
        "--admin",
        action="store_true",
        help="may read every token's runs and cancel any (the /console operator)",
    )
    tsub.add_parser("list", help="list tokens (names and scopes, never the token)")
    for action, text in (
        ("revoke", "remove a token; a running relay refuses it from its next request"),
        ("rotate", "give a token a new value (printed once), same scopes"),
        ("secret", "print a token's own webhook secret (to verify its callbacks)"),
    ):
        tsub.add_parser(action, help=text).add_argument("name", help="the token's name")
    tokens.set_defaults(func=cmd_tokens)
    jobs = sub.add_parser("jobs", help="list and validate the job catalog")
    jobs.set_defaults(func=cmd_jobs)
    sub.add_parser(
        "run",
        help="run a job on the relay at RELAY_URL, its output live (relay run --help)",
        add_help=False,
    )
    sub.add_parser(
        "exec", help="run a raw command: relay exec [OPTIONS] -- ARGV... (command scope)"
    )
    runs = sub.add_parser("runs", help="list, show, follow and cancel runs")
    rsub = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listed = rsub.add_parser("list", help="this token's runs, newest first")
    listed.add_argument("--state", help="only runs in this state")
    listed.add_argument("--job", help="only runs of this job")
    listed.add_argument("--limit", type=int, default=20, help="how many (1-200)")
    listed.add_argument("--json", action="store_true", help="the whole page as JSON")
    rsub.add_parser("show", help="one run, as JSON").add_argument("run_id", help="run_…")
    logs = rsub.add_parser("logs", help="a run's output")
    logs.add_argument("run_id", help="run_…")
    logs.add_argument("-f", "--follow", action="store_true", help="follow it as it happens")
    rsub.add_parser("cancel", help="cancel a run").add_argument("run_id", help="run_…")
    for each in (listed, *[rsub.choices[name] for name in ("show", "logs", "cancel")]):
        each.add_argument("--no-auth-header", action="store_true", help=argparse.SUPPRESS)
    runs.set_defaults(func=cmd_runs)
    probe = sub.add_parser(
        "probe", help="create a sandbox, run `echo ok`, terminate it; print the timings"
    )
    probe.add_argument(
        "provider", help="a provider name: local, e2b, modal, vercel, daytona, sprites"
    )
    probe.set_defaults(func=cmd_probe)
    reap = sub.add_parser("reap", help="one reaper sweep: terminate what outlived its run")
    reap.add_argument("--dry-run", action="store_true", help="only say what it would do")
    reap.add_argument(
        "--now",
        action="store_true",
        help="count every relay on this database dead now, not after its missed heartbeats "
        "(only when you know none runs: their runs are marked lost, their sandboxes ended)",
    )
    reap.set_defaults(func=cmd_reap)
    prune = sub.add_parser(
        "prune", help="delete final runs older than RELAY_RETENTION_DAYS (and their deliveries)"
    )
    prune.add_argument(
        "--older-than", type=float, metavar="DAYS", help="default: RELAY_RETENTION_DAYS"
    )
    prune.add_argument("--dry-run", action="store_true", help="only count what would go")
    prune.set_defaults(func=cmd_prune)
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return relay_client.main(argv[1:], prog="relay run")
    if argv and argv[0] == "exec":
        rest = argv[1:]
        if "--" not in rest:
            if rest in (["-h"], ["--help"]):
                return relay_client.main(["--help"], prog="relay exec")
            print("error: put the command after --: relay exec -- ls -la", file=sys.stderr)
            return 2
        return relay_client.main(rest, prog="relay exec")
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a printed traceback
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `relay runs show ID | head`
        return relay_client.stdout_closed()
    return code
