"""``relay serve``: check what would fail at startup in one line each, then serve; ``--dev``
makes a token and prints how to call the relay."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import shlex
import shutil
import sys
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from relay.auth import new_token
from relay.cli.configuration import load_settings, open_store
from relay.errors import ConfigError
from relay.runs.catalog import Catalog
from relay.settings import Settings

if TYPE_CHECKING:
    from relay.providers.contract import Provider

DEV_TOKEN_FILE = Path(".relay-dev-token")


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


def _print_howto(settings: Settings, token: str | None, jobs: Collection[str] = ("echo",)) -> None:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # IPv6
    url = f"http://{host}:{settings.port}"
    relay = shlex.quote(_command_name())
    if "echo" not in jobs:  # the example call would answer 422 unknown_job
        _print_without_echo(settings, url, relay, jobs)
        return
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


def _print_without_echo(settings: Settings, url: str, relay: str, jobs: Collection[str]) -> None:
    if jobs:
        print(f"\nThe relay is starting. Its jobs: {', '.join(sorted(jobs))} ({relay} jobs)\n")
    else:
        print(
            f"\nThe relay is starting with no jobs: {settings.jobs_dir} holds none, so every run "
            f"would be refused (422 unknown_job). Add one ({settings.jobs_dir}/NAME/job.toml), "
            f"or write the example jobs with `{relay} init`, then send it SIGHUP (kill -HUP "
            f"{os.getpid()}) to load them, or restart it.\n"
        )
    print(f"The console: {url}/console\n", flush=True)


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
    store = await open_store(url)
    await store.close()


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

    settings = load_settings()
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
            write_timeout_s=settings.write_timeout_s,
            keep_alive_s=settings.keep_alive_s,
            max_connections=settings.max_connections,
        ),
    )
    if args.dev:
        _print_howto(settings, token, Catalog.load(settings.jobs_dir).jobs)
    RelayServer(config, app).run()
    return 0
