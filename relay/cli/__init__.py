"""The ``relay`` command: serve | run | exec | runs | tokens | jobs | probe | reap | prune.

Every subcommand prints one ``error: …`` line that says what to do and exits 2 when
something is wrong, never a trace.
"""

from __future__ import annotations

import argparse
import sys

from relay import __version__
from relay import client as relay_client
from relay.cli.jobs import cmd_jobs
from relay.cli.probe import cmd_probe
from relay.cli.prune import cmd_prune
from relay.cli.reap import cmd_reap
from relay.cli.runs import cmd_runs
from relay.cli.serve import cmd_serve
from relay.cli.tokens import cmd_tokens
from relay.errors import ConfigError

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
