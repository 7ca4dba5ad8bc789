"""``relay jobs``: list the job catalog, which validates it (a bad manifest: one line);
``relay jobs reload``: have a running relay read its jobs folder again.

``reload`` talks to the relay at ``RELAY_URL`` (or ``--url``) with ``RELAY_TOKEN``, an admin
token: ``POST /v1/jobs/reload``. It reloads the one replica that answers; behind a balancer,
name each replica with ``--url``, or send each one ``SIGHUP``."""

from __future__ import annotations

import argparse
import json
import sys

from relay import client as relay_client
from relay.cli.configuration import load_settings
from relay.errors import ConfigError
from relay.runs.catalog import Catalog


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.action == "reload":
        return _reload(args)
    settings = load_settings()
    catalog = Catalog.load(settings.jobs_dir)
    if args.json:
        listed = [
            {
                "name": job.name,
                "description": job.description,
                "timeout_s": job.timeout_s,
                "egress": list(job.egress),
                "params": {
                    name: {"type": param.type, "required": param.required}
                    for name, param in job.params.items()
                },
            }
            for job in catalog.jobs.values()
        ]
        print(json.dumps(listed, indent=2))
        return 0
    for job in catalog.jobs.values():
        params = " ".join(
            f"{p.name}:{p.type}{'' if p.required else '?'}" for p in job.params.values()
        )
        print(f"{job.name:20} {job.timeout_s:>6.0f}s egress={list(job.egress)} {params}")
    if not catalog.jobs:
        print(f"no jobs in {settings.jobs_dir}: `relay init` writes the examples", file=sys.stderr)
        return 0
    print(f"{len(catalog.jobs)} job(s) valid in {settings.jobs_dir}", file=sys.stderr)
    return 0


def _reload(args: argparse.Namespace) -> int:
    try:
        client = relay_client.client_from_environment(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        done = client.reload_jobs()
    except relay_client.RelayClientError as exc:
        if exc.status != 403:
            raise
        hint = "HTTP 403: reloading the jobs needs an admin token (relay tokens new NAME --admin)"
        raise relay_client.RelayClientError(hint, exc.status, exc.code) from None
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    changes = [
        f"{what} {', '.join(done.get(what) or [])}"
        for what in ("added", "changed", "removed")
        if done.get(what)
    ]
    jobs = done.get("jobs") or []
    print(f"reloaded: {len(jobs)} job(s); {'; '.join(changes) or 'nothing changed'}")
    for warning in done.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    return 0
