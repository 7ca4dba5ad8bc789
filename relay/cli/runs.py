"""``relay runs``: list, show, follow and cancel runs on the relay at RELAY_URL."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from relay import client as relay_client
from relay.errors import ConfigError


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
