"""The ``relay`` command: serve | run | tokens | jobs | probe | reap | prune.

Every subcommand prints ``error: …`` and exits 2 when something is wrong, never a trace.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relay import client as relay_client
from relay.auth import TokenStore, new_token
from relay.errors import ConfigError
from relay.runs.catalog import Catalog
from relay.settings import Settings

DEV_TOKEN_FILE = Path(".relay-dev-token")


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "RELAY_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        raise ConfigError(f"{field}: {first['msg']}") from exc


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
    from relay.providers.local.provider import bwrap_works

    if settings.local_isolation != "auto" or "local" not in settings.providers or bwrap_works():
        return settings
    print(
        "warning: bubblewrap is not available here, so this dev relay runs jobs WITHOUT "
        "isolation (RELAY_LOCAL_ISOLATION=none): no network wall, no filesystem wall. "
        "Install bubblewrap (apt-get install bubblewrap) for real sandboxes.",
        file=sys.stderr,
    )
    return settings.model_copy(update={"local_isolation": "none"})


def _print_howto(settings: Settings, token: str | None) -> None:
    url = f"http://{settings.host}:{settings.port}"
    shown = token or "<your token>"
    header = f"{settings.auth_header}: Bearer {shown}"
    if settings.auth_header.lower() != "authorization":
        header = f"{settings.auth_header}: {shown}"
    body = '{"job": "echo", "params": {"message": "hello from the relay"}}'
    print("\nThe relay is starting. Try it:\n")
    print(f"  curl -sS {url}/v1/runs -H {shlex.quote(header)} \\")
    print(f"       -H 'Content-Type: application/json' -d {shlex.quote(body)}\n")
    print(f"  RELAY_URL={url} RELAY_TOKEN={shown} relay run echo -p message=hi\n", flush=True)


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
    from relay.logs import configure

    settings = _settings()
    configure(settings.log_level, settings.log_format)
    token = None
    if args.dev:
        token = _dev_setup(settings)
        settings = _dev_isolation(settings)
    app = create_app(settings)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            # Everything loaded so far (SDKs, schemas, the app) lives as long as the
            # process: keep it out of the collector's full passes, which otherwise stall
            # the loop for tens of milliseconds under load (bench/README.md).
            gc.collect()
            gc.freeze()

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(app.state, "relay", None)
            if state is not None:
                state.service.begin_drain()
            super().handle_exit(sig, frame)

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
    Server(config).run()
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    settings = _settings()
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
        )
        print(token)
        print(f"(shown once; its hash is in {settings.tokens_file})", file=sys.stderr)
        if args.webhook_secret:
            print(f"(its webhook_secret is in {settings.tokens_file})", file=sys.stderr)
        return 0
    principals = TokenStore(settings.tokens_file).principals
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
            f"{' command' if principal.command else ''}"
            f"\tproviders={','.join(sorted(principal.providers))}"
            f"\t{' '.join(shown) or 'no limits'}\ttoday: {runs} runs, ${usd:.4f}"
        )
    return 0


async def _usage_today(settings: Settings, names: list[str]) -> dict[str, tuple[int, float]]:
    from relay.store.database import Store
    from relay.store.limits import day_start

    store = await Store.open(settings.database_url)
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


def cmd_run(args: argparse.Namespace) -> int:
    argv = [args.job]
    for pair in args.param:
        argv += ["-p", pair]
    if args.json:
        argv.append("--json")
    return relay_client.main(argv)  # it reads RELAY_URL, RELAY_TOKEN itself


async def _reap(settings: Settings, dry_run: bool) -> int:
    from relay.providers.registry import load_providers
    from relay.runs.reaper import Reaper
    from relay.store.database import Store

    store = await Store.open(settings.database_url)
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
        report = await reaper.sweep(dry_run=dry_run)
    finally:
        for provider in providers.values():
            await provider.aclose()
        await store.close()
    verb = "would terminate" if dry_run else "terminated"
    for provider_name, sandbox_id in report.terminated:
        print(f"{verb} {provider_name} {sandbox_id}")
    for run_id in report.lost_runs:
        print(f"{'would mark' if dry_run else 'marked'} {run_id} lost")
    for provider_name, sandbox_id in report.failures:
        print(f"failed to terminate {provider_name} {sandbox_id}", file=sys.stderr)
    return 1 if report.failures else 0


async def _prune(settings: Settings, older_than_days: float, dry_run: bool) -> int:
    from relay.store import retention
    from relay.store.database import Store

    store = await Store.open(settings.database_url)
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


def cmd_probe(args: argparse.Namespace) -> int:
    from relay.providers.probe import run_probe

    result = asyncio.run(run_probe(args.provider, _settings()))
    print(result.line(), flush=True)
    if not result.ok:
        print(f"error: {result.error}", file=sys.stderr)
        return 2
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    return asyncio.run(_reap(_settings(), args.dry_run))


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="relay", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the relay")
    serve.add_argument(
        "--dev",
        action="store_true",
        help="make a dev token if there is none and print how to call the relay",
    )
    serve.set_defaults(func=cmd_serve)
    tokens = sub.add_parser("tokens", help="manage tokens")
    tsub = tokens.add_subparsers(dest="action", required=True)
    new = tsub.add_parser("new", help="create a token (printed once)")
    new.add_argument("name")
    new.add_argument("--job", action="append", help="a job it may run (repeat); default all")
    new.add_argument("--command", action="store_true", help="may send a raw argv")
    new.add_argument("--provider", action="append", help="a provider it may use (repeat)")
    new.add_argument("--max-timeout-s", type=float)
    new.add_argument("--max-concurrent", type=int)
    new.add_argument("--runs-per-day", type=int)
    new.add_argument("--usd-per-day", type=float)
    new.add_argument(
        "--webhook-secret", action="store_true", help="give it a secret to sign its callbacks"
    )
    tsub.add_parser("list", help="list tokens (names and scopes, never the token)")
    tokens.set_defaults(func=cmd_tokens)
    jobs = sub.add_parser("jobs", help="list and validate the job catalog")
    jobs.set_defaults(func=cmd_jobs)
    run = sub.add_parser("run", help="run a job on the relay at RELAY_URL with RELAY_TOKEN")
    run.add_argument("job")
    run.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a string param; KEY:=JSON for numbers, booleans, lists",
    )
    run.add_argument("--json", action="store_true")
    run.set_defaults(func=cmd_run)
    probe = sub.add_parser(
        "probe", help="create a sandbox, run `echo ok`, terminate it; print the timings"
    )
    probe.add_argument("provider", help="a provider name: local, e2b, modal, vercel")
    probe.set_defaults(func=cmd_probe)
    reap = sub.add_parser("reap", help="one reaper sweep: terminate what outlived its run")
    reap.add_argument("--dry-run", action="store_true")
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
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
