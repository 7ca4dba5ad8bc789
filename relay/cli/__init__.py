"""The ``relay`` command: serve | init | run | exec | runs | tokens | jobs | probe | reap | prune
| completion.

Every subcommand prints one ``error: …`` line that says what to do, never a trace, and
exits by what went wrong (``relay --help`` lists the codes: relay/client.py ``EXIT_CODES``).
Only what a command needs is imported, when it runs: ``relay --version`` imports no more
than the argument tree (relay/cli/arguments.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay import client as relay_client

if TYPE_CHECKING:
    import argparse

    from relay.errors import RelayError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return relay_client.main(argv[1:], prog="relay run")
    if argv and argv[0] == "exec":
        return relay_client.main(argv[1:], prog="relay exec", raw=True)
    from relay.cli.arguments import parser

    args = parser().parse_args(argv)
    from relay.errors import ConfigError, RelayError

    try:
        code = _handler(args)(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a printed traceback
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return relay_client.EXIT_USAGE
    except RelayError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exit_code_for(exc)
    except relay_client.RelayClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return relay_client.error_exit_code(exc)
    except KeyboardInterrupt:
        return relay_client.EXIT_INTERRUPTED
    except BrokenPipeError:  # `relay runs show ID | head`
        return relay_client.stdout_closed()
    return code


def _handler(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    """The function of the chosen command (``module:function`` under relay.cli), imported."""
    module, _, function = str(args.handler).partition(":")
    found: Callable[[argparse.Namespace], int] = getattr(
        importlib.import_module(f"relay.cli.{module}"), function
    )
    return found


def exit_code_for(error: RelayError) -> int:
    """A relay error raised on this side (a token name not in the file) as an exit code."""
    return relay_client.error_exit_code(
        relay_client.RelayClientError(error.message, error.status, error.code)
    )
