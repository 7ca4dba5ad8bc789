"""The ``relay`` command's arguments: every command, option and help line, in one tree.

It imports nothing heavy: ``relay --version``, ``--help`` and the completion scripts come from
here alone, and a command's module (with the settings, the store, the providers) is imported
only when that command runs (``handler``: ``"module:function"`` under ``relay.cli``).
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from relay import __version__
from relay import client as relay_client

DESCRIPTION = """\
relay: run declared jobs in sandboxes behind one host and one token.

Start here:
  relay init                         a jobs folder, a dev token and a .env, here
  relay serve --dev                  serve on 127.0.0.1:8080 with a dev token
  relay run echo -p message=hi       run a job, print its output as it happens
  relay runs list                    your runs (RELAY_URL, RELAY_TOKEN: env or .env)

Errors are one line, `error: ...`, saying what to do.
"""

SHELLS = ("bash", "zsh", "fish")
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
NEVER = "never"


if TYPE_CHECKING:
    # Where a command's parser is added (each a OneLineParser: one-line errors).
    Commands = argparse._SubParsersAction[relay_client.OneLineParser]


def _port(text: str) -> int:
    """``--port``, held to what ``RELAY_PORT`` accepts (a socket wraps 70000 to 4464)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def duration_s(text: str) -> float:
    """``90s``, ``15m``, ``1h``, ``30d``, ``2w`` (or ``1h30m``) in seconds, more than 0."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text.strip().lower())
    joined = "".join(number + unit for number, unit in parts)
    total = sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)
    if not parts or joined != text.strip().lower() or total <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number and a unit, s m h d w (90s, 1h, 30d)"
        )
    return total


def _lifetime(text: str) -> float | None:
    """``--expires``: a duration, or ``never`` (None)."""
    return None if text.strip().lower() == NEVER else duration_s(text)


def _json_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def parser() -> argparse.ArgumentParser:
    root = relay_client.OneLineParser(
        prog="relay",
        description=DESCRIPTION,
        epilog=relay_client.exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    root.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve(sub)
    _init(sub)
    _tokens(sub)
    _jobs(sub)
    sub.add_parser(
        "run",
        help="run a job on the relay at RELAY_URL, its output live (relay run --help)",
        add_help=False,
    )
    sub.add_parser(
        "exec", help="run a raw command: relay exec [OPTIONS] -- ARGV... (command scope)"
    )
    _runs(sub)
    _operations(sub)
    completion = sub.add_parser(
        "completion",
        help='print a shell completion script: eval "$(relay completion bash)"',
    )
    completion.add_argument("shell", choices=SHELLS, help="bash, zsh or fish")
    completion.set_defaults(handler="completion:cmd_completion")
    return root


def _serve(sub: Commands) -> None:
    serve = sub.add_parser("serve", help="serve the relay")
    serve.add_argument(
        "--dev",
        action="store_true",
        help="make a dev token if there is none and print how to call the relay",
    )
    serve.add_argument("--host", help="address to listen on (default: RELAY_HOST)")
    serve.add_argument("--port", type=_port, help="port to listen on (default: RELAY_PORT)")
    serve.set_defaults(handler="serve:cmd_serve")


def _init(sub: Commands) -> None:
    init = sub.add_parser(
        "init", help="write a jobs folder with the example jobs, a dev token and a .env"
    )
    init.add_argument("directory", nargs="?", default=".", help="where (default: here)")
    init.set_defaults(handler="init:cmd_init")


def _tokens(sub: Commands) -> None:
    tokens = sub.add_parser("tokens", help="manage tokens")
    tsub = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
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
        "--max-artifact-bytes", type=int, help="what all its runs' artifacts may keep together"
    )
    new.add_argument(
        "--webhook-secret", action="store_true", help="give it a secret to sign its callbacks"
    )
    new.add_argument(
        "--admin",
        action="store_true",
        help="may read every token's runs and cancel any (the /console operator)",
    )
    new.add_argument(
        "--expires",
        type=_lifetime,
        default=False,
        metavar="DURATION",
        help="refused (401 token_expired) this long from now: 90m, 12h, 30d, 2w",
    )
    listed = tsub.add_parser("list", help="list tokens (names, scopes, last use; never the token)")
    _json_option(listed, "the tokens")
    rotate = tsub.add_parser("rotate", help="give a token a new value (printed once), same scopes")
    rotate.add_argument("name", help="the token's name")
    rotate.add_argument(
        "--overlap",
        type=duration_s,
        metavar="DURATION",
        help="the old value stays valid this long (1h: time to update a routine's secret); "
        "default: it stops now",
    )
    rotate.add_argument(
        "--expires",
        type=_lifetime,
        default=False,  # keep the expiry the token has
        metavar="DURATION",
        help="the new value expires this long from now, or never (default: as before)",
    )
    secret = tsub.add_parser(
        "secret", help="print a token's own webhook secret (to verify its callbacks)"
    )
    secret.add_argument("name", help="the token's name")
    secret.add_argument(
        "--new",
        action="store_true",
        help="give it a new secret (whsec_…) first: for a token without one, or to rotate it",
    )
    revoke = tsub.add_parser(
        "revoke", help="remove a token; a running relay refuses it from its next request"
    )
    revoke.add_argument("name", help="the token's name")
    tokens.set_defaults(handler="tokens:cmd_tokens")


def _jobs(sub: Commands) -> None:
    jobs = sub.add_parser(
        "jobs", help="list and validate the job catalog; `relay jobs reload`: a relay's, live"
    )
    _json_option(jobs, "the jobs")
    actions = jobs.add_subparsers(dest="action", metavar="[reload]")
    reload = actions.add_parser(
        "reload",
        help="have the relay at RELAY_URL read its jobs folder again (an admin token); a "
        "folder that does not load is refused, the last good jobs serve on",
    )
    reload.add_argument("--url", help="the relay (one replica) to reload; default: RELAY_URL")
    _json_option(reload, "the relay's answer")
    reload.add_argument("--no-auth-header", action="store_true", help=argparse.SUPPRESS)
    jobs.set_defaults(handler="jobs:cmd_jobs", action=None)


def _runs(sub: Commands) -> None:
    runs = sub.add_parser(
        "runs", help="list, show, follow and cancel runs, download their artifacts"
    )
    rsub = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listed = rsub.add_parser("list", help="this token's runs, newest first")
    listed.add_argument("--state", help="only runs in this state")
    listed.add_argument("--job", help="only runs of this job")
    listed.add_argument("--limit", type=int, default=20, help="how many (1-200)")
    _json_option(listed, "the whole page")
    show = rsub.add_parser("show", help="one run: its state, exit, timings and error")
    show.add_argument("run_id", help="run_…")
    _json_option(show, "the whole run")
    logs = rsub.add_parser("logs", help="a run's output")
    logs.add_argument("run_id", help="run_…")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="follow it as it happens, and exit as `relay run` does",
    )
    rsub.add_parser("cancel", help="cancel a run").add_argument("run_id", help="run_…")
    artifacts = rsub.add_parser(
        "artifacts", help="download a run's artifacts (the files its job declared)"
    )
    artifacts.add_argument("run_id", help="run_…")
    artifacts.add_argument(
        "-o", "--output", default=".", metavar="DIR", help="where to save them (default: here)"
    )
    for each in rsub.choices.values():
        each.add_argument("--no-auth-header", action="store_true", help=argparse.SUPPRESS)
    runs.set_defaults(handler="runs:cmd_runs")


def _operations(sub: Commands) -> None:
    probe = sub.add_parser(
        "probe", help="create a sandbox, run `echo ok`, terminate it; print the timings"
    )
    probe.add_argument(
        "provider",
        help="a provider name: local, e2b, modal, vercel, daytona, sprites, exedev, cloudflare",
    )
    _json_option(probe, "the result")
    probe.set_defaults(handler="probe:cmd_probe")
    reap = sub.add_parser("reap", help="one reaper sweep: terminate what outlived its run")
    reap.add_argument("--dry-run", action="store_true", help="only say what it would do")
    reap.add_argument(
        "--now",
        action="store_true",
        help="count every relay on this database dead now, not after its missed heartbeats "
        "(only when you know none runs: their runs are marked lost, their sandboxes ended)",
    )
    reap.set_defaults(handler="reap:cmd_reap")
    prune = sub.add_parser(
        "prune", help="delete final runs older than RELAY_RETENTION_DAYS (and their deliveries)"
    )
    prune.add_argument(
        "--older-than", type=float, metavar="DAYS", help="default: RELAY_RETENTION_DAYS"
    )
    prune.add_argument("--dry-run", action="store_true", help="only count what would go")
    prune.set_defaults(handler="prune:cmd_prune")
