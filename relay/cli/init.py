"""``relay init [DIR]``: what a relay installed from a wheel needs to start, in one folder.

It writes ``jobs/`` (the example jobs, shipped in the package), ``tokens.toml`` with a token
named ``dev`` (the clear token also in ``.relay-dev-token``, as ``serve --dev`` keeps it), and
``.env`` (the relay's paths, and ``RELAY_URL`` and ``RELAY_TOKEN`` for ``relay run``), then
prints the next command. What is there already is kept, and said so: a second ``init`` never
overwrites a token file or a job.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from pathlib import Path

from relay.cli.serve import DEV_TOKEN_FILE
from relay.errors import ConfigError
from relay.token_file import new_token

ENV_FILE = """\
# Written by `relay init`. The relay's settings (every RELAY_ setting: .env.example in the
# source, or the README's Configuration), and the caller's: RELAY_URL and RELAY_TOKEN are
# what `relay run` and `relay runs` use. Holds a token in clear: keep it yours (0600).
RELAY_TOKENS_FILE=tokens.toml
RELAY_JOBS_DIR=jobs
RELAY_DATABASE_URL=sqlite:///relay.db
RELAY_PROVIDERS=local
RELAY_URL=http://127.0.0.1:8080
RELAY_TOKEN={token}
"""


def examples() -> Path:
    """The example jobs: ``relay/examples/jobs`` in an installed wheel (pyproject's
    force-include), else the ``jobs/`` folder of the checkout the package runs from."""
    package = Path(__file__).resolve().parent.parent
    for found in (package / "examples" / "jobs", package.parent / "jobs"):
        if (found / "echo" / "job.toml").is_file():
            return found
    raise ConfigError("the example jobs are not installed with this relay; reinstall it")


def cmd_init(args: argparse.Namespace) -> int:
    folder = Path(args.directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        done = [_jobs(folder), *_tokens(folder)]
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot write there ({exc.strerror})") from None
    for line in done:
        print(line)
    go = "" if folder.resolve() == Path.cwd().resolve() else f"cd {shlex.quote(str(folder))} && "
    print(f"\nNext: {go}relay serve --dev")
    print("Then, in another shell there: relay run echo -p message=hi")
    return 0


def _jobs(folder: Path) -> str:
    jobs = folder / "jobs"
    if jobs.exists():
        return f"kept {jobs} (it exists)"
    shutil.copytree(examples(), jobs, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    names = sorted(path.name for path in jobs.iterdir() if (path / "job.toml").is_file())
    return f"wrote {jobs}: the example jobs {', '.join(names)}"


def _tokens(folder: Path) -> list[str]:
    tokens, env = folder / "tokens.toml", folder / ".env"
    if tokens.exists() or env.exists():
        kept = [path for path in (tokens, env) if path.exists()]
        return [f"kept {path} (it exists)" for path in kept]
    token = new_token(tokens, "dev")
    _write_private(folder / DEV_TOKEN_FILE, token + "\n")
    _write_private(env, ENV_FILE.format(token=token))
    return [
        f"wrote {tokens}: a token named dev (every job, no raw command; mode 0600)",
        f"wrote {env}: the relay's paths, RELAY_URL and RELAY_TOKEN (mode 0600)",
    ]


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
