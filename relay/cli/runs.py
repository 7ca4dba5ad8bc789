"""``relay runs``: list, show, follow and cancel runs on the relay at RELAY_URL.

What it prints is for people (a table with a header, a run as labelled lines); ``--json``
prints the relay's answer as it is, for scripts. ``relay runs logs -f`` exits as ``relay run``
does: the job's code, 124 when it timed out, 7 when it was canceled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from relay import client as relay_client
from relay.cli.output import columns
from relay.errors import ConfigError

COMMAND_CHARS = 40
"""A run's job (or raw command) is cut to this many characters in the table."""
COLUMNS = ("ID", "STATE", "JOB", "EXIT", "CREATED", "DURATION")


def _client(args: argparse.Namespace) -> relay_client.Client:
    try:
        return relay_client.client_from_environment(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _what(run: dict[str, Any]) -> str:
    """The run's job, else its raw command (from what was asked, when the answer has it)."""
    if run.get("job"):
        return str(run["job"])
    command = (run.get("request") or {}).get("command")
    return "$ " + " ".join(command) if command else "(raw command)"


def _ending(run: dict[str, Any]) -> str:
    code, error = run.get("exit_code"), run.get("error")
    if code is not None:
        return f"exit {code}"
    return str(error.get("code")) if isinstance(error, dict) else "-"


def _row(run: dict[str, Any]) -> list[str]:
    took = run.get("duration_ms")
    what = _what(run)
    return [
        str(run.get("id")),
        str(run.get("state")),
        what if len(what) <= COMMAND_CHARS else what[: COMMAND_CHARS - 1] + "…",
        _ending(run),
        str(run.get("created_at") or "").replace("T", " ")[:19],
        "-" if took is None else f"{took} ms",
    ]


def table(runs: list[dict[str, Any]]) -> str:
    """The runs as aligned columns under a header row."""
    return columns(COLUMNS, [_row(run) for run in runs])


def _details(run: dict[str, Any]) -> str:
    """One run as labelled lines; its output is ``relay runs logs``'s to print."""
    lines = [f"{run.get('id')}  {run.get('state')}  {_ending(run)}", f"job        {_what(run)}"]
    lines.append(f"provider   {run.get('provider')}  sandbox {run.get('sandbox_id') or '-'}")
    for line in relay_client.failed_attempts(run):  # a route's providers that did not run it
        lines.append(f"tried      {line}")
    for label in ("created", "started", "ended"):
        lines.append(f"{label:<10} {run.get(label + '_at') or '-'}")
    took = run.get("duration_ms")
    lines.append(
        f"duration   {'-' if took is None else f'{took} ms'}  (timeout {run.get('timeout_s')} s)"
    )
    lines.append(f"cost       ${float(run.get('cost_usd') or 0):.6f}")
    error = run.get("error")
    if isinstance(error, dict):
        lines.append(f"error      {error.get('code')}: {error.get('message')}")
    sizes = [
        f"{len(str(run.get(stream) or '').encode())} B {stream}"
        + (" (truncated)" if run.get(f"{stream}_truncated") else "")
        for stream in ("stdout", "stderr")
    ]
    lines.append(f"output     {', '.join(sizes)}  (relay runs logs {run.get('id')})")
    for delivery in run.get("deliveries") or []:
        attempts = len(delivery.get("attempts") or [])
        lines.append(
            f"webhook    {delivery.get('id')} {delivery.get('state')}, {attempts} attempt(s)"
        )
    return "\n".join(lines)


def cmd_runs(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        return _action(client, args)
    except relay_client.RelayClientError as exc:
        if exc.code != "not_found":
            raise
        hint = f"{exc}; list your runs with `relay runs list`"
        raise relay_client.RelayClientError(hint, exc.status, exc.code) from None


def _action(client: relay_client.Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        page = client.list_runs(state=args.state, job=args.job, limit=args.limit)
        if args.json:
            print(json.dumps(page, indent=2))
            return 0
        print(table(page.get("runs", [])))
        if page.get("next_cursor"):
            print("(more: raise --limit, at most 200)", file=sys.stderr)
    elif args.action == "show":
        run = client.get(args.run_id)
        print(json.dumps(run, indent=2) if args.json else _details(run))
    elif args.action == "logs":
        if args.follow:
            return relay_client.finished(client.follow(args.run_id))
        run = client.get(args.run_id)
        sys.stdout.write(run.get("stdout") or "")
        sys.stderr.write(run.get("stderr") or "")
    elif args.action == "artifacts":
        run = client.get(args.run_id)
        found = client.download_artifacts(run, Path(args.output), on_skipped=relay_client.skipped)
        relay_client.saved(found)
        if not run.get("artifacts"):
            print(f"run {args.run_id} has no artifacts", file=sys.stderr)
    elif args.action == "cancel":
        run = client.cancel(args.run_id)
        print(f"canceled {run.get('id', args.run_id)} (was {run.get('state')})")
    return 0
